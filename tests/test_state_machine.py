"""A model-based test of the lease state machine: Hypothesis drives the real API on the real
database (whichever `DATABASE_URL` selects) with several jobs and owners, and checks after every
step, reading the database, the guarantees the README makes:

1. One owner at a time: a job has at most one open attempt (ledger row without `ended_at`); a
   processing job has exactly one, under its current owner and fencing token; any other job has
   none.
2. The fencing token of a job strictly grows with every acquisition and is never handed out
   twice: the ledger's tokens rise with its attempt numbers, and a job's token never goes back.
3. A record of every attempt: exactly one ledger row per acquisition, numbered 1..n, and
   `attempts` equals the number of acquisitions the API reported.
4. The ledger is append-only: a closed row never changes again, except that `fenced_at` may be
   set once (its holder came back and was refused) and the row that put its job under review (a
   watcher's review, or a timeout after a checkpoint) gets its verdict once. Operator actions
   are recorded beside it: one event per job changed, never changed afterwards.
5. A worker that lost its lease cannot write: its write raises `LeaseLost` and leaves every job
   row and every ledger row as they were (only `fenced_at` of its own attempt may be set).
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

Besides, each rule checks what its own call must have done (a claim takes exactly the jobs the
specification makes claimable, an operator action changes exactly the jobs its eligibility
names, a holder's write wins exactly while it holds the lease, an enqueue waits exactly when its
lock has a holder, a requeued job of a lock keeps the lock it held or rejoins the lock), and that
an operator action without "force" in its name never takes a live lease.

Time passes only through the database clock: a rule moves `lease_until` or `run_at` into the
past with an UPDATE, never a mocked clock. Leases are long (`TTL`), so nothing expires unless a
rule says so.

The default run is derandomized (the same examples every run); `LEASES_STATE_MACHINE_EXAMPLES=N`
runs N examples with fresh random choices (`LEASES_STATE_MACHINE_STEPS`: steps per example), and
`LEASES_STATE_MACHINE_MARATHON=1` lets one job per example fail 1024 times first, the backoff's
largest exponent (seconds per example). docs/concepts.md has the commands.
"""

import logging
import os
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from itertools import combinations
from typing import Any

import pytest
from django.db.models import BooleanField, Case, When
from django.db.models.functions import Now
from django.test import override_settings
from hypothesis import HealthCheck, settings
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

from django_leases.backoff import retry_delay
from django_leases.exceptions import LeaseLost
from django_leases.lease import Lease
from django_leases.models import JobAttempt, JobEvent, PaymentJob, Worker
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    WAITING,
)
from django_leases.watcher import StuckWatcher

pytestmark = pytest.mark.django_db(transaction=True)

FINAL = {COMPLETED, FAILED, CANCELLED}
# The statuses in which a job of a lock holds it.
HOLDING = {PENDING, PROCESSING, REVIEW}
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
LEASE_SETTINGS = {"STUCK_POLICY": "retry", "STUCK_POLICY_BY_KIND": {REVIEW_KIND: "review"}}
OWNERS = ("w1", "w2", "w3")
WATCHERS = ("watcher", "slow-watcher")
TTL = 600  # seconds: no lease ends by itself while an example runs
PAST = timedelta(seconds=30)
LATER = timedelta(seconds=3600)
FLAG = BooleanField()
# What a rescue decides on, and so must restate.
RESTATED = ("lease_token", "checkpoint", "max_attempts")
# What may still change in a closed ledger row, once: when its holder was refused after losing
# the lease, and the verdict on a row that put its job under review.
APPEND_ONCE = {"fenced_at"}
VERDICT = {"resolution", "resolved_by", "resolved_at"}
# Outcomes of the attempts that put a job under review: the watcher's, and a timeout after a
# checkpoint of a review-policy kind.
PUT_UNDER_REVIEW = ("review", "timed_out")

# Attempts after which the backoff's exponent no longer fits a float (2 ** 1024).
MARATHON = 1024
WITH_MARATHON = bool(os.environ.get("LEASES_STATE_MACHINE_MARATHON"))
EXAMPLES = int(os.environ.get("LEASES_STATE_MACHINE_EXAMPLES", "0"))
STEPS = int(os.environ.get("LEASES_STATE_MACHINE_STEPS", "40"))


def job_rows() -> dict[int, dict[str, Any]]:
    """Every job row, with whether its lease is live and whether it is due, by the database
    clock."""
    rows = PaymentJob.objects.annotate(
        live=Case(When(lease_until__gte=Now(), then=True), default=False, output_field=FLAG),
        due=Case(When(run_at__lte=Now(), then=True), default=False, output_field=FLAG),
    )
    return {row["id"]: row for row in rows.values()}


def ledger_rows() -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in JobAttempt.objects.order_by("id").values()}


def event_rows() -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in JobEvent.objects.order_by("id").values()}


def held(row: dict[str, Any], lease: PaymentJob) -> bool:
    """Whether `lease` (a claimed job as the claim returned it) still holds the job `row`."""
    return (
        row["status"] == PROCESSING
        and row["lease_owner"] == lease.lease_owner
        and row["lease_token"] == lease.lease_token
    )


def claimable(row: dict[str, Any]) -> bool:
    """The specification of a claimable job: due and pending, or an expired lease that the
    review policy does not hold, with an attempt left."""
    if row["attempts"] >= row["max_attempts"]:
        return False
    if row["status"] == PENDING:
        return bool(row["due"])
    if row["status"] == PROCESSING and not row["live"]:
        return not (row["kind"] == REVIEW_KIND and row["checkpoint"])
    return False


def expired(row: dict[str, Any]) -> bool:
    return row["status"] == PROCESSING and not row["live"]


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
        return status in (PENDING, WAITING, REVIEW, PROCESSING)
    if name == "cancel":
        return status in (PENDING, WAITING)
    return status == REVIEW  # resolve_review_*


# The event each admin action records beside the ledger.
OPERATOR_EVENT = {
    "requeue": "requeued",
    "force_requeue": "requeued",
    "release_stuck": "released",
    "mark_failed": "failed",
    "force_mark_failed": "failed",
    "cancel": "cancelled",
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
    "resolve_review_completed": COMPLETED,
    "resolve_review_retry": PENDING,
    "resolve_review_failed": FAILED,
}


def operator_call(name: str, jobs: Any, by: str) -> int:
    """Call the queryset method behind the admin action `name`, as the admin does."""
    if name == "requeue":
        return int(jobs.requeue(by=by))
    if name == "force_requeue":
        return int(jobs.requeue(force=True, by=by))
    if name == "release_stuck":
        return int(jobs.release_stuck(by=by))
    if name in ("mark_failed", "force_mark_failed"):
        force = name == "force_mark_failed"
        return int(jobs.mark_failed(reason=f"marked failed by {by}", force=force, by=by))
    if name == "cancel":
        return int(jobs.cancel(by=by))
    return int(jobs.resolve_review(name.removeprefix("resolve_review_"), by=by))


class LeaseMachine(RuleBasedStateMachine):
    """Jobs of two kinds (one under each stuck policy), three owners, operators, watchers."""

    jobs = Bundle("jobs")
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        # Each example starts from empty tables: examples never see each other's rows.
        JobAttempt.objects.all().delete()
        JobEvent.objects.all().delete()
        PaymentJob.objects.all().delete()
        Worker.objects.all().delete()
        self.acquisitions: Counter[int] = Counter()
        self.tokens: dict[int, int] = {}
        self.closed: dict[int, dict[str, Any]] = {}
        self.events: dict[int, dict[str, Any]] = {}
        # (job id, token) of attempts whose holder's own write ended them.
        self.finished_by_holder: set[tuple[int, int]] = set()
        # Expired leases a watcher read and decided on, not yet written back.
        self.watcher_read: list[tuple[Any, str, str]] = []
        # Per lock holder: the earlier jobs of its lock an operator requeued while it held the
        # lock (they wait, and may stay unfinished when it first runs).
        self.requeued_behind: dict[int, set[int]] = {}
        # On request only: one job per example may go through MARATHON attempts (seconds each).
        self.marathon = WITH_MARATHON

    # ---- enqueue and claims -----------------------------------------------------------------

    @initialize(
        target=jobs,
        kinds=st.lists(
            st.tuples(st.sampled_from([RETRY_KIND, REVIEW_KIND]), LOCKING), min_size=2, max_size=4
        ),
        max_attempts=st.integers(1, 3),
    )
    def several_jobs(
        self, kinds: list[tuple[str, tuple[str | None, str | None]]], max_attempts: int
    ) -> Any:
        """Every example starts with a few due jobs, so that its steps act on jobs."""
        return multiple(
            *(self.enqueue(kind, max_attempts, False, locking) for kind, locking in kinds)
        )

    @rule(
        target=jobs,
        kind=st.sampled_from([RETRY_KIND, REVIEW_KIND]),
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
        return int(job.pk)

    def _acquired(self, claimed: list[PaymentJob], owner: str, before: dict[int, dict]) -> None:
        after = job_rows()
        for job in claimed:
            row, old = after[job.pk], before[job.pk]
            assert claimable(old), f"job {job.pk} was claimed from {old}"
            assert row["status"] == PROCESSING and row["lease_owner"] == owner and row["live"]
            assert row["attempts"] == old["attempts"] + 1 == job.attempts
            assert row["lease_token"] == job.lease_token > old["lease_token"]
            self.acquisitions[job.pk] += 1
            if old["attempts"] == 0 and row["lock"]:
                self._runs_in_lock_order(job.pk, after)

    def _runs_in_lock_order(self, pk: int, rows: dict[int, dict[str, Any]]) -> None:
        """Invariant 10, at job `pk`'s first claim: every earlier job of its lock is
        finished, except one an operator requeued while `pk` held the lock (it waits)."""
        lock = rows[pk]["lock"]
        excused = self.requeued_behind.get(pk, set())
        early = {
            other: row["status"]
            for other, row in rows.items()
            if row["lock"] == lock and other < pk and row["status"] not in FINAL
        }
        assert all(other in excused and status == WAITING for other, status in early.items()), (
            f"job {pk} of lock {lock!r} started before earlier jobs {early}"
        )

    @rule(
        target=leases,
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        kinds=st.sampled_from([None, [RETRY_KIND], [REVIEW_KIND]]),
    )
    def claim(self, owner: str, limit: int, kinds: list[str] | None) -> Any:
        before = job_rows()
        wanted = [
            pk
            for pk, row in before.items()
            if claimable(row) and (kinds is None or row["kind"] in kinds)
        ]
        claimed = PaymentJob.objects.claim(owner, ttl=TTL, limit=limit, kinds=kinds)
        assert len(claimed) == min(limit, len(wanted))
        assert {job.pk for job in claimed} <= set(wanted)
        self._acquired(claimed, owner, before)
        return multiple(*claimed)

    @rule(target=leases, pk=jobs, owner=st.sampled_from(OWNERS))
    def claim_job(self, pk: int, owner: str) -> Any:
        before = job_rows()
        job = PaymentJob.objects.claim_job(pk, owner, ttl=TTL)
        assert (job is not None) == claimable(before[pk])
        if job is None:
            return multiple()
        self._acquired([job], owner, before)
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
            self.acquisitions[pk] += 1
            Lease(job, ttl=TTL).fail(RuntimeError("psp down"), retry_in=retry_delay(job.attempts))
            self.finished_by_holder.add((pk, job.lease_token))
            PaymentJob.objects.filter(pk=pk).update(run_at=Now() - PAST)
        job = PaymentJob.objects.claim_job(pk, owner, ttl=TTL)
        assert job is not None and job.attempts == MARATHON + 1
        self.acquisitions[pk] += 1
        return job

    # ---- the database clock -----------------------------------------------------------------

    @rule(pk=jobs)
    def lease_runs_out(self, pk: int) -> None:
        PaymentJob.objects.filter(pk=pk, status=PROCESSING).update(lease_until=Now() - PAST)

    @rule(pk=jobs)
    def run_at_passes(self, pk: int) -> None:
        PaymentJob.objects.filter(pk=pk, status=PENDING).update(run_at=Now() - PAST)

    @rule()
    def time_passes(self) -> None:
        """Every lease runs out and every pending job is due (a worker was paused for long)."""
        PaymentJob.objects.filter(status=PROCESSING).update(lease_until=Now() - PAST)
        PaymentJob.objects.filter(status=PENDING).update(run_at=Now() - PAST)

    # ---- holders' writes, including those of holders that lost their lease -------------------

    def _holder_write(self, lease: PaymentJob, write: str, needs_live: bool, call: Any) -> Any:
        """Run a holder's `write`; check that it wins exactly while `lease` holds the job (and,
        for renewals and checkpoints, the lease is live), and that a refused write changes
        nothing."""
        jobs_before, ledger_before = job_rows(), ledger_rows()
        row = jobs_before[lease.pk]
        wins = held(row, lease) and (row["live"] or not needs_live)
        if not wins:
            with pytest.raises(LeaseLost):
                call()
            assert job_rows() == jobs_before, f"a fenced-out {write} changed a job"
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
        if write not in ("heartbeat", "checkpoint"):
            self.finished_by_holder.add((lease.pk, lease.lease_token))
        return result

    @rule(lease=leases)
    def heartbeat(self, lease: PaymentJob) -> None:
        self._holder_write(lease, "heartbeat", True, Lease(lease, ttl=TTL).heartbeat)

    @rule(owner=st.sampled_from(OWNERS))
    def worker_renews_everything_it_ever_held(self, owner: str) -> None:
        """The worker's heartbeat thread: one statement renews many leases, some of them lost."""
        tokens = {
            row["job_ref"]: row["token"]
            for row in JobAttempt.objects.filter(owner=owner).order_by("token").values()
        }
        before = job_rows()
        renewed = PaymentJob.objects.heartbeat(owner, tokens, ttl=TTL)
        assert renewed == {
            pk
            for pk, token in tokens.items()
            if before[pk]["status"] == PROCESSING
            and (before[pk]["lease_owner"], before[pk]["lease_token"]) == (owner, token)
            and before[pk]["live"]
        }

    @rule(lease=leases, step=st.sampled_from(["psp_called", "ledger_posted"]))
    def checkpoint(self, lease: PaymentJob, step: str) -> None:
        self._holder_write(
            lease, "checkpoint", True, lambda: Lease(lease, ttl=TTL).checkpoint(step)
        )
        if (row := job_rows()[lease.pk])["checkpoint"] == step and held(row, lease):
            open_row = JobAttempt.objects.get(job_ref=lease.pk, token=lease.lease_token)
            assert open_row.checkpoint == step

    @rule(lease=leases)
    def complete(self, lease: PaymentJob) -> None:
        before = job_rows()[lease.pk]
        self._holder_write(lease, "complete", False, Lease(lease, ttl=TTL).complete)
        if held(before, lease):
            assert job_rows()[lease.pk]["status"] == COMPLETED

    @rule(owner=st.sampled_from(OWNERS), limit=st.integers(0, 3))
    def worker_acknowledges_everything_it_ever_held(self, owner: str, limit: int) -> None:
        """A worker's batched completion (ack="batch"): it claims up to `limit` jobs and runs
        them, then completes in one call every job it ever held: those, and older ones lost,
        finished or of a lock (left to `complete()`); each row wins exactly while its lease
        holds it."""
        if limit:
            before = job_rows()
            self._acquired(PaymentJob.objects.claim(owner, ttl=TTL, limit=limit), owner, before)
        acks = {
            row["job_ref"]: row["token"]
            for row in JobAttempt.objects.filter(owner=owner).order_by("token").values()
        }
        jobs_before, ledger_before = job_rows(), ledger_rows()
        won = PaymentJob.objects.complete_many(owner, acks)
        assert won == {
            pk
            for pk, token in acks.items()
            if jobs_before[pk]["status"] == PROCESSING
            and (jobs_before[pk]["lease_owner"], jobs_before[pk]["lease_token"]) == (owner, token)
            and not jobs_before[pk]["lock"]
        }
        jobs_after, ledger_after = job_rows(), ledger_rows()
        clock = {"live", "due"}
        for pk, old in jobs_before.items():
            new = jobs_after[pk]
            if pk in won:
                assert (new["status"], new["lock_holder"]) == (COMPLETED, None)
                self.finished_by_holder.add((pk, acks[pk]))
            else:
                assert {k: v for k, v in new.items() if k not in clock} == {
                    k: v for k, v in old.items() if k not in clock
                }, f"a refused batched completion changed job {pk}"
        assert ledger_after.keys() == ledger_before.keys()
        for pk, old in ledger_before.items():
            new, ack = ledger_after[pk], (old["job_ref"], old["token"])
            if ack[0] in won and acks[ack[0]] == ack[1]:
                assert (new["outcome"], new["ended_by"]) == (COMPLETED, owner)
            elif ack in acks.items():
                assert old["fenced_at"] is None or new["fenced_at"] == old["fenced_at"]
                assert {**new, "fenced_at": old["fenced_at"]} == old, f"ledger row {pk} changed"
            else:
                assert new == old, f"a batched completion changed ledger row {pk}"

    @rule(
        target=leases,
        owner=st.sampled_from(OWNERS),
        limit=st.integers(1, 3),
        kinds=st.sampled_from([None, [RETRY_KIND], [REVIEW_KIND]]),
    )
    def worker_completes_and_claims_its_next(
        self, owner: str, limit: int, kinds: list[str] | None
    ) -> Any:
        """A worker's group write (`complete_and_claim`, one statement on PostgreSQL): it
        completes every job it ever held and claims up to `limit` next ones. Exactly the
        completions `complete_many()` would make win (older leases lost, finished or of a lock
        are refused or left alone), then exactly the claims `claim()` would make after them."""
        acks = {
            row["job_ref"]: row["token"]
            for row in JobAttempt.objects.filter(owner=owner).order_by("token").values()
        }
        before = job_rows()
        won, claimed = PaymentJob.objects.complete_and_claim(
            owner, acks, ttl=TTL, limit=limit, kinds=kinds
        )
        assert won == {
            pk
            for pk, token in acks.items()
            if before[pk]["status"] == PROCESSING
            and (before[pk]["lease_owner"], before[pk]["lease_token"]) == (owner, token)
            and not before[pk]["lock"]
        }
        after = job_rows()
        for pk in won:
            assert (after[pk]["status"], after[pk]["lock_holder"]) == (COMPLETED, None)
            self.finished_by_holder.add((pk, acks[pk]))
        wanted = [
            pk
            for pk, row in before.items()
            if pk not in won and claimable(row) and (kinds is None or row["kind"] in kinds)
        ]
        assert len(claimed) == min(limit, len(wanted))
        assert {job.pk for job in claimed} <= set(wanted)
        self._acquired(claimed, owner, before)
        return multiple(*claimed)

    @rule(lease=leases, permanent=st.booleans())
    def fail(self, lease: PaymentJob, permanent: bool) -> None:
        """A handler raised: retried after the worker's backoff, or failed for good."""
        before = job_rows()[lease.pk]
        holder = Lease(lease, ttl=TTL)
        delay = None if permanent else retry_delay(lease.attempts)
        status = self._holder_write(
            lease,
            "fail",
            False,
            lambda: holder.fail(RuntimeError("psp said no"), retry_in=delay, permanent=permanent),
        )
        if held(before, lease):
            out_of_attempts = before["attempts"] >= before["max_attempts"]
            row = job_rows()[lease.pk]
            assert status == row["status"] == (FAILED if permanent or out_of_attempts else PENDING)
            assert row["due"] is False or status == FAILED

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
        actions = StuckWatcher(watcher_id="watcher").run_once()
        assert {action.pk for action in actions} == stuck
        after = job_rows()
        for pk in stuck:
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

    # ---- operators --------------------------------------------------------------------------

    @rule(
        name=st.sampled_from(sorted(OPERATOR_STATUS)),
        selected=st.lists(jobs, min_size=1, max_size=3, unique=True),
    )
    def operator(self, name: str, selected: list[int]) -> None:
        before = job_rows()
        last_event = max(event_rows(), default=0)
        eligible = {pk for pk in selected if operator_eligible(name, before[pk])}
        changed = operator_call(name, PaymentJob.objects.filter(pk__in=selected).order_by(), "op")
        assert changed == len(eligible), f"{name} changed {changed} of {sorted(eligible)}"
        # Recorded beside the attempts: one event per job changed, as it was when changed.
        added = [event for pk, event in event_rows().items() if pk > last_event]
        assert sorted((e["job_ref"], e["action"], e["by"]) for e in added) == sorted(
            (pk, OPERATOR_EVENT[name], "op") for pk in eligible
        )
        for event in added:
            old = before[event["job_ref"]]
            assert (event["attempts"], event["token"]) == (old["attempts"], old["lease_token"])
        after = job_rows()
        holders = {row["lock_holder"]: pk for pk, row in after.items() if row["lock_holder"]}
        for pk, old in before.items():
            if pk in eligible:
                self._operator_changed(name, pk, old, after[pk], holders)
            elif old["status"] == WAITING and after[pk]["status"] == PENDING:
                # A lock a finished job released passes on to one of its waiting jobs.
                promoted = {"status": WAITING, "lock_holder": None}
                assert {**after[pk], **promoted} == old, f"{name} changed waiting job {pk}"
                assert holders[old["lock"]] == pk
            else:
                assert after[pk] == old, f"{name} changed job {pk}, not eligible"
            if "force" not in name and old["status"] == PROCESSING and old["live"]:
                assert after[pk] == old, f"{name} took the live lease of job {pk}"

    def _operator_changed(
        self, name: str, pk: int, old: dict[str, Any], row: dict[str, Any], holders: dict[str, int]
    ) -> None:
        """The status an operator action gave job `pk`: a requeued job of a lock keeps the lock
        it held, or rejoins the lock (waiting while another job holds it)."""
        expected = OPERATOR_STATUS[name]
        if expected == PENDING and old["lock_holder"]:
            assert row["lock_holder"] == old["lock_holder"], f"{name} moved job {pk}'s lock"
        if name in ("requeue", "force_requeue") and holders.get(row["lock"], pk) != pk:
            expected = WAITING
            # Invariant 10's one exception: it waits ahead of the lock's holder.
            self.requeued_behind.setdefault(holders[row["lock"]], set()).add(pk)
        assert row["status"] == expected, f"{name} made job {pk} {row['status']}"

    # ---- invariants, read from the database -------------------------------------------------

    @invariant()
    def ledger_and_jobs_agree(self) -> None:
        jobs, ledger = job_rows(), ledger_rows()
        attempts: dict[int, list[dict[str, Any]]] = {pk: [] for pk in jobs}
        for row in ledger.values():
            attempts[row["job_ref"]].append(row)
        for pk, job in jobs.items():
            rows = sorted(attempts[pk], key=lambda row: row["attempt"])
            # 3. One ledger row per acquisition, numbered 1..n.
            assert [row["attempt"] for row in rows] == list(range(1, job["attempts"] + 1))
            assert job["attempts"] == self.acquisitions[pk]
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
            if job["status"] == PROCESSING:
                assert job["lease_owner"] and job["lease_until"] is not None
            assert (job["completed_at"] is not None) == (job["status"] in FINAL), job
            assert job["attempts"] <= job["max_attempts"]
            if job["status"] == PENDING:
                assert job["attempts"] < job["max_attempts"], f"job {pk} pending, no attempt left"

    @invariant()
    def one_job_of_a_lock_at_a_time(self) -> None:
        jobs = job_rows()
        by_lock: dict[str, list[dict[str, Any]]] = {}
        for pk, job in jobs.items():
            holder, status = job["lock_holder"], job["status"]
            # 8. The lock holder column agrees with the lock and the status.
            if holder is not None:
                assert holder == job["lock"] and status in HOLDING, f"job {pk} holds {holder!r}"
            if status == WAITING:
                assert job["lock"] and holder is None, f"job {pk} waits without a lock"
            if job["lock"]:
                by_lock.setdefault(job["lock"], []).append(job)
        for lock, rows in by_lock.items():
            # 8. One holder per lock, and it is marked as the holder.
            active = [row for row in rows if row["status"] in HOLDING]
            assert len(active) <= 1, f"lock {lock!r} held by {[row['id'] for row in active]}"
            assert all(row["lock_holder"] == lock for row in active)
            # 9. Nothing stranded: a lock with waiting jobs is held.
            if any(row["status"] == WAITING for row in rows):
                assert active, f"lock {lock!r} has waiting jobs and no holder"
        # 11. No overlap: attempts of different jobs of a lock never run at the same time.
        for lock, rows in by_lock.items():
            spans = JobAttempt.objects.filter(job_ref__in=[row["id"] for row in rows]).values_list(
                "job_ref", "claimed_at", "ended_at"
            )
            for (one, start, end), (other, other_start, other_end) in combinations(spans, 2):
                overlap = (end is None or other_start < end) and (
                    other_end is None or start < other_end
                )
                assert one == other or not overlap, (
                    f"lock {lock!r}: attempts of jobs {one} ({start}..{end}) and {other} "
                    f"({other_start}..{other_end}) overlap"
                )

    @invariant()
    def closed_ledger_rows_never_change(self) -> None:
        # 4. Append-only: compare every row closed at an earlier step with what it is now.
        ledger = ledger_rows()
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


def machine_settings() -> settings:
    if EXAMPLES:
        return settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    # CI: the same examples every run, about a minute per database on a slow machine.
    return settings(
        max_examples=200,
        stateful_step_count=STEPS,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture
def quiet_watcher() -> Iterator[None]:
    """Keep the watcher's line per rescued job out of the output: thousands per run."""
    logger = logging.getLogger("django_leases.watcher")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


@override_settings(DJANGO_LEASES=LEASE_SETTINGS)
def test_lease_state_machine__keeps_every_guarantee(quiet_watcher: None) -> None:
    run_state_machine_as_test(LeaseMachine, settings=machine_settings())
