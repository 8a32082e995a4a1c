"""Job locks: jobs sharing a `lock` run one at a time, in enqueue order.

A job of a lock holds it while it is next in line (pending), running (processing) or under
review: its `lock_holder` column then equals `lock`, and that column's plain UNIQUE index lets
one job per lock hold it, on every database. The later jobs of the lock wait (status waiting),
out of every claim's sight, so a backlog behind busy locks costs a claim nothing. Each
transition that moves the holder to a final status releases the lock in its UPDATE and passes
it on, in the same transaction, to the first waiting job of the lock (lowest id), which becomes
pending: that is where an execution ends (`endings`), the one place a lock is given back.
Retries, rescues to pending, takeovers and reviews keep the lock where it is. This module
holds the taking of a lock by an enqueue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.db import connections

from django_leases.dialects import dialect_of
from django_leases.exceptions import LeaseError
from django_leases.querysets.reads import J, LeaseReads

T = TypeVar("T")


ENQUEUE_ROUNDS = 10
"""Enqueues of one lock that can beat ours to its free lock, one after another, before we
give up: each round is lost only to a job that then holds the lock, which we wait behind."""


def table_jobs(qs: LeaseReads[J]) -> LeaseReads[J]:
    """All jobs of the table on this database: a lock spans every job, whatever the
    selection an operator action or a transition was called on."""
    return type(qs)(qs.model, using=qs.db)


def in_lock_rounds(
    qs: LeaseReads[J], lock: str, wait: Callable[[], T], take: Callable[[], T | None]
) -> T:
    """Enqueue a job of `lock` in the enqueue's transaction: `take()` it (insert it pending,
    holding the lock) if the lock is free, else `wait()` (insert it waiting); return what the
    one that ran returned.

    `take()` returns None when the lock's unique index refused its row (another enqueue took
    the free lock first): the next round then waits behind that job.
    """
    for _ in range(ENQUEUE_ROUNDS):
        # Share-lock the holder's row until we commit. Its finishing UPDATE then waits for
        # our commit, and its passing on of the lock (a later statement, with a later
        # snapshot) sees our job. A holder that is finishing right now makes us wait for
        # it; we then find the job it passed the lock to, or none.
        if holder_share_locked(qs, lock):
            return wait()
        # No holder: take the lock. The unique index decides between two enqueues that both
        # found none; the loser goes round again and waits behind the winner.
        taken = take()
        if taken is not None:
            return taken
    raise LeaseError(f"lock {lock!r}: no place taken after {ENQUEUE_ROUNDS} rounds")


def holder_share_locked(qs: LeaseReads[J], lock: str) -> bool:
    connection = connections[qs.db]
    table = connection.ops.quote_name(qs.model._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(*dialect_of(connection).share_lock_holder(table, lock))
        return cursor.fetchone() is not None
