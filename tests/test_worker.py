"""`run_lease_worker` end to end: real worker processes against the real test database."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction
from django.db.models import F
from django.db.models.functions import Now

from django_leases import job_handler, stats
from django_leases.exceptions import InvalidArgument
from django_leases.handlers import unregister
from django_leases.models import JobAttempt, PaymentJob, Worker
from django_leases.network import CLIENT_SLACK, Deadline, auto_timeout
from django_leases.worker import LeaseWorker
from tests.testapp.models import Charge, LockRun

from .conftest import ON_SQLITE, Processes, finish, read_until, subprocess_env, wait_for
from .leasing import token_of

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status
FAST = ("--poll-interval", "0.1")


@pytest.fixture
def kind() -> Iterator[str]:
    """A job kind a test registers a handler for, unregistered after it."""
    name = "test_worker_kind"
    yield name
    unregister(name)


def worker(processes: Processes, name: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    return processes.manage(
        "run_lease_worker", "--worker-id", name, *FAST, *args, "-v", "2", **kwargs
    )  # type: ignore[arg-type]


def fresh(job: PaymentJob) -> PaymentJob:
    """Re-read the job, reconnecting if the database connection was cut under us."""
    try:
        return PaymentJob.objects.get(pk=job.pk)
    except OperationalError:
        connection.close()
        return PaymentJob.objects.get(pk=job.pk)


def held_by(job: PaymentJob, owner: str, attempt: int | None = None) -> bool:
    """Whether `owner` holds the job (under its `attempt`-th acquisition, if given)."""
    job = fresh(job)
    return (
        job.status == Status.PROCESSING
        and job.lease_owner == owner
        and (attempt is None or job.attempts == attempt)
    )


def ledger(job: PaymentJob) -> list[tuple[int, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "owner", "outcome")  # in token order: tokens rise with attempts
    )


def test_worker__burst_runs_every_job_and_exits_zero(processes: Processes) -> None:
    ok = [PaymentJob.objects.enqueue("noop") for _ in range(20)]
    retried = PaymentJob.objects.enqueue("boom", {"message": "psp 502"}, max_attempts=3)
    failed = PaymentJob.objects.enqueue("boom", max_attempts=1)
    declined = PaymentJob.objects.enqueue("permanent")
    unknown = PaymentJob.objects.enqueue("no-such-kind")

    # A backoff of minutes: the retried job is still waiting when we look, however slow the run.
    slow_backoff = json.dumps({"BACKOFF_BASE": 300, "BACKOFF_MAX": 600})
    proc = worker(
        processes,
        "burst-1",
        "--burst",
        "--concurrency",
        "3",
        env=subprocess_env(LEASES_TEST_SETTINGS=slow_backoff),
    )
    out = finish(proc)

    assert proc.returncode == 0, out
    assert (
        PaymentJob.objects.filter(pk__in=[j.pk for j in ok], status=Status.COMPLETED).count() == 20
    )
    retried = fresh(retried)
    assert (retried.status, retried.attempts) == (Status.PENDING, 1)
    assert retried.last_error == "RuntimeError: psp 502"
    assert PaymentJob.objects.filter(pk=retried.pk, run_at__gt=Now()).exists()
    assert fresh(failed).status == Status.FAILED
    declined = fresh(declined)
    assert (declined.status, declined.attempts, declined.last_error) == (
        Status.FAILED,
        1,
        "django_leases.exceptions.PermanentError: card declined",
    )
    assert fresh(unknown).status == Status.PENDING and fresh(unknown).attempts == 0
    assert ledger(retried) == [(1, "burst-1", "retried")]
    assert JobAttempt.objects.get(job_ref=failed.pk).error_class == "RuntimeError"
    assert "claimed=23 completed=20 retried=1 failed=2" in out
    assert (
        f"claimed job_id={ok[0].pk} kind=noop attempt=1 token={token_of(ok[0])} owner=burst-1"
        in out
    )


def test_worker__max_jobs_stops_after_that_many(processes: Processes) -> None:
    for _ in range(5):
        PaymentJob.objects.enqueue("noop")
    proc = worker(processes, "capped", "--max-jobs", "2")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert PaymentJob.objects.filter(status=Status.COMPLETED).count() == 2
    assert PaymentJob.objects.filter(status=Status.PENDING).count() == 3


def test_worker__keeps_its_connection_from_job_to_job_whatever_conn_max_age(
    processes: Processes,
) -> None:
    """With Django's default CONN_MAX_AGE = 0 the slot thread still opens one connection for
    all its jobs: a worker is not a request cycle."""
    jobs = [PaymentJob.objects.enqueue("connections") for _ in range(5)]
    proc = worker(
        processes,
        "keeper",
        "--burst",
        "--concurrency",
        "1",
        env=subprocess_env(LEASES_TEST_CONN_MAX_AGE="0"),
    )
    out = finish(proc)
    assert proc.returncode == 0, out
    done = [fresh(job) for job in jobs]
    assert [(job.status, job.checkpoint) for job in done] == [(Status.COMPLETED, "opened=1")] * 5
    assert "kept open for the worker's lifetime, whatever CONN_MAX_AGE says" in out


def test_worker__sigkill_mid_job_is_rescued_after_ttl(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"durations": [60, 0]})
    victim = worker(processes, "victim", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: held_by(job, "victim"))
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)

    worker(processes, "rescuer", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=60)

    job = fresh(job)
    assert (job.attempts, job.lease_token, job.lease_owner) == (2, token_of(job, 2), "rescuer")
    assert ledger(job) == [(1, "victim", "lease_lost"), (2, "rescuer", "completed")]


@pytest.mark.slow
def test_worker__paused_past_its_lease_writes_nothing(processes: Processes) -> None:
    # Attempt 1 takes 4 s; attempt 2 (the new owner's) takes 10 s, so the zombie resumes while
    # the new owner is still running, even on a loaded machine.
    job = PaymentJob.objects.enqueue("sleep", {"durations": [4, 10]})
    zombie = worker(processes, "zombie", "--ttl", "2", "--heartbeat", "0.4")
    # Paused in the handler, not between the claim and its start (a lease found run out
    # there is never started: nothing to fence).
    read_until(zombie, f"started job_id={job.pk} ")
    os.killpg(zombie.pid, signal.SIGSTOP)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())

    worker(processes, "owner", "--ttl", "3", "--heartbeat", "0.5")
    wait_for(lambda: held_by(job, "owner", attempt=2))
    os.killpg(zombie.pid, signal.SIGCONT)

    # The zombie notices: its heartbeat is refused, or its completion is.
    wait_for(
        lambda: JobAttempt.objects.filter(
            job_ref=job.pk, attempt=1, fenced_at__isnull=False
        ).exists()
    )
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=60)
    job = fresh(job)
    assert (job.lease_owner, job.lease_token, job.attempts) == ("owner", token_of(job, 2), 2)
    assert ledger(job) == [(1, "zombie", "lease_lost"), (2, "owner", "completed")]
    assert zombie.poll() is None, "the zombie must keep running, not crash"


def test_worker__never_starts_a_job_whose_lease_ran_out_before_its_slot_got_it(
    processes: Processes,
) -> None:
    """The completion of job `first` claims the slot's next job (`second`) in the same write.
    That write waits on a row lock longer than a TTL, so `second`'s lease has run out when it
    comes back (another worker could own it by then): the slot must not start it, whichever way
    it got the job. It is taken over once its lease expires and runs once, under a new token."""
    ttl = 2.0
    first = PaymentJob.objects.enqueue("sleep", {"seconds": 1}, priority=1)
    second = PaymentJob.objects.enqueue("watches_lease", {"seconds": 0})
    settings = json.dumps({"NETWORK_TIMEOUT": 10})  # the blocked write must not time out
    proc = worker(
        processes, "w", "--concurrency", "1", "--ttl", str(ttl), "--heartbeat", "0.5",
        env=subprocess_env(LEASES_TEST_SETTINGS=settings),
    )  # fmt: skip
    wait_for(lambda: held_by(first, "w"), interval=0.01)
    with transaction.atomic():
        # Hold `first`'s row (SQLite: the database) until `second`, claimed with `first`'s
        # completion when its 1 s handler returns, has been held a whole TTL unstarted.
        if ON_SQLITE:
            PaymentJob.objects.filter(pk=first.pk).update(priority=F("priority"))
        else:
            PaymentJob.objects.select_for_update().get(pk=first.pk)
        time.sleep(1 + ttl + 0.5)
    wait_for(lambda: fresh(second).status == Status.COMPLETED, timeout=60)
    proc.terminate()
    out = finish(proc)

    attempts = ledger(second)
    assert [outcome for _, _, outcome in attempts] == ["lease_lost", "completed"], out
    first_token, second_token = token_of(second, 1), token_of(second, 2)
    # Only the takeover's attempt ran the handler; the first one was never started.
    assert list(LockRun.objects.filter(job_ref=second.pk).values_list("token", flat=True)) == [
        second_token
    ], out
    assert f"fenced out job_id={second.pk} token={first_token}" in out, out
    assert "not started" in out, out
    assert fresh(first).status == Status.COMPLETED


@pytest.mark.slow
def test_worker__long_job_with_heartbeats_is_never_claimed_twice(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 10})  # 5 x the TTL
    worker(processes, "long", "--ttl", "2", "--heartbeat", "0.4")
    wait_for(lambda: held_by(job, "long"))
    pollers = [
        worker(processes, f"poller-{n}", "--ttl", "2", "--heartbeat", "0.4") for n in range(2)
    ]

    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=60)
    job = fresh(job)
    assert (job.attempts, job.lease_token, job.lease_owner) == (1, token_of(job), "long")
    assert ledger(job) == [(1, "long", "completed")]
    assert all(p.poll() is None for p in pollers)


@pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian package)")
@pytest.mark.skipif(
    ON_SQLITE,
    reason="SQLite has no server clock: its now() is read by each calling process, so a "
    "process with a faked clock brings its own; SQLite is for one host, whose processes share "
    "one clock",
)
def test_worker__clock_thirty_seconds_ahead_steals_nothing(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 8})
    worker(processes, "honest", "--ttl", "3", "--heartbeat", "0.5", "--kind", "sleep")
    wait_for(lambda: held_by(job, "honest"))
    skewed = worker(
        processes, "skewed", "--ttl", "3", "--heartbeat", "0.5", prefix=["faketime", "-f", "+30s"]
    )
    # The skewed worker is alive and claims what is free...
    other = PaymentJob.objects.enqueue("noop")
    wait_for(lambda: fresh(other).status == Status.COMPLETED, timeout=30)
    assert fresh(other).lease_owner == "skewed"
    # ...but not the live lease, even though by its clock that lease ended 27 s ago.
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    job = fresh(job)
    assert (job.attempts, job.lease_owner) == (1, "honest")
    assert skewed.poll() is None


def cut_database_connections() -> None:
    """Kill every other session on the test database: a restart as the workers see it."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        else:
            cursor.execute(
                "SELECT id FROM information_schema.processlist WHERE db = DATABASE() "
                "AND id <> CONNECTION_ID()"
            )
            for (pid,) in cursor.fetchall():
                cursor.execute(f"KILL {int(pid)}")


def restart_postgresql() -> None:
    version = os.listdir("/etc/postgresql")[0]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"], check=True
    )
    connection.close()


# Serial: with LEASES_TEST_PG_RESTART it restarts the PostgreSQL server under every test.
@pytest.mark.serial
@pytest.mark.skipif(
    ON_SQLITE,
    reason="SQLite is a file inside the worker's process: it has no server to go away",
)
def test_worker__survives_the_database_going_away(processes: Processes) -> None:
    jobs = [PaymentJob.objects.enqueue("sleep", {"seconds": 0.3}) for _ in range(30)]
    workers = [
        worker(processes, f"w{n}", "--concurrency", "2", "--ttl", "5", "--heartbeat", "1")
        for n in range(2)
    ]
    wait_for(lambda: PaymentJob.objects.filter(status=Status.COMPLETED).count() >= 4)

    # LEASES_TEST_PG_RESTART=1 (CI): restart the real server; unset or 0: cut the connections.
    restart = os.environ.get("LEASES_TEST_PG_RESTART", "") not in ("", "0")
    if connection.vendor == "postgresql" and restart:
        restart_postgresql()
    else:
        cut_database_connections()
    wait_for(lambda: PaymentJob.objects.filter(status=Status.COMPLETED).count() >= 12, timeout=60)
    cut_database_connections()

    def all_done() -> bool:
        try:
            return PaymentJob.objects.filter(status=Status.COMPLETED).count() == len(jobs)
        except OperationalError:
            connection.close()
            return False

    wait_for(all_done, timeout=120)
    assert all(w.poll() is None for w in workers), "a worker exited on an outage"
    assert not PaymentJob.objects.exclude(status=Status.COMPLETED).exists()


@pytest.mark.slow
def test_worker__sigterm_lets_running_jobs_finish_and_exits_zero(processes: Processes) -> None:
    # Long enough that SIGTERM lands while both run, even when a loaded machine delays the test
    # process by seconds between reading "started" and sending the signal.
    running = [PaymentJob.objects.enqueue("sleep", {"seconds": 8}, priority=1) for _ in range(2)]
    waiting = [PaymentJob.objects.enqueue("noop") for _ in range(3)]
    proc = worker(processes, "graceful", "--concurrency", "2", "--grace-period", "30")
    # Claimed is not started: a job still queued for a slot would be released, not finished.
    started = read_until(proc, *(f"started job_id={job.pk} " for job in running))
    proc.send_signal(signal.SIGTERM)
    out = started + finish(proc)

    assert proc.returncode == 0, out
    assert [fresh(job).status for job in running] == [Status.COMPLETED] * 2, out
    assert [(fresh(job).status, fresh(job).attempts) for job in waiting] == [
        (Status.PENDING, 0)
    ] * 3, out
    assert "worker graceful stopped: claimed=2 completed=2" in out


def test_worker__sigterm_past_grace_period_abandons_to_lease_expiry(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 60})
    proc = worker(
        processes, "impatient", "--grace-period", "0.5", "--ttl", "30", "--heartbeat", "5"
    )
    # Claimed is not started: wait for the slot to run the handler, or it would be released.
    started = read_until(proc, f"started job_id={job.pk} ")
    proc.send_signal(signal.SIGTERM)
    out = started + finish(proc, timeout=30)

    assert proc.returncode == 0, out
    assert f"abandoned job_id={job.pk}" in out
    # Not released under a handler that may still run: the lease runs out instead.
    assert held_by(job, "impatient")


def test_worker__shutdown_counts_a_lease_lost_under_a_running_handler_as_lost(
    processes: Processes,
) -> None:
    """Its summary said lost=0 abandoned=1 and "its lease expires in at most 30s" for a lease
    another worker had taken over while the handler ran."""
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 60})
    proc = worker(
        processes, "overtaken", "--grace-period", "0.5", "--ttl", "30", "--heartbeat", "0.5"
    )
    started = read_until(proc, f"started job_id={job.pk} ")
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=1))
    assert [taken.pk for taken in PaymentJob.objects.claim("rescuer", ttl=30)] == [job.pk]
    lost = read_until(proc, f"lease lost job_id={job.pk} token={token_of(job)}")
    proc.send_signal(signal.SIGTERM)
    out = started + lost + finish(proc, timeout=30)

    assert proc.returncode == 0, out
    assert f"abandoned job_id={job.pk}" not in out and "expires in at most" not in out, out
    assert (
        f"fenced out job_id={job.pk} token={token_of(job)} owner=overtaken: still running "
        "after the 0.5s grace period, its lease lost before: heartbeat refused"
    ) in out
    assert " lost=1 released=0 abandoned=0 " in out, out
    assert held_by(job, "rescuer", attempt=2)


def test_worker__bounds_its_database_waits_by_the_shortest_kind_ttl_it_serves(kind) -> None:
    """NETWORK_TIMEOUT "auto" is a third of the lease: it was the worker's --ttl (60 s: 20 s)
    even where every job it ran had a 9 s lease of its kind's, which a blocked renewal of 20 s
    would outlast."""
    seen: list[float] = []

    def handler(job, lease):
        seen.extend(w.seconds for w in connection.execute_wrappers if isinstance(w, Deadline))

    job_handler(kind, ttl=9)(handler)
    job = PaymentJob.objects.enqueue(kind)
    LeaseWorker(kinds=[kind], burst=True, ttl=60, heartbeat=1, poll_interval=0.05).run()
    assert fresh(job).status == Status.COMPLETED
    assert seen == ([] if ON_SQLITE else [auto_timeout(9) + CLIENT_SLACK])  # SQLite: no network


@pytest.mark.parametrize("bad", ["w1\nworker stopped", "w 1", "w1\x1b[2J", ""])
def test_worker__refuses_a_worker_id_that_would_forge_a_log_line(bad: str) -> None:
    if not bad:
        assert LeaseWorker(worker_id=bad, ttl=30, heartbeat=5).worker_id  # the default id
        return
    with pytest.raises(InvalidArgument, match="worker_id must not contain whitespace or control"):
        LeaseWorker(worker_id=bad, ttl=30, heartbeat=5)
    with pytest.raises(InvalidArgument, match="owner must not contain whitespace or control"):
        PaymentJob.objects.claim(bad, ttl=30)
    assert not JobAttempt.objects.exists()


def test_worker__second_signal_exits_at_once(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"seconds": 60})
    proc = worker(processes, "hasty", "--grace-period", "60")
    # Started, not just claimed: a job claimed but not started is released on the first signal,
    # and the worker would be gone before the second.
    read_until(proc, f"started job_id={job.pk} ")
    proc.send_signal(signal.SIGTERM)
    # Signals do not queue: wait until the first one was handled before sending the second.
    read_until(proc, "stop requested")
    proc.send_signal(signal.SIGTERM)
    finish(proc, timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM


STOP_WHILE_HOLDING_ITS_LOCK = """
import os, signal, threading
import django
from django.conf import settings
settings.configure()
django.setup()
from django_leases.management.commands._options import stop_signals
lock, stopped = threading.Lock(), threading.Event()
def stop():
    with lock:
        stopped.set()
with stop_signals(stop):
    with lock:
        os.kill(os.getpid(), signal.SIGTERM)
        # The handler runs here, on this thread, which holds the lock that stop() takes.
        for _ in range(100_000):
            pass
    print("stopped" if stopped.wait(10) else "not stopped", flush=True)
"""


def test_stop_signals__stop_runs_off_the_thread_the_signal_interrupts() -> None:
    """SIGTERM landed while the worker's loop held the lock of the Event that `stop()` sets
    (it clears and waits on it all the time): `stop()` called in the handler waited for that
    thread, its own, forever, and the worker hung until SIGKILL (seen once in a CI run)."""
    proc = subprocess.run(
        [sys.executable, "-c", STOP_WHILE_HOLDING_ITS_LOCK],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (0, "stopped\n"), proc.stderr


def test_worker__unstarted_jobs_are_released_on_stop() -> None:
    job = PaymentJob.objects.enqueue("noop")
    lease_worker = LeaseWorker(worker_id="in-process", concurrency=1, ttl=30, heartbeat=5)
    assert lease_worker.run_once() == 1  # claimed, not yet started: no slot runs yet
    lease_worker.stop()
    stats = lease_worker.run()

    job = fresh(job)
    assert (job.status, job.attempts, job.max_attempts) == (Status.PENDING, 1, 6)
    assert ledger(job) == [(1, "in-process", "released")]
    assert (stats.claimed, stats.released, stats.completed) == (1, 1, 0)


def test_worker__a_job_claimed_as_stop_arrives_is_released_once_and_counted() -> None:
    job = PaymentJob.objects.enqueue("noop")
    lease_worker = LeaseWorker(worker_id="in-process", concurrency=1, ttl=30, heartbeat=5)
    lease_worker._supervise()  # the slot thread runs and waits for a lease
    lease_worker.stop()
    # The claim in flight when the signal lands: its lease reaches a live slot thread, which
    # leaves it to the shutdown instead of releasing it behind the shutdown's back.
    assert lease_worker.run_once() == 1
    stats = lease_worker.run()

    job = fresh(job)
    assert (job.status, job.attempts) == (Status.PENDING, 1)
    assert ledger(job) == [(1, "in-process", "released")]
    assert (stats.claimed, stats.released, stats.completed) == (1, 1, 0)


# "async_charge" is the same handler as an `async def`, writing under `await lease.aatomic()`.
@pytest.mark.parametrize("kind", ["charge", "async_charge"])
def test_worker__lease_atomic_rolls_back_the_zombies_writes(
    processes: Processes, kind: str
) -> None:
    job = PaymentJob.objects.enqueue(kind, {"durations": [3, 2]})
    zombie = worker(processes, "zombie", "--ttl", "1.5", "--heartbeat", "0.3")
    # Paused in the handler, not between the claim and its start (a lease found run out
    # there is never started: nothing to fence).
    read_until(zombie, f"started job_id={job.pk} ")
    os.killpg(zombie.pid, signal.SIGSTOP)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())
    worker(processes, "owner", "--ttl", "1.5", "--heartbeat", "0.3")
    wait_for(lambda: held_by(job, "owner", attempt=2))
    os.killpg(zombie.pid, signal.SIGCONT)

    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    wait_for(
        lambda: JobAttempt.objects.filter(
            job_ref=job.pk, attempt=1, fenced_at__isnull=False
        ).exists()
    )
    assert list(Charge.objects.values_list("job_ref", "token", "owner")) == [
        (job.pk, token_of(job, 2), "owner")
    ]
    assert ledger(job) == [(1, "zombie", "lease_lost"), (2, "owner", "completed")]
    assert zombie.poll() is None, "the zombie must keep running, not crash"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ttl", "0"], "'0' must be a number of seconds from 1 to "),
        (["--ttl", "-3"], "'-3' must be a number of seconds from 1 to "),
        (["--grace-period", "-5"], "'-5' must be zero or more seconds, up to "),
        # An empty or blank kind is refused by name, not listed as an invisible unknown one.
        (["--kind", ""], "kind must be a string of 1 to 100 characters, got ''"),
        (["--kind", " "], "kind must not contain whitespace or control characters, got ' '"),
        (["--ttl", "10", "--heartbeat", "10"], "heartbeat (10s) must be shorter than ttl (10s)"),
        (["--heartbeat", "abc"], "'abc' is not a number of seconds"),
        (["--concurrency", "0"], "must be from 1 to 1000"),
        (["--kind", "nope"], "no handler for job kind(s) nope"),
        (["--worker-id", "has space"], "not a valid worker id"),
        (["--ack-batch-size", "0"], "'0' must be from 1 to 1000"),
        (["--ack-batch-size", "many"], "'many' is not a whole number"),
        (["--ack-flush-interval", "0"], "must be a positive number of seconds"),
    ],
)
def test_worker__bad_options_fail_with_one_line_before_any_claim(
    processes: Processes, args: list[str], message: str
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    proc = processes.manage("run_lease_worker", "--burst", *args)
    out = finish(proc, timeout=30)
    assert proc.returncode == 1
    assert message in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1
    assert fresh(job).attempts == 0


def test_run_lease_worker__kind_takes_several_values_per_flag_and_repeated_flags(
    processes: Processes,
) -> None:
    jobs = {
        kind: PaymentJob.objects.enqueue(kind) for kind in ("noop", "sleep", "permanent", "boom")
    }
    proc = worker(processes, "picky", "--burst", "--kind", "noop", "sleep", "--kind", "permanent")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "kinds=noop,permanent,sleep" in out
    assert {kind: fresh(job).status for kind, job in jobs.items()} == {
        "noop": Status.COMPLETED,
        "sleep": Status.COMPLETED,
        "permanent": Status.FAILED,
        "boom": Status.PENDING,
    }


def test_worker__outcome_written_by_the_handler_is_counted_as_such() -> None:
    job = PaymentJob.objects.enqueue("self_fail")
    stats = LeaseWorker(worker_id="w", burst=True, ttl=30, heartbeat=5, poll_interval=0.05).run()
    assert (stats.failed, stats.completed) == (1, 0)
    assert fresh(job).status == Status.FAILED
    assert ledger(job) == [(1, "w", "failed")]


def test_worker__registers_its_heartbeat_and_shows_late_once_frozen_for_two(
    processes: Processes,
) -> None:
    proc = worker(processes, "frozen", "--heartbeat", "0.5", "--kind", "sleep")
    wait_for(lambda: Worker.objects.filter(worker_id="frozen").exists())
    row = Worker.objects.get(worker_id="frozen")
    assert (row.role, row.heartbeat, row.kinds) == ("worker", 0.5, ["sleep"])
    (live,) = stats.fleet(Worker.objects.all()).workers
    assert not live.late

    os.killpg(proc.pid, signal.SIGSTOP)  # frozen: alive by WORKER_GONE_AFTER (120 s) for long
    wait_for(lambda: stats.fleet(Worker.objects.all()).late == 1, timeout=10)
    fleet = stats.fleet(Worker.objects.all())
    assert [w.worker_id for w in fleet.workers] == ["frozen"]
    assert fleet.unserved(["sleep"]) == ["sleep"]
    os.killpg(proc.pid, signal.SIGCONT)
    wait_for(lambda: stats.fleet(Worker.objects.all()).late == 0, timeout=10)
