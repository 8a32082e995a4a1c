"""Where an execution ends: what a stopped job held is given back here, once its execution is
over, never when its status alone changes.

An operator's `cancel()` of a running job and a time-out (`time_out()`) stop the job: status
stopping, the status it will end as in `ends_as`, its attempt's ledger row given its outcome
(cancelled, timed out) but left open. While its holder may still run the handler, a stopping
job keeps its lock and counts against its kind's `limit=` (its lease is live), and nobody
renews or claims it, so its lease runs out within one TTL. Its execution ends when its holder
acknowledges the stop (`acknowledge_stops()`: the handler returned, whatever it returned or
raised) or once its lease has expired (`end_expired_stops()`, the watcher's pass). The ending
is one conditional UPDATE per batch: the job takes `ends_as`, a final status releases its lock
(passed on in the same transaction), and the ledger row is closed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import Case, F, PositiveBigIntegerField, Q, Value, When
from django.db.models.functions import Now

from django_leases.exceptions import LeaseError
from django_leases.limits import check_owner
from django_leases.querysets.base import (
    LeaseKey,
    key_groups,
    keys_filter,
    lease_keys,
    retry_deadlocks,
)
from django_leases.querysets.ledger import J, job_column, ledger_update
from django_leases.querysets.locks import pass_lock
from django_leases.status import CANCELLED, FAILED, STOPPING

if TYPE_CHECKING:
    from django_leases.querysets.leases import LeaseQuerySet


ENDINGS_PER_BATCH = 500
"""Stopped executions one ending transaction ends at most (one locking read, one UPDATE)."""

RELEASING = (CANCELLED, FAILED)
"""The `ends_as` statuses that release the job's lock: the final ones a stop leads to."""


def acknowledge_stops(
    qs: LeaseQuerySet[J], owner: str, leases: Iterable[LeaseKey] | Mapping[int, int]
) -> dict[LeaseKey, str]:
    """End the stopped executions among `leases` ((job id, token) pairs) that `owner` held:
    their handlers are done. Return the status each one ended as; a lease not stopping under
    that token (completed, lost, taken over, ended already) is left alone."""
    check_owner(owner)
    ended: dict[LeaseKey, str] = {}
    for group in key_groups(lease_keys(leases)):
        ended.update(end_stops(qs, keys_filter(group) & Q(lease_owner=owner)))
    return ended


def end_expired_stops(qs: LeaseQuerySet[J]) -> dict[LeaseKey, str]:
    """End the stopped executions whose lease expired (their holder died or ignores the stop),
    a batch at most; return the status each one ended as."""
    return end_stops(qs, Q(lease_until__lt=Now()))


@retry_deadlocks
def end_stops(qs: LeaseQuerySet[J], where: Q) -> dict[LeaseKey, str]:
    """End the stopping jobs that match `where`, ENDINGS_PER_BATCH at most, in one transaction:
    the jobs' UPDATE, the passing on of the locks it released and the closing of their ledger
    rows commit together. Return the status each one ended as."""
    eligible = where & Q(status=STOPPING)
    with transaction.atomic(using=qs.db):
        # Lock the rows, then ONE UPDATE restating the precondition: exactly the rows locked
        # change (PostgreSQL and MariaDB/MySQL lock them; SQLite holds its write lock).
        rows = list(
            qs.filter(eligible)
            .order_by("pk")
            .select_for_update()
            .values_list("pk", "lease_token", "ends_as", "lock")[:ENDINGS_PER_BATCH]
        )
        if not rows:
            return {}
        releases = Q(ends_as__in=RELEASING)
        won = qs.filter(eligible, pk__in=[pk for pk, _, _, _ in rows]).update(
            # MariaDB/MySQL evaluate SET left to right, each assignment seeing the columns set
            # before it: every assignment that reads `ends_as` comes before it is cleared.
            completed_at=Case(When(releases, then=Now()), default=None),
            lock_holder=Case(When(releases, then=None), default=F("lock_holder")),
            # A cancelled job's token is one past its last lease, as an immediate cancel's.
            lease_token=Case(
                When(ends_as=CANCELLED, then=F("lease_token") + 1),
                default=F("lease_token"),
                output_field=PositiveBigIntegerField(),
            ),
            status=F("ends_as"),
            ends_as=Value(""),
        )
        if won != len(rows):
            raise LeaseError(f"{won} of {len(rows)} locked stopping jobs ended; rolled back")
        # In id order: the locks pass on in the order the rows were locked.
        for pk, _, ends_as, lock in rows:
            if lock and ends_as in RELEASING:
                pass_lock(qs, pk)
        keys = [(pk, token) for pk, token, _, _ in rows]
        # The stop gave the rows their outcome; they close now that the execution has ended.
        ledger_update(
            qs,
            keys,
            Q(ended_at__isnull=True),
            ended_at=Now(),
            checkpoint=job_column(qs, "checkpoint"),
        )
    return {(pk, token): ends_as for pk, token, ends_as, _ in rows}
