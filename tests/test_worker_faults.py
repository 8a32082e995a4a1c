"""The worker under its own faults: whatever a handler raises or leaves behind, a handler past
its time limit, a thread of ours that dies, an outcome the database refuses, a worker id used
twice. Real worker processes (or a real in-process `LeaseWorker`) on the real test database."""

import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from django.db import DataError
from django.db.models.functions import Now

from django_leases import job_handler
from django_leases.handlers import unregister
from django_leases.models import JobAttempt, PaymentJob, Worker
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.claims import Claimer
from django_leases.worker import LeaseWorker
from tests.testapp.models import Charge

from .conftest import Processes, wait_for
from .leasing import token_of
from .test_worker import finish, fresh, held_by, ledger, worker

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status


def test_worker__whatever_a_handler_raises_ends_only_that_attempt(processes: Processes) -> None:
    faulty = {
        kind: PaymentJob.objects.enqueue(kind, priority=1)
        for kind in (
            "exits",
            "interrupted",
            "long_named_error",
            "unstorable_error",
            "leaves_transaction_open",
        )
    }
    behind = [PaymentJob.objects.enqueue("noop") for _ in range(5)]
    proc = worker(processes, "sturdy", "--burst", "--concurrency", "1")
    out = finish(proc)

    assert proc.returncode == 0, out
    assert all(fresh(job).status == Status.COMPLETED for job in behind), out
    rows = {kind: JobAttempt.objects.get(job_ref=job.pk, attempt=1) for kind, job in faulty.items()}
    assert {kind: row.outcome for kind, row in rows.items()} == dict.fromkeys(faulty, "retried")
    assert rows["exits"].error_class == "SystemExit"
    assert rows["interrupted"].error_class == "tests.testapp.jobs.Interrupted"
    long_name = rows["long_named_error"].error_class
    assert len(long_name) == 255 and long_name.startswith("tests.testapp.jobs.LongNNN")
    assert long_name.endswith("…")
    assert "transaction open" in rows["leaves_transaction_open"].error_message
    assert rows["unstorable_error"].error_message == "card\\x00 declined \\udc80"
    # The handler's uncommitted write was rolled back, not committed by the worker's outcome.
    assert not Charge.objects.filter(owner="never committed").exists()
    for job in faulty.values():
        job = fresh(job)
        assert (job.status, job.attempts) == (Status.PENDING, 1)
    assert "claimed=10 completed=5 retried=5" in out


def test_worker__handler_past_its_timeout_is_ended_and_the_slot_goes_on(
    processes: Processes,
) -> None:
    # "hangs" has timeout=1.5: attempt 1 blocks 4 s, then tries to write under its lease.
    late = PaymentJob.objects.enqueue("hangs", {"durations": [4, 0]}, priority=1)
    behind = [PaymentJob.objects.enqueue("noop") for _ in range(3)]
    started = time.monotonic()
    worker(processes, "patient", "--concurrency", "1", "--ttl", "3", "--heartbeat", "0.5")

    # The slot runs the jobs behind it long before the blocked handler returns.
    wait_for(lambda: all(fresh(job).status == Status.COMPLETED for job in behind), timeout=30)
    row = JobAttempt.objects.get(job_ref=late.pk, attempt=1)
    assert (row.outcome, row.ended_by) == ("timed_out", "patient")
    assert "timeout of 1.5s" in row.error_message
    # Within timeout + TTL + a few seconds of load, whatever the handler does.
    assert time.monotonic() - started < 1.5 + 3 + 10
    # The retry (after its backoff) runs to completion; the abandoned first run's charge, which
    # it tries to write after its timeout, is refused.
    wait_for(lambda: fresh(late).status == Status.COMPLETED, timeout=60)
    time.sleep(1)  # attempt 1 woke at 4 s; give its refused write time to show if it were not
    assert list(Charge.objects.values_list("job_ref", "token")) == [(late.pk, token_of(late, 2))]
    assert ledger(late) == [(1, "patient", "timed_out"), (2, "patient", "completed")]


def test_worker__stops_itself_when_too_many_handlers_outlive_their_timeout(
    processes: Processes,
) -> None:
    stuck = [PaymentJob.objects.enqueue("hangs", {"seconds": 60}) for _ in range(2)]
    proc = worker(processes, "overrun", "--concurrency", "1", "--ttl", "5", "--heartbeat", "1")
    out = finish(proc, timeout=90)

    assert proc.returncode == 3, out
    assert "stopped itself" in out and "past their timeout" in out
    outcomes = set(
        JobAttempt.objects.filter(job_ref__in=[j.pk for j in stuck]).values_list(
            "outcome", flat=True
        )
    )
    assert outcomes == {"timed_out"}
    assert not Charge.objects.exists()


def test_worker__refuses_a_worker_id_a_live_worker_holds(processes: Processes) -> None:
    first = worker(processes, "twin")
    wait_for(lambda: Worker.objects.alive().filter(worker_id="twin").exists())
    second = worker(processes, "twin", "--burst")
    out = finish(second)

    assert second.returncode == 1, out
    assert "'twin' is in use by a live worker process" in out
    assert "Traceback" not in out
    assert first.poll() is None
    # The refused process did not mark the live one's registry row stopped.
    assert Worker.objects.alive().filter(worker_id="twin").exists()
    job = PaymentJob.objects.enqueue("noop")
    wait_for(lambda: fresh(job).status == Status.COMPLETED)
    assert fresh(job).lease_owner == "twin"

    first.terminate()
    assert finish(first) and first.returncode == 0
    # Once the first one stopped, the id is free again.
    third = worker(processes, "twin", "--burst")
    assert finish(third) and third.returncode == 0


# ---- faults of our own code, injected into a real in-process worker ------------------------


@pytest.fixture
def run_in_thread() -> Iterator[list[LeaseWorker]]:
    """Run LeaseWorkers on threads; stop them and wait for them at teardown."""
    started: list[LeaseWorker] = []
    threads: list[threading.Thread] = []

    def start(lease_worker: LeaseWorker) -> None:
        started.append(lease_worker)
        thread = threading.Thread(target=lease_worker.run)
        threads.append(thread)
        thread.start()

    yield start  # type: ignore[misc]
    for lease_worker in started:
        lease_worker.stop()
    for thread in threads:
        thread.join(timeout=30)


class DiesOnce(LeaseWorker):
    """A worker whose slot thread dies (outside any handler) the first time it runs a job."""

    died = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        execute = self._attempts.execute

        def dies_once(lease):
            if not self.died:
                self.died = True
                raise MemoryError("injected: the slot's own code failed")
            execute(lease)

        self._attempts.execute = dies_once


def test_worker__a_dead_slot_thread_is_replaced_and_its_lease_never_renewed(
    run_in_thread,
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    lease_worker = DiesOnce(worker_id="fragile", ttl=1.5, heartbeat=0.3, poll_interval=0.05)
    run_in_thread(lease_worker)

    # The abandoned lease runs out (nobody renews it); the new slot thread takes it over.
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    assert ledger(job) == [(1, "fragile", "lease_lost"), (2, "fragile", "completed")]
    assert lease_worker.stats.abandoned == 1


def dies_at_first_start(lease_worker, part, loop, thread):
    """Make `part`'s thread body `loop` raise at its first start; count starts on the worker."""
    run = getattr(part, loop)

    def dies_once():
        lease_worker.starts += 1
        if lease_worker.starts == 1:
            raise RuntimeError(f"injected: the {thread} thread's own code failed")
        run()

    setattr(part, loop, dies_once)


class HeartbeatDiesOnce(LeaseWorker):
    """A worker whose heartbeat thread dies at its first start."""

    starts = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        dies_at_first_start(self, self._heartbeat, "_heartbeat_loop", "heartbeat")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_worker__a_dead_heartbeat_thread_is_restarted(run_in_thread) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 4})  # several TTLs
    lease_worker = HeartbeatDiesOnce(
        worker_id="no-pulse", ttl=1.5, heartbeat=0.3, poll_interval=0.05
    )
    run_in_thread(lease_worker)

    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    assert ledger(job) == [(1, "no-pulse", "completed")]
    assert lease_worker.starts >= 2


class AcksDieOnce(LeaseWorker):
    """A worker whose acknowledgement thread dies at its first start."""

    starts = 0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        dies_at_first_start(self, self._ack_writer, "_ack_loop", "acknowledgement")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_worker__a_dead_acknowledgement_thread_is_restarted(run_in_thread) -> None:
    jobs = [PaymentJob.objects.enqueue("noop_batch") for _ in range(3)]
    lease_worker = AcksDieOnce(
        worker_id="no-acks", kinds=["noop_batch"], ttl=1.5, heartbeat=0.3, poll_interval=0.05
    )
    run_in_thread(lease_worker)

    # Without a new writer the buffered completions would never be written.
    wait_for(lambda: all(fresh(job).status == Status.COMPLETED for job in jobs), timeout=30)
    assert [ledger(job) for job in jobs] == [[(1, "no-acks", "completed")]] * 3
    assert lease_worker.starts >= 2


@pytest.fixture
def unrecordable_kind() -> Iterator[str]:
    """A kind whose completion the database refuses, whichever statement writes it: the slots'
    group write (the worker's `Claimer.complete_and_claim`) and a completion of its own
    (`complete`)."""
    kind = "unrecordable"
    real_complete, real_group = LeaseQuerySet.complete, Claimer.complete_and_claim

    def refuse_if_ours(pks: object) -> None:
        if PaymentJob.objects.filter(pk__in=pks, kind=kind).exists():  # type: ignore[misc]
            raise DataError("injected: value too long for type character varying(255)")

    def complete(self: LeaseQuerySet, pk: int, *args: object, **kwargs: object) -> None:
        refuse_if_ours([pk])
        return real_complete(self, pk, *args, **kwargs)  # type: ignore[arg-type]

    def complete_and_claim(
        self: Claimer[Any], leases: list[tuple[int, int]], limit: int, **kwargs: bool
    ) -> object:
        refuse_if_ours([pk for pk, _ in leases])
        return real_group(self, leases, limit, **kwargs)

    job_handler(kind)(lambda job, lease: None)
    with (
        mock.patch.object(LeaseQuerySet, "complete", complete),
        mock.patch.object(Claimer, "complete_and_claim", complete_and_claim),
    ):
        yield kind
    unregister(kind)


def test_worker__an_outcome_the_database_refuses_still_ends_the_attempt(
    unrecordable_kind,
) -> None:
    job = PaymentJob.objects.enqueue(unrecordable_kind)
    behind = PaymentJob.objects.enqueue("noop", priority=-1)
    lease_worker = LeaseWorker(
        worker_id="refused", burst=True, ttl=30, heartbeat=5, poll_interval=0.05
    )
    stats = lease_worker.run()

    row = JobAttempt.objects.get(job_ref=job.pk)
    assert row.outcome == "retried"
    assert "could not record the outcome 'completed'" in row.error_message
    assert "DataError" in row.error_message
    assert fresh(job).status == Status.PENDING
    assert fresh(behind).status == Status.COMPLETED
    assert (stats.completed, stats.retried) == (1, 1)


@pytest.mark.slow
def test_worker__reclaiming_its_own_expired_job_keeps_the_new_lease_alive(run_in_thread) -> None:
    # Attempt 1 outlives its (made stale) lease; attempt 2, on the other slot of the same
    # worker, runs for several TTLs and must be renewed all along.
    # A TTL of 4 s: a busy machine (the suite runs on several processes) may delay one renewal
    # by a second or two, which a TTL of 1.5 s did not survive.
    job = PaymentJob.objects.enqueue("sleep", {"durations": [6, 10]})
    lease_worker = LeaseWorker(
        worker_id="same", concurrency=2, ttl=4, heartbeat=0.5, poll_interval=0.05, max_jobs=2
    )
    run_in_thread(lease_worker)
    wait_for(lambda: held_by(job, "same", attempt=1))
    # The database says the lease ran out (as after an outage longer than the TTL).
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now())

    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    assert ledger(job) == [(1, "same", "lease_lost"), (2, "same", "completed")]
    assert fresh(job).attempts == 2
