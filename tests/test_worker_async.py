"""`async def` handlers on real worker processes: run (once), awaited, with every guarantee the
synchronous ones have. Each handler proves its body ran by its own `Charge` write."""

import time

import pytest

from django_leases.models import JobAttempt, PaymentJob
from tests.testapp.models import Charge

from .conftest import Processes, finish, read_until, wait_for
from .leasing import token_of
from .test_worker import fresh, ledger, worker

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status


def charges(job: PaymentJob) -> list[tuple[int, str]]:
    return list(Charge.objects.filter(job_ref=job.pk).values_list("token", "owner"))


def test_async_handler__completes_only_after_its_body_ran_once(processes: Processes) -> None:
    atomic = [PaymentJob.objects.enqueue("async_charge", {"seconds": 0.2}) for _ in range(4)]
    orm = [PaymentJob.objects.enqueue("async_record", {"seconds": 0.1}) for _ in range(4)]
    # The regression: a plain function returning a coroutine was completed, the coroutine never
    # awaited. Its body's write must exist for every job recorded completed.
    returned = [PaymentJob.objects.enqueue("returns_coroutine") for _ in range(3)]
    proc = worker(processes, "awaiter", "--burst", "--concurrency", "3")
    out = finish(proc)

    assert proc.returncode == 0, out
    for job in (*atomic, *orm, *returned):
        assert fresh(job).status == Status.COMPLETED, out
        assert charges(job) == [(token_of(job), "awaiter")]
        assert ledger(job) == [(1, "awaiter", "completed")]
    assert {fresh(job).checkpoint for job in orm} == {"started"}
    assert "claimed=11 completed=11" in out


def test_async_handler__fails_retries_and_fails_permanently(processes: Processes) -> None:
    retried = PaymentJob.objects.enqueue("async_boom", {"message": "psp 502"}, max_attempts=3)
    exhausted = PaymentJob.objects.enqueue("async_boom", max_attempts=1)
    declined = PaymentJob.objects.enqueue("async_permanent")
    proc = worker(processes, "async-failures", "--burst")
    out = finish(proc)

    assert proc.returncode == 0, out
    retried = fresh(retried)
    assert (retried.status, retried.attempts, retried.last_error) == (
        Status.PENDING,
        1,
        "RuntimeError: psp 502",
    )
    # Deferred past the failure (by BACKOFF_BASE, 2 s): measured against the attempt's end, not
    # the time of this read, which a loaded machine can put past the retry.
    assert retried.run_at > JobAttempt.objects.get(job_ref=retried.pk).ended_at
    assert ledger(retried) == [(1, "async-failures", "retried")]
    assert fresh(exhausted).status == Status.FAILED
    declined = fresh(declined)
    assert (declined.status, declined.attempts) == (Status.FAILED, 1)
    assert JobAttempt.objects.get(job_ref=declined.pk).error_class.endswith("PermanentError")


# Paused past its lease (SIGSTOP) and fenced out, its `lease.aatomic()` writes refused:
# test_worker.py::test_worker__lease_atomic_rolls_back_the_zombies_writes[async_charge].


def test_async_handler__cancelled_at_its_timeout(processes: Processes) -> None:
    hung = PaymentJob.objects.enqueue("async_hangs", priority=1)  # timeout=1, awaits 60 s
    behind = PaymentJob.objects.enqueue("noop")
    started = time.monotonic()
    proc = worker(processes, "canceller", "--burst", "--concurrency", "1")
    out = finish(proc, timeout=60)

    assert proc.returncode == 0, out
    assert time.monotonic() - started < 30
    row = JobAttempt.objects.get(job_ref=hung.pk)
    assert (row.outcome, row.ended_by) == ("timed_out", "canceller")
    assert "timeout of 1s" in row.error_message
    assert fresh(hung).status == Status.PENDING
    # Cancelled at its await: the write after it never happened, and the slot went on.
    assert not Charge.objects.exists()
    assert fresh(behind).status == Status.COMPLETED
    assert "timed_out=1" in out


def test_async_handler__blocking_its_loop_is_timed_out_by_the_worker(processes: Processes) -> None:
    blocked = PaymentJob.objects.enqueue("async_blocks_its_loop", {"seconds": 30}, priority=1)
    behind = PaymentJob.objects.enqueue("noop")
    worker(processes, "blocked", "--concurrency", "1", "--ttl", "5", "--heartbeat", "1")

    wait_for(lambda: fresh(behind).status == Status.COMPLETED, timeout=30)
    row = JobAttempt.objects.get(job_ref=blocked.pk, attempt=1)
    assert (row.outcome, row.ended_by) == ("timed_out", "blocked")


def test_async_handler__sigterm_lets_it_finish_within_the_grace_period(
    processes: Processes,
) -> None:
    jobs = [PaymentJob.objects.enqueue("async_charge", {"seconds": 1.5}) for _ in range(2)]
    proc = worker(processes, "async-graceful", "--concurrency", "2", "--grace-period", "20")
    started = read_until(proc, *(f"started job_id={job.pk} " for job in jobs))
    proc.terminate()
    out = started + finish(proc)

    assert proc.returncode == 0, out
    for job in jobs:
        assert fresh(job).status == Status.COMPLETED
        assert charges(job) == [(token_of(job), "async-graceful")]
