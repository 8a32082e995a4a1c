"""Claiming one job by its id (`LeaseQuerySet.claim_job()`): the seed's conditional UPDATE of
one row, within its kind's throttle if it has one, its ledger row opened in the same
transaction (`claims.py` claims from the whole queue)."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction

from django_leases.conf import to_seconds
from django_leases.handlers import lease_lengths_of, throttles
from django_leases.limits import JOB_ID, check_int, check_owner
from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.claims import claim_values
from django_leases.querysets.ledger import J, open_attempts
from django_leases.querysets.pauses import paused_rows
from django_leases.querysets.reads import LeaseReads
from django_leases.querysets.throttles import claim_throttled


@retry_deadlocks
def claim_job(qs: LeaseReads[J], pk: int, owner: str, *, ttl: float | timedelta) -> J | None:
    """Claim the job `pk` for `owner` if it is claimable (and its kind's throttle lets it
    start); return it, or None if not."""
    check_int(pk, "pk", JOB_ID)
    seconds = to_seconds(ttl, "ttl")
    check_owner(owner)
    known = throttles()
    kind = qs.filter(pk=pk).values_list("kind", flat=True).first() if known else None
    if kind is None or kind not in known:
        with transaction.atomic(using=qs.db):
            jobs = claim_one(qs, pk, owner, seconds)
        return jobs[0] if jobs else None
    jobs = claim_throttled(
        qs, kind, known[kind], 1, lambda room: claim_one(qs, pk, owner, seconds, kind)
    )
    return jobs[0] if jobs else None


def claim_one(
    qs: LeaseReads[J], pk: int, owner: str, seconds: float, kind: str | None = None
) -> list[J]:
    """`claim_job()` in the caller's transaction: `[job]`, or `[]`; with `kind`, only a
    job still of that kind (the one a throttled claim counted)."""
    # The seed's statement: UPDATE ... WHERE id = :id AND (pending and due, or processing
    # with an expired lease). Its row count is the decision.
    # A paused kind's job is left alone, decided in the UPDATE itself.
    paused = paused_rows(qs.db).of_table(qs.model).values("kind")
    claimable = qs.claimable().filter(pk=pk).exclude(kind__in=paused)
    if kind is not None:
        claimable = claimable.filter(kind=kind)
    lengths = lease_lengths_of(seconds, None if kind is None else (kind,))
    if not claimable.update(**claim_values(owner, seconds, lengths)):
        return []
    # We hold the row lock until commit (and SQLite's write lock), so this read is ours.
    job = qs.get(pk=pk)
    # attempts > 1: a ledger row of an earlier holder may still be open; close it.
    job.taken_over = job.attempts > 1  # type: ignore[attr-defined]
    open_attempts(qs, [job], owner)
    return [job]
