"""Acknowledgements: completing a batch of held jobs in one round trip (`ack="batch"` kinds).

`LeaseQuerySet.complete_many()`, a function taking the queryset first: each row of a batch is
still conditional on its own id, `processing`, owner and fencing token, and the ledger rows of
exactly the rows that won are closed in the same statement or transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from django.db import connections, transaction
from django.db.models import Q
from django.db.models.functions import Now

from django_leases.dialects import ClaimPath, dialect_of
from django_leases.limits import check_owner
from django_leases.querysets.base import (
    LeaseKey,
    bound_cursor,
    key_groups,
    keys_filter,
    lease_keys,
    quoted_table,
    retry_deadlocks,
)
from django_leases.querysets.dependencies import release_dependents
from django_leases.querysets.ledger import J, close_attempts, ledger_of, record_fenced_many
from django_leases.querysets.locks import pass_lock
from django_leases.status import COMPLETED, PROCESSING, AttemptOutcome

if TYPE_CHECKING:
    from django_leases.querysets.leases import LeaseQuerySet


@retry_deadlocks
def complete_many(
    qs: LeaseQuerySet[J], owner: str, leases: Iterable[LeaseKey] | Mapping[int, int]
) -> set[LeaseKey]:
    """Complete every job of `leases` ((job id, token) pairs) that `owner` still holds under
    that token; return the pairs completed.

    One statement on PostgreSQL, one transaction of set-based statements elsewhere, for the
    jobs without a lock. Each row is still conditional on its own id, `processing`, owner
    and token: a job lost, taken over, released or finished meanwhile is left alone (and its
    ledger row noted as fenced), the others complete, with their open ledger rows closed in
    the same transaction. A job of a lock completes too, and passes its lock on, as in
    `complete()`.
    """
    check_owner(owner)
    keys = lease_keys(leases)
    if not keys:
        return set()
    won = complete_many_by_path(qs, owner, keys, complete_many_path(qs))
    lost = [key for key in keys if key not in won]
    if lost:
        record_fenced_many(qs, lost)
    return won


def complete_many_path(qs: LeaseQuerySet[J]) -> ClaimPath:
    """The raw statements need the stock ledger (for their ledger UPDATE); else the ORM."""
    return dialect_of(connections[qs.db]).complete_many_path(ledger_of(qs))


def complete_many_by_path(
    qs: LeaseQuerySet[J], owner: str, keys: list[LeaseKey], path: ClaimPath
) -> set[LeaseKey]:
    """`complete_many()` by `path`: the jobs without a lock by the path's statements, then
    (in a second transaction on PostgreSQL, only if some were left) the jobs of a lock."""
    ledger = ledger_of(qs)
    dialect = dialect_of(connections[qs.db])
    groups = list(key_groups(keys))
    if path == "postgresql+ledger" and ledger is not None:
        # One statement: atomic without a transaction block.
        with bound_cursor(qs.db) as cursor:
            done = dialect.complete_many(
                cursor, quoted_table(qs.model, qs.db), ledger, owner, groups
            )
        left = [key for key in keys if key not in done]
        return done | (complete_locked(qs, owner, left) if left else set())
    # One transaction: the jobs' completions and their ledger rows commit together.
    with transaction.atomic(using=qs.db):
        if path != "orm" and ledger is not None:
            with connections[qs.db].cursor() as cursor:
                done = dialect.complete_many(
                    cursor, quoted_table(qs.model, qs.db), ledger, owner, groups
                )
        else:
            done = complete_unlocked(qs, owner, groups)
        left = [key for key in keys if key not in done]
        return done | (complete_locked(qs, owner, left) if left else set())


def complete_unlocked(
    qs: LeaseQuerySet[J], owner: str, groups: list[dict[int, int]]
) -> set[LeaseKey]:
    """The specification (MariaDB/MySQL's statements write it out) of the batched completion
    of the jobs without a lock, in the caller's transaction: lock the rows still held, then
    complete exactly those; the row locks keep the read true until commit."""
    done: set[LeaseKey] = set()
    for group in groups:
        held = qs.filter(
            keys_filter(group),
            status=PROCESSING,
            lease_owner=owner,
            lock="",
            dependents__isnull=True,
        )
        locked = dict(held.select_for_update().values_list("pk", "lease_token"))
        if locked:
            held.filter(pk__in=locked).update(status=COMPLETED, completed_at=Now(), last_error="")
            done.update(locked.items())
    if done:
        close_attempts(qs, done, AttemptOutcome.COMPLETED, by=owner)
    return done


@retry_deadlocks
def complete_locked(qs: LeaseQuerySet[J], owner: str, keys: list[LeaseKey]) -> set[LeaseKey]:
    """Complete the jobs of a lock (or with dependents) among `keys` that `owner` still holds,
    in one transaction (the caller's, if any): release each one's lock in its UPDATE, close
    its ledger row, pass the lock on and release its dependents, as `complete()` does; return
    the pairs completed.

    The lock rule lives here, beside the completion, not with the caller: a batch may hold
    jobs of a lock, and none of them is left holding it or reported lost.
    """
    done: set[LeaseKey] = set()
    with transaction.atomic(using=qs.db, savepoint=False):
        for group in key_groups(keys):
            held = qs.filter(keys_filter(group), status=PROCESSING, lease_owner=owner)
            held = held.filter(~Q(lock="") | Q(dependents__isnull=False))
            # In id order: the locks are passed on in the order the rows were locked.
            rows = held.select_for_update().order_by("pk").values_list("pk", "lease_token")
            locked = dict(rows)
            if not locked:
                continue
            held.filter(pk__in=locked).update(
                status=COMPLETED, completed_at=Now(), last_error="", lock_holder=None
            )
            done.update(locked.items())
            for pk in locked:
                pass_lock(qs, pk)
            release_dependents(qs, locked)
        if done:
            close_attempts(qs, done, AttemptOutcome.COMPLETED, by=owner)
    return done
