"""MariaDB/MySQL specifics. Their claim is the ORM path (`SELECT ... FOR UPDATE SKIP LOCKED`, then
the conditional UPDATE): they have no `UPDATE ... RETURNING` and refuse a LIMIT in an IN subquery
on the table being updated, so no statement of theirs is written by hand."""

DEADLOCK_ERRORS = (1205, 1213)
"""1205: lock wait timeout; 1213: deadlock found. InnoDB rolls the transaction back for both."""
