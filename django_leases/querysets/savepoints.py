"""The enqueue through the ORM, each job in a savepoint that catches its key's conflict: for a
database that returns no rows from an INSERT (MySQL; MariaDB does), and for jobs enqueued
`after=` others (`dependencies`)."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from django_leases.querysets import inserts
from django_leases.querysets.base import after
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import in_lock_rounds, table_jobs
from django_leases.querysets.notices import notify
from django_leases.querysets.reads import LeaseReads
from django_leases.status import PENDING, WAITING


def enqueue_with_savepoints(
    qs: LeaseReads[J], values: dict[str, Any], row: inserts.Row, delay: float | None
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


def add_job(qs: LeaseReads[J], values: dict[str, Any]) -> J:
    """Insert the job of `values` through the ORM; one of a lock in the rounds of
    `locks.in_lock_rounds()`, a conflict caught in a savepoint, unless it waits for its
    prerequisites first (it joins its lock's line when they completed:
    `dependencies.join_lock()`)."""
    lock = values["lock"]
    if not lock or values.get("unmet"):
        return qs.create(**values)
    jobs = table_jobs(qs)

    def take() -> J | None:
        try:
            with transaction.atomic(using=qs.db):
                return jobs.create(status=PENDING, lock_holder=lock, **values)
        except IntegrityError:
            if not jobs.filter(lock_holder=lock).exists():
                raise  # another unique field (the idempotency key) refused the row
            return None

    return in_lock_rounds(qs, lock, lambda: jobs.create(status=WAITING, **values), take)
