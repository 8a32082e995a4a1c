"""A model-based test of the lease state machine: Hypothesis drives the real API on the real
database (whichever `DATABASE_URL` selects) with several jobs and owners, and checks after every
step, reading the database, the guarantees the README makes:

1. One owner at a time: a job has at most one open attempt (ledger row without `ended_at`); a
   processing job has exactly one, under its current owner and fencing token; any other job has
   none.
2. The fencing token of a job strictly grows with every acquisition and is never handed out
   twice: the ledger's tokens rise with its attempt numbers, and a job's token never goes back.
   Not even across a failover that lost the last commits (the rule `failover` puts the tables
   back as a standby had them at `standby_replays`): a token issued after it is none that any
   acquisition of the job had before, lost or kept.
3. A record of every attempt: exactly one ledger row per acquisition, numbered 1..n, and
   `attempts` equals the number of acquisitions the API reported.
4. The ledger is append-only: a closed row never changes again, except that `fenced_at` may be
   set once (its holder came back and was refused) and the row that put its job under review (a
   watcher's review, a timeout or a cancel after a checkpoint) gets its verdict once. Operator
   actions are recorded beside it: one event per job changed, with who and why (an edit of a
   pending job also each old and new value), never changed afterwards.
5. A worker that lost its lease cannot write: its write raises `LeaseLost` (`Cancelled` exactly
   when an operator's `cancel()` ended that lease) and leaves every job row and every ledger row
   as they were (only `fenced_at` of its own attempt may be set).
6. A job of a kind under the review policy that passed a checkpoint is never run again blindly:
   no claim takes over its expired lease, the watcher never returns it to pending, and no
   attempt of it ends "lease_lost" or "rescued" after a checkpoint.
7. Nothing abandoned and the columns agree with each other (the model's check constraints and
   more): a processing job has an owner and a lease end; a job has `completed_at` exactly when
   it is completed, failed or cancelled; `attempts <= max_attempts`; a pending job has an attempt
   left.

The jobs are of two locks, of two payments (locked by `payment_id`, `LOCK_BY_PAYMENT`), or of
none, and the README's job locks ("one at a time, in enqueue order: a job starts only once
every earlier job of its lock is completed, failed or cancelled"; "a unique index admits one
lock holder per lock") hold, for every lock:

8. One holder: at most one job of a lock is pending, processing or under review, and its
   `lock_holder` is the lock; a non-NULL `lock_holder` is its row's lock, on a row in one of
   those statuses; a waiting job has a lock and no `lock_holder`; a finished job has none.
9. Nothing stranded: a lock with a waiting job has a holder (the lock is passed on in the
   transaction that finishes the holder).
10. Enqueue order: when a job of a lock is claimed for the first time, every earlier job of the
    lock is completed, failed or cancelled, except one an operator requeued while this job
    held the lock (it waits, and runs next).
11. One at a time: the attempts (`claimed_at` to `ended_at`) of different jobs of a lock never
    overlap in the ledger.

A third kind has a `limit=` (`@job_handler(kind, limit=LIMIT)`), and the README's "at most N
jobs of the kind processing at once, across every worker" holds:

13. At most `LIMIT` jobs of the limited kind are processing with a live lease (an expired one
    no longer counts: its slot is free, and a claim that takes it over takes that slot); a
    claim or `claim_job()` takes a job of the kind only while one is free.

14. A cancelled job never runs again: it stays cancelled, with the attempts it had, until an
    operator requeues it (`cancel()` reaches running jobs; a review-policy job past its
    checkpoint goes to review instead).

15. Nothing committed is lost: every attempt in the ledger (so every attempt that ends failed or
    rescued) is one the API call that made it handed out, even when a gate of a later part of
    its claim was held by a silent session (a second connection idle in its transaction). A
    fourth kind, throttled and never enqueued, gives a claim of every kind such a later part;
    while a gate is held, its kind is skipped and every other kind is still claimed.

16. What an execution held is released by its end, never by a state change alone: while the
    handler of a lease still runs (claimed, and no outcome of its holder's, no acknowledgement
    of a stop since) and its lease has not expired, no other job of its lock is pending or
    running, and its kind's `limit=` counts it. An operator's cancel or a time-out while the
    handler runs makes the job stopping (its holder's writes refused); the holder's
    acknowledgement (`holder_returns`), or the watcher once the lease expired, ends it. Only a
    forced requeue or failure takes a running job's lock on purpose (it fences its holder).

18. A recorded step is never run again and a fenced-out holder records nothing: a step runs
    and is recorded exactly while its holder holds the job with a live lease (its result, its
    token and attempt); a step recorded before is returned, not run; every recorded step was
    recorded under a token that acquired its job, within that attempt, once per (job, name),
    and never changes. A step that started and did not record leaves its marker in the job's
    checkpoint (unless one was set), which the review policy reads as any other checkpoint.

17. An error text of adversarial length (a megabyte a PostgreSQL error quotes, runs of what the
    redactor's patterns loop on) is recorded, cut to MAX_ERROR_LENGTH and redacted, on the job
    and on its attempt's row, and its failure follows the same rules as any other.

19. A paused kind: no claim (of its kind, of every kind, of one job, with completions) takes a
    job of it after its pause committed (no ledger row of the kind has a `claimed_at` past its
    `paused_at`); running jobs of it go on and end as before; its pending job holding a lock
    keeps the jobs behind it waiting; a limited kind's slots are counted as before. Pausing a
    kind without a handler is refused and writes nothing; pausing a paused kind, or resuming a
    running one, changes nothing.
20. A job enqueued after others (`after=`) waits for them: its count of prerequisites not
    completed is exact, it holds no lock and has no attempt while one is left, and its first
    attempt was claimed after every one of them completed (the ledger's `claimed_at` against
    their `completed_at`). A failed or cancelled prerequisite holds it; an operator's requeue
    of it, cancelled meanwhile, leaves it waiting for what is left.
21. A group's callback (`enqueue_group()`) runs once every member has ended: until then it
    counts exactly the members not ended, records each ended member as it is (kind, final
    status, last error), holds no lock and has no attempt; it is released in the step that
    ended the last member (every member final then, as recorded), once: its results never
    change after. Members and callbacks are of every kind (the limited one, paused or not) and
    lock, a member may wait for another job (`after=`), and every rule (claims, completions,
    failures, time-outs, stops, cancels, operator actions, the watcher) acts on them.
22. The queue history counts what happened: the watcher's aggregation of a minute (here the
    current one) gives, per kind, the jobs completed and failed in it, the retried attempts
    that ended in it (claimed within LONG_RUNNING before it), the due backlog, and the wait and
    run time of the attempt that finished each finished job, bucket by bucket as the rows say,
    whatever locks, limits, cancels, time-outs, pauses, dependencies and rescues did.
24. A job enqueued under a span keeps the trace context its enqueue stored (the span's W3C
    `traceparent`), through every claim, ending, lock passed on, rescue, operator action and
    failover; a job enqueued outside a span has none.

A second machine, `ScheduleMachine`, drives `SCHEDULES` (one schedule that catches up, one that
does not, and a cron schedule in Berlin's time from the eve of a DST change, whose fire times
pass as the database clock moves) through passes of the schedulers, ticks passing (or the clock
going back), their jobs running or failing, `prune()` between ticks, and edits of the schedules
(and their rollbacks) between ticks, and checks the README's "exactly one job per tick" (per
fire time), whatever was pruned or edited:

23. A schedule run now by an operator enqueues one job of its own key, apart from every tick
    (which go on as before), recorded once as the operator's; the same request again, while its
    job is kept, is that job.

12. A pass enqueues exactly the ticks due (the current one unless enqueued already; with
    `catch_up` also the one before it, if it was missed), and never a tick enqueued before;
    every schedule job in the table is the one job its tick was ever given. A schedule edited
    or rolled back between ticks starts a new series: no tick before the edit is enqueued
    that the previous definition had not enqueued, and each series has one job per tick.

Besides, each rule checks what its own call must have done (a claim takes exactly the jobs the
specification makes claimable, an operator action changes exactly the jobs its eligibility
names, a holder's write wins exactly while it holds the lease, an enqueue waits exactly when its
lock has a holder, a requeued job of a lock keeps the lock it held or rejoins the lock), and that
an operator action without "force" in its name never takes a live lease.

Time passes only through the database clock: a rule moves `lease_until` or `run_at` into the
past with an UPDATE, never a mocked clock. Leases and retry delays are long (`TTL`, 600 s), so
nothing expires or comes due unless a rule says so.

The default run is derandomized (the same examples every run); `LEASES_STATE_MACHINE_EXAMPLES=N`
runs N examples with fresh random choices (`LEASES_STATE_MACHINE_STEPS`: steps per example), and
`LEASES_STATE_MACHINE_MARATHON=1` lets one job per example fail 1024 times first, the backoff's
largest exponent (seconds per example). docs/concepts.md has the commands.
"""

import copy
import logging
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator
from datetime import UTC, datetime, timedelta
from itertools import combinations, takewhile
from typing import Any

import pytest
from django.db import DataError, connection, connections
from django.db.models import BooleanField, Case, Exists, F, OuterRef, QuerySet, When
from django.db.models.functions import Now
from django.db.models.sql.compiler import SQLCompiler
from django.test import override_settings
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from opentelemetry.sdk.trace import TracerProvider

from django_leases import job_handler
from django_leases.backoff import retry_delay
from django_leases.conf import leases_settings
from django_leases.exceptions import Cancelled, IdempotencyKeyReused, InvalidArgument, LeaseLost
from django_leases.handlers import registered_kinds, unregister
from django_leases.lease import Lease, Presence
from django_leases.limits import MAX_ERROR_LENGTH
from django_leases.models import (
    JobAttempt,
    JobEvent,
    JobStep,
    KindEvent,
    PausedKind,
    PaymentJob,
    ScheduleState,
    Worker,
)
from django_leases.querysets.claims import failures_of
from django_leases.querysets.history import MINUTE, KindMinute, aggregate_minute, bucket_of
from django_leases.querysets.schedules import Series
from django_leases.schedules import Schedule, configured, database_now, enqueue_due, run_now
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    STOPPING,
    WAITING,
    AttemptOutcome,
)
from django_leases.watcher import StuckWatcher

from .leasing import database_micros
from .throttled import held_gate
from .ticking import DatabaseClock, of_series, prune_finished, run, tick_of, ticks_pass

pytestmark = pytest.mark.django_db(transaction=True)

FINAL = {COMPLETED, FAILED, CANCELLED}
# The statuses in which a job of a lock holds it.
HOLDING = {PENDING, PROCESSING, STOPPING, REVIEW}
# The statuses of a job whose handler may run: its lease counts against its kind's limit.
LEASED = {PROCESSING, STOPPING}
# How a job is locked: (enqueue's `lock`, `payment_id`). None with a payment id locks it by its
# payment (LOCK_BY_PAYMENT); "" opts out. Most jobs share one of three locks ("L1", "L2" and
# "payment:p1"), so that locks are contended within a few steps.
LOCKING = st.sampled_from(
    [
        (None, None),
        ("", "p1"),
        ("L1", None),
        ("L1", None),
        ("L1", "p2"),
        ("L2", None),
        (None, "p1"),
        (None, "p1"),
    ]
)
# Kinds without handlers here: no reconcile hook resolves their reviews behind the test.
RETRY_KIND, REVIEW_KIND = "payout", "settle"
# Retry delays of exactly 600 s: a retried job becomes due only when a rule says so. A backoff
# of seconds came due on a slow machine while the example ran, so that a claim took different
# jobs when Hypothesis replayed the same steps (FlakyStrategyDefinition).
LEASE_SETTINGS = {
    "STUCK_POLICY": "retry",
    "STUCK_POLICY_BY_KIND": {REVIEW_KIND: "review"},
    "BACKOFF_BASE": 600,
    "BACKOFF_MAX": 600,
}
# A kind with `limit=LIMIT`, registered for the machine's run only (its handler never runs).
LIMITED_KIND, LIMIT = "capped_payout", 2
# A throttled kind with no jobs, claimed after LIMITED_KIND: its held gate fails a claim's later
# part (15). Each held gate costs a claim the gate's wait (1 s), so an example holds one at
# most, and one example in four may (drawn: a replayed example makes the same choices).
SILENT_KIND = "capped_refund"
GATES_HELD = st.sampled_from([0, 0, 0, 1])
KINDS = st.sampled_from([RETRY_KIND, REVIEW_KIND, LIMITED_KIND])
# 21. The spans an enqueue runs in: the SDK's, so that they have valid ids to store.
TRACER = TracerProvider().get_tracer("tests.state_machine")
CLAIM_KINDS = st.sampled_from(
    [None, [RETRY_KIND], [REVIEW_KIND], [LIMITED_KIND], [LIMITED_KIND, RETRY_KIND]]
)
OWNERS = ("w1", "w2", "w3")
WATCHERS = ("watcher", "slow-watcher")
TTL = 600  # seconds: no lease ends by itself while an example runs
GONE_AFTER = 120  # WORKER_GONE_AFTER's default: shorter than the TTL, as it may be configured
PAST = timedelta(seconds=30)
LATER = timedelta(seconds=3600)
FLAG = BooleanField()
# What a rescue decides on, and so must restate.
RESTATED = ("lease_token", "checkpoint", "max_attempts")
# What may still change in a closed ledger row, once: when its holder was refused after losing
# the lease, and the verdict on a row that put its job under review.
APPEND_ONCE = {"fenced_at"}
VERDICT = {"resolution", "resolved_by", "resolved_at"}
# Outcomes of the attempts that put a job under review: the watcher's, and a timeout or a cancel
# after a checkpoint of a review-policy kind.
PUT_UNDER_REVIEW = ("review", "timed_out", "cancelled")

# Attempts after which the backoff's exponent no longer fits a float (2 ** 1024).
MARATHON = 1024
WITH_MARATHON = bool(os.environ.get("LEASES_STATE_MACHINE_MARATHON"))
CARD = "4111111111111111"
"""A card number inside the adversarial error texts: never stored."""
ERRORS: tuple[BaseException, ...] = (
    RuntimeError("psp said no"),
    # 17. A megabyte value PostgreSQL quotes whole, and runs of what the redactor's patterns
    # loop on: the redaction that once took seconds per 20,000 characters, under the GIL.
    DataError(f'invalid input syntax for type integer: "{CARD}{chr(10) * 1_000_000}"'),
    DataError(f" near '{CARD}" * 43_000),
    DataError(f"refused {CARD}" + "\n \t" * 333_000),
)

# The steps a holder runs (`lease.step()`), and what a step's function raises when its worker
# "crashes" after the provider answered.
STEP_NAMES = st.sampled_from(["authorize", "capture"])


class StepInterruptedError(Exception):
    """A step's function stopped after the provider's answer, before the step's record."""


EXAMPLES = int(os.environ.get("LEASES_STATE_MACHINE_EXAMPLES", "0"))
STEPS = int(os.environ.get("LEASES_STATE_MACHINE_STEPS", "40"))


class Snapshot:
    """A `.values()` query compiled on its first run and sent as the same SQL after that, its
    rows converted as the ORM converts them: the machines read every row around each step, and
    building the query each time was the larger part of the read."""

    def __init__(self, queryset: QuerySet[Any, dict[str, Any]]) -> None:
        self.queryset = queryset
        self.compiled: tuple[SQLCompiler, str, tuple[Any, ...], list[str]] | None = None

    def __call__(self) -> list[dict[str, Any]]:
        if self.compiled is None:
            query = self.queryset.query
            compiler = query.get_compiler(self.queryset.db)
            sql, params = compiler.as_sql()
            names = [*query.extra_select, *query.values_select, *query.annotation_select]
            self.compiled = compiler, sql, tuple(params), names
        compiler, sql, params, names = self.compiled
        with connections[self.queryset.db].cursor() as cursor:
            cursor.execute(sql, params)
            fetched = cursor.fetchall()
        return [dict(zip(names, row, strict=True)) for row in compiler.results_iter([fetched])]


JOBS = Snapshot(
    PaymentJob.objects.annotate(
        live=Case(When(lease_until__gte=Now(), then=True), default=False, output_field=FLAG),
        due=Case(When(run_at__lte=Now(), then=True), default=False, output_field=FLAG),
        paused=Exists(
            PausedKind.objects.filter(job_model="django_leases.paymentjob", kind=OuterRef("kind"))
        ),
    ).values()
)
LEDGER = Snapshot(JobAttempt.objects.order_by("id").values())
EVENTS = Snapshot(JobEvent.objects.order_by("id").values())
STEP_ROWS = Snapshot(JobStep.objects.order_by("id").values())


def job_rows() -> dict[int, dict[str, Any]]:
    """Every job row, with whether its lease is live and whether it is due, by the database
    clock."""
    return {row["id"]: row for row in JOBS()}


def stored(rows: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """`job_rows()` without what the clock decides (`live`, `due`) and the kind's pause."""
    clocked = {"live", "due", "paused"}
    return {pk: {k: v for k, v in row.items() if k not in clocked} for pk, row in rows.items()}


def seconds(duration: timedelta) -> float:
    return duration.total_seconds()


def ledger_rows() -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in LEDGER()}


def event_rows() -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in EVENTS()}


def step_rows() -> dict[tuple[int, str], dict[str, Any]]:
    """Every recorded step, by (job id, step name)."""
    rows = STEP_ROWS()
    steps = {(row["job_ref"], row["name"]): row for row in rows}
    assert len(steps) == len(rows), f"a step recorded twice: {rows}"
    return steps


def ever_held(owner: str) -> list[tuple[int, int]]:
    """Every (job, token) `owner` ever acquired, from the ledger: a job it holds again under a
    newer token is in it twice, as a worker that holds the old and the new lease sends it."""
    return list(
        JobAttempt.objects.filter(owner=owner).order_by("token").values_list("job_ref", "token")
    )


def held(row: dict[str, Any], lease: PaymentJob) -> bool:
    """Whether `lease` (a claimed job as the claim returned it) still holds the job `row`."""
    return (
        row["status"] == PROCESSING
        and row["lease_owner"] == lease.lease_owner
        and row["lease_token"] == lease.lease_token
    )


def claimable(row: dict[str, Any]) -> bool:
    """The specification of a claimable job: due and pending, or an expired lease that the
    review policy does not hold, with an attempt left, of a kind not paused (18)."""
    if row["attempts"] >= row["max_attempts"] or row["paused"]:
        return False
    if row["status"] == PENDING:
        return bool(row["due"])
    if row["status"] == PROCESSING and not row["live"]:
        return not (row["kind"] == REVIEW_KIND and row["checkpoint"])
    return False


def limited_live(rows: dict[int, dict[str, Any]], finished: Collection[int] = ()) -> int:
    """How many jobs of the limited kind hold a live lease (but those in `finished`)."""
    return sum(
        1
        for pk, row in rows.items()
        if row["kind"] == LIMITED_KIND and row["status"] in LEASED and row["live"]
        if pk not in finished
    )


def claims_expected(
    rows: dict[int, dict[str, Any]],
    kinds: list[str] | None,
    limit: int,
    finished: Collection[int] = (),
) -> tuple[int, set[int]]:
    """How many jobs a claim of `kinds` takes from `rows`, and which it may take: the limited
    kind only up to its free slots (13), every other kind as far as `limit` allows."""
    wanted = {
        pk
        for pk, row in rows.items()
        if pk not in finished and claimable(row) and (kinds is None or row["kind"] in kinds)
    }
    limited = sum(1 for pk in wanted if rows[pk]["kind"] == LIMITED_KIND)
    free = max(0, LIMIT - limited_live(rows, finished))
    return min(limit, min(free, limited) + len(wanted) - limited), wanted


def passed_on(rows: dict[int, dict[str, Any]], finished: Collection[int]) -> dict[int, Any]:
    """The rows of the waiting jobs the locks of the `finished` jobs (holders a moment ago) pass
    on to, as they are then: each lock's first waiting job (lowest id) not waiting for
    prerequisites, pending and holding it."""
    promoted = {}
    for pk in finished:
        lock = rows[pk]["lock"]
        waiting = [
            o
            for o, row in rows.items()
            if lock and row["lock"] == lock and row["status"] == WAITING and not row["unmet"]
        ]
        if waiting:
            promoted[min(waiting)] = {**rows[min(waiting)], "status": PENDING, "lock_holder": lock}
    return promoted


def completing(rows: dict[int, dict[str, Any]], completed: Collection[int]) -> dict[int, Any]:
    """The rows the completion of the `completed` jobs (holders a moment ago) changes besides
    their own, as they are then: the locks passed on (`passed_on`), then each job enqueued
    after them counts them as met, and one waiting whose last prerequisite they were is
    released: pending, or of a lock, holding it if it is free, else waiting in its line."""
    changed = passed_on(rows, completed)
    done = {
        pk: {**rows[pk], "status": COMPLETED, "lock_holder": None, "last_error": ""}
        for pk in completed
    }
    now = {**rows, **done, **changed}
    for pk, row in now.items():
        met = [p for p in completed if pk in (rows[p]["dependents"] or [])]
        if not met or not row["unmet"]:
            continue
        if row["group_results"] is not None:
            holders = {other["lock_holder"] for other in now.values()}
            changed[pk] = now[pk] = noted(row, {p: now[p] for p in met}, holders)
            continue
        new = {**row, "unmet": row["unmet"] - len(met)}
        if new["unmet"] == 0 and row["status"] == WAITING:
            held = {other["lock_holder"] for other in now.values()}
            if not row["lock"] or row["lock"] not in held:
                new = {**new, "status": PENDING, "lock_holder": row["lock"] or None}
        changed[pk] = now[pk] = new
    return changed


def noted(
    row: dict[str, Any], members: dict[int, dict[str, Any]], holders: Collection[str | None]
) -> dict[str, Any]:
    """The group's callback `row` once its `members` (their rows now; each listing it) ended
    or were requeued: a final one recorded as it is, counted once; another one taken back. With
    none left it is released: pending, or of a lock, holding it if it is free (`holders`),
    else waiting in its line. A callback released already no longer changes (21)."""
    if not row["unmet"]:
        return row
    results = dict(row["group_results"])
    for pk, member in members.items():
        if member["status"] in FINAL:
            results[str(pk)] = {
                "pk": pk,
                "kind": member["kind"],
                "status": member["status"],
                "last_error": member["last_error"],
            }
        else:
            results.pop(str(pk), None)
    left = row["unmet"] - (len(results) - len(row["group_results"]))
    new = {**row, "group_results": results, "unmet": left}
    if left == 0 and row["status"] == WAITING and (not row["lock"] or row["lock"] not in holders):
        new |= {"status": PENDING, "lock_holder": row["lock"] or None}
    return new


def callbacks_noting(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], ended: Collection[int]
) -> dict[int, dict[str, Any]]:
    """The group callbacks the ends of the jobs `ended` (their executions, or an operator's
    action) change, as `noted()` makes them from those jobs as they are `after`."""
    expected = {}
    for pk, row in before.items():
        members = {m: after[m] for m in ended if pk in (before[m]["dependents"] or [])}
        if row["group_results"] is None or not members or not row["unmet"]:
            continue
        holders = {other["lock_holder"] for o, other in after.items() if o != pk}
        expected[pk] = noted(row, members, holders)
    return expected


def expired(row: dict[str, Any]) -> bool:
    return row["status"] == PROCESSING and not row["live"]


def stopped(row: dict[str, Any], lease: Any) -> bool:
    """Whether the job `row` was stopped (cancelled, timed out) while `lease` held it."""
    return (
        row["status"] == STOPPING
        and row["lease_owner"] == lease.lease_owner
        and row["lease_token"] == lease.lease_token
    )


def operator_eligible(name: str, row: dict[str, Any]) -> bool:
    """Which jobs each operator action changes (docs/operations.md)."""
    status = row["status"]
    if name == "requeue":
        return status in (FAILED, CANCELLED, REVIEW, PENDING) or expired(row)
    if name == "force_requeue":
        return status not in (COMPLETED, WAITING)
    if name == "release_stuck":
        return expired(row)
    if name == "mark_failed":
        return status in (PENDING, WAITING, REVIEW) or expired(row)
    if name == "force_mark_failed":
        return status in (PENDING, WAITING, REVIEW, PROCESSING, STOPPING)
    if name == "cancel":
        return status in (PENDING, WAITING)
    if name == "force_cancel":
        return status in (PENDING, WAITING, PROCESSING)
    return status == REVIEW  # resolve_review_*


# The event each admin action records beside the ledger.
OPERATOR_EVENT = {
    "requeue": "requeued",
    "force_requeue": "force_requeued",
    "release_stuck": "released",
    "mark_failed": "failed",
    "force_mark_failed": "failed",
    "cancel": "cancelled",
    "force_cancel": "force_cancelled",
    "resolve_review_completed": "review_completed",
    "resolve_review_retry": "review_retry",
    "resolve_review_failed": "review_failed",
}
OPERATOR_STATUS = {
    "requeue": PENDING,
    "force_requeue": PENDING,
    "release_stuck": PENDING,
    "mark_failed": FAILED,
    "force_mark_failed": FAILED,
    "cancel": CANCELLED,
    "force_cancel": CANCELLED,
    "resolve_review_completed": COMPLETED,
    "resolve_review_retry": PENDING,
    "resolve_review_failed": FAILED,
}


def operator_call(name: str, jobs: Any, by: str, why: str = "") -> int:
    """Call the queryset method behind the admin action `name`, as the admin does, with the
    operator's reason `why` (which the event records)."""
    if name == "requeue":
        return int(jobs.requeue(by=by, reason=why))
    if name == "force_requeue":
        return int(jobs.requeue(force=True, by=by, reason=why))
    if name == "release_stuck":
        return int(jobs.release_stuck(by=by, reason=why))
    if name in ("mark_failed", "force_mark_failed"):
        force = name == "force_mark_failed"
        return int(jobs.mark_failed(reason=why, force=force, by=by))
    if name == "cancel":
        return int(jobs.cancel(running=False, by=by, reason=why))
    if name == "force_cancel":
        return int(jobs.cancel(by=by, reason=why))
    return int(jobs.resolve_review(name.removeprefix("resolve_review_"), by=by, reason=why))


class WorkerClock:
    """A worker's monotonic clock in the model: real time, plus the pauses it was given (a pause
    moves the database's times back by as much: time passed for both)."""

    def __init__(self) -> None:
        self.paused = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.paused


def key(job: Any) -> tuple[int, int]:
    return job.pk, job.lease_token


class LeaseMachine(RuleBasedStateMachine):
    """Jobs of two kinds (one under each stuck policy), three owners, operators, watchers."""

    jobs = Bundle("jobs")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        # Each example starts from empty tables: examples never see each other's rows.
        JobAttempt.objects.all().delete()
        JobEvent.objects.all().delete()
        JobStep.objects.all().delete()
        PaymentJob.objects.all().delete()
        Worker.objects.all().delete()
        PausedKind.objects.all().delete()
        KindEvent.objects.all().delete()
        self.acquisitions: Counter[int] = Counter()
        self.tokens: dict[int, int] = {}
        # Every token each job was ever issued by an acquisition, lost in a failover or not.
        self.issued: dict[int, set[int]] = {}
        # What a standby had replayed at `standby_replays`, and the model's state then.
        self.standby: tuple[list[dict], list[dict], list[dict], dict[str, Any]] | None = None
        self.closed: dict[int, dict[str, Any]] = {}
        self.events: dict[int, dict[str, Any]] = {}
        # The recorded steps as the last step read them (18: they never change), and those the
        # standby had replayed at `standby_replays`.
        self.steps: dict[tuple[int, str], dict[str, Any]] = {}
        self.standby_steps: list[dict[str, Any]] = []
        # (job id, token) of attempts whose holder's own write ended them.
        self.finished_by_holder: set[tuple[int, int]] = set()
        # Expired leases a watcher read and decided on, not yet written back.
        self.watcher_read: list[tuple[Any, str, str]] = []
        # Per lock holder: the earlier jobs of its lock an operator requeued while it held the
        # lock (they wait, and may stay unfinished when it first runs).
        self.requeued_behind: dict[int, set[int]] = {}
        # On request only: one job per example may go through MARATHON attempts (seconds each).
        self.marathon = WITH_MARATHON
        # What each worker believes of the leases it claimed: `Lease` objects on its own clock,
        # which end a TTL after their last renewal or once its registry row may look gone.
        self.clocks = {owner: WorkerClock() for owner in OWNERS}
        self.presence = {owner: Presence(GONE_AFTER, clock=self.clocks[owner]) for owner in OWNERS}
        self.beliefs: dict[tuple[int, int], Lease] = {}
        # (job id, token) of the leases an operator's cancel() ended; per job cancelled, its
        # attempts then (until an operator requeues it).
        self.cancelled_leases: set[tuple[int, int]] = set()
        self.cancelled: dict[int, int] = {}
        self.gates_left = 0
        # (job id, token) of the leases whose handler still runs (16): claimed, and neither
        # ended by a write of its holder nor by the acknowledgement of a stop.
        self.running: set[tuple[int, int]] = set()
        # The results of each group's callback, as they were when it was released (21).
        self.released_groups: dict[int, dict[str, Any]] = {}
        # 24. The trace context each job's enqueue stored (None: enqueued outside a span).
        self.trace_contexts: dict[int, dict[str, str] | None] = {}
        for owner in OWNERS:
            self.worker_beats(owner)

    # ---- enqueue and claims -----------------------------------------------------------------

    @initialize(
        target=jobs,
        kinds=st.lists(st.tuples(KINDS, LOCKING), min_size=2, max_size=4),
        max_attempts=st.integers(1, 3),
    )
    def several_jobs(
        self, kinds: list[tuple[str, tuple[str | None, str | None]]], max_attempts: int
    ) -> Any:
        """Every example starts with a few due jobs, so that its steps act on jobs."""
        return multiple(
            *(self.enqueue(kind, max_attempts, False, locking) for kind, locking in kinds)
        )

    @rule(target=jobs, kind=KINDS, locking=LOCKING)
    def enqueue_traced(self, kind: str, locking: tuple[str | None, str | None]) -> int:
        """24. An enqueue inside a span (a request's, say) stores the span's trace context."""
        with TRACER.start_as_current_span("request") as span:
            pk = self.enqueue(kind, 3, False, locking)
        ids = span.get_span_context()
        context = job_rows()[pk]["trace_context"]
        assert context["traceparent"] == (
            f"00-{ids.trace_id:032x}-{ids.span_id:016x}-{ids.trace_flags:02x}"
        )
        self.trace_contexts[pk] = context
        return pk

    @rule(
        target=jobs,
        kind=KINDS,
        max_attempts=st.integers(1, 3),
        later=st.booleans(),
        locking=LOCKING,
    )
    def enqueue(
        self, kind: str, max_attempts: int, later: bool, locking: tuple[str | None, str | None]
    ) -> int:
        lock, payment_id = locking
        held_before = {row["lock_holder"] for row in job_rows().values()}
        job = PaymentJob.objects.enqueue(
            kind,
            {"amount": 100},
            max_attempts=max_attempts,
            run_at=LATER if later else None,
            lock=lock,
            payment_id=payment_id,
        )
        row = job_rows()[job.pk]
        expected_lock = f"payment:{payment_id}" if lock is None and payment_id else lock or ""
        assert row["lock"] == expected_lock
        # Behind the lock's holder if it has one, else its holder: next in line.
        if expected_lock in held_before:
            assert (row["status"], row["lock_holder"]) == (WAITING, None)
        else:
            assert (row["status"], row["lock_holder"]) == (PENDING, expected_lock or None)
        assert (row["attempts"], row["lease_token"]) == (0, 0)
        assert row["due"] is not later
        self.trace_contexts.setdefault(job.pk, None)
        return int(job.pk)

    @rule(
        target=jobs,
        kind=st.sampled_from([RETRY_KIND, REVIEW_KIND]),
        amount=st.sampled_from([100, 200]),
        keys=st.lists(st.sampled_from([None, "batch-1", "batch-2", "batch-3"]), max_size=4),
        locking=LOCKING,
    )
    def enqueue_many(
        self, kind: str, amount: int, keys: list[str | None], locking: tuple[str | None, str | None]
    ) -> Any:
        """A batch follows enqueue()'s rules: a key stored already or repeated in the batch
        returns its first job; of a lock, the first new job is next in line if the lock has no
        holder, every later one waits, in the payloads' order. A key stored already with
        another kind or payload rejects the batch, naming the key, and changes nothing."""
        lock, payment_id = locking
        before = job_rows()
        held_before = {row["lock_holder"] for row in before.values()}
        first_job = {row["idempotency_key"]: pk for pk, row in before.items()}
        payload = {"amount": amount}
        reused = [
            key
            for key in keys
            if key is not None
            and key in first_job
            and (before[first_job[key]]["kind"], before[first_job[key]]["payload"])
            != (kind, payload)
        ]
        if reused:
            with pytest.raises(IdempotencyKeyReused, match=f"idempotency_key '{reused[0]}'"):
                PaymentJob.objects.enqueue_many(
                    kind, [payload] * len(keys), idempotency_keys=keys, lock=lock,
                    payment_id=payment_id,
                )  # fmt: skip
            assert stored(job_rows()) == stored(before)
            return multiple()
        batch = PaymentJob.objects.enqueue_many(
            kind,
            [payload] * len(keys),
            idempotency_keys=keys,
            lock=lock,
            payment_id=payment_id,
        )
        rows = job_rows()
        expected_lock = f"payment:{payment_id}" if lock is None and payment_id else lock or ""
        new: list[int] = []
        for key, job in zip(keys, batch, strict=True):
            if key is not None and key in first_job:
                assert job.pk == first_job[key], key
                continue
            assert job.pk not in before and job.pk not in new
            first_job[key] = job.pk
            new.append(job.pk)
        assert new == sorted(new), "ids in the payloads' order"
        for position, pk in enumerate(new):
            row = rows[pk]
            assert (row["lock"], row["attempts"], row["lease_token"]) == (expected_lock, 0, 0)
            if expected_lock and (expected_lock in held_before or position > 0):
                assert (row["status"], row["lock_holder"]) == (WAITING, None)
            else:
                assert (row["status"], row["lock_holder"]) == (PENDING, expected_lock or None)
        return multiple(*new)

    @rule(
        target=jobs,
        kind=KINDS,
        prerequisites=st.lists(jobs, min_size=1, max_size=2, unique=True),
        locking=LOCKING,
    )
    def enqueue_after(
        self, kind: str, prerequisites: list[int], locking: tuple[str | None, str | None]
    ) -> Any:
        """A job enqueued after others (18) waits until each of them has completed: pending at
        once (or behind its lock's holder) if they all have, else waiting, counted on each
        prerequisite not completed. A job that is gone (a failover lost it) is refused, and
        nothing changes."""
        lock, payment_id = locking
        before = job_rows()
        if any(pk not in before for pk in prerequisites):
            with pytest.raises(InvalidArgument, match="after: no job"):
                PaymentJob.objects.enqueue(
                    kind, lock=lock, payment_id=payment_id, after=prerequisites
                )
            assert stored(job_rows()) == stored(before)
            return multiple()
        job = PaymentJob.objects.enqueue(
            kind, {"amount": 100}, lock=lock, payment_id=payment_id, after=prerequisites
        )
        rows = job_rows()
        row = rows[job.pk]
        unmet = [pk for pk in prerequisites if before[pk]["status"] != COMPLETED]
        assert (row["waits_for"], row["unmet"], row["attempts"]) == (prerequisites, len(unmet), 0)
        if unmet or row["lock"] in {other["lock_holder"] for other in before.values()}:
            assert (row["status"], row["lock_holder"]) == (WAITING, None)
        else:
            assert (row["status"], row["lock_holder"]) == (PENDING, row["lock"] or None)
        for pk, old in before.items():
            listed = old["dependents"]
            if pk in unmet:
                listed = [*(listed or []), job.pk]
            assert stored({pk: rows[pk]}) == stored({pk: {**old, "dependents": listed}}), pk
        return int(job.pk)

    @rule(
        target=jobs,
        members=st.lists(st.tuples(KINDS, LOCKING), min_size=1, max_size=2),
        prerequisite=st.none() | jobs,
        then=KINDS,
        locking=LOCKING,
    )
    def enqueue_group(
        self,
        members: list[tuple[str, tuple[str | None, str | None]]],
        prerequisite: int | None,
        then: str,
        locking: tuple[str | None, str | None],
    ) -> Any:
        """A group (21): its members enqueued as `enqueue()` would (the first one after
        `prerequisite`, if it is still there), its callback waiting for every one of them,
        listed on each; nothing else changes but the prerequisite's list of dependents."""
        before = job_rows()
        after = [prerequisite] if prerequisite in before else None
        specs = [
            {"kind": kind, "payload": {"amount": 100}, "lock": lock, "payment_id": payment_id}
            for kind, (lock, payment_id) in members
        ]
        if after:
            specs[0]["after"] = after
        lock, payment_id = locking
        group = PaymentJob.objects.enqueue_group(
            specs, then, {"amount": 100}, lock=lock, payment_id=payment_id
        )
        rows = job_rows()
        pks = [job.pk for job in group.members]
        callback = rows[group.callback.pk]
        assert (callback["waits_for"], callback["unmet"], callback["group_results"]) == (
            pks,
            len(pks),
            {},
        )
        assert (callback["status"], callback["attempts"], callback["lock_holder"]) == (
            WAITING,
            0,
            None,
        )
        for pk in pks:
            assert pk not in before and rows[pk]["attempts"] == 0
            assert rows[pk]["dependents"] == [group.callback.pk]
        for pk, old in before.items():
            if after and pk == prerequisite and old["status"] != COMPLETED:
                old = {**old, "dependents": [*(old["dependents"] or []), pks[0]]}
            assert stored({pk: rows[pk]}) == stored({pk: old}), pk
        return multiple(*pks, group.callback.pk)

    @rule(
        key=st.sampled_from(["batch-1", "batch-2", "batch-3"]),
        kind=st.sampled_from([RETRY_KIND, REVIEW_KIND]),
        amount=st.sampled_from([100, 200]),
    )
    def enqueue_with_a_used_key(self, key: str, kind: str, amount: int) -> None:
        """A key names one job, with its kind and payload: enqueue() with a stored key returns
        its job if both match, else raises naming the key; neither changes any row."""
        before = job_rows()
        first = next((pk for pk, row in before.items() if row["idempotency_key"] == key), None)
        if first is None:
            return
        payload = {"amount": amount}
        if (before[first]["kind"], before[first]["payload"]) == (kind, payload):
            assert PaymentJob.objects.enqueue(kind, payload, idempotency_key=key).pk == first
        else:
            with pytest.raises(IdempotencyKeyReused, match=f"idempotency_key '{key}'"):
                PaymentJob.objects.enqueue(kind, payload, idempotency_key=key)
        assert stored(job_rows()) == stored(before)

    def _acquired(
        self, claimed: list[PaymentJob], owner: str, before: dict[int, dict], started: float
    ) -> None:
        """Check the claims `owner` sent at `started` (its clock), and note what it believes."""
        after = job_rows()
        for job in claimed:
            self.beliefs[key(job)] = Lease(
                job, ttl=TTL, renewed_at=started, presence=self.presence[owner]
            )
            row, old = after[job.pk], before[job.pk]
            assert claimable(old), f"job {job.pk} was claimed from {old}"
            assert row["status"] == PROCESSING and row["lease_owner"] == owner and row["live"]
            assert row["attempts"] == old["attempts"] + 1 == job.attempts
            assert row["lease_token"] == job.lease_token > old["lease_token"]
            self._issued(job)
            self.running.add(key(job))
            if old["attempts"] == 0 and row["lock"]:
                self._runs_in_lock_order(job.pk, after)

    def _runs_in_lock_order(self, pk: int, rows: dict[int, dict[str, Any]]) -> None:
        """Invariant 10, at job `pk`'s first claim: every earlier job of its lock is
        finished, except one an operator requeued while `pk` held the lock (it waits), and one
        enqueued after other jobs, which joins its lock's line once they completed."""
        lock = rows[pk]["lock"]
        excused = self.requeued_behind.get(pk, set())
        early = {
            other: row["status"]
            for other, row in rows.items()
            if row["lock"] == lock
            and other < pk
            and row["status"] not in FINAL
            and not (row["waits_for"] and row["status"] == WAITING)
        }
        assert all(other in excused and status == WAITING for other, status in early.items()), (
            f"job {pk} of lock {lock!r} started before earlier jobs {early}"
        )

    @rule(
        target=leases,
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        kinds=CLAIM_KINDS,
    )
    def claim(self, owner: str, limit: int, kinds: list[str] | None) -> Any:
        before = job_rows()
        count, wanted = claims_expected(before, kinds, limit)
        started = self.clocks[owner]()
        claimed = PaymentJob.objects.claim(owner, ttl=TTL, limit=limit, kinds=kinds)
        assert len(claimed) == count
        assert {job.pk for job in claimed} <= wanted
        self._acquired(claimed, owner, before, started)
        return multiple(*claimed)

    @initialize(gates=GATES_HELD)
    def gates_to_hold(self, gates: int) -> None:
        """How many gates a silent session may hold in this example (not on SQLite: its one
        writer holding the write lock stops every kind)."""
        self.gates_left = 0 if connection.vendor == "sqlite" else gates

    @precondition(lambda self: self.gates_left > 0)
    @rule(
        target=leases,
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        kinds=st.sampled_from([None, [LIMITED_KIND, RETRY_KIND]]),
        gate=st.sampled_from([LIMITED_KIND, SILENT_KIND]),
    )
    def claim_while_a_silent_session_holds_a_gate(
        self, owner: str, limit: int, kinds: list[str] | None, gate: str
    ) -> Any:
        """15. The held gate's kind is skipped, every other kind is claimed; with SILENT_KIND's
        held, the claim fails after the limited kind's part committed, and hands that out."""
        self.gates_left -= 1
        before = job_rows()
        open_kinds = {pk: row for pk, row in before.items() if row["kind"] != gate}
        count, wanted = claims_expected(open_kinds, kinds, limit)
        started = self.clocks[owner]()
        with held_gate(gate) as holder:
            claimed = PaymentJob.objects.claim(owner, ttl=TTL, limit=limit, kinds=kinds)
        assert len(claimed) == count
        assert {job.pk for job in claimed} <= wanted
        # Throttled kinds are claimed in name order (LIMITED_KIND first), each while the claim
        # has room left; the held one is reported skipped, naming the silent session.
        limited = sum(job.kind == LIMITED_KIND for job in claimed)
        reached = (kinds is None or gate in kinds) and (gate == LIMITED_KIND or limited < limit)
        skipped = [(f.kind, holder in (f.holders or "")) for f in failures_of(claimed)]
        assert skipped == ([(gate, True)] if reached else []), skipped
        self._acquired(claimed, owner, before, started)
        return multiple(*claimed)

    @rule(target=leases, pk=jobs, owner=st.sampled_from(OWNERS))
    def claim_job(self, pk: int, owner: str) -> Any:
        before = job_rows()
        started = self.clocks[owner]()
        job = PaymentJob.objects.claim_job(pk, owner, ttl=TTL)
        free = before[pk]["kind"] != LIMITED_KIND or limited_live(before) < LIMIT
        assert (job is not None) == (claimable(before[pk]) and free)
        if job is None:
            return multiple()
        self._acquired([job], owner, before, started)
        return job

    @precondition(lambda self: self.marathon)
    @rule(target=leases, owner=st.sampled_from(OWNERS))
    def retried_a_thousand_times(self, owner: str) -> PaymentJob:
        """A job that failed MARATHON times, each retried after the worker's backoff, and is
        claimed once more: its next failure computes the backoff of attempt MARATHON + 1."""
        self.marathon = False
        pk = PaymentJob.objects.enqueue(RETRY_KIND, max_attempts=MARATHON + 2).pk
        for _ in range(MARATHON):
            job = PaymentJob.objects.claim_job(pk, owner, ttl=TTL)
            assert job is not None
            self._issued(job)
            Lease(job, ttl=TTL).fail(RuntimeError("psp down"), retry_in=retry_delay(job.attempts))
            self.finished_by_holder.add((pk, job.lease_token))
            PaymentJob.objects.filter(pk=pk).update(run_at=Now() - PAST)
        job = PaymentJob.objects.claim_job(pk, owner, ttl=TTL)
        assert job is not None and job.attempts == MARATHON + 1
        self._issued(job)
        return job

    def _issued(self, job: PaymentJob) -> None:
        """Count an acquisition; its token must be new to the job, whatever a failover lost."""
        issued = self.issued.setdefault(job.pk, set())
        assert job.lease_token not in issued, (
            f"job {job.pk} was issued token {job.lease_token} a second time (a failover lost "
            "the acquisition that had it)"
        )
        issued.add(job.lease_token)
        self.acquisitions[job.pk] += 1

    # ---- the database forgets its last commits ----------------------------------------------

    # The model's state that follows the database back in a failover (deep copies).
    FOLLOWS_THE_DATABASE = (
        "acquisitions",
        "tokens",
        "finished_by_holder",
        "requeued_behind",
        "cancelled",
        "released_groups",
        "trace_contexts",
    )

    @rule()
    def standby_replays(self) -> None:
        """An asynchronous standby has replayed every commit so far, and none after."""
        self.standby = (
            list(PaymentJob.objects.order_by("pk").values()),
            list(JobAttempt.objects.order_by("pk").values()),
            list(JobEvent.objects.order_by("pk").values()),
            {name: copy.deepcopy(getattr(self, name)) for name in self.FOLLOWS_THE_DATABASE},
        )
        self.standby_steps = list(JobStep.objects.order_by("pk").values())

    @precondition(
        lambda self: (
            self.standby is not None
            and {row["id"] for row in self.standby[0]}
            == set(PaymentJob.objects.values_list("pk", flat=True))
        )
    )
    @rule()
    def failover(self) -> None:
        """The primary dies and the standby is promoted: the commits since `standby_replays`
        are lost (jobs, ledger and events; none enqueued a job, or the machine's bundles would
        name jobs that never were). Workers, watchers and their leases live on, unaware.

        A failover takes longer than the database clock's tick (SQLite's is a millisecond), as
        the caveat of the fencing clock requires: the new primary's clock is past every token
        issued before."""
        assert self.standby is not None
        jobs, attempts, events, model = self.standby
        JobAttempt.objects.all().delete()
        JobEvent.objects.all().delete()
        JobStep.objects.all().delete()
        PaymentJob.objects.all().delete()
        PaymentJob.objects.bulk_create(PaymentJob(**row) for row in jobs)
        JobAttempt.objects.bulk_create(JobAttempt(**row) for row in attempts)
        JobEvent.objects.bulk_create(JobEvent(**row) for row in events)
        JobStep.objects.bulk_create(JobStep(**row) for row in self.standby_steps)
        for name, value in model.items():
            setattr(self, name, copy.deepcopy(value))
        # A handler whose acquisition was lost runs on unseen: the known caveat of a failover
        # that loses commits (docs/deployment.md), outside what 15 can hold.
        restored = {row["id"]: row for row in jobs}
        self.running = {
            (pk, token)
            for pk, token in self.running
            if restored[pk]["status"] in LEASED and restored[pk]["lease_token"] == token
        }
        # The append-only invariant (4) compares with the restored rows from here on.
        ledger = ledger_rows()
        self.closed = {pk: row for pk, row in ledger.items() if row["ended_at"] is not None}
        self.events = event_rows()
        self.steps = step_rows()
        newest = max((token for tokens in self.issued.values() for token in tokens), default=0)
        while database_micros() <= newest:
            time.sleep(0.001)

    # ---- the database clock -----------------------------------------------------------------

    @rule(pk=jobs)
    def lease_runs_out(self, pk: int) -> None:
        PaymentJob.objects.filter(pk=pk, status__in=LEASED).update(lease_until=Now() - PAST)

    @rule(pk=jobs)
    def run_at_passes(self, pk: int) -> None:
        PaymentJob.objects.filter(pk=pk, status=PENDING).update(run_at=Now() - PAST)

    @rule()
    def time_passes(self) -> None:
        """Every lease runs out and every pending job is due (a worker was paused for long)."""
        PaymentJob.objects.filter(status__in=LEASED).update(lease_until=Now() - PAST)
        PaymentJob.objects.filter(status=PENDING).update(run_at=Now() - PAST)

    # ---- holders' writes, including those of holders that lost their lease -------------------

    def _holder_write(
        self, lease: PaymentJob, write: str, needs_live: bool, call: Any, *, ends: bool = True
    ) -> Any:
        """Run a holder's `write`; check that it wins exactly while `lease` holds the job (and,
        for renewals and checkpoints, the lease is live), and that a refused write changes
        nothing."""
        jobs_before, ledger_before = job_rows(), ledger_rows()
        row = jobs_before[lease.pk]
        wins = held(row, lease) and (row["live"] or not needs_live)
        if not wins:
            with pytest.raises(LeaseLost) as refused:
                call()
            cancelled = (lease.pk, lease.lease_token) in self.cancelled_leases
            assert isinstance(refused.value, Cancelled) == cancelled, refused.value
            # Stored columns only: `live` and `due` follow the clock, which moves meanwhile.
            assert stored(job_rows()) == stored(jobs_before), f"a fenced-out {write} changed a job"
            ledger_after = ledger_rows()
            for pk, old in ledger_before.items():
                new = ledger_after[pk]
                if (old["job_ref"], old["token"]) == (lease.pk, lease.lease_token):
                    assert old["fenced_at"] is None or new["fenced_at"] == old["fenced_at"]
                    new = {**new, "fenced_at": old["fenced_at"]}
                assert new == old, f"a fenced-out {write} changed ledger row {pk}"
            assert ledger_after.keys() == ledger_before.keys()
            return None
        result = call()
        if write not in ("heartbeat", "checkpoint") and ends:
            self.finished_by_holder.add((lease.pk, lease.lease_token))
            self.running.discard(key(lease))
        return result

    @rule(lease=leases)
    def heartbeat(self, lease: PaymentJob) -> None:
        self._holder_write(lease, "heartbeat", True, Lease(lease, ttl=TTL).heartbeat)

    @rule(owner=st.sampled_from(OWNERS))
    def worker_renews_everything_it_ever_held(self, owner: str) -> None:
        """The worker's heartbeat thread: one statement renews many leases, some of them lost,
        some of them older leases of a job it holds again under a newer token. Exactly the
        current, live ones are renewed, by (job, token)."""
        keys = ever_held(owner)
        before = job_rows()
        started = self.clocks[owner]()
        renewed = PaymentJob.objects.heartbeat(owner, keys, ttl=TTL)
        assert renewed == {
            (pk, token)
            for pk, token in keys
            if before[pk]["status"] == PROCESSING
            and (before[pk]["lease_owner"], before[pk]["lease_token"]) == (owner, token)
            and before[pk]["live"]
        }
        for pair in keys:
            if pair in self.beliefs and pair in renewed:
                self.beliefs[pair].renewed(started)
            elif pair in self.beliefs:
                self.beliefs[pair].mark_lost("heartbeat refused")

    @rule(lease=leases, step=st.sampled_from(["psp_called", "ledger_posted"]))
    def checkpoint(self, lease: PaymentJob, step: str) -> None:
        self._holder_write(
            lease, "checkpoint", True, lambda: Lease(lease, ttl=TTL).checkpoint(step)
        )
        if (row := job_rows()[lease.pk])["checkpoint"] == step and held(row, lease):
            open_row = JobAttempt.objects.get(job_ref=lease.pk, token=lease.lease_token)
            assert open_row.checkpoint == step

    @rule(lease=leases, name=STEP_NAMES)
    def step(self, lease: PaymentJob, name: str) -> None:
        """18. The holder runs the step `name`: recorded once while it holds the live lease,
        returned (not run) if recorded before, refused (nothing run) once the lease is lost."""
        before, steps = job_rows()[lease.pk], step_rows()
        runs: list[str] = []

        def call_the_provider() -> dict[str, Any]:
            runs.append(name)
            return {"step": name, "token": lease.lease_token}

        result = self._holder_write(
            lease,
            "step",
            True,
            lambda: Lease(lease, ttl=TTL).step(name, call_the_provider),
            ends=False,
        )
        if not (held(before, lease) and before["live"]):
            assert not runs, f"a fenced-out holder ran step {name!r} of job {lease.pk}"
            return
        earlier = steps.get((lease.pk, name))
        if earlier is not None:
            assert not runs, f"step {name!r} of job {lease.pk} ran again"
            assert result == earlier["result"]
            assert stored(job_rows())[lease.pk] == stored({lease.pk: before})[lease.pk]
            return
        assert runs == [name] and result == {"step": name, "token": lease.lease_token}
        row = step_rows()[(lease.pk, name)]
        assert (row["token"], row["attempt"], row["result"]) == (
            lease.lease_token,
            lease.attempts,
            result,
        )
        self.assert_checkpoint_after_step(lease, before["checkpoint"], name, recorded=True)

    @rule(lease=leases, name=STEP_NAMES)
    def step_interrupted(self, lease: PaymentJob, name: str) -> None:
        """18. The step's function raises after the provider answered (a crash before the
        record): nothing recorded, the step's marker left for the review policy."""
        before, steps = job_rows()[lease.pk], step_rows()

        def answered_then_crashed() -> None:
            raise StepInterruptedError(name)

        def run() -> Any:
            try:
                return Lease(lease, ttl=TTL).step(name, answered_then_crashed)
            except StepInterruptedError:
                return StepInterruptedError

        result = self._holder_write(lease, "step", True, run, ends=False)
        if not (held(before, lease) and before["live"]):
            return
        earlier = steps.get((lease.pk, name))
        if earlier is not None:
            assert result == earlier["result"], f"step {name!r} of job {lease.pk} ran again"
            return
        assert result is StepInterruptedError
        assert step_rows() == steps, f"an interrupted step {name!r} was recorded"
        self.assert_checkpoint_after_step(lease, before["checkpoint"], name, recorded=False)

    def assert_checkpoint_after_step(
        self, lease: PaymentJob, checkpoint: str, name: str, *, recorded: bool
    ) -> None:
        """The job's checkpoint after its holder's step `name`, from the one before: the step's
        marker while it is not recorded, unless a checkpoint was there; the attempt's follows."""
        marker = f"step:{name}"
        expected = checkpoint or marker
        if recorded and expected == marker:
            expected = ""
        after = job_rows()[lease.pk]["checkpoint"]
        assert after == expected, f"job {lease.pk}: checkpoint {checkpoint!r} -> {after!r}"
        attempt = JobAttempt.objects.get(job_ref=lease.pk, token=lease.lease_token)
        assert attempt.checkpoint == expected

    @rule(lease=leases)
    def complete(self, lease: PaymentJob) -> None:
        before = job_rows()[lease.pk]
        self._holder_write(lease, "complete", False, Lease(lease, ttl=TTL).complete)
        if held(before, lease):
            assert job_rows()[lease.pk]["status"] == COMPLETED

    @rule(owner=st.sampled_from(OWNERS), limit=st.integers(0, 3))
    def worker_acknowledges_everything_it_ever_held(self, owner: str, limit: int) -> None:
        """A worker's batched completion (ack="batch"): it claims up to `limit` jobs and runs
        them, then completes in one call every job it ever held: those, and older ones lost or
        finished; each row wins exactly while its lease holds it, and a job of a lock passes
        its lock on."""
        if limit:
            before, started = job_rows(), self.clocks[owner]()
            claimed = PaymentJob.objects.claim(owner, ttl=TTL, limit=limit)
            self._acquired(claimed, owner, before, started)
        acks = ever_held(owner)
        jobs_before, ledger_before = job_rows(), ledger_rows()
        won = PaymentJob.objects.complete_many(owner, acks)
        assert won == {
            (pk, token)
            for pk, token in acks
            if jobs_before[pk]["status"] == PROCESSING
            and (jobs_before[pk]["lease_owner"], jobs_before[pk]["lease_token"]) == (owner, token)
        }
        completed = {pk for pk, _ in won}
        promoted = completing(jobs_before, completed)
        jobs_after, ledger_after = job_rows(), ledger_rows()
        clock = {"live", "due"}
        for pk, old in jobs_before.items():
            new = jobs_after[pk]
            if pk in completed:
                assert (new["status"], new["lock_holder"]) == (COMPLETED, None)
            else:
                old = promoted.get(pk, old)
                assert {k: v for k, v in new.items() if k not in clock} == {
                    k: v for k, v in old.items() if k not in clock
                }, f"a refused batched completion changed job {pk}"
        assert ledger_after.keys() == ledger_before.keys()
        self.finished_by_holder |= won
        self.running -= won
        for pk, old in ledger_before.items():
            new, ack = ledger_after[pk], (old["job_ref"], old["token"])
            if ack in won:
                assert (new["outcome"], new["ended_by"]) == (COMPLETED, owner)
            elif ack in acks:
                assert old["fenced_at"] is None or new["fenced_at"] == old["fenced_at"]
                assert {**new, "fenced_at": old["fenced_at"]} == old, f"ledger row {pk} changed"
            else:
                assert new == old, f"a batched completion changed ledger row {pk}"

    @rule(
        target=leases,
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        kinds=CLAIM_KINDS,
    )
    def worker_completes_and_claims_its_next(
        self, owner: str, limit: int, kinds: list[str] | None
    ) -> Any:
        """A worker's group write (`complete_and_claim`, one statement on PostgreSQL): it
        completes every job it ever held and claims up to `limit` next ones. Exactly the
        completions `complete_many()` would make win (older leases lost or finished are
        refused), then exactly the claims `claim()` would make after them, the jobs next in
        line of the locks they released among them."""
        acks = ever_held(owner)
        before, started = job_rows(), self.clocks[owner]()
        won, claimed = PaymentJob.objects.complete_and_claim(
            owner, acks, ttl=TTL, limit=limit, kinds=kinds
        )
        assert won == {
            (pk, token)
            for pk, token in acks
            if before[pk]["status"] == PROCESSING
            and (before[pk]["lease_owner"], before[pk]["lease_token"]) == (owner, token)
        }
        after = job_rows()
        for pk, _ in won:
            assert (after[pk]["status"], after[pk]["lock_holder"]) == (COMPLETED, None)
        self.finished_by_holder |= won
        self.running -= won
        finished = {pk for pk, _ in won}
        rows = {**before, **completing(before, finished)}
        count, wanted = claims_expected(rows, kinds, limit, finished)
        assert len(claimed) == count
        assert {job.pk for job in claimed} <= wanted
        self._acquired(claimed, owner, rows, started)
        return multiple(*claimed)

    @rule(lease=leases, permanent=st.booleans(), error=st.sampled_from(ERRORS))
    def fail(self, lease: PaymentJob, permanent: bool, error: BaseException) -> None:
        """A handler raised: retried after the worker's backoff, or failed for good; its error
        may be of adversarial length (17)."""
        before = job_rows()[lease.pk]
        holder = Lease(lease, ttl=TTL)
        delay = None if permanent else retry_delay(lease.attempts)
        status = self._holder_write(
            lease,
            "fail",
            False,
            lambda: holder.fail(error, retry_in=delay, permanent=permanent),
        )
        if held(before, lease):
            out_of_attempts = before["attempts"] >= before["max_attempts"]
            row = job_rows()[lease.pk]
            assert status == row["status"] == (FAILED if permanent or out_of_attempts else PENDING)
            assert row["due"] is False or status == FAILED
            # 17. Recorded, cut and redacted, on the job and on its attempt's row.
            key = (lease.pk, lease.lease_token)
            (attempt,) = (a for a in ledger_rows().values() if (a["job_ref"], a["token"]) == key)
            message, last_error = attempt["error_message"], row["last_error"]
            assert message and len(message) <= MAX_ERROR_LENGTH and CARD not in message
            # The job's copy is the class path, ": " and the same message.
            assert last_error.endswith(message) and len(last_error) <= MAX_ERROR_LENGTH + 64

    @rule(lease=leases)
    def release(self, lease: PaymentJob) -> None:
        before = job_rows()[lease.pk]
        self._holder_write(lease, "release", False, Lease(lease, ttl=TTL).release)
        if held(before, lease):
            row = job_rows()[lease.pk]
            assert (row["status"], row["due"]) == (PENDING, True)
            assert row["max_attempts"] == before["max_attempts"] + 1

    @rule(lease=leases)
    def time_out(self, lease: PaymentJob) -> None:
        """The handler ran past its kind's timeout: the worker ends the attempt."""
        before = job_rows()[lease.pk]
        holder = Lease(lease, ttl=TTL)
        status = self._holder_write(
            lease,
            "time_out",
            False,
            lambda: holder.time_out("ran past 5s", retry_in=retry_delay(lease.attempts)),
        )
        if held(before, lease):
            if before["kind"] == REVIEW_KIND and before["checkpoint"]:
                expected = REVIEW
            elif before["attempts"] >= before["max_attempts"]:
                expected = FAILED
            else:
                expected = PENDING
            assert status == job_rows()[lease.pk]["status"] == expected

    @rule(lease=leases)
    def time_out_while_its_handler_runs(self, lease: PaymentJob) -> None:
        """The loop times out a handler that runs on (a thread cannot be stopped): the job is
        stopping, and keeps its lock and its limit slot (16) until the handler returns."""
        before = job_rows()[lease.pk]
        holder = Lease(lease, ttl=TTL)
        ends_as = self._holder_write(
            lease,
            "time_out",
            False,
            lambda: holder.time_out("ran past 5s", retry_in=600, running=True),
            ends=False,
        )
        if held(before, lease):
            row = job_rows()[lease.pk]
            assert (row["status"], row["ends_as"], row["lock_holder"]) == (
                STOPPING,
                ends_as,
                before["lock_holder"],
            )
            attempt = JobAttempt.objects.get(job_ref=lease.pk, token=lease.lease_token)
            assert (attempt.outcome, attempt.ended_at) == ("timed_out", None)

    @rule(lease=leases)
    def holder_returns(self, lease: PaymentJob) -> None:
        """The handler of `lease` returned after its lease was lost (a stop, a takeover): its
        worker acknowledges, which ends the job's execution if it was stopped under `lease`,
        releasing its lock (passed on) and its slot, and changes nothing else."""
        before = job_rows()
        row = before[lease.pk]
        if held(row, lease):
            return  # it still holds the job: its worker writes an outcome instead
        was = stopped(row, lease)
        ended = PaymentJob.objects.acknowledge_stops(lease.lease_owner, [key(lease)])
        self.running.discard(key(lease))
        assert ended == ({key(lease): row["ends_as"]} if was else {})
        after = job_rows()
        if not was:
            assert stored(after) == stored(before), "an acknowledgement changed a job"
            return
        self._stop_ended(lease.pk, key(lease), row, after)
        promoted = passed_on(before, [lease.pk] if row["ends_as"] in (CANCELLED, FAILED) else [])
        promoted |= callbacks_noting(before, after, [lease.pk])
        for pk, old in before.items():
            if pk != lease.pk:
                assert stored({pk: after[pk]}) == stored({pk: promoted.get(pk, old)})

    def _stop_ended(
        self, pk: int, lease: tuple[int, int], old: dict[str, Any], after: dict[int, Any]
    ) -> None:
        """Check the end of the stopped execution `lease` of job `pk` (as it was: `old`)."""
        row = after[pk]
        ends_as = old["ends_as"]
        assert (row["status"], row["ends_as"]) == (ends_as, "")
        assert row["lease_token"] == old["lease_token"] + (ends_as == CANCELLED)
        assert (row["lock_holder"] is None) == (ends_as in (CANCELLED, FAILED) or not old["lock"])
        attempt = JobAttempt.objects.get(job_ref=pk, token=lease[1])
        assert attempt.ended_at is not None and attempt.outcome in ("cancelled", "timed_out")
        if attempt.outcome == "timed_out":
            self.finished_by_holder.add(lease)
        if ends_as == CANCELLED:
            self.cancelled[pk] = row["attempts"]

    @rule(lease=leases)
    def finished_by(self, lease: PaymentJob) -> None:
        """The worker's question after a lost acknowledgement: did my own write commit?"""
        answer = PaymentJob.objects.finished_by(lease.pk, lease.lease_owner, lease.lease_token)
        assert answer == ((lease.pk, lease.lease_token) in self.finished_by_holder), (
            f"finished_by says {answer} for token {lease.lease_token} of job {lease.pk}"
        )

    # ---- the stuck watcher ------------------------------------------------------------------

    @rule()
    def watcher_pass(self) -> None:
        before = job_rows()
        gone = set(Worker.objects.gone().values_list("worker_id", flat=True))
        stuck = {
            pk
            for pk, row in before.items()
            if expired(row) or (row["status"] == PROCESSING and row["lease_owner"] in gone)
        }
        stops = {pk for pk, row in before.items() if row["status"] == STOPPING and not row["live"]}
        actions = StuckWatcher(watcher_id="watcher").run_once()
        assert {action.pk for action in actions} == stuck | stops
        after = job_rows()
        for pk in stops:
            self._stop_ended(pk, (pk, before[pk]["lease_token"]), before[pk], after)
        for pk in stuck:
            if before[pk]["lease_owner"] in gone:
                # A gone worker runs nothing: its live lease is given away on purpose.
                self.running.discard((pk, before[pk]["lease_token"]))
            row, old = after[pk], before[pk]
            if old["kind"] == REVIEW_KIND and old["checkpoint"]:
                assert row["status"] == REVIEW
            elif old["attempts"] >= old["max_attempts"]:
                assert row["status"] == FAILED
            else:
                # Due at once: the attempt did not fail, the TTL already spaced it.
                assert (row["status"], row["due"]) == (PENDING, True)
            assert row["lease_token"] == old["lease_token"]

    @rule()
    def slow_watcher_reads(self) -> None:
        """A watcher reads the expired leases and decides; its writes come in a later step."""
        watcher = StuckWatcher(watcher_id="slow-watcher")
        self.watcher_read = [
            (job, *watcher._decide(job, False)) for job in PaymentJob.objects.expired()
        ]

    @precondition(lambda self: bool(self.watcher_read))
    @rule()
    def slow_watcher_writes(self) -> None:
        """The slow watcher writes what it decided: each rescue must win exactly when the job
        is still as the watcher read it (expired, same token, checkpoint and attempts left)."""
        read, self.watcher_read = self.watcher_read, []
        for job, action, reason in read:
            row = job_rows()[job.pk]
            read_then = {name: getattr(job, name) for name in RESTATED}
            now = {name: row[name] for name in RESTATED}
            won = PaymentJob.objects.rescue(job, action, by="slow-watcher", reason=reason)
            assert won == (expired(row) and now == read_then), (
                f"rescue ({action}) of job {job.pk} won={won}: read {read_then}, now {now}, "
                f"expired={expired(row)}"
            )

    @rule(owner=st.sampled_from(OWNERS))
    def worker_gone(self, owner: str) -> None:
        """The registry learns that `owner` stopped (its live leases are orphaned)."""
        Worker.objects.register(
            owner, instance=owner, hostname="host", pid=1, kinds=[], concurrency=1
        )
        Worker.objects.stopped(owner, owner)

    # ---- what a worker believes of its leases ------------------------------------------------

    def worker_beats(self, owner: str) -> None:
        """The worker refreshes its registry row (its first beat registers it)."""
        started = self.clocks[owner]()
        fields = {"instance": owner, "hostname": "host", "pid": 1, "kinds": [], "concurrency": 1}
        if Worker.objects.beat(owner, owner) or Worker.objects.register(owner, **fields):
            self.presence[owner].confirmed(started)

    @rule(owner=st.sampled_from(OWNERS))
    def worker_refreshes_its_registry_row(self, owner: str) -> None:
        self.worker_beats(owner)

    @rule(target=leases, lease=leases)
    def same_owner_claims_its_job_again(self, lease: PaymentJob) -> Any:
        """An operator force-requeues a running job and its owner claims it again before its
        next heartbeat: it holds the old lease and the new one of one job. Its heartbeat, given
        both, renews exactly the new one, in either order, and the old one is refused."""
        before = job_rows()
        if not held(before[lease.pk], lease):
            return multiple()
        owner = lease.lease_owner
        assert PaymentJob.objects.filter(pk=lease.pk).requeue(force=True, by="op") == 1
        self.running.discard(key(lease))
        requeued = job_rows()
        started = self.clocks[owner]()
        again = PaymentJob.objects.claim_job(lease.pk, owner, ttl=TTL)
        if requeued[lease.pk]["paused"]:  # 19: its kind is paused, the requeued job waits
            assert again is None
            return multiple()
        assert again is not None and again.lease_token > lease.lease_token
        self._acquired([again], owner, requeued, started)
        for pairs in ([key(lease), key(again)], [key(again), key(lease)]):
            assert PaymentJob.objects.heartbeat(owner, pairs, ttl=TTL) == {key(again)}
        self.beliefs[key(again)].renewed(started)
        if key(lease) in self.beliefs:
            self.beliefs[key(lease)].mark_lost("heartbeat refused")
        return again

    @initialize(paused=st.booleans())
    def limited_kind_paused(self, paused: bool) -> None:
        """Half the examples start with the limited kind paused (18): claims meet the pause
        in most of their steps, not only after a rule happened to pause it."""
        if paused:
            assert PaymentJob.objects.pause_kind(LIMITED_KIND, by="op") is True

    @rule(kind=st.sampled_from([LIMITED_KIND, LIMITED_KIND, RETRY_KIND]), resume=st.booleans())
    def operator_pauses_or_resumes_a_kind(self, kind: str, resume: bool) -> None:
        """19. Jobs and the ledger are untouched: running jobs go on, pending ones wait. A kind
        without a handler is refused; a pause of a paused kind (a resume of a running one) is
        a no-op."""
        jobs, ledger, events = stored(job_rows()), ledger_rows(), KindEvent.objects.count()
        was_paused = PausedKind.objects.filter(kind=kind).exists()
        change = PaymentJob.objects.resume_kind if resume else PaymentJob.objects.pause_kind
        if kind not in registered_kinds():
            with pytest.raises(InvalidArgument, match=kind):
                change(kind, by="op")
            assert KindEvent.objects.count() == events
        else:
            assert change(kind, by="op", reason="psp down") == (was_paused == resume)
            assert PausedKind.objects.filter(kind=kind).exists() == (not resume)
        assert stored(job_rows()) == jobs and ledger_rows() == ledger

    @rule(owner=st.sampled_from(OWNERS), seconds=st.sampled_from([GONE_AFTER + 1, TTL + 1]))
    def worker_paused_then_starts_its_jobs(self, owner: str, seconds: int) -> None:
        """The worker is paused (a GC, SIGSTOP, a VM migration) between claiming jobs and
        starting them: no renewal, no registry beat, while `seconds` pass for it and for the
        database alike. A job it then starts, by its own clock, must still be its own: the
        database holds the lease for it, live, and its registry row does not look gone, so
        neither a claim nor the watcher can have handed the job to someone else. (Past
        WORKER_GONE_AFTER the registry row looks gone well before the TTL ends.)"""
        before = job_rows()
        believed = {
            pair: lease
            for pair, lease in self.beliefs.items()
            if lease.owner == owner
            and before[pair[0]]["status"] == PROCESSING
            and (before[pair[0]]["lease_owner"], before[pair[0]]["lease_token"]) == (owner, pair[1])
            and before[pair[0]]["live"]
        }
        self.clocks[owner].paused += seconds
        past = timedelta(seconds=seconds)
        PaymentJob.objects.filter(status__in=LEASED, lease_owner=owner).update(
            lease_until=F("lease_until") - past
        )
        Worker.objects.filter(worker_id=owner).update(last_seen_at=F("last_seen_at") - past)
        after = job_rows()
        gone = set(Worker.objects.gone().values_list("worker_id", flat=True))
        for (pk, token), lease in believed.items():
            if lease.lost:
                continue  # the worker gives it up: it is never started
            row = after[pk]
            assert row["lease_token"] == token and row["live"], (
                f"job {pk} started on lease {token} that the database no longer holds: {row}"
            )
            assert owner not in gone, (
                f"job {pk} started by {owner}, whose registry row the watcher takes for gone"
            )

    # ---- operators --------------------------------------------------------------------------

    @rule(
        name=st.sampled_from(sorted(OPERATOR_STATUS)),
        selected=st.lists(jobs, min_size=1, max_size=3, unique=True),
    )
    def operator(self, name: str, selected: list[int]) -> None:
        before = job_rows()
        last_event = max(event_rows(), default=0)
        eligible = {pk for pk in selected if operator_eligible(name, before[pk])}
        selection = PaymentJob.objects.filter(pk__in=selected).order_by()
        changed = operator_call(name, selection, "op", why=f"why {name}")
        assert changed == len(eligible), f"{name} changed {changed} of {sorted(eligible)}"
        # Recorded beside the attempts: one event per job changed, as it was when changed, with
        # who and why.
        added = [event for pk, event in event_rows().items() if pk > last_event]
        assert sorted((e["job_ref"], e["action"], e["by"], e["reason"]) for e in added) == sorted(
            (pk, OPERATOR_EVENT[name], "op", f"why {name}") for pk in eligible
        )
        for event in added:
            old = before[event["job_ref"]]
            assert (event["attempts"], event["token"]) == (old["attempts"], old["lease_token"])
        after = job_rows()
        holders = {row["lock_holder"]: pk for pk, row in after.items() if row["lock_holder"]}
        released = completing(before, eligible) if name == "resolve_review_completed" else {}
        grouped = callbacks_noting(before, after, eligible)
        for pk, old in before.items():
            if pk in eligible:
                self._operator_changed(name, pk, old, after[pk], holders)
            elif pk in grouped:
                assert stored({pk: after[pk]}) == stored({pk: grouped[pk]}), pk
            elif pk in released:
                assert stored({pk: after[pk]}) == stored({pk: released[pk]}), pk
            elif old["status"] == WAITING and after[pk]["status"] == PENDING:
                # A lock a finished job released passes on to one of its waiting jobs.
                promoted = {"status": WAITING, "lock_holder": None}
                assert {**after[pk], **promoted} == old, f"{name} changed waiting job {pk}"
                assert holders[old["lock"]] == pk
            else:
                assert after[pk] == old, f"{name} changed job {pk}, not eligible"
            if "force" not in name and old["status"] in LEASED and old["live"]:
                assert after[pk] == old, f"{name} took the live lease of job {pk}"
            if pk in eligible and name in ("force_requeue", "force_mark_failed"):
                # It fences the holder out on purpose: 15 no longer holds its handler.
                self.running = {pair for pair in self.running if pair[0] != pk}

    @rule(
        job=jobs,
        priority=st.integers(min_value=-3, max_value=3),
        payload=st.sampled_from([None, {"v": 1}, {"v": 2}]),
    )
    def edit(self, job: int, priority: int, payload: dict[str, int] | None) -> None:
        """An operator's edit (`edit_pending()`) changes a pending job's priority and payload,
        nothing else, and records each old and new value in one event; a job that is not pending
        (claimed, waiting for its lock or its prerequisites, stopping, finished, paused or not)
        it leaves alone and records nothing."""
        before = job_rows()
        edits: dict[str, Any] = {"priority": priority}
        if payload is not None:
            edits["payload"] = payload
        last_event = max(event_rows(), default=0)
        changes = PaymentJob.objects.edit_pending(job, edits, by="op", reason="why edit")
        added = [event for pk, event in event_rows().items() if pk > last_event]
        after = job_rows()
        if before[job]["status"] != PENDING:
            assert changes is None and not added, f"edited job {job}, {before[job]['status']}"
            assert stored(after) == stored(before)
            return
        old = before[job]
        expected = {name: [old[name], new] for name, new in edits.items() if old[name] != new}
        assert changes == expected
        recorded = [(e["job_ref"], e["action"], e["changes"], e["reason"]) for e in added]
        assert recorded == ([(job, "edited", expected, "why edit")] if expected else [])
        assert stored(after) == stored({**before, job: {**old, **edits}})

    def _operator_changed(
        self, name: str, pk: int, old: dict[str, Any], row: dict[str, Any], holders: dict[str, int]
    ) -> None:
        """The status an operator action gave job `pk`: a requeued job of a lock keeps the lock
        it held, or rejoins the lock (waiting while another job holds it)."""
        expected = OPERATOR_STATUS[name]
        if name in ("requeue", "force_requeue"):
            self.cancelled.pop(pk, None)
        if name == "force_cancel" and old["status"] == PROCESSING:
            # It may have moved money past a checkpoint: under review, under the same token.
            review = old["kind"] == REVIEW_KIND and bool(old["checkpoint"])
            expected = REVIEW if review else CANCELLED
            attempt = JobAttempt.objects.get(job_ref=pk, token=old["lease_token"])
            assert (attempt.outcome, attempt.ended_by) == ("cancelled", "op")
            self.cancelled_leases.add((pk, old["lease_token"]))
            if old["live"]:
                # Its handler may still run: stopping, until it returns or its lease expires.
                assert (row["ends_as"], row["lease_token"]) == (expected, old["lease_token"])
                assert attempt.ended_at is None
                expected = STOPPING
            else:
                assert row["lease_token"] == old["lease_token"] + (0 if review else 1)
        if expected == CANCELLED:
            self.cancelled[pk] = row["attempts"]
        if expected == PENDING and old["lock_holder"]:
            assert row["lock_holder"] == old["lock_holder"], f"{name} moved job {pk}'s lock"
        if name in ("requeue", "force_requeue") and row["unmet"]:
            expected = WAITING  # enqueued after jobs not all completed: it waits for them again
        elif name in ("requeue", "force_requeue") and holders.get(row["lock"], pk) != pk:
            expected = WAITING
            # Invariant 10's one exception: it waits ahead of the lock's holder.
            self.requeued_behind.setdefault(holders[row["lock"]], set()).add(pk)
        assert row["status"] == expected, f"{name} made job {pk} {row['status']}"

    # ---- the queue history ------------------------------------------------------------------

    @rule()
    def the_watcher_counts_this_minute(self) -> None:
        """22. The history's aggregation of the current minute, against the rows."""
        start = database_now(PaymentJob.objects.db).replace(second=0, microsecond=0)
        counted = aggregate_minute(PaymentJob.objects.all(), start, depth=True)
        jobs, ledger = job_rows(), ledger_rows()
        end = start + MINUTE
        window = start - timedelta(seconds=leases_settings.LONG_RUNNING)
        expected: dict[str, KindMinute] = defaultdict(KindMinute)
        attempts = {(row["job_ref"], row["token"]): row for row in ledger.values()}
        for job in jobs.values():
            kind = expected[job["kind"]]
            finished = job["completed_at"] is not None and start <= job["completed_at"] < end
            if job["status"] in (COMPLETED, FAILED) and finished:
                setattr(kind, job["status"], getattr(kind, job["status"]) + 1)
                final = attempts.get((job["id"], job["lease_token"]))
                if final is not None and final["ended_at"] is not None:
                    kind.wait[bucket_of(seconds(final["claimed_at"] - job["run_at"]))] += 1
                    kind.run[bucket_of(seconds(final["ended_at"] - final["claimed_at"]))] += 1
            if job["status"] == PENDING and job["due"]:
                kind.depth = (kind.depth or 0) + 1
        for row in ledger.values():
            ended = row["ended_at"] is not None and start <= row["ended_at"] < end
            recent = window <= row["claimed_at"] < end
            if row["outcome"] == AttemptOutcome.RETRIED and ended and recent:
                expected[jobs[row["job_ref"]]["kind"]].retried += 1
        empty = KindMinute().fields()
        wanted = {k: v.fields() for k, v in expected.items() if v.fields() != empty}
        assert {k: v.fields() for k, v in counted.items()} == wanted

    # ---- invariants, read from the database -------------------------------------------------

    @invariant()
    def every_guarantee_holds(self) -> None:
        """Read the jobs and the ledger once after each step, and hold each guarantee to them
        (reading them once per guarantee was most of the machine's time)."""
        jobs, ledger = job_rows(), ledger_rows()
        self.ledger_and_jobs_agree(jobs, ledger)
        self.a_cancelled_job_never_runs_again(jobs)
        self.one_job_of_a_lock_at_a_time(jobs, ledger)
        self.a_limited_kind_never_runs_past_its_limit(jobs)
        self.an_execution_releases_what_it_held_only_when_it_ends(jobs)
        self.closed_ledger_rows_never_change(ledger)
        self.recorded_steps_were_held_and_never_change(ledger)
        self.no_attempt_of_a_paused_kind_starts_after_its_pause(jobs, ledger)
        self.a_dependent_starts_after_its_prerequisites_completed(jobs, ledger)
        self.a_callback_is_released_once_every_member_ended(jobs)
        self.a_job_keeps_its_trace_context(jobs)

    def a_job_keeps_its_trace_context(self, jobs: dict[int, dict[str, Any]]) -> None:
        """24: no transition writes `trace_context`."""
        for pk, row in jobs.items():
            assert row["trace_context"] == self.trace_contexts.get(pk), pk

    def no_attempt_of_a_paused_kind_starts_after_its_pause(
        self, jobs: dict[int, dict[str, Any]], ledger: dict[int, dict[str, Any]]
    ) -> None:
        """19, by the database clock: the ledger's `claimed_at` against the kind's `paused_at`."""
        paused = dict(PausedKind.objects.values_list("kind", "paused_at"))
        for row in ledger.values():
            kind = jobs[row["job_ref"]]["kind"]
            if kind in paused:
                assert row["claimed_at"] <= paused[kind], f"{kind} claimed after its pause: {row}"

    def ledger_and_jobs_agree(
        self, jobs: dict[int, dict[str, Any]], ledger: dict[int, dict[str, Any]]
    ) -> None:
        attempts: dict[int, list[dict[str, Any]]] = {pk: [] for pk in jobs}
        for row in ledger.values():
            attempts[row["job_ref"]].append(row)
        for pk, job in jobs.items():
            rows = sorted(attempts[pk], key=lambda row: row["attempt"])
            # 3. One ledger row per acquisition, numbered 1..n.
            assert [row["attempt"] for row in rows] == list(range(1, job["attempts"] + 1))
            assert job["attempts"] == self.acquisitions[pk]
            # 15. Every attempt was handed out by the call that made it.
            unseen = [row["token"] for row in rows if row["token"] not in self.issued.get(pk, ())]
            assert not unseen, f"job {pk} has attempts of tokens {unseen} no call handed out"
            # 2. Tokens rise with attempts, a job's token never goes back.
            tokens = [row["token"] for row in rows]
            assert tokens == sorted(set(tokens)), f"job {pk} reused or reordered tokens {tokens}"
            assert job["lease_token"] >= max(tokens, default=0)
            assert job["lease_token"] >= self.tokens.get(pk, 0)
            self.tokens[pk] = job["lease_token"]
            # 1. At most one open attempt: the holder's, while the job is processing.
            open_rows = [row for row in rows if row["ended_at"] is None]
            if job["status"] == PROCESSING:
                assert [(r["owner"], r["token"], r["outcome"]) for r in open_rows] == [
                    (job["lease_owner"], job["lease_token"], "running")
                ], f"job {pk} processing with open attempts {open_rows}"
            elif job["status"] == STOPPING:
                # Its outcome is known; the row closes when the execution ends.
                ((owner, token, outcome),) = [
                    (r["owner"], r["token"], r["outcome"]) for r in open_rows
                ]
                assert (owner, token) == (job["lease_owner"], job["lease_token"])
                assert outcome in ("cancelled", "timed_out"), f"job {pk} stopping as {outcome}"
            else:
                assert not open_rows, f"job {pk} {job['status']} with open attempts {open_rows}"
            assert all(row["outcome"] != "running" for row in rows if row["ended_at"])
            # 6. The review policy: never run again blindly after a checkpoint.
            if job["kind"] == REVIEW_KIND:
                blind = [
                    row
                    for row in rows
                    if row["checkpoint"]
                    and (
                        row["outcome"] == "lease_lost"
                        or (row["outcome"] == "rescued" and row["ended_by"] in WATCHERS)
                    )
                ]
                assert not blind, f"job {pk} ran again after checkpoint without a verdict"
            # 7. Columns that agree.
            if job["status"] in LEASED:
                assert job["lease_owner"] and job["lease_until"] is not None
            assert bool(job["ends_as"]) == (job["status"] == STOPPING), job
            assert (job["completed_at"] is not None) == (job["status"] in FINAL), job
            assert job["attempts"] <= job["max_attempts"]
            if job["status"] == PENDING:
                assert job["attempts"] < job["max_attempts"], f"job {pk} pending, no attempt left"

    def a_cancelled_job_never_runs_again(self, jobs: dict[int, dict[str, Any]]) -> None:
        # 14. Cancelled until requeued, and never claimed meanwhile.
        for pk, attempts in self.cancelled.items():
            assert (jobs[pk]["status"], jobs[pk]["attempts"]) == (CANCELLED, attempts), jobs[pk]

    def one_job_of_a_lock_at_a_time(
        self, jobs: dict[int, dict[str, Any]], ledger: dict[int, dict[str, Any]]
    ) -> None:
        by_lock: dict[str, list[dict[str, Any]]] = {}
        for pk, job in jobs.items():
            holder, status = job["lock_holder"], job["status"]
            # 8. The lock holder column agrees with the lock and the status.
            if holder is not None:
                assert holder == job["lock"] and status in HOLDING, f"job {pk} holds {holder!r}"
            if status == WAITING:
                # For its lock, or for its prerequisites (then perhaps without a lock).
                assert holder is None and (job["lock"] or job["unmet"]), f"job {pk} waits"
            if job["lock"]:
                by_lock.setdefault(job["lock"], []).append(job)
        for lock, rows in by_lock.items():
            # 8. One holder per lock, and it is marked as the holder.
            active = [row for row in rows if row["status"] in HOLDING]
            assert len(active) <= 1, f"lock {lock!r} held by {[row['id'] for row in active]}"
            assert all(row["lock_holder"] == lock for row in active)
            # 9. Nothing stranded: a lock with waiting jobs is held (a job waiting for its
            # prerequisites joins the line once they completed).
            if any(row["status"] == WAITING and not row["unmet"] for row in rows):
                assert active, f"lock {lock!r} has waiting jobs and no holder"
        # 11. No overlap: attempts of different jobs of a lock never run at the same time.
        for lock, rows in by_lock.items():
            ids = {row["id"] for row in rows}
            spans = [
                (row["job_ref"], row["claimed_at"], row["ended_at"])
                for row in ledger.values()
                if row["job_ref"] in ids
            ]
            for (one, start, end), (other, other_start, other_end) in combinations(spans, 2):
                overlap = (end is None or other_start < end) and (
                    other_end is None or start < other_end
                )
                assert one == other or not overlap, (
                    f"lock {lock!r}: attempts of jobs {one} ({start}..{end}) and {other} "
                    f"({other_start}..{other_end}) overlap"
                )

    def a_dependent_starts_after_its_prerequisites_completed(
        self, jobs: dict[int, dict[str, Any]], ledger: dict[int, dict[str, Any]]
    ) -> None:
        # 20. A job enqueued after others counts exactly those not completed, is never claimed
        # while one is left, and its first attempt started after the last one completed.
        first = {
            row["job_ref"]: row["claimed_at"] for row in ledger.values() if row["attempt"] == 1
        }
        for pk, job in jobs.items():
            if not job["waits_for"] or job["group_results"] is not None:
                continue
            left = [p for p in job["waits_for"] if jobs[p]["status"] != COMPLETED]
            assert job["unmet"] == len(left), f"job {pk} counts {job['unmet']}, left {left}"
            if left:
                assert job["status"] in (WAITING, CANCELLED, FAILED), f"job {pk} ran early"
                assert job["attempts"] == 0 and job["lock_holder"] is None, job
            for p in job["waits_for"] if pk in first else ():
                assert jobs[p]["completed_at"] <= first[pk], f"job {pk} started before {p}"

    def a_callback_is_released_once_every_member_ended(
        self, jobs: dict[int, dict[str, Any]]
    ) -> None:
        # 21. Until released: the exact count, each ended member recorded as it is, no attempt,
        # no lock. Released: in the step whose end made every member final, as recorded; once.
        for pk, job in jobs.items():
            results = job["group_results"]
            if results is None:
                continue
            members = job["waits_for"]
            recorded = {
                str(m): {
                    "pk": m,
                    "kind": jobs[m]["kind"],
                    "status": jobs[m]["status"],
                    "last_error": jobs[m]["last_error"],
                }
                for m in members
                if jobs[m]["status"] in FINAL
            }
            if job["unmet"]:
                assert results == recorded, f"callback {pk} recorded {results}, not {recorded}"
                assert job["unmet"] == len(members) - len(results), job
                assert job["attempts"] == 0 and job["lock_holder"] is None, f"{pk} ran early"
                assert job["status"] in (WAITING, CANCELLED, FAILED), job
            elif pk not in self.released_groups:
                assert results == recorded and len(results) == len(members), (
                    f"callback {pk} released with {results}; its members are {recorded}"
                )
                self.released_groups[pk] = results
            else:
                assert results == self.released_groups[pk], f"callback {pk}'s results changed"

    def a_limited_kind_never_runs_past_its_limit(self, jobs: dict[int, dict[str, Any]]) -> None:
        # 13. Processing with a live lease, by the database clock.
        live = limited_live(jobs)
        assert live <= LIMIT, f"{live} jobs of {LIMITED_KIND!r} hold live leases, limit {LIMIT}"

    def an_execution_releases_what_it_held_only_when_it_ends(
        self, jobs: dict[int, dict[str, Any]]
    ) -> None:
        # 16. A handler still running on a lease that has not expired keeps its job's lock
        # and its limit slot, whatever its job's status says. A lease that expired frees them.
        self.running = {pair for pair in self.running if jobs[pair[0]]["live"]}
        may_start = LEASED | {PENDING}
        for pk, token in self.running:
            lock = jobs[pk]["lock"]
            others = [
                other
                for other, row in jobs.items()
                if other != pk and lock and row["lock"] == lock and row["status"] in may_start
            ]
            assert not others, (
                f"lock {lock!r}: jobs {others} may start while job {pk}'s handler (token {token}) "
                f"still runs, its job {jobs[pk]['status']}"
            )
        running = {pk for pk, _ in self.running if jobs[pk]["kind"] == LIMITED_KIND}
        others = {
            pk
            for pk, row in jobs.items()
            if row["kind"] == LIMITED_KIND and row["status"] in LEASED and row["live"]
        }
        assert len(running | others) <= LIMIT, (
            f"{LIMITED_KIND!r}: handlers of jobs {sorted(running)} run and jobs "
            f"{sorted(others)} hold live leases, limit {LIMIT}"
        )

    def recorded_steps_were_held_and_never_change(self, ledger: dict[int, dict[str, Any]]) -> None:
        # 18. Each step recorded once, under a token that acquired its job, within that
        # attempt (between its claim and its end, by the database clock); never changed.
        attempts = {(row["job_ref"], row["token"]): row for row in ledger.values()}
        steps = step_rows()
        for (pk, name), step in steps.items():
            attempt = attempts.get((pk, step["token"]))
            assert attempt is not None, f"step {name!r} of job {pk} under a token never issued"
            assert step["attempt"] == attempt["attempt"]
            assert attempt["claimed_at"] <= step["recorded_at"]
            assert attempt["ended_at"] is None or step["recorded_at"] <= attempt["ended_at"], (
                f"step {name!r} of job {pk} recorded after its attempt ended"
            )
        for key, old in self.steps.items():
            assert steps.get(key) == old, f"recorded step {key} changed or went"
        self.steps = steps

    def closed_ledger_rows_never_change(self, ledger: dict[int, dict[str, Any]]) -> None:
        # 4. Append-only: compare every row closed at an earlier step with what it is now.
        for pk, old in self.closed.items():
            new = ledger.get(pk)
            assert new is not None, f"ledger row {pk} deleted"
            changed = {name for name in old if new[name] != old[name]}
            allowed = {name for name in APPEND_ONCE if old[name] is None}
            if old["outcome"] in PUT_UNDER_REVIEW and not old["resolution"]:
                allowed |= VERDICT
            assert changed <= allowed, (
                f"closed ledger row {pk} ({old['outcome']} by {old['ended_by']}) changed: "
                + ", ".join(f"{name} {old[name]!r} -> {new[name]!r}" for name in sorted(changed))
            )
        self.closed = {pk: row for pk, row in ledger.items() if row["ended_at"] is not None}
        # Operator events are append-only too.
        events = event_rows()
        assert {pk: events.get(pk) for pk in self.events} == self.events
        self.events = events


# Each machine's examples run as SHARDS tests of a part each, every part from its own seed: on
# several test processes (-n) they run side by side, and the longest test is a part, not the
# whole. A change of SHARDS draws other examples, as many in all.
SHARDS = 4
SHARD = pytest.mark.parametrize("shard", range(SHARDS))


def run_shard(machine: type[RuleBasedStateMachine], shard: int, examples: int) -> None:
    """Run part `shard` of `examples` examples of `machine` (of `LEASES_STATE_MACHINE_EXAMPLES`
    fresh ones if set); CI's parts are the same every run."""
    common = {
        "stateful_step_count": STEPS,
        "deadline": None,
        "database": None,
        "suppress_health_check": list(HealthCheck),
    }
    part = type(f"{machine.__name__}Part{shard}", (machine,), {})
    if EXAMPLES:
        chosen = settings(max_examples=math.ceil(EXAMPLES / SHARDS), **common)
    else:
        chosen = settings(max_examples=examples // SHARDS, **common)
        part = seed(shard)(part)
    run_state_machine_as_test(part, settings=chosen)


# ---- schedules ------------------------------------------------------------------------------

# Ticks of about 115 days: they pass only when a rule moves the schedules' records back. The
# cron schedule's fire times pass with the database clock, which a rule moves, from a day before
# a change of Berlin's clocks: 02:00, 02:20 and 02:40 skipped in spring (they fire at 03:00 CEST),
# repeated in autumn (they fire in the first pass). Each schedule has a second definition an
# edit switches to (another period, another expression), and back.
DEFINITIONS: dict[str, list[dict[str, Any]]] = {
    "sweep": [{"kind": "sweep", "every": 10**7}, {"kind": "sweep", "every": 2 * 10**7}],
    "report": [
        {"kind": "report", "every": 10**7, "catch_up": False},
        {"kind": "report", "every": 3 * 10**7, "catch_up": False},
    ],
    "nightly": [
        {"kind": "nightly", "cron": "*/20 2 * * *", "tz": "Europe/Berlin"},
        {"kind": "nightly", "cron": "*/30 2 * * *", "tz": "Europe/Berlin"},
    ],
}
SCHEDULE_SETTINGS = {"SCHEDULES": {name: entries[0] for name, entries in DEFINITIONS.items()}}
DST_EVES = [datetime(2027, 3, 27, 0, 50, tzinfo=UTC), datetime(2027, 10, 30, 0, 10, tzinfo=UTC)]
DAY = 86400


class ScheduleMachine(RuleBasedStateMachine):
    """Schedulers passing, ticks passing, tick jobs finishing and pruned between ticks,
    schedules edited and rolled back between ticks.

    Its own machine: pruning deletes ledger rows, which the lease machine's append-only
    invariant (4) holds on to, and jobs its bundles still name.
    """

    def __init__(self) -> None:
        super().__init__()
        JobAttempt.objects.all().delete()
        JobEvent.objects.all().delete()
        PaymentJob.objects.all().delete()
        ScheduleState.objects.all().delete()
        every = [
            Schedule.from_setting(name, entry)
            for name, entries in DEFINITIONS.items()
            for entry in entries
        ]
        self.series = {schedule.series: schedule for schedule in every}
        self.chosen = dict.fromkeys(DEFINITIONS, 0)
        self.edited: override_settings | None = None
        # Per series, the job each tick was given, by tick: moved back as ticks pass.
        self.given: dict[Series, dict[int, int]] = {series: {} for series in self.series}
        # Per schedule, what its row holds (its series and last tick); per series, the tick it
        # last started at (a new or edited schedule's current tick, covered without a job).
        self.rows: dict[str, tuple[Series, int]] = {}
        self.starts: dict[Series, int] = {}
        self.clock = DatabaseClock(PaymentJob.objects.db)
        # Per (schedule, request) run now, the job it enqueued last.
        self.run_now_jobs: dict[tuple[str, str], int] = {}
        self.moment = self.furthest = DST_EVES[0]
        self.passed = self.most_passed = 0

    @initialize(eve=st.sampled_from(DST_EVES))
    def clock_starts(self, eve: datetime) -> None:
        self.moment = self.furthest = eve
        self.clock.set(eve)

    def teardown(self) -> None:
        self.clock.reset()
        if self.edited is not None:
            self.edited.disable()

    def due(self, schedule: Schedule) -> tuple[int | None, int]:
        """Return the tick before the current one and the current one: a cron schedule's by
        walking its fire times forward from three days back."""
        epoch = database_now(PaymentJob.objects.db).timestamp()
        if not schedule.cron:
            tick = math.floor(epoch / schedule.every)
            return tick - 1, tick
        walked = list(takewhile(lambda f: f <= epoch, schedule.fires_after(int(epoch) - 3 * DAY)))
        return (walked[-2] if len(walked) > 1 else None), walked[-1]

    @rule()
    def scheduler_passes(self) -> None:
        """12. Exactly the due ticks, none of them enqueued before, none before an edit."""
        due = {}
        for schedule in configured():
            (before, tick), row = self.due(schedule), self.rows.get(schedule.name)
            due[schedule.series] = [tick]
            if row is None or row[0] != schedule.series:
                due[schedule.series] = []  # new, edited or rolled back: starts after `tick`
                self.starts[schedule.series] = tick
            elif row[1] >= tick:
                due[schedule.series] = []  # enqueued already, or the clock went back
            elif schedule.catch_up and before is not None and before > row[1]:
                due[schedule.series] = [before, tick]
            if row is None or row[0] != schedule.series or row[1] < tick:
                self.rows[schedule.name] = (schedule.series, tick)
        jobs = enqueue_due()
        assert all(any(of_series(s, job.idempotency_key) for s in configured()) for job in jobs)
        for schedule in configured():
            given = self.given[schedule.series]
            mine = [job for job in jobs if of_series(schedule, job.idempotency_key)]
            ticks = [tick_of(job.idempotency_key) for job in mine]
            again = set(ticks) & set(given)
            assert not again, f"{schedule.name}: ticks {sorted(again)} enqueued a second time"
            assert ticks == due[schedule.series], f"{schedule.name} enqueued {ticks}"
            start = self.starts[schedule.series]
            assert all(tick > start for tick in ticks), f"{schedule.name}: a tick before {start}"
            assert [job.run_at for job in mine] == [schedule.start(tick) for tick in ticks]
            given.update(zip(ticks, (job.pk for job in mine), strict=True))

    @precondition(lambda self: self.moment >= self.furthest and self.passed >= self.most_passed)
    @rule(name=st.sampled_from(sorted(DEFINITIONS)))
    def schedule_edited(self, name: str) -> None:
        """A schedule edited between ticks, or the edit rolled back. (Not while the clock is
        behind a moment it was at: across an edit, a clock that went back may give a series a
        tick it had before the edit, which its new row knows nothing of.)"""
        self.chosen[name] ^= 1
        if self.edited is not None:
            self.edited.disable()
        entries = {name: DEFINITIONS[name][n] for name, n in self.chosen.items()}
        self.edited = override_settings(DJANGO_LEASES={"SCHEDULES": entries})
        self.edited.enable()

    @rule(count=st.sampled_from([1, 1, 2, 5, -1]))
    def ticks_pass(self, count: int) -> None:
        """`count` ticks pass (a negative count: the database clock went back)."""
        self.passed += count
        self.most_passed = max(self.most_passed, self.passed)
        for series, schedule in self.series.items():
            if schedule.cron:
                continue  # its fire times pass with the clock
            ticks_pass(schedule, count)
            self.given[series] = {tick - count: pk for tick, pk in self.given[series].items()}
            if series in self.starts:
                self.starts[series] -= count
            row = self.rows.get(schedule.name)
            if row is not None and row[0] == series:
                self.rows[schedule.name] = (series, row[1] - count)

    @rule(minutes=st.sampled_from([10, 20, 20, 30, 60, 180, 1440, -20]))
    def clock_moves(self, minutes: int) -> None:
        """The database clock moves on (or back), across the DST change or not."""
        self.moment += timedelta(minutes=minutes)
        self.furthest = max(self.furthest, self.moment)
        self.clock.set(self.moment)

    @rule(which=st.integers(0, 3), fail=st.booleans())
    def tick_job_finishes(self, which: int, fail: bool) -> None:
        """A due tick's job runs: completed, or failed for good (kept 30 days by default)."""
        pending = list(PaymentJob.objects.filter(status=PENDING, run_at__lte=Now()).order_by("pk"))
        if pending:
            run(pending[which % len(pending)], fail=fail)

    @rule(name=st.sampled_from(sorted(DEFINITIONS)), request=st.sampled_from(["r1", "r2"]))
    def run_now(self, name: str, request: str) -> None:
        """23. An operator runs a schedule now."""
        kept = self.run_now_jobs.get((name, request))
        job = run_now(name, by="ops", request=request)
        assert not any(of_series(s, job.idempotency_key) for s in self.series.values())
        if kept is not None and PaymentJob.objects.filter(pk=kept).exists():
            assert job.pk == kept, f"{name}/{request}: a second job"
        self.run_now_jobs[(name, request)] = job.pk

    @rule(statuses=st.sampled_from([("completed",), ("completed", "failed")]))
    def prune(self, statuses: tuple[str, ...]) -> None:
        """`prune_jobs` with a retention shorter than a tick."""
        before = PaymentJob.objects.filter(status__in=statuses).count()
        assert sum(prune_finished(statuses).values()) == before

    @invariant()
    def each_job_run_now_recorded_once(self) -> None:
        """23. One operator event per job run now, and none for a tick's."""
        now = PaymentJob.objects.filter(idempotency_key__contains=":now:")
        events = JobEvent.objects.filter(action="run_now")
        # A pruned job's events go with it.
        assert Counter(events.values_list("job_ref", flat=True)) == Counter(
            now.values_list("pk", flat=True)
        )

    @invariant()
    def one_job_per_tick(self) -> None:
        """12. Every schedule job in the table is the one its tick of its series was given."""
        keyed = PaymentJob.objects.filter(idempotency_key__isnull=False)
        rows = list(keyed.values_list("pk", "idempotency_key"))  # one read for every schedule
        for series, schedule in self.series.items():
            found = {tick_of(key): pk for pk, key in rows if of_series(schedule, key)}
            given = self.given[series]
            assert all(given.get(tick) == pk for tick, pk in found.items()), (
                f"{series}: jobs {found}, ticks given {given}"
            )


# Both machines run for minutes on a busy machine (CI's PostgreSQL phase took the lease machine
# past the default 300 s once, with six test processes on two cores): their parts start first,
# and get the time they need. Their examples are seeded, so the time does not vary by run.
@pytest.mark.slow
@pytest.mark.timeout(900)
@override_settings(DJANGO_LEASES=SCHEDULE_SETTINGS)
@SHARD
def test_schedule_state_machine__one_job_per_tick_whatever_was_pruned(shard: int) -> None:
    run_shard(ScheduleMachine, shard, examples=100)


@pytest.fixture
def quiet_watcher() -> Iterator[None]:
    """Keep the watcher's line per rescued job out of the output: thousands per run."""
    logger = logging.getLogger("django_leases.watcher")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@pytest.fixture
def limited_kind() -> Iterator[None]:
    """Register the limited kind's handler (and so its limit) for one run of the machine."""
    job_handler(LIMITED_KIND, limit=LIMIT)(never_runs)
    job_handler(SILENT_KIND, limit=LIMIT)(never_runs)
    yield
    unregister(LIMITED_KIND)
    unregister(SILENT_KIND)


def never_runs(job: Any, lease: Any) -> None:
    raise AssertionError("no worker runs in the state machine")


@pytest.mark.slow
@pytest.mark.timeout(900)
@override_settings(DJANGO_LEASES=LEASE_SETTINGS)
@SHARD
def test_lease_state_machine__keeps_every_guarantee(
    shard: int, quiet_watcher: None, limited_kind: None
) -> None:
    run_shard(LeaseMachine, shard, examples=200)
