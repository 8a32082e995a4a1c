"""Dependencies: a job enqueued `after=[...]` other jobs waits until every one has completed.

The dependent is inserted waiting (out of every claim's sight, like a job behind its lock) with
`unmet`, the count of its prerequisites not completed yet, and `waits_for`, their ids; each
such prerequisite lists it in `dependents`. The enqueue share-locks nothing but those
prerequisites' rows (FOR UPDATE), so a prerequisite completing at the same moment either
completed before (and counts as met) or completes after our commit and finds us in its
`dependents`. Every completion of a job with dependents calls `release_dependents()` in its
own transaction: it locks the dependents, counts one more prerequisite met, and releases those
it brought to zero, pending (due at their `run_at`) or, with a `lock`, in their lock's line.
The row locks make the count exact under any isolation level: of two prerequisites completing
at once, the second waits for the first's commit and alone sees the count reach zero.

A prerequisite that fails, is cancelled, or waits for a review verdict holds its dependents:
they stay waiting, shown in the admin, until an operator acts (requeue or resolve the
prerequisite, which then completes and releases them, or cancel them). Cycles cannot arise:
a job can only name jobs that exist already.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import models, transaction

from django_leases.exceptions import InvalidArgument
from django_leases.limits import shown
from django_leases.querysets import inserts
from django_leases.querysets.keys import check_bound
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import table_jobs
from django_leases.querysets.reads import LeaseReads
from django_leases.querysets.savepoints import enqueue_with_savepoints
from django_leases.status import COMPLETED, WAITING

MAX_PREREQUISITES = 100
"""Jobs one `after=` may name."""


def prerequisite_pks(qs: LeaseReads[J], after: Any) -> list[int]:
    """Return the ids `after` names (jobs or ids), in order, once each; raise
    `InvalidArgument` for a job of another table or database, or anything else."""
    if isinstance(after, (str, bytes, dict, models.Model)) or not isinstance(after, Iterable):
        raise InvalidArgument(f"after must be a list of jobs or job ids, got {shown(after)}")
    pks: list[int] = []
    for item in after:
        if isinstance(item, models.Model):
            if item._meta.concrete_model is not qs.model._meta.concrete_model:
                raise InvalidArgument(
                    f"after: {shown(item)} is a {item._meta.label}, not a "
                    f"{qs.model._meta.label}: a job waits for jobs of its own table"
                )
            if item.pk is None:
                raise InvalidArgument(f"after: {shown(item)} is not saved")
            if item._state.db != qs.db:
                raise InvalidArgument(
                    f"after: job {item.pk} is on database {item._state.db!r}, this job goes to "
                    f"{qs.db!r}: a job waits for jobs of its own database"
                )
            item = item.pk
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise InvalidArgument(f"after: expected jobs or job ids, got {shown(item)}")
        if item not in pks:
            pks.append(item)
    if len(pks) > MAX_PREREQUISITES:
        raise InvalidArgument(f"after names {len(pks)} jobs; at most {MAX_PREREQUISITES}")
    return pks


def lock_prerequisites(qs: LeaseReads[J], pks: list[int]) -> dict[int, Any]:
    """Lock the rows of the prerequisites `pks` until the enqueue commits; return the
    `dependents` of each one not completed. Raise `InvalidArgument` if any does not exist.

    Runs inside the enqueue's transaction. FOR UPDATE, in id order: a prerequisite's
    completion waits for our commit (and then sees the dependents we add), or committed before
    our read (which then sees it completed: met). Tested on PostgreSQL, MariaDB, SQLite."""
    rows = (
        table_jobs(qs)
        .select_for_update()
        .filter(pk__in=pks)
        .order_by("pk")
        .values_list("pk", "status", "dependents")
    )
    found = {pk: (status, dependents) for pk, status, dependents in rows}
    missing = [pk for pk in pks if pk not in found]
    if missing:
        raise InvalidArgument(
            f"after: no job {', '.join(map(str, missing))} in {qs.model._meta.label} "
            f"on database {qs.db!r}"
        )
    return {pk: found[pk][1] or [] for pk in pks if found[pk][0] != COMPLETED}


def enqueue_after(
    qs: LeaseReads[J],
    kind: str,
    values: dict[str, Any],
    rows: list[inserts.Row],
    delay: float | None,
    pks: list[int],
) -> list[J]:
    """Enqueue a job of `values` per row after the jobs `pks` (`dependencies`): waiting
    until they have completed, or at once if they all have. One transaction, each job in a
    savepoint; an idempotency key that exists gives its job, and no dependency."""
    many = len(rows) > 1
    with transaction.atomic(using=qs.db):
        unmet = lock_prerequisites(qs, pks)
        values = {**values, "waits_for": pks, "unmet": len(unmet)}
        if unmet:
            values["status"] = WAITING
        done, new = [], []
        for position, row in enumerate(rows):
            job, created = enqueue_with_savepoints(qs, values, row, delay)
            if created:
                new.append(job.pk)
            else:
                job = check_bound(job, kind, row, f"payloads[{position}]: " if many else "")
            done.append(job)
        add_dependents(qs, unmet, new)
    return done


def add_dependents(qs: LeaseReads[J], unmet: dict[int, Any], new: list[int]) -> None:
    """List the new dependents `new` on each prerequisite of `unmet` (locked by
    `lock_prerequisites()` in this transaction, so its `dependents` read there are current)."""
    if not new:
        return
    jobs = table_jobs(qs)
    for pk, dependents in unmet.items():
        jobs.filter(pk=pk).update(dependents=[*dependents, *new])
