"""MariaDB/MySQL specifics. Their claim is the ORM path (`SELECT ... FOR UPDATE SKIP LOCKED`, then
the conditional UPDATE; for several kinds an unlocked read of each kind's first rows first,
`querysets.claims.lock_merged()`): they have no `UPDATE ... RETURNING` and refuse a LIMIT in an
IN subquery on the table being updated, so their claim is not written by hand."""

from typing import Any

from django_leases.sql import MIGRATE
from django_leases.sql.insert import InsertDialect

Params = dict[str, Any]

DEADLOCK_ERRORS = (1205, 1213)
"""1205: lock wait timeout; 1213: deadlock found. InnoDB rolls the transaction back for both."""

FENCING_CLOCK = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
"""The database clock in microseconds since the epoch, whatever the session's time zone: the
floor of every new fencing token."""


def share_lock_holder(table: str, *, lock: str) -> tuple[str, Params]:
    """Return the enqueue's read of the job holding `lock`, share-locking its row until commit.

    A shared lock, not FOR UPDATE: an enqueue that lost the race to take a free lock already
    holds InnoDB's shared lock on the winner's index record (from the duplicate-key check), and
    two of them upgrading to exclusive locks would deadlock. Tested on MariaDB 10.11.
    """
    sql = f"SELECT id FROM {table} WHERE lock_holder = %(lock)s LOCK IN SHARE MODE"  # noqa: S608
    return sql, {"lock": lock}


INSERT = InsertDialect(
    skip_verb="INSERT IGNORE",
    now_plus="CURRENT_TIMESTAMP(6) + INTERVAL %(delay)s MICROSECOND",
    delay=lambda seconds: round(seconds * 1e6),
)
"""The enqueue's INSERT (`sql.insert.insert_jobs`): INSERT IGNORE leaves out the rows a unique
index refuses, and RETURNING (MariaDB 10.5+, not MySQL) returns only the rows inserted (tested
on MariaDB 10.11). IGNORE would also turn a bad value into a warning: the enqueue has checked
every value before."""


SESSION_CLOCK = (
    "SELECT @@session.time_zone, @@system_time_zone, TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW())"
)
"""The session's time zone, the server's, and how far the session's NOW() is from UTC: what
`checks.databases.database_clock_problems` reads, since lease times are compared with NOW()."""


def row_estimate(
    table: str, *, status: str | None = None, other_than: bool = False
) -> tuple[str, Params]:
    """Return the optimizer's plan of reading `table` (only its rows in `status`, or with
    `other_than` only the others): its `rows` column is InnoDB's estimate, from the table's
    statistics or, for `status`, from dives into the index that leads with it. Nothing is
    counted. Tested on MariaDB 10.11. `planned_rows()` reads the estimate off its result."""
    if status is None:
        return f"EXPLAIN SELECT 1 FROM {table}", {}  # noqa: S608
    operator = "<>" if other_than else "="
    sql = f"EXPLAIN SELECT 1 FROM {table} WHERE status {operator} %(status)s"  # noqa: S608
    return sql, {"status": status}


def planned_rows(columns: list[str], row: tuple[Any, ...]) -> int:
    """Return the row estimate of a `row_estimate()` plan row, whose `columns` are its names."""
    return round(float(dict(zip(columns, row, strict=True))["rows"] or 0))


def status_estimate(equal: int, other_than: int, table_rows: int) -> int:
    """Return the estimate of a status's rows from `row_estimate()`'s three plans.

    InnoDB caps an index range's estimate at half the table (rounded down): a status holding
    most of the table (completed, typically) reads as half of it. Then the table less the other
    statuses, a smaller range estimated without the cap, is the better estimate.
    """
    if equal >= table_rows // 2:
        return max(equal, table_rows - other_than)
    return equal


# MariaDB/MySQL's error numbers: 1045/1698 access denied (password), 1044 no access to the
# database, 1049 unknown database, 1146/1054 unknown table/column, 1142/1143 no privilege on a
# table/column, 1193/1231/1232/1298 an unknown variable or time zone, or a wrong value (an
# init_command), 1115/1273 an unknown character set or collation, 1251/2059 an authentication
# plugin the client lacks.
MISCONFIGURED_ERRORS = {
    1045: "PASSWORD",
    1698: "PASSWORD",
    1044: "USER",
    1049: "NAME",
    1146: MIGRATE,
    1054: MIGRATE,
    1142: "USER",
    1143: "USER",
    1193: "OPTIONS",
    1231: "OPTIONS",
    1232: "OPTIONS",
    1115: "OPTIONS",
    1273: "OPTIONS",
    1298: "OPTIONS",
    1251: "OPTIONS",
    2059: "OPTIONS",
}
