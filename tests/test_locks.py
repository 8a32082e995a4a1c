"""Job locks: one job of a lock at a time, in enqueue order, enforced by the database.

The unit tests drive each transition through the queryset API on one connection; the process
tests race real `run_lease_worker` processes (and kill them) over locked jobs, on whichever
database DATABASE_URL names.
"""

import json
import os
import random
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from django_leases.exceptions import InvalidArgument
from django_leases.models import JobAttempt, PaymentJob
from tests.testapp.models import LockRun

from .conftest import Processes, subprocess_env, wait_for

Status = PaymentJob.Status
LOCK = "payment:42"


def statuses(*jobs: PaymentJob) -> list[str]:
    return [PaymentJob.objects.get(pk=job.pk).status for job in jobs]


def claim(pk: int, owner: str = "w") -> PaymentJob:
    job = PaymentJob.objects.claim_job(pk, owner, ttl=60)
    assert job is not None
    return job


def expire(job: PaymentJob) -> PaymentJob:
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=5))
    return PaymentJob.objects.get(pk=job.pk)


# ---- enqueue -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue__first_job_of_a_lock_is_pending_the_later_ones_wait() -> None:
    first, second, third = (PaymentJob.objects.enqueue("noop", lock=LOCK) for _ in range(3))
    other = PaymentJob.objects.enqueue("noop", lock="payment:43")
    free = PaymentJob.objects.enqueue("noop")
    assert statuses(first, second, third, other, free) == [
        Status.PENDING,
        Status.WAITING,
        Status.WAITING,
        Status.PENDING,
        Status.PENDING,
    ]
    assert list(PaymentJob.objects.lock_holders().values_list("pk", "lock_holder")) == [
        (first.pk, LOCK),
        (other.pk, "payment:43"),
    ]
    assert free.lock == "" and PaymentJob.objects.get(pk=free.pk).lock_holder is None


@pytest.mark.django_db
def test_enqueue__locks_by_payment_by_default(settings: Any) -> None:
    capture = PaymentJob.objects.enqueue("capture", payment_id="pay_1")
    refund = PaymentJob.objects.enqueue("refund", payment_id="pay_1")
    opted_out = PaymentJob.objects.enqueue("webhook", payment_id="pay_1", lock="")
    named = PaymentJob.objects.enqueue("refund", payment_id="pay_1", lock="merchant:7")
    assert [capture.lock, refund.lock, opted_out.lock, named.lock] == [
        "payment:pay_1",
        "payment:pay_1",
        "",
        "merchant:7",
    ]
    assert statuses(capture, refund, opted_out, named) == [
        Status.PENDING,
        Status.WAITING,
        Status.PENDING,
        Status.PENDING,
    ]
    settings.DJANGO_LEASES = {"LOCK_BY_PAYMENT": False}
    assert PaymentJob.objects.enqueue("refund", payment_id="pay_1").lock == ""


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("lock", "message"),
    [
        (42, "lock must be a string of at most 255 characters, got 42"),
        ("x" * 256, "lock must be a string of at most 255 characters"),
        ("pay\x00ment", "lock contains a NUL character"),
    ],
)
def test_enqueue__bad_lock_names_the_argument_and_writes_nothing(lock: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        PaymentJob.objects.enqueue("noop", lock=lock)
    assert not PaymentJob.objects.exists()


@pytest.mark.django_db
def test_enqueue__idempotency_key_of_a_locked_job_returns_the_first() -> None:
    first = PaymentJob.objects.enqueue("capture", payment_id="p", idempotency_key="k")
    again = PaymentJob.objects.enqueue("capture", payment_id="p", idempotency_key="k")
    behind = PaymentJob.objects.enqueue("refund", payment_id="p", idempotency_key="k2")
    again_behind = PaymentJob.objects.enqueue("refund", payment_id="p", idempotency_key="k2")
    assert (again.pk, again_behind.pk) == (first.pk, behind.pk)
    assert PaymentJob.objects.count() == 2
    assert statuses(first, behind) == [Status.PENDING, Status.WAITING]


# ---- the database enforces it ------------------------------------------------------------------


@pytest.mark.django_db
def test_database__refuses_a_second_job_of_a_lock_in_progress() -> None:
    first = PaymentJob.objects.enqueue("noop", lock=LOCK)
    second = PaymentJob.objects.enqueue("noop", lock=LOCK)
    claim(first.pk)
    running = {"status": Status.PROCESSING, "lease_owner": "rogue", "lease_until": Now()}
    # Whatever a buggy or hostile writer does, a second job of the lock cannot be processing:
    # without the lock (check constraint) or with it (unique index).
    for values in (running, {**running, "lock_holder": F("lock")}):
        with pytest.raises(IntegrityError), transaction.atomic():
            PaymentJob.objects.filter(pk=second.pk).update(**values)
    # Nor can a job hold a lock that is not its own, or hold one while finished.
    for values in (
        {"lock_holder": "payment:other"},
        {"status": Status.COMPLETED, "completed_at": Now()},
    ):
        with pytest.raises(IntegrityError), transaction.atomic():
            PaymentJob.objects.filter(pk=first.pk).update(**values)
    assert statuses(first, second) == [Status.PROCESSING, Status.WAITING]


@pytest.mark.django_db
def test_claim__takes_only_the_first_job_of_each_lock() -> None:
    jobs = [PaymentJob.objects.enqueue("noop", lock=f"l{i % 2}") for i in range(6)]
    claimed = PaymentJob.objects.claim("w", ttl=60, limit=10)
    assert sorted(job.pk for job in claimed) == [jobs[0].pk, jobs[1].pk]
    assert PaymentJob.objects.claim("w", ttl=60, limit=10) == []


# ---- the lock passes on when its holder finishes, and only then -------------------------------


@pytest.mark.django_db
def test_complete__passes_the_lock_to_the_next_job_in_enqueue_order() -> None:
    first, second, third = (PaymentJob.objects.enqueue("noop", lock=LOCK) for _ in range(3))
    PaymentJob.objects.enqueue("noop", lock="other")
    job = claim(first.pk)
    PaymentJob.objects.complete(job.pk, "w", job.lease_token)
    assert statuses(first, second, third) == [Status.COMPLETED, Status.PENDING, Status.WAITING]
    assert PaymentJob.objects.get(pk=first.pk).lock_holder is None
    job = claim(second.pk)
    PaymentJob.objects.complete(job.pk, "w", job.lease_token, result={"ok": True})
    assert statuses(second, third) == [Status.COMPLETED, Status.PENDING]
    assert JobAttempt.objects.get(job_ref=second.pk).outcome == "completed"


@pytest.mark.django_db
def test_fail__a_retry_keeps_the_lock_the_last_failure_passes_it() -> None:
    first = PaymentJob.objects.enqueue("boom", lock=LOCK, max_attempts=2)
    second = PaymentJob.objects.enqueue("noop", lock=LOCK)
    job = claim(first.pk)
    assert PaymentJob.objects.fail(job.pk, "w", job.lease_token, "psp 502") == Status.PENDING
    assert statuses(first, second) == [Status.PENDING, Status.WAITING]
    job = claim(first.pk)
    assert PaymentJob.objects.fail(job.pk, "w", job.lease_token, "psp 502") == Status.FAILED
    assert statuses(first, second) == [Status.FAILED, Status.PENDING]


@pytest.mark.django_db
def test_time_out__passes_the_lock_only_when_the_job_fails() -> None:
    first = PaymentJob.objects.enqueue("hangs", lock=LOCK, max_attempts=2)
    second = PaymentJob.objects.enqueue("noop", lock=LOCK)
    job = claim(first.pk)
    PaymentJob.objects.time_out(job.pk, "w", job.lease_token, retry_in=None, reason="too slow")
    assert statuses(first, second) == [Status.PENDING, Status.WAITING]
    job = claim(first.pk)
    PaymentJob.objects.time_out(job.pk, "w", job.lease_token, retry_in=None, reason="too slow")
    assert statuses(first, second) == [Status.FAILED, Status.PENDING]


@pytest.mark.django_db
def test_takeover_and_rescue__keep_the_lock_and_the_order() -> None:
    first = PaymentJob.objects.enqueue("noop", lock=LOCK)
    second = PaymentJob.objects.enqueue("noop", lock=LOCK)
    claim(first.pk, "dead")
    expire(first)
    # An expired lease keeps the lock: the takeover claims the first job, never the second.
    (taken,) = PaymentJob.objects.claim("heir", ttl=60, limit=5)
    assert taken.pk == first.pk
    assert statuses(first, second) == [Status.PROCESSING, Status.WAITING]
    # A rescue back to pending keeps it too: the first job runs again before the second.
    assert PaymentJob.objects.rescue(expire(first), "retry", by="watcher")
    assert statuses(first, second) == [Status.PENDING, Status.WAITING]
    claim(first.pk, "heir")
    # A rescue that fails the job passes the lock on.
    assert PaymentJob.objects.rescue(expire(first), "failed", by="watcher", reason="no attempts")
    assert statuses(first, second) == [Status.FAILED, Status.PENDING]


@pytest.mark.django_db
def test_review__holds_the_lock_until_the_verdict() -> None:
    capture = PaymentJob.objects.enqueue("capture", payment_id="pay_7")
    refund = PaymentJob.objects.enqueue("refund", payment_id="pay_7")
    claim(capture.pk)
    assert PaymentJob.objects.rescue(expire(capture), "review", by="watcher")
    assert PaymentJob.objects.claim("w", ttl=60, limit=5) == []
    assert statuses(capture, refund) == [Status.REVIEW, Status.WAITING]
    # A retry verdict keeps the lock with the capture; completing it passes it on.
    assert PaymentJob.objects.filter(pk=capture.pk).resolve_review("retry") == 1
    assert statuses(capture, refund) == [Status.PENDING, Status.WAITING]
    claim(capture.pk)
    assert PaymentJob.objects.rescue(expire(capture), "review", by="watcher")
    assert PaymentJob.objects.filter(pk=capture.pk).resolve_review("completed") == 1
    assert statuses(capture, refund) == [Status.COMPLETED, Status.PENDING]


# ---- operator actions keep the order ----------------------------------------------------------


@pytest.mark.django_db
def test_cancel__a_waiting_job_leaves_the_lock_a_pending_holder_passes_it() -> None:
    first, second, third = (PaymentJob.objects.enqueue("noop", lock=LOCK) for _ in range(3))
    assert PaymentJob.objects.filter(pk=second.pk).cancel() == 1
    assert statuses(first, second, third) == [Status.PENDING, Status.CANCELLED, Status.WAITING]
    assert PaymentJob.objects.filter(pk=first.pk).cancel() == 1
    assert statuses(first, third) == [Status.CANCELLED, Status.PENDING]


@pytest.mark.django_db
def test_mark_failed__passes_the_lock_of_a_holder() -> None:
    first, second = (PaymentJob.objects.enqueue("noop", lock=LOCK) for _ in range(2))
    claim(first.pk)
    expire(first)
    assert PaymentJob.objects.filter(pk=first.pk).mark_failed(reason="gave up") == 1
    assert statuses(first, second) == [Status.FAILED, Status.PENDING]


@pytest.mark.django_db
def test_requeue__a_finished_job_rejoins_its_lock_in_enqueue_order() -> None:
    jobs = [PaymentJob.objects.enqueue("noop", lock=LOCK) for _ in range(4)]
    job = claim(jobs[0].pk)
    PaymentJob.objects.fail(job.pk, "w", job.lease_token, "declined", permanent=True)
    job = claim(jobs[1].pk)  # the second job runs now; the third and fourth wait
    # Requeued while its lock is busy: the failed first job waits, ahead of the later ones.
    assert PaymentJob.objects.filter(pk=jobs[0].pk).requeue() == 1
    assert statuses(*jobs) == [Status.WAITING, Status.PROCESSING, Status.WAITING, Status.WAITING]
    PaymentJob.objects.complete(job.pk, "w", job.lease_token)
    assert statuses(*jobs) == [Status.PENDING, Status.COMPLETED, Status.WAITING, Status.WAITING]
    job = claim(jobs[0].pk)
    PaymentJob.objects.complete(job.pk, "w", job.lease_token)
    assert statuses(*jobs[2:]) == [Status.PENDING, Status.WAITING]
    # A requeue of the holder keeps the lock with it.
    assert PaymentJob.objects.filter(pk=jobs[2].pk).requeue() == 1
    assert statuses(*jobs[2:]) == [Status.PENDING, Status.WAITING]
    # Cancelled, then requeued while the fourth job holds the lock: it waits for that one.
    assert PaymentJob.objects.filter(pk=jobs[2].pk).cancel() == 1
    assert PaymentJob.objects.filter(pk=jobs[2].pk).requeue() == 1
    assert statuses(*jobs[2:]) == [Status.WAITING, Status.PENDING]
    job = claim(jobs[3].pk)
    PaymentJob.objects.complete(job.pk, "w", job.lease_token)
    assert statuses(*jobs[2:]) == [Status.PENDING, Status.COMPLETED]
    # Requeued while its lock is free: pending at once.
    job = claim(jobs[2].pk)
    PaymentJob.objects.fail(job.pk, "w", job.lease_token, "declined", permanent=True)
    assert PaymentJob.objects.filter(pk=jobs[2].pk).requeue() == 1
    assert statuses(jobs[2]) == [Status.PENDING]
    assert PaymentJob.objects.get(pk=jobs[2].pk).lock_holder == LOCK


# ---- real workers racing over locked jobs ------------------------------------------------------

FAST = ("--poll-interval", "0.1")


def worker(processes: Processes, name: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return processes.manage(
        "run_lease_worker", "--worker-id", name, *FAST, *args, "-v", "2", env=env
    )


def all_finished(jobs: list[PaymentJob]) -> bool:
    pks = [job.pk for job in jobs]
    return PaymentJob.objects.filter(pk__in=pks, status=Status.COMPLETED).count() == len(pks)


def runs_of(lock: str) -> list[LockRun]:
    return list(LockRun.objects.filter(lock=lock).order_by("started_at", "pk"))


def assert_one_at_a_time_in_order(lock: str, jobs: list[PaymentJob]) -> list[LockRun]:
    """Each run of `lock` started after the one before it finished, in enqueue (id) order."""
    runs = runs_of(lock)
    assert [run.job_ref for run in runs] == sorted(job.pk for job in jobs), lock
    for before, after in zip(runs, runs[1:], strict=False):
        assert before.finished_at is not None, (lock, before.job_ref)
        assert after.started_at >= before.finished_at, (lock, before.job_ref, after.job_ref)
    return runs


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__run_each_lock_one_at_a_time_in_enqueue_order(processes: Processes) -> None:
    rng = random.Random(7)
    locks = [f"payment:{n}" for n in range(6)]
    jobs: dict[str, list[PaymentJob]] = {lock: [] for lock in locks}
    for n in range(4):
        worker(processes, f"racer-{n}", "--ttl", "30", "--heartbeat", "5")
    # Enqueued while the workers run, so that enqueues race the completions that pass each
    # lock on: a job left waiting unseen would never complete.
    for i in range(48):  # interleaved: lock 0, 1, ..., 5, 0, 1, ...
        lock = locks[i % len(locks)]
        seconds = rng.uniform(0.05, 0.15)
        jobs[lock].append(
            PaymentJob.objects.enqueue("locked_step", {"seconds": seconds}, lock=lock)
        )
        time.sleep(rng.uniform(0, 0.03))  # spread the enqueues over the first completions
    everything = [job for batch in jobs.values() for job in batch]

    wait_for(lambda: all_finished(everything), timeout=120)

    assert LockRun.objects.count() == 48  # each job ran once
    for lock in locks:
        assert_one_at_a_time_in_order(lock, jobs[lock])
    assert JobAttempt.objects.filter(outcome="completed").count() == 48
    # Four workers really raced: more than one of them ran jobs.
    owners = set(PaymentJob.objects.values_list("lease_owner", flat=True))
    assert len(owners) > 1, owners


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_enqueue__racing_enqueues_and_completions_lose_no_job(processes: Processes) -> None:
    locks = ["payment:a", "payment:b"]
    for n in range(3):
        worker(processes, f"racer-{n}", "--ttl", "30", "--heartbeat", "5")
    start_at = str(time.time() + 3)  # every enqueuer has started up by then
    enqueuers = [
        processes.start(
            "-m", "tests.enqueuer", "--jobs", "16", "--locks", *locks, "--start-at", start_at
        )
        for _ in range(3)
    ]
    orders = []
    for proc in enqueuers:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        orders.append(json.loads(out.strip().splitlines()[-1])["pks"])
    jobs = list(PaymentJob.objects.filter(pk__in=[pk for order in orders for pk in order]))
    assert len(jobs) == 48

    wait_for(lambda: all_finished(jobs), timeout=120)

    assert LockRun.objects.count() == 48
    started = {run.job_ref: run.started_at for run in LockRun.objects.all()}
    for lock in locks:
        runs = runs_of(lock)
        for before, after in zip(runs, runs[1:], strict=False):
            assert after.started_at >= before.finished_at, (lock, before.job_ref, after.job_ref)
    # Each process enqueued its jobs one after the other: they ran in that order, per lock.
    by_pk = {job.pk: job.lock for job in jobs}
    for order in orders:
        for lock in locks:
            mine = [pk for pk in order if by_pk[pk] == lock]
            assert sorted(mine, key=started.__getitem__) == mine, lock


def kill_the_holder(processes: Processes, *args: str) -> tuple[PaymentJob, PaymentJob]:
    """Enqueue two jobs of LOCK; SIGKILL the worker running the first (for 60 s) mid-run."""
    first = PaymentJob.objects.enqueue("locked_step", {"durations": [60, 0.05]}, lock=LOCK)
    second = PaymentJob.objects.enqueue("locked_step", {"seconds": 0.05}, lock=LOCK)
    victim = worker(processes, "victim", *args)
    wait_for(lambda: LockRun.objects.filter(job_ref=first.pk).exists())
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    return first, second


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_killed_holder_keeps_its_lock_until_taken_over(processes: Processes) -> None:
    first, second = kill_the_holder(processes, "--ttl", "2", "--heartbeat", "0.5")
    assert statuses(first, second) == [Status.PROCESSING, Status.WAITING]

    worker(processes, "heir", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: all_finished([first, second]), timeout=60)

    lost, rerun = JobAttempt.objects.filter(job_ref=first.pk).order_by("token")
    (after,) = JobAttempt.objects.filter(job_ref=second.pk)
    assert (lost.owner, lost.outcome, rerun.owner, rerun.outcome) == (
        "victim",
        "lease_lost",
        "heir",
        "completed",
    )
    # The second job was claimed only after the takeover, and after the first job's rerun.
    assert after.claimed_at >= lost.ended_at
    assert after.claimed_at >= rerun.ended_at
    killed, again, next_run = runs_of(LOCK)
    assert (killed.job_ref, killed.finished_at) == (first.pk, None)
    assert (again.job_ref, next_run.job_ref) == (first.pk, second.pk)
    assert next_run.started_at >= again.finished_at


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_rescued_holder_runs_again_before_the_next_job(processes: Processes) -> None:
    first, second = kill_the_holder(processes, "--ttl", "1", "--heartbeat", "0.3")
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=first.pk).exists())

    watcher = processes.manage("watch_stuck_jobs", "--once")
    out, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, out
    assert statuses(first, second) == [Status.PENDING, Status.WAITING]

    worker(processes, "after-rescue", "--ttl", "5", "--heartbeat", "1")
    wait_for(lambda: all_finished([first, second]), timeout=60)
    rescued = JobAttempt.objects.get(job_ref=first.pk, attempt=1)
    (after,) = JobAttempt.objects.filter(job_ref=second.pk)
    assert rescued.outcome == "rescued" and rescued.ended_by.startswith("watcher")
    assert after.claimed_at >= rescued.ended_at
    runs = runs_of(LOCK)
    assert [run.job_ref for run in runs] == [first.pk, first.pk, second.pk]
    assert runs[2].started_at >= runs[1].finished_at


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_capture_under_review_blocks_its_refund_until_the_verdict(
    processes: Processes,
) -> None:
    review = subprocess_env(LEASES_TEST_SETTINGS='{"STUCK_POLICY_BY_KIND": {"risky": "review"}}')
    capture = PaymentJob.objects.enqueue("risky", {"seconds": 60}, payment_id="pay_9")
    refund = PaymentJob.objects.enqueue("locked_step", {"seconds": 0.05}, payment_id="pay_9")
    victim = worker(processes, "victim", "--ttl", "1", "--heartbeat", "0.3", env=review)
    wait_for(lambda: PaymentJob.objects.filter(pk=capture.pk, checkpoint="psp_called").exists())
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    # A worker polls throughout: it may neither take the capture over nor run the refund.
    worker(processes, "bystander", "--ttl", "5", "--heartbeat", "1", env=review)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=capture.pk).exists())
    watcher = processes.manage("watch_stuck_jobs", "--once", env=review)
    out, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, out
    assert statuses(capture, refund) == [Status.REVIEW, Status.WAITING]
    assert not LockRun.objects.filter(job_ref=refund.pk).exists()

    assert PaymentJob.objects.filter(pk=capture.pk).resolve_review("completed") == 1
    wait_for(lambda: all_finished([refund]), timeout=60)

    verdict = JobAttempt.objects.get(job_ref=capture.pk)
    (run,) = LockRun.objects.filter(job_ref=refund.pk)
    assert (verdict.outcome, verdict.resolution) == ("review", "completed")
    # The refund started only after the verdict, by the database clock.
    assert run.started_at >= verdict.resolved_at
    assert PaymentJob.objects.get(pk=capture.pk).attempts == 1  # the capture never ran twice
