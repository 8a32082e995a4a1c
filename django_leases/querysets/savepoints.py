"""The enqueue through the ORM, each job in a savepoint that catches its key's conflict: for a
database that returns no rows from an INSERT (MySQL; MariaDB does), and for jobs enqueued
`after=` others (`dependencies`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction

from django_leases.querysets import inserts
from django_leases.querysets.base import after
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import enqueue_locked
from django_leases.querysets.notices import notify

if TYPE_CHECKING:
    from django_leases.querysets.leases import LeaseQuerySet


def enqueue_with_savepoints(
    qs: LeaseQuerySet[J], values: dict[str, Any], row: inserts.Row, delay: float | None
) -> tuple[J, bool]:
    """Enqueue the job of `values` and `row` through the ORM, conflicts caught in
    savepoints: for a database that returns no rows from an INSERT (MySQL; MariaDB does),
    and for jobs enqueued `after=` others. Return it, or the first job of its key, and
    whether it is new."""
    payload, key = row
    values = {**values, "payload": payload, **({} if delay is None else {"run_at": after(delay)})}
    if key is not None:
        values["idempotency_key"] = key
    with transaction.atomic(using=qs.db):
        if key is None:
            job = add_job(qs, values)
        else:
            # The unique index decides between racing enqueues of one key, not a prior read:
            # the loser's INSERT fails inside its savepoint and it returns the winner's row.
            try:
                with transaction.atomic(using=qs.db):
                    job = add_job(qs, values)
            except IntegrityError:
                existing = qs.filter(idempotency_key=key).first()
                if existing is None:
                    raise
                return existing, False
        notify(qs, values["kind"])
    return job, True


def add_job(qs: LeaseQuerySet[J], values: dict[str, Any]) -> J:
    """Insert a job of `values`; one of a lock joins its line now, unless it waits for its
    prerequisites first (`dependencies.join_lock()` then)."""
    if values["lock"] and not values.get("unmet"):
        return enqueue_locked(qs, values)
    return qs.create(**values)
