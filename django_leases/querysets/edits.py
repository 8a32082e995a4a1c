"""An operator's edit of a pending job: its priority or its payload, recorded as an operator event
with each field's old and new value.

A running job's payload is in its handler's hands: the edit is one conditional UPDATE that
restates `status = pending`, so a job claimed while the operator's form was open is left alone.
It never writes a lease field.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

from django_leases.exceptions import InvalidArgument
from django_leases.limits import PRIORITY, check_int
from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.enqueue import job_row
from django_leases.querysets.ledger import J
from django_leases.querysets.operators import record_events
from django_leases.querysets.reads import LeaseReads
from django_leases.status import EventAction

EDITABLE_FIELDS = ("priority", "payload")
"""The only fields of a job an operator edits."""


@retry_deadlocks
def edit_pending(
    qs: LeaseReads[J], pk: int, edits: dict[str, Any], *, by: str, reason: str = ""
) -> dict[str, list[Any]] | None:
    """Set `edits` (of EDITABLE_FIELDS) on job `pk` if it is still pending and among `qs`.

    Returns what changed, each field's [old, new] value (empty: the values were those already),
    or None if the job is not pending (nothing written). A change is recorded as an
    `EventAction.EDITED` event by `by`, with `reason`, in the UPDATE's transaction.
    """
    unknown = sorted(set(edits) - set(EDITABLE_FIELDS))
    if unknown:
        raise InvalidArgument(f"only {', '.join(EDITABLE_FIELDS)} can be edited, not {unknown}")
    # The bounds an enqueue checks (`enqueue.job_row()`, the priority's range): an edit is no
    # way around them.
    if "priority" in edits:
        check_int(edits["priority"], "priority", PRIORITY)
    if "payload" in edits:
        job_row(edits["payload"], None)
    # One transaction, the row locked first: the old values recorded are the ones the UPDATE
    # replaced, and the event commits with it or not at all (SQLite: the IMMEDIATE transaction
    # holds the write lock; tested on the three databases).
    with transaction.atomic(using=qs.db):
        jobs = qs.pending().filter(pk=pk)
        old = jobs.select_for_update().values(*edits, "lease_token", "attempts").first()
        if old is None:
            return None
        changes = {name: [old[name], value] for name, value in edits.items() if old[name] != value}
        if not changes:
            return changes
        new = {name: value for name, (_, value) in changes.items()}
        # Named one by one: the UPDATE writes these two columns and no other.
        priority, payload = (new.get(name, F(name)) for name in EDITABLE_FIELDS)
        if not jobs.update(priority=priority, payload=payload):
            return None
        record_events(
            qs,
            [(pk, old["lease_token"], old["attempts"])],
            EventAction.EDITED,
            by,
            reason,
            changes=changes,
        )
    return changes
