"""Job locks: jobs sharing a `lock` run one at a time, in enqueue order.

A job of a lock holds it while it is next in line (pending), running (processing) or under
review: its `lock_holder` column then equals `lock`, and that column's plain UNIQUE index lets
one job per lock hold it, on every database. The later jobs of the lock wait (status waiting),
out of every claim's sight, so a backlog behind busy locks costs a claim nothing. Each
transition that moves the holder to a final status releases the lock in its UPDATE and passes
it on, in the same transaction, to the first waiting job of the lock (lowest id), which becomes
pending. Retries, rescues to pending, takeovers and reviews keep the lock where it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connections, transaction
from django.db.models import F

from django_leases.dialects import dialect_of
from django_leases.exceptions import LeaseError
from django_leases.querysets.ledger import J
from django_leases.status import PENDING, WAITING

if TYPE_CHECKING:
    from django_leases.querysets.leases import LeaseQuerySet


ENQUEUE_ROUNDS = 10
"""Enqueues of one lock that can beat ours to its free lock, one after another, before we
give up: each round is lost only to a job that then holds the lock, which we wait behind."""


def table_jobs(qs: LeaseQuerySet[J]) -> LeaseQuerySet[J]:
    """All jobs of the table on this database: a lock spans every job, whatever the
    selection an operator action or a transition was called on."""
    return type(qs)(qs.model, using=qs.db)


def enqueue_locked(qs: LeaseQuerySet[J], fields: dict[str, Any]) -> J:
    """Insert a job of the lock `fields["lock"]`: pending if the lock is free, else waiting.

    Runs inside the enqueue's transaction.
    """
    lock = fields["lock"]
    jobs = table_jobs(qs)
    for _ in range(ENQUEUE_ROUNDS):
        # Share-lock the holder's row until we commit. Its finishing UPDATE then waits for
        # our commit, and its passing on of the lock (a later statement, with a later
        # snapshot) sees our job. A holder that is finishing right now makes us wait for
        # it; we then find the job it passed the lock to, or none.
        if holder_share_locked(qs, lock):
            return jobs.create(status=WAITING, **fields)
        try:
            # No holder: take the lock. The unique index decides between two enqueues
            # that both found none; the loser goes round again and waits behind the winner.
            with transaction.atomic(using=qs.db):
                return jobs.create(status=PENDING, lock_holder=lock, **fields)
        except IntegrityError:
            if not jobs.filter(lock_holder=lock).exists():
                raise  # another unique field (the idempotency key) refused the row
    raise LeaseError(f"lock {lock!r}: no place taken after {ENQUEUE_ROUNDS} rounds")


def holder_share_locked(qs: LeaseQuerySet[J], lock: str) -> bool:
    connection = connections[qs.db]
    table = connection.ops.quote_name(qs.model._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(*dialect_of(connection).share_lock_holder(table, lock))
        return cursor.fetchone() is not None


def pass_lock(qs: LeaseQuerySet[J], pk: int, *, contested: bool = False) -> None:
    """If job `pk` no longer holds its lock, make the lock's first waiting job pending.

    Called in the transaction of the UPDATE that released the lock, after it: that UPDATE
    holds the row lock every enqueue of the lock takes first, so no job of the lock is
    left waiting unseen. `contested`: the lock may have been taken meanwhile (an operator
    requeued a finished job of a busy lock), so a unique conflict only means it is held.
    """
    jobs = table_jobs(qs)
    lock = (
        jobs.filter(pk=pk, lock_holder__isnull=True)
        .exclude(lock="")
        .values_list("lock", flat=True)
        .first()
    )
    if lock is None or (contested and jobs.filter(lock_holder=lock).exists()):
        return
    # FOR UPDATE: a waiting job cancelled meanwhile is re-checked and skipped, never
    # promoted from a stale read. Lowest id first: enqueue order.
    first = list(
        jobs.select_for_update()
        .filter(status=WAITING, lock=lock, unmet=0)
        .order_by("pk")
        .values_list("pk", flat=True)[:1]
    )
    if not first:
        return
    promote = jobs.filter(pk=first[0], status=WAITING)
    if not contested:
        promote.update(status=PENDING, lock_holder=F("lock"))
        return
    try:
        with transaction.atomic(using=qs.db):
            promote.update(status=PENDING, lock_holder=F("lock"))
    except IntegrityError:
        return  # an enqueue took the free lock first: our job waits behind it
