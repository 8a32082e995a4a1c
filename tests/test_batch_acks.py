"""Batched acknowledgements (`@job_handler(..., ack="batch")`): `complete_many()` on the real
database, and real worker processes that buffer, flush, get killed and are stopped."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_leases.checks import check_ack_batching
from django_leases.exceptions import HandlerError, InvalidArgument
from django_leases.handlers import get_handler, job_handler
from django_leases.lease import Lease
from django_leases.models import JobAttempt, PaymentJob
from django_leases.worker import LeaseWorker
from tests.testapp.models import Charge

from .conftest import Processes, finish, read_until, wait_for
from .leasing import claim_one, expire, ledger, statements, token_of

Status = PaymentJob.Status
FAST = ("--poll-interval", "0.1", "-v", "2")


def closed_rows(pks: list[int]) -> dict[int, tuple[object, ...]]:
    """The closed ledger rows of `pks`, every column that append-only keeps."""
    rows = JobAttempt.objects.filter(job_ref__in=pks, ended_at__isnull=False)
    fields = ("outcome", "ended_at", "ended_by", "owner", "error_class", "error_message")
    return {row[0]: row[1:] for row in rows.values_list("pk", *fields)}


# ---- the handler option ------------------------------------------------------------------------


def test_job_handler__ack_is_each_by_default_and_batch_on_request() -> None:
    assert get_handler("noop").ack == "each"
    assert get_handler("noop_batch").ack == "batch"


@pytest.mark.parametrize("ack", ["batched", "", None, 1, "BATCH"])
def test_job_handler__refuses_an_unknown_ack(ack: object) -> None:
    with pytest.raises(HandlerError, match=r"job kind 'x': ack must be one of 'each', 'batch'"):
        job_handler("x", ack=ack)(lambda job, lease: None)  # type: ignore[arg-type]


# ---- the settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ids"),
    [(100, []), (1, []), (1000, []), (0, ["E032"]), (1001, ["E032"]), (True, ["E032"]),
     (2.5, ["E032"]), ("100", ["E032"])],
)  # fmt: skip
def test_check_ack_batching__batch_size(value: object, ids: list[str]) -> None:
    with override_settings(DJANGO_LEASES={"ACK_BATCH_SIZE": value}):
        assert [m.id for m in check_ack_batching()] == [f"django_leases.{i}" for i in ids]


@pytest.mark.parametrize(
    ("value", "ids"),
    [(0.1, []), (5, []), (0, ["E033"]), (-1, ["E033"]), (float("nan"), ["E033"]),
     ("0.1", ["E033"]), (None, ["E033"])],
)  # fmt: skip
def test_check_ack_batching__flush_interval(value: object, ids: list[str]) -> None:
    with override_settings(DJANGO_LEASES={"ACK_FLUSH_INTERVAL": value}):
        assert [m.id for m in check_ack_batching()] == [f"django_leases.{i}" for i in ids]


# ---- the queryset ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_complete_many__completes_exactly_the_rows_still_held() -> None:
    jobs = [PaymentJob.objects.enqueue("noop_batch") for _ in range(6)]
    locked = PaymentJob.objects.enqueue("noop_batch", lock="order:1")
    held = PaymentJob.objects.claim("w1", ttl=60, limit=7)
    tokens = {job.pk: job.lease_token for job in held}
    ok1, ok2, taken, released, done, stale = jobs
    expire(taken)
    assert PaymentJob.objects.claim_job(taken.pk, "w2", ttl=60) is not None  # token bumped
    PaymentJob.objects.release(released.pk, "w1", tokens[released.pk])
    PaymentJob.objects.complete(done.pk, "w1", tokens[done.pk])
    acks = {**tokens, stale.pk: tokens[stale.pk] + 5}  # a token this job never had
    before = closed_rows(list(acks))
    done_at = PaymentJob.objects.get(pk=done.pk).completed_at

    won = PaymentJob.objects.complete_many("w1", acks)

    assert won == {
        (ok1.pk, tokens[ok1.pk]),
        (ok2.pk, tokens[ok2.pk]),
        (locked.pk, tokens[locked.pk]),
    }
    rows = {job.pk: job for job in PaymentJob.objects.filter(pk__in=acks)}
    assert {pk: rows[pk].status for pk in acks} == {
        ok1.pk: Status.COMPLETED,
        ok2.pk: Status.COMPLETED,
        taken.pk: Status.PROCESSING,
        released.pk: Status.PENDING,
        done.pk: Status.COMPLETED,
        stale.pk: Status.PROCESSING,
        locked.pk: Status.COMPLETED,  # a job of a lock too, its lock released
    }
    assert rows[ok1.pk].completed_at is not None and rows[done.pk].completed_at == done_at
    assert (rows[taken.pk].lease_owner, rows[taken.pk].lease_token) == ("w2", token_of(taken, 2))
    for job in (ok1, ok2, done, locked):
        assert ledger(job) == [(1, 1, "w1", "completed")]
    assert ledger(taken) == [(1, 1, "w1", "lease_lost"), (2, 2, "w2", "running")]
    assert ledger(released) == [(1, 1, "w1", "released")]
    assert ledger(stale) == [(1, 1, "w1", "running")]
    # Closed rows never change (append-only); the refused acks are noted as fenced, except
    # where the holder itself closed the row (its own release or completion).
    assert {pk: row for pk, row in closed_rows(list(acks)).items() if pk in before} == before
    fenced = JobAttempt.objects.filter(fenced_at__isnull=False)
    assert set(fenced.values_list("job_ref", "attempt")) == {(taken.pk, 1)}
    assert PaymentJob.objects.complete_many("w1", {ok1.pk: tokens[ok1.pk]}) == set()
    assert ledger(ok1) == [(1, 1, "w1", "completed")]


@pytest.mark.django_db
def test_complete_many__one_round_trip_whatever_the_batch_size() -> None:
    """PostgreSQL: one statement; SQLite: the UPDATE and the ledger's UPDATE; MariaDB: the
    row locks, the UPDATE and the ledger's UPDATE. Never a statement per job."""
    for _ in range(22):
        PaymentJob.objects.enqueue("noop_batch")
    held = {job.pk: job.lease_token for job in PaymentJob.objects.claim("w1", ttl=60, limit=22)}
    small, large = dict(list(held.items())[:2]), dict(list(held.items())[2:])
    counts = []
    for batch in (small, large):
        with CaptureQueriesContext(connection) as ctx:
            assert PaymentJob.objects.complete_many("w1", batch) == set(batch.items())
        counts.append(len(statements(ctx)))
    expected = {"postgresql": 1, "sqlite": 2}.get(connection.vendor, 3)
    assert counts == [expected, expected]
    assert JobAttempt.objects.filter(outcome="completed", ended_by="w1").count() == 22


@pytest.mark.django_db
def test_complete_many__refuses_bad_input_and_writes_nothing() -> None:
    PaymentJob.objects.enqueue("noop_batch")
    job = claim_one()
    assert PaymentJob.objects.complete_many("w1", {}) == set()
    for acks in ({job.pk: "1"}, {-1: 1}, {job.pk: True}):
        with pytest.raises(InvalidArgument):
            PaymentJob.objects.complete_many("w1", acks)  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument):
        PaymentJob.objects.complete_many("", {job.pk: job.lease_token})
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PROCESSING
    assert ledger(job) == [(1, 1, "w1", "running")]


# ---- the worker, in this process -----------------------------------------------------------


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__atomic_locked_and_failed_attempts_of_a_batch_kind_are_never_buffered() -> None:
    plain = PaymentJob.objects.enqueue("noop_batch")
    atomic = PaymentJob.objects.enqueue("atomic_batch")
    locked = PaymentJob.objects.enqueue("noop_batch", lock="order:1")
    failing = PaymentJob.objects.enqueue("noop_batch", {"fail": True}, max_attempts=1)
    worker = LeaseWorker(
        worker_id="w",
        ttl=120,
        heartbeat=10,
        concurrency=2,
        poll_interval=0.05,
        ack_flush_interval=3600,
        kinds=["noop_batch", "atomic_batch"],
        # Its loop claims for the slots (it counts its claims): a batch kind's completion would
        # cost a statement of its own, so it is buffered.
        max_jobs=100,
    )
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        final = [Status.COMPLETED, Status.COMPLETED, Status.FAILED]
        others = [atomic.pk, locked.pk, failing.pk]
        statuses = PaymentJob.objects.filter(pk__in=others).order_by("pk")
        wait_for(lambda: list(statuses.values_list("status", flat=True)) == final)
        wait_for(lambda: len(worker._acks) == 1)
        # Written at once, while the plain job's completion waits in the buffer (an hour).
        assert PaymentJob.objects.get(pk=plain.pk).status == Status.PROCESSING
        assert ledger(plain) == [(1, 1, "w", "running")]
        assert ledger(atomic) == ledger(locked) == [(1, 1, "w", "completed")]
        assert ledger(failing) == [(1, 1, "w", "failed")]
        assert list(Charge.objects.values_list("job_ref", flat=True)) == [atomic.pk]
    finally:
        worker.stop()
        runner.join(timeout=60)
    assert not runner.is_alive()
    # Stopping writes what was buffered.
    assert ledger(plain) == [(1, 1, "w", "completed")]
    assert (worker.stats.completed, worker.stats.failed, worker.stats.lost) == (3, 1, 0)


# ---- worker processes --------------------------------------------------------------------------


def worker(processes: Processes, name: str, *args: str) -> subprocess.Popen[str]:
    return processes.manage("run_lease_worker", "--worker-id", name, *FAST, *args)


def acknowledged(out: str) -> list[int]:
    """The sizes of the batches the worker's log says it wrote."""
    return [int(n) for n in re.findall(r"acknowledged completed=(\d+)", out)]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["claim-ahead", "mixed-kinds", "max-jobs"])
def test_worker__drains_a_batch_kind_and_closes_every_ledger_row_once(
    processes: Processes, mode: str
) -> None:
    """A worker of batch kinds only claims ahead: its completions are buffered and each batch,
    at most one per slot, is written with the claims of the next jobs. Beside a kind acked one by
    one, the slots' group write carries the completion: nothing is buffered. A worker that
    counts its claims (its loop claims) buffers them."""
    jobs = [PaymentJob.objects.enqueue("noop_batch") for _ in range(60)]
    options = {
        "claim-ahead": (),
        "mixed-kinds": ("--kind", "noop"),
        "max-jobs": ("--max-jobs", "1000"),
    }[mode]
    proc = worker(
        processes, "drain", "--burst", "--concurrency", "4", "--kind", "noop_batch", *options
    )
    out = finish(proc)
    assert proc.returncode == 0, out
    assert PaymentJob.objects.filter(status=Status.COMPLETED).count() == 60
    rows = JobAttempt.objects.filter(job_ref__in=[job.pk for job in jobs])
    assert sorted(rows.values_list("job_ref", "outcome", "ended_by")) == sorted(
        (job.pk, "completed", "drain") for job in jobs
    )
    batches = acknowledged(out)
    assert sum(batches) == (0 if mode == "mixed-kinds" else 60)
    assert ("ack buffered" in out) is (mode != "mixed-kinds")
    if mode == "claim-ahead":
        assert max(batches) <= 4  # a batch is due once every slot finished a job
    assert "claimed=60 completed=60" in out


@pytest.mark.django_db(transaction=True)
def test_worker__a_job_claimed_ahead_whose_lease_ran_out_is_never_started() -> None:
    """A job that waited, claimed ahead, longer than its lease (the heartbeat could not renew it)
    is not handed to a slot: another worker may own it by now. It is counted lost, nothing is
    written, and its job is taken over once the lease expires in the database."""
    lease_worker = LeaseWorker(worker_id="ahead", kinds=["noop_batch"], ttl=60, heartbeat=5)
    assert lease_worker._ahead
    stale, live = (PaymentJob.objects.enqueue("noop_batch") for _ in range(2))
    claimed = {job.pk: job for job in PaymentJob.objects.claim("ahead", ttl=60, limit=2)}
    # Its last confirmed renewal started more than a lease ago, by the worker's clock.
    lease_worker._pool._ready.append(
        Lease(claimed[stale.pk], ttl=60, renewed_at=time.monotonic() - 61)
    )
    lease_worker._pool._ready.append(Lease(claimed[live.pk], ttl=60))

    taken = lease_worker._pool.next_ready()

    assert taken is not None and taken.pk == live.pk
    assert not lease_worker._pool._ready
    assert lease_worker.stats.lost == 1
    assert ledger(stale) == [(1, 1, "ahead", "running")]  # left open for the takeover
    stale.refresh_from_db()
    assert (stale.status, stale.lease_owner) == (Status.PROCESSING, "ahead")


@pytest.mark.django_db(transaction=True)
def test_heartbeat__releases_a_job_claimed_ahead_that_waited_a_whole_ttl() -> None:
    """A queued job is renewed while a slot may soon start it, not for as long as the slots'
    handlers hang: once it has waited a whole TTL, the heartbeat releases it (conditional on
    owner and token) for any worker to claim; a job queued since is renewed."""
    lease_worker = LeaseWorker(worker_id="ahead", kinds=["noop_batch"], ttl=60, heartbeat=5)
    waited, fresh_job = (PaymentJob.objects.enqueue("noop_batch") for _ in range(2))
    claimed = {job.pk: job for job in PaymentJob.objects.claim("ahead", ttl=60, limit=2)}
    old, new = (Lease(claimed[job.pk], ttl=60) for job in (waited, fresh_job))
    lease_worker._pool.hand_out([old, new])
    lease_worker._pool._queued_at[old.key] = time.monotonic() - 61  # queued a whole TTL ago

    lease_worker._heartbeat.renew()

    assert list(lease_worker._pool._ready) == [new]
    assert ledger(waited) == [(1, 1, "ahead", "released")]
    waited.refresh_from_db()
    assert waited.status == Status.PENDING
    assert lease_worker.stats.released == 1
    assert ledger(fresh_job) == [(1, 1, "ahead", "running")]
    fresh_job.refresh_from_db()
    assert fresh_job.status == Status.PROCESSING


def claimed_ahead(
    processes: Processes, name: str, *args: str
) -> tuple[subprocess.Popen[str], list[PaymentJob]]:
    """A worker of 2 slots whose last job waits, claimed ahead, while the slots run 3 s jobs.

    Its first claim takes a (3 s) and b (at once); b's slot is then idle, and the next claim,
    the loop's or the one written with b's completion, takes c (3 s) for it and d (2 s) ahead."""
    seconds = [3, 0, 3, 2]
    jobs = [PaymentJob.objects.enqueue("sleep_batch", {"seconds": s}) for s in seconds]
    proc = worker(processes, name, "--concurrency", "2", "--kind", "sleep_batch", "--burst", *args)
    read_until(proc, f"claimed job_id={jobs[3].pk} ", f"started job_id={jobs[2].pk} ")
    return proc, jobs


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_job_claimed_ahead_is_renewed_while_it_waits_and_runs_once(
    processes: Processes,
) -> None:
    # Leases of 4 s: d waits ~3 s for a slot (less than a lease: a job that waited a whole one
    # would be released), then runs 2 s: only renewals, queued and running, keep it ours.
    proc, jobs = claimed_ahead(processes, "ahead", "--ttl", "4", "--heartbeat", "0.5")
    out = finish(proc)
    assert proc.returncode == 0, out
    for job in jobs:
        assert ledger(job) == [(1, 1, "ahead", "completed")], out
    first, last = (JobAttempt.objects.get(job_ref=job.pk) for job in (jobs[0], jobs[3]))
    assert first.ended_at is not None and last.ended_at is not None
    # d was claimed while a ran, waited for its slot, and was held longer than a lease.
    assert last.claimed_at < first.ended_at
    assert (first.ended_at - last.claimed_at).total_seconds() > 2
    assert (last.ended_at - last.claimed_at).total_seconds() > 4
    assert "lease lost" not in out and "fenced out" not in out


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__sigterm_releases_the_jobs_claimed_ahead(processes: Processes) -> None:
    proc, jobs = claimed_ahead(processes, "stopped")
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    for job in (jobs[0], jobs[1], jobs[2]):
        assert ledger(job) == [(1, 1, "stopped", "completed")], out
    # A write taken before the stop may claim it once more as the stop lands: released again.
    assert {row[2:] for row in ledger(jobs[3])} == {("stopped", "released")}, out
    jobs[3].refresh_from_db()
    assert jobs[3].status == Status.PENDING
    assert f"released unstarted job_id={jobs[3].pk} token={token_of(jobs[3])}" in out
    assert "died" not in out


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_full_batch_is_written_without_waiting_for_the_interval(
    processes: Processes,
) -> None:
    for _ in range(10):
        PaymentJob.objects.enqueue("noop_batch")
    # An hour's interval and a lease of minutes: only a full batch makes the worker write.
    proc = worker(
        processes,
        "sizer",
        *("--ack-batch-size", "5", "--ack-flush-interval", "3600"),
        *("--ttl", "300", "--heartbeat", "50"),
        *("--max-jobs", "100"),  # its loop claims: completions are buffered
    )
    wait_for(lambda: PaymentJob.objects.filter(status=Status.COMPLETED).count() == 10)
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert acknowledged(out) == [5, 5]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__sigterm_writes_the_buffered_acks_before_exit(processes: Processes) -> None:
    jobs = [PaymentJob.objects.enqueue("noop_batch") for _ in range(4)]
    proc = worker(
        processes,
        "stopper",
        *("--ack-flush-interval", "3600", "--ttl", "300", "--heartbeat", "50"),
        *("--max-jobs", "100"),  # its loop claims: completions are buffered
    )
    read_until(proc, *(f"ack buffered job_id={job.pk} " for job in jobs))
    assert PaymentJob.objects.filter(status=Status.PROCESSING).count() == 4
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    for job in jobs:
        assert ledger(job) == [(1, 1, "stopper", "completed")]
    assert PaymentJob.objects.filter(status=Status.COMPLETED, attempts=1).count() == 4
    assert acknowledged(out) == [4]
    assert "completed=4" in out


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__max_jobs_exit_writes_the_buffered_acks(processes: Processes) -> None:
    for _ in range(5):
        PaymentJob.objects.enqueue("noop_batch")
    proc = worker(processes, "capped", "--max-jobs", "3", "--ack-flush-interval", "3600")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert PaymentJob.objects.filter(status=Status.COMPLETED).count() == 3
    assert PaymentJob.objects.filter(status=Status.PENDING).count() == 2
    assert "completed=3" in out


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__sigkill_with_buffered_acks_runs_those_jobs_again(processes: Processes) -> None:
    jobs = [PaymentJob.objects.enqueue("noop_batch") for _ in range(4)]
    # Leases of 6 s, so the buffer is written at the latest a heartbeat (2 s) before they end:
    # the kill lands in the ~4 s between the handlers' return and that write.
    lease = ("--ttl", "6", "--heartbeat", "2")
    first = worker(
        processes,
        "doomed",
        *("--ack-flush-interval", "3600", "--concurrency", "2", *lease),
        *("--max-jobs", "100"),  # its loop claims: completions are buffered
    )
    read_until(first, *(f"ack buffered job_id={job.pk} " for job in jobs))
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    assert PaymentJob.objects.filter(status=Status.PROCESSING, lease_owner="doomed").count() == 4

    second = worker(processes, "rescuer", *lease)
    wait_for(lambda: PaymentJob.objects.filter(status=Status.COMPLETED).count() == 4, timeout=60)
    second.send_signal(signal.SIGTERM)
    out = finish(second)
    assert second.returncode == 0, out
    for job in jobs:
        assert ledger(job) == [(1, 1, "doomed", "lease_lost"), (2, 2, "rescuer", "completed")]
    assert PaymentJob.objects.filter(status=Status.COMPLETED, attempts=2).count() == 4


@pytest.mark.django_db
def test_complete_many__completes_a_job_of_a_lock_and_passes_the_lock_on() -> None:
    """A job of a lock given to `complete_many()` is completed, not reported lost: its lock is
    released in its UPDATE and passed on, in the same transaction, to the lock's first waiting
    job; its ledger row is closed as completed and never noted as fenced."""
    first = PaymentJob.objects.enqueue("noop_batch", lock="order:7")
    second = PaymentJob.objects.enqueue("noop_batch", lock="order:7")
    free = PaymentJob.objects.enqueue("noop_batch")
    assert PaymentJob.objects.get(pk=second.pk).status == Status.WAITING
    held = {job.pk: job.lease_token for job in PaymentJob.objects.claim("w1", ttl=60, limit=5)}
    assert set(held) == {first.pk, free.pk}  # the waiting job is out of every claim's sight

    won = PaymentJob.objects.complete_many("w1", held)

    assert won == set(held.items())
    rows = {job.pk: job for job in PaymentJob.objects.all()}
    assert (rows[first.pk].status, rows[first.pk].lock_holder) == (Status.COMPLETED, None)
    assert (rows[second.pk].status, rows[second.pk].lock_holder) == (Status.PENDING, "order:7")
    assert rows[free.pk].status == Status.COMPLETED
    assert ledger(first) == ledger(free) == [(1, 1, "w1", "completed")]
    assert not JobAttempt.objects.filter(fenced_at__isnull=False).exists()
    (claimed,) = PaymentJob.objects.claim("w1", ttl=60)
    assert claimed.pk == second.pk


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_batched_completion_of_a_cancelled_job_ends_it_counted_as_cancelled(
    processes: Processes,
) -> None:
    """A job cancelled while its handler runs, whose holder learns it only when its batched
    completion is refused (no heartbeat meanwhile): the refusal acknowledges the stop, and the
    job is counted and logged as cancelled, not as a lost lease."""
    job = PaymentJob.objects.enqueue("sleep_batch", {"seconds": 1.5})
    proc = worker(processes, "acker", "--ttl", "300", "--heartbeat", "50", "--kind", "sleep_batch")
    wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, status=Status.PROCESSING).exists())
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1

    read_until(proc, f"cancelled job_id={job.pk}")
    wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, status=Status.CANCELLED).exists())
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "cancelled=1" in out and "lost=0" in out, out
    assert "fenced out" not in out, out
    (row,) = JobAttempt.objects.filter(job_ref=job.pk)
    assert (row.outcome, row.ended_by, row.ended_at is not None) == ("cancelled", "ops", True)
