"""Decisions on jobs their holder no longer speaks for: the watcher's rescue of an expired or
orphaned lease, and the operator actions (requeue, release, fail, cancel, review verdicts, a
job enqueued at once by an operator: `enqueue_now()`).

The watcher, the admin's actions and any operator script call these, never their own UPDATEs.
Each is conditional per row: it changes only the rows still eligible when its UPDATE runs (a
rescue restates everything its decision read), and says how many it changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.apps import apps
from django.db import transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Greatest, Now

from django_leases.conf import to_seconds
from django_leases.exceptions import Cancelled, LeaseLost
from django_leases.querysets.base import (
    JOB_KEY,
    LEDGER_KEY,
    LeaseKey,
    after,
    key_groups,
    keys_filter,
    lease_keys,
    next_token,
    retry_deadlocks,
)
from django_leases.querysets.endings import Ending, end_executions, end_one
from django_leases.querysets.enqueue import enqueue
from django_leases.querysets.ledger import MAX_ERROR_LENGTH, J, ledger_update, storable
from django_leases.querysets.reads import LeaseReads, takeover_guard
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    LEASED_STATUSES,
    PENDING,
    PROCESSING,
    REVIEW,
    STOPPING,
    WAITING,
    AttemptOutcome,
    EventAction,
    StuckPolicy,
    Verdict,
)

OPERATOR_BATCH_SIZE = 500
"""Jobs one operator action changes per transaction (one locking read and one UPDATE)."""
REVIEW_EVENTS: dict[str, str] = {
    Verdict.COMPLETED: EventAction.REVIEW_COMPLETED,
    Verdict.RETRY: EventAction.REVIEW_RETRY,
    Verdict.FAILED: EventAction.REVIEW_FAILED,
}


@retry_deadlocks
def rescue(
    qs: LeaseReads[J],
    job: J,
    action: str,
    *,
    by: str,
    retry_in: float | timedelta | None = None,
    reason: str = "",
    orphaned: bool = False,
) -> bool:
    """Resolve the expired lease of `job` (as read by the watcher) with `action`.

    `action` is "retry" (back to pending after `retry_in`), "review" (held for an operator),
    "failed" or "completed" (a reconcile hook's verdict). The UPDATE restates everything the
    decision read: the expiry, the token, the checkpoint and `max_attempts`, so a job
    completed, renewed, claimed, checkpointed or rescued a moment ago is left alone. With
    `orphaned`, the lease may still be live but its owner is known gone (see `orphaned()`):
    the UPDATE then restates that owner instead of the expiry. Returns whether this call won.
    """
    values: dict[str, Any]
    outcome: str
    if action == Verdict.RETRY:
        delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
        values = {"status": PENDING, "run_at": after(delay) if delay else Now()}
        outcome = AttemptOutcome.RESCUED
    elif action == StuckPolicy.REVIEW:
        values = {"status": REVIEW}
        outcome = AttemptOutcome.REVIEW
    elif action in (FAILED, COMPLETED):
        values = {"status": action, "completed_at": Now()}
        outcome = action
    else:
        raise ValueError(f"unknown rescue action {action!r}")
    if reason:
        values["last_error"] = reason[:MAX_ERROR_LENGTH]
    ending = Ending(
        values,
        releases=action in (FAILED, COMPLETED),
        outcome=outcome,
        by=by,
        error=("", reason) if reason else None,
    )
    stale = qs.processing().filter(lease_owner=job.lease_owner) if orphaned else qs.expired()
    row = stale.filter(
        pk=job.pk,
        lease_token=job.lease_token,
        checkpoint=job.checkpoint,
        max_attempts=job.max_attempts,
    )
    return end_one(qs, row, (job.pk, job.lease_token), ending) is not None


class Changed(int):
    """How many jobs an operator action changed, and which (`pks`, in id order)."""

    pks: tuple[int, ...]

    def __new__(cls, pks: Iterable[int]) -> Changed:
        kept = tuple(pks)
        changed = super().__new__(cls, len(kept))
        changed.pks = kept
        return changed


def requeue(
    qs: LeaseReads[J], *, force: bool = False, by: str = "operator", reason: str = ""
) -> Changed:
    """Make the selected jobs pending and due now; return how many changed.

    Failed, cancelled, under-review and expired jobs are requeued; a processing job with a
    live lease, and a stopping one (its handler may still run), only with `force`, which also
    bumps its fencing token so that the current holder is fenced out of every further write.
    Completed jobs are never requeued. A job without attempts left gets one more.

    A job of a lock that holds it keeps it (pending, next in line). A finished job of a
    lock rejoins it at its enqueue place: pending if the lock is free, else waiting, ahead
    of every later job of the lock (the lowest id waiting goes first).
    """
    eligible = Q(status__in=[FAILED, CANCELLED, REVIEW, PENDING]) | Q(
        status=PROCESSING, lease_until__lt=Now()
    )
    if force:
        eligible |= Q(status__in=LEASED_STATUSES)
    values = {
        "ends_as": "",
        "status": Case(
            # A dependent whose prerequisites have not all completed waits for them again.
            When(unmet__gt=0, then=Value(WAITING)),
            When(Q(lock="") | Q(lock_holder__isnull=False), then=Value(PENDING)),
            default=Value(WAITING),
        ),
        "run_at": Now(),
        "completed_at": None,
        # A requeued job gets at least one more attempt, whatever it used up.
        "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
        "lease_token": next_token(),
    }
    ending = operator_ending(values, by, AttemptOutcome.REQUEUED, releases=False)
    event = EventAction.FORCE_REQUEUED if force else EventAction.REQUEUED
    return operator_write(qs, eligible, ending, event=event, reason=reason)


def release_stuck(qs: LeaseReads[J], *, by: str = "operator", reason: str = "") -> Changed:
    """Return the selected jobs whose lease expired to pending (the watcher's retry).

    A job that used its last attempt gets one more, or it would sit pending unclaimable.
    """
    values = {
        "status": PENDING,
        "run_at": Now(),
        "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
    }
    ending = operator_ending(values, by, AttemptOutcome.RESCUED, releases=False)
    expired = Q(status=PROCESSING, lease_until__lt=Now())
    return operator_write(qs, expired, ending, event=EventAction.RELEASED, reason=reason)


def mark_failed(
    qs: LeaseReads[J], *, reason: str, force: bool = False, by: str = "operator"
) -> Changed:
    """Fail the selected pending, waiting, under-review or expired jobs (any processing or
    stopping one with `force`, fencing out its holder); return how many changed."""
    eligible = Q(status__in=[PENDING, WAITING, REVIEW]) | Q(
        status=PROCESSING, lease_until__lt=Now()
    )
    if force:
        eligible |= Q(status__in=LEASED_STATUSES)
    values = {
        "ends_as": "",
        "status": FAILED,
        "completed_at": Now(),
        "last_error": reason[:MAX_ERROR_LENGTH],
        "lease_token": next_token(),
    }
    ending = operator_ending(values, by, AttemptOutcome.FAILED, reason=reason)
    return operator_write(qs, eligible, ending, event=EventAction.FAILED, reason=reason)


def cancel(
    qs: LeaseReads[J], *, by: str = "operator", reason: str = "", running: bool = True
) -> Changed:
    """Cancel the selected pending, waiting and processing jobs; return how many changed.

    A processing job with a live lease is stopping (`endings`): its holder's renewals and
    writes are refused, it learns `Cancelled` within one heartbeat interval, and the job keeps
    its lock and its `limit=` slot until the holder's execution ends or its lease expires; it
    then ends cancelled, or under review if its kind's review policy applies past its
    checkpoint (it may have moved money). An expired lease's job ends so at once; its holder
    is fenced out (its token is bumped). `running=False` leaves processing jobs alone; the
    events of a cancel that may reach them (the default) say it was forced.
    """
    note = f"cancelled by {by}" + (f": {reason}" if reason else "")
    eligible = Q(status__in=[PENDING, WAITING])
    if running:
        eligible |= Q(status=PROCESSING)
    guard = takeover_guard()[0]
    review = Q(status=PROCESSING) & ~guard if guard else Q(pk__in=[])
    live = Q(status=PROCESSING, lease_until__gte=Now())
    # A job under review or stopping keeps its token (the verdict is noted on that attempt's
    # row) and its lock; the others end with the cancel.
    keeps = live | review
    values = {
        # MariaDB/MySQL evaluate SET left to right, each assignment seeing the columns set
        # before it: status, which the conditions read, goes last.
        "ends_as": Case(
            When(live & review, then=Value(REVIEW)),
            When(live, then=Value(CANCELLED)),
            default=Value(""),
        ),
        "completed_at": Case(When(keeps, then=None), default=Now()),
        "last_error": note[:MAX_ERROR_LENGTH],
        "lease_token": Case(When(keeps, then=F("lease_token")), default=F("lease_token") + 1),
        "status": Case(
            When(live, then=Value(STOPPING)),
            When(review, then=Value(REVIEW)),
            default=Value(CANCELLED),
        ),
    }
    ending = operator_ending(
        values, by, AttemptOutcome.CANCELLED, releases=~keeps, reason=reason, stops=True
    )
    event = EventAction.FORCE_CANCELLED if running else EventAction.CANCELLED
    return operator_write(qs, eligible, ending, event=event, reason=reason)


def refused(qs: LeaseReads[J], pk: int, token: int, why: str) -> LeaseLost:
    """Return the error of a refused holder write: `Cancelled` if an operator's cancel ended
    that lease, else `LeaseLost`."""
    by = cancelled_leases(qs, [(pk, token)]).get((pk, token))
    if by is not None:
        return Cancelled(f"job {pk}: cancelled by {by}")
    return LeaseLost(f"job {pk}: {why}")


def cancelled_leases(qs: LeaseReads[J], leases: Iterable[LeaseKey]) -> dict[LeaseKey, str]:
    """Return which of `leases` ((job id, token) pairs) an operator's `cancel()` ended, each
    with who cancelled it: how a holder whose write or renewal was refused tells a cancel
    from other losses. Without a ledger, a job cancelled under the next token counts."""
    ledger = qs._ledger()
    found: dict[LeaseKey, str] = {}
    for group in key_groups(lease_keys(leases)):
        if ledger is not None:
            rows = ledger.objects.using(qs.db).filter(
                keys_filter(group, LEDGER_KEY), outcome=AttemptOutcome.CANCELLED
            )
            found.update(
                ((pk, token), by) for pk, token, by in rows.values_list(*LEDGER_KEY, "ended_by")
            )
            continue
        jobs = qs.filter(pk__in=group, status=CANCELLED).values_list(*JOB_KEY)
        found.update(
            ((pk, token - 1), "an operator") for pk, token in jobs if group[pk] == token - 1
        )
        stopping = qs.filter(pk__in=group, status=STOPPING, ends_as=CANCELLED)
        found.update(
            ((pk, token), "an operator")
            for pk, token in stopping.values_list(*JOB_KEY)
            if group[pk] == token
        )
    return found


def resolve_review(
    qs: LeaseReads[J], verdict: str, *, by: str = "operator", reason: str = ""
) -> Changed:
    """Resolve the selected jobs under review: "completed", "retry" or "failed".

    The verdict is an event of the job; it is also noted on the ledger row that put the job
    under review, if no verdict is there yet.
    """
    values: dict[str, Any]
    if verdict == Verdict.RETRY:
        values = {
            "status": PENDING,
            "run_at": Now(),
            "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
        }
    elif verdict in (COMPLETED, FAILED):
        values = {"status": verdict, "completed_at": Now()}
    else:
        raise ValueError(f"unknown review verdict {verdict!r}")
    # The attempt's row was closed when the job went under review: the verdict is noted on it.
    ending = operator_ending(values, by, None, releases=verdict != Verdict.RETRY)
    return operator_write(
        qs,
        Q(status=REVIEW),
        ending,
        event=REVIEW_EVENTS[verdict],
        reason=reason,
        resolution=verdict,
    )


def operator_ending(
    values: dict[str, Any],
    by: str,
    ends: str | None,
    *,
    releases: Q | bool = True,
    reason: str = "",
    stops: bool = False,
) -> Ending:
    """The end of an operator action: an open attempt it ends is closed as `ends` by `by` (None:
    the attempts are left as they are); a lock may have been taken meanwhile (`contested`)."""
    error = ("", storable(reason)[:MAX_ERROR_LENGTH])
    return Ending(
        values,
        releases=releases,
        outcome=ends,
        closes=ends is not None,
        by=by,
        error=error,
        stops=stops,
        contested=True,
    )


def operator_write(
    qs: LeaseReads[J],
    eligible: Q,
    ending: Ending,
    *,
    event: str,
    reason: str = "",
    resolution: str = "",
) -> Changed:
    """Apply an operator action, `ending`, to the selected jobs that are `eligible`, in batches
    of OPERATOR_BATCH_SIZE; return which changed.

    Each changed job gets an event (`event`, by `ending.by`, `reason`); the resolution of a
    review is noted on the ledger row that put the job under review.
    """
    changed: list[int] = []
    after_pk: int | None = 0
    while after_pk is not None:
        won, after_pk = operator_batch(qs, eligible, after_pk, ending, event, reason, resolution)
        changed += won
    return Changed(changed)


@retry_deadlocks
def operator_batch(
    qs: LeaseReads[J],
    eligible: Q,
    after_pk: int,
    ending: Ending,
    event: str,
    reason: str,
    resolution: str,
) -> tuple[list[int], int | None]:
    # One transaction per batch: the jobs' UPDATE (`end_executions()`: the rows locked, then one
    # UPDATE restating the precondition; the locks released passed on, the attempts it ended
    # closed, or left open while the job is stopping), and the events that record it commit
    # together, or not at all. Tested on all three databases (on SQLite the IMMEDIATE
    # transaction holds the database write lock, see check W003).
    with transaction.atomic(using=qs.db):
        rows = end_executions(qs, eligible & Q(pk__gt=after_pk), ending, limit=OPERATOR_BATCH_SIZE)
        if not rows:
            return [], None
        if resolution:
            ledger_update(
                qs,
                [(row.pk, row.token) for row in rows],
                Q(resolution=""),
                resolution=resolution,
                resolved_by=ending.by,
                resolved_at=Now(),
            )
        record_events(qs, [row[:3] for row in rows], event, ending.by, reason)
    return [row.pk for row in rows], rows[-1].pk


@retry_deadlocks
def enqueue_now(qs: LeaseReads[J], kind: str, payload: Any, *, key: str, by: str, reason: str) -> J:
    """Enqueue a job of `kind` under idempotency key `key` for the operator `by`, with its
    operator event (`EventAction.RUN_NOW`); a job already under `key` is returned as it is, and
    nothing is recorded again."""
    # The job and its event commit together: a job enqueued this way always names who asked.
    with transaction.atomic(using=qs.db):
        found = qs.filter(idempotency_key=key).first()
        if found is not None:
            return found
        job = enqueue(qs, kind, payload, idempotency_key=key)
        if not recorded(qs, job.pk, EventAction.RUN_NOW):
            # Else a process racing this one with the same key enqueued the job first.
            row = (job.pk, job.lease_token, job.attempts)
            record_events(qs, [row], EventAction.RUN_NOW, by, reason)
    return job


def recorded(qs: LeaseReads[J], pk: int, action: str) -> bool:
    """Whether job `pk` has an operator event `action`, as committed now (a locking read:
    MariaDB's plain reads keep the transaction's first snapshot); True without an event log."""
    label = qs.model.event_model
    if not label:
        return True
    events = apps.get_model(label).objects.using(qs.db).filter(job_ref=pk, action=action)
    return bool(list(events.select_for_update().values_list("pk", flat=True)[:1]))


def record_events(
    qs: LeaseReads[J],
    rows: list[tuple[int, int, int]],
    action: str,
    by: str,
    reason: str,
    changes: dict[str, Any] | None = None,
) -> None:
    """Record `action` by `by` on each job of `rows` (id, token, attempts), as an operator
    event: why (`reason`), and what an edit changed (`changes`: field -> [old, new])."""
    label = qs.model.event_model
    if not label:
        return
    events = apps.get_model(label)
    events.objects.using(qs.db).bulk_create(
        events(
            # `job` is the concrete event log's foreign key (see AbstractJobEvent).
            **{"job_id": pk},
            job_ref=pk,
            token=token,
            attempts=attempts,
            action=action,
            by=by,
            reason=storable(reason)[:MAX_ERROR_LENGTH],
            changes=changes,
        )
        for pk, token, attempts in rows
    )
