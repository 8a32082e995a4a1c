"""`cancel()` on real worker processes: a pending job never runs; a running handler learns it
within one heartbeat (`lease.check()` raises `Cancelled`), is fenced out of every later write,
an `async def` one is cancelled; the job never runs again, whatever the TTL and the watcher."""

import json
import signal
from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.test import override_settings

from django_leases.models import JobAttempt, JobEvent, PaymentJob
from tests.testapp.models import LockRun

from .conftest import Processes, finish, read_until, subprocess_env, wait_for
from .test_worker import fresh

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status
REVIEW = {"STUCK_POLICY_BY_KIND": {"watches_cancel": "review"}}
LEASE = ("--ttl", "2", "--heartbeat", "0.3", "--poll-interval", "0.1", "-v", "2")


def worker(processes: Processes, name: str, *args: str, env: dict | None = None):
    return processes.manage("run_lease_worker", "--worker-id", name, *LEASE, *args, env=env)


def started(job: PaymentJob) -> LockRun:
    return wait_for(lambda: LockRun.objects.filter(job_ref=job.pk).first())  # type: ignore[return-value]


def finished(job: PaymentJob) -> str:
    """What the handler recorded when its run ended."""
    run = wait_for(
        lambda: LockRun.objects.filter(job_ref=job.pk, finished_at__isnull=False).first()
    )
    return run.lock  # type: ignore[attr-defined]


def attempts(job: PaymentJob) -> list[tuple[int, str, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("token", "owner", "outcome", "ended_by")
    )


def never_runs_again(processes: Processes, job: PaymentJob, env: dict | None = None) -> None:
    """Past its lease (by the database clock), a watcher pass and a burst worker leave it be."""
    before = fresh(job)
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(hours=1))
    pass_ = processes.manage("watch_stuck_jobs", "--once", env=env)
    out = finish(pass_)
    assert pass_.returncode == 0, out
    burst = worker(processes, "after", "--burst", env=env)
    out = finish(burst)
    assert burst.returncode == 0 and "claimed=0" in out, out
    after = fresh(job)
    assert (after.status, after.attempts, after.lease_token) == (
        before.status,
        before.attempts,
        before.lease_token,
    )
    assert LockRun.objects.filter(job_ref=job.pk).count() <= 1


def stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    return out


def test_cancel__a_pending_job_never_runs(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("watches_cancel")
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1
    never_runs_again(processes, job)
    assert fresh(job).status == Status.CANCELLED
    assert not LockRun.objects.filter(job_ref=job.pk).exists()
    assert attempts(job) == []


def test_cancel__a_running_sync_handler_learns_it_and_is_fenced_out(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("watches_cancel", {"seconds": 120})
    proc = worker(processes, "holder", "--kind", "watches_cancel")
    run = started(job)
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops", reason="customer") == 1

    # check() raised Cancelled; the write it tried next was refused as Cancelled.
    assert finished(job) == "saw=Cancelled lost=True write=Cancelled"
    # Its execution ends once its handler returned: then, and only then, it is cancelled.
    job = wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, status=Status.CANCELLED).first())
    assert (job.status, job.checkpoint, job.lease_token) == (Status.CANCELLED, "", run.token + 1)
    assert attempts(job) == [(run.token, "holder", "cancelled", "ops")]
    assert JobEvent.objects.get(job_ref=job.pk).reason == "customer"
    read_until(proc, f"cancelled job_id={job.pk}")
    never_runs_again(processes, job)
    out = stop(proc)
    assert "cancelled=1" in out and "lost=0" in out, out


def test_cancel__a_running_async_handler_is_cancelled(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("async_watches_cancel", {"seconds": 120})
    proc = worker(processes, "awaiter", "--kind", "async_watches_cancel")
    run = started(job)
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1

    assert finished(job) == "coroutine cancelled lease.cancelled=True"
    wait_for(lambda: fresh(job).status == Status.CANCELLED)
    assert attempts(job) == [(run.token, "awaiter", "cancelled", "ops")]
    read_until(proc, f"cancelled job_id={job.pk}")
    never_runs_again(processes, job)
    out = stop(proc)
    assert "cancelled=1" in out and "lost=0" in out, out


def test_cancel__a_review_policy_job_past_its_checkpoint_goes_to_review(
    processes: Processes,
) -> None:
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(REVIEW))
    job = PaymentJob.objects.enqueue("watches_cancel", {"seconds": 120, "checkpoint": "psp_called"})
    proc = worker(processes, "holder", "--kind", "watches_cancel", env=env)
    run = started(job)
    with override_settings(DJANGO_LEASES=REVIEW):  # the caller reads the workers' policy
        assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1

    assert finished(job) == "saw=Cancelled lost=True write=Cancelled"
    job = wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, status=Status.REVIEW).first())
    assert (job.status, job.checkpoint, job.lease_token) == (
        Status.REVIEW,
        "psp_called",
        run.token,
    )
    assert attempts(job) == [(run.token, "holder", "cancelled", "ops")]
    never_runs_again(processes, job, env=env)
    assert "cancelled=1" in stop(proc)


def runs(*jobs: PaymentJob) -> list[LockRun]:
    """The handler runs of `jobs`, in order, once each has ended (by the database clock)."""
    pks = [job.pk for job in jobs]
    ended = LockRun.objects.filter(job_ref__in=pks, finished_at__isnull=False)
    wait_for(lambda: ended.values("job_ref").distinct().count() == len(set(pks)), timeout=60)
    return list(LockRun.objects.filter(job_ref__in=pks).order_by("started_at", "pk"))


@pytest.mark.parametrize(
    "payload",
    [{"seconds": 60, "polls": True, "cleanup": 1}, {"seconds": 1.5}],
    ids=["polls-then-cleans-up", "ignores-the-stop"],
)
def test_cancel__the_next_job_of_its_lock_starts_once_the_handler_returned(
    processes: Processes, payload: dict
) -> None:
    first = PaymentJob.objects.enqueue("spanned", payload, lock="account:1")
    second = PaymentJob.objects.enqueue("spanned", {"seconds": 0}, lock="account:1")
    proc = worker(processes, "holder", "--kind", "spanned", "--concurrency", "2")
    started(first)
    assert PaymentJob.objects.filter(pk=first.pk).cancel(by="ops") == 1

    ran, then = runs(first, second)
    assert (ran.job_ref, then.job_ref) == (first.pk, second.pk)
    assert ran.finished_at <= then.started_at, (ran.finished_at, then.started_at)
    wait_for(lambda: fresh(second).status == Status.COMPLETED)
    assert fresh(first).status == Status.CANCELLED
    assert attempts(first) == [(ran.token, "holder", "cancelled", "ops")]
    out = stop(proc)
    assert "cancelled=1" in out and "lost=0" in out, out


def test_requeue__of_a_cancelled_running_job_waits_until_its_execution_ended(
    processes: Processes,
) -> None:
    job = PaymentJob.objects.enqueue("spanned", {"durations": [1.5, 0]})
    proc = worker(processes, "holder", "--kind", "spanned", "--concurrency", "2")
    started(job)
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1
    # Its handler still runs: a plain requeue leaves it alone.
    assert PaymentJob.objects.filter(pk=job.pk).requeue() == 0
    assert fresh(job).status == Status.STOPPING

    wait_for(lambda: fresh(job).status == Status.CANCELLED)
    assert PaymentJob.objects.filter(pk=job.pk).requeue() == 1
    wait_for(lambda: LockRun.objects.filter(job_ref=job.pk, finished_at__isnull=False).count() == 2)
    first, again = LockRun.objects.filter(job_ref=job.pk).order_by("started_at", "pk")
    assert first.finished_at <= again.started_at, (first.finished_at, again.started_at)
    stop(proc)
