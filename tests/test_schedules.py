"""Periodic jobs: one job per tick of the database clock, whatever the number of processes."""

import json
import os
import re
import shutil
import signal
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

from django_leases.models import JobAttempt, PaymentJob
from django_leases.schedules import Schedule, Ticker, configured, database_now, enqueue_due
from django_leases.watcher import StuckWatcher

from .conftest import ON_SQLITE, Processes, subprocess_env, wait_for

Status = PaymentJob.Status
# Ticks of about 115 days: no test here runs across a boundary by chance.
LONG = {"kind": "noop", "every": 10**7}


def schedules(**entries: object) -> override_settings:
    return override_settings(DJANGO_LEASES={"SCHEDULES": entries})


def ticks(name: str = "beat") -> list[int]:
    """Return the tick of every job of schedule `name`, in order."""
    keys = PaymentJob.objects.filter(idempotency_key__startswith=f"schedule:{name}:")
    return sorted(
        int(key.rsplit(":", 1)[1]) for key in keys.values_list("idempotency_key", flat=True)
    )


def current_tick(schedule: Schedule) -> int:
    return schedule.tick(database_now(connection.alias).timestamp())


# ---- one pass -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_due__enqueues_the_current_tick_once() -> None:
    with schedules(beat={**LONG, "payload": {"report": "daily"}}):
        [schedule] = configured()
        tick = current_tick(schedule)
        [job] = enqueue_due()
        assert enqueue_due() == []
        assert StuckWatcher().run_once() == []
    assert PaymentJob.objects.count() == 1
    assert job.idempotency_key == f"schedule:beat:10000000:{tick}"
    assert (job.kind, job.payload, job.status) == ("noop", {"report": "daily"}, Status.PENDING)
    # Due at once: the tick started before now, by the database clock.
    assert job.run_at == schedule.start(tick) <= database_now(connection.alias)


@pytest.mark.django_db
def test_enqueue_due__accepts_a_timedelta_and_keys_by_period() -> None:
    with schedules(beat={"kind": "noop", "every": timedelta(days=200)}):
        [schedule] = configured()
        [job] = enqueue_due()
    assert schedule.every == 200 * 86400.0
    assert job.idempotency_key == f"schedule:beat:17280000:{current_tick(schedule)}"


@pytest.mark.django_db
@pytest.mark.parametrize("catch_up", [True, False])
def test_enqueue_due__missed_ticks_are_caught_up_once_or_skipped(catch_up: bool) -> None:
    with schedules(beat={**LONG, "catch_up": catch_up}):
        [schedule] = configured()
        tick = current_tick(schedule)
        # The schedule last ran five ticks ago; nothing ran during the four ticks since.
        PaymentJob.objects.enqueue("noop", idempotency_key=schedule.key(tick - 5))
        jobs = enqueue_due()
        assert enqueue_due() == []
    caught_up = [tick - 1] if catch_up else []
    assert [job.idempotency_key for job in jobs] == [schedule.key(t) for t in [*caught_up, tick]]
    assert ticks() == [tick - 5, *caught_up, tick]
    if catch_up:
        assert jobs[0].run_at == schedule.start(tick - 1)


@pytest.mark.django_db
def test_enqueue_due__a_new_schedule_or_period_catches_nothing_up() -> None:
    with schedules(beat=LONG):
        [old] = configured()
        PaymentJob.objects.enqueue("noop", idempotency_key=old.key(current_tick(old) - 3))
    with schedules(beat={**LONG, "every": 2 * 10**7}, fresh=LONG):
        jobs = enqueue_due()
    assert sorted(job.idempotency_key.rsplit(":", 1)[0] for job in jobs) == [
        "schedule:beat:20000000",
        "schedule:fresh:10000000",
    ]


@pytest.mark.django_db
def test_enqueue_due__a_removed_schedule_enqueues_nothing() -> None:
    with schedules(beat=LONG, other=LONG):
        assert len(enqueue_due()) == 2
    with schedules(other=LONG):
        assert enqueue_due() == []
    with schedules():
        assert enqueue_due() == []
        assert Ticker().poll() == []
    assert PaymentJob.objects.count() == 2


@pytest.mark.django_db
def test_ticker__reads_the_clock_once_per_tick(django_assert_num_queries: object) -> None:
    with schedules(beat=LONG):
        ticker = Ticker()
        [job] = ticker.poll()
        # The next boundary is months away: the loop's later passes ask the database nothing.
        with django_assert_num_queries(0):  # type: ignore[operator]
            assert ticker.poll() == []
        assert 0 < ticker.next_check < float("inf")
    with schedules():
        assert Ticker().next_check == float("inf")
    assert PaymentJob.objects.get() == job


# ---- real processes -------------------------------------------------------------------------

EVERY_SECOND = {"SCHEDULES": {"beat": {"kind": "noop", "every": 1}}}


def start(processes: Processes, name: str, settings: dict[str, object], *prefix: str):
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(settings))
    args = ["--worker-id", name, "--kind", "noop", "--poll-interval", "0.5", "-v", "2"]
    return processes.manage("run_lease_worker", *args, env=env, prefix=list(prefix) or None)


def stop(*procs: subprocess.Popen[str]) -> list[str]:
    """SIGTERM `procs`; return their output once each exited 0."""
    for proc in procs:
        # faketime runs the worker as its child and does not pass signals on; it exits with
        # the worker's status.
        faked = isinstance(proc.args, list) and proc.args[0] == "faketime"
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(children[0]) if faked else proc.pid, signal.SIGTERM)
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        outputs.append(out)
    return outputs


def settled_ticks(count: int) -> list[int]:
    """Wait until `count` ticks' jobs are completed; return every tick enqueued."""
    done = PaymentJob.objects.filter(kind="noop", status=Status.COMPLETED)
    wait_for(lambda: done.count() >= count, timeout=30 + 3 * count, interval=0.2)
    return ticks()


def assert_one_job_per_tick() -> list[int]:
    """Every tick from the first to the last has one job, each run by one acquisition."""
    enqueued = ticks()
    assert enqueued == list(range(enqueued[0], enqueued[-1] + 1)), enqueued
    assert PaymentJob.objects.filter(kind="noop").count() == len(enqueued)
    for job in PaymentJob.objects.filter(kind="noop", status=Status.COMPLETED):
        attempts = JobAttempt.objects.filter(job_ref=job.pk)
        assert job.attempts == 1 and list(attempts.values_list("outcome", flat=True)) == [
            "completed"
        ], job
    return enqueued


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_schedules__three_workers_and_a_watcher_enqueue_one_job_per_tick(
    processes: Processes,
) -> None:
    workers = [start(processes, f"w{n}", EVERY_SECOND) for n in range(3)]
    watcher = processes.manage(
        "watch_stuck_jobs",
        *("--interval", "0.5", "--watcher-id", "watcher", "-v", "2"),
        env=subprocess_env(LEASES_TEST_SETTINGS=json.dumps(EVERY_SECOND)),
    )
    settled_ticks(8)
    outputs = stop(*workers, watcher)

    enqueued = assert_one_job_per_tick()
    assert len(enqueued) >= 8
    # Each job was created in its own tick or, caught up, the next one (database clock; a busy
    # machine may cross one more boundary between the clock read and the INSERT).
    for job in PaymentJob.objects.filter(kind="noop"):
        tick = int(job.idempotency_key.rsplit(":", 1)[1])
        assert job.run_at.timestamp() == tick
        assert tick <= job.created_at.timestamp() < tick + 3, job.idempotency_key
    # Several processes enqueued ticks (a race's loser logs the winner's job): the race was
    # real, and harmless.
    logged = [
        set(re.findall(r"enqueued schedule=beat tick=\d+ job_id=(\d+)", out)) for out in outputs
    ]
    assert set().union(*logged) == {
        str(pk) for pk in PaymentJob.objects.values_list("pk", flat=True)
    }
    assert sum(1 for ids in logged if ids) >= 2, outputs


SKEWED_CLOCKS = [
    pytest.mark.skipif(shutil.which("faketime") is None, reason="needs faketime (Debian package)"),
    pytest.mark.skipif(
        ON_SQLITE,
        reason="SQLite has no server clock: its now() is read by each calling process, so a "
        "process with a faked clock brings its own; SQLite is for one host, whose processes "
        "share one clock",
    ),
]


def assert_ticks_follow_the_database_clock(since: float) -> None:
    """Every job's tick is the database's time when it was enqueued (or, late, the tick before)."""
    now = database_now(connection.alias).timestamp()
    jobs = PaymentJob.objects.filter(kind="noop")
    assert jobs.exists()
    for job in jobs:
        tick = int(job.idempotency_key.rsplit(":", 1)[1])
        # Hosts hours ahead or behind would be thousands of ticks off.
        assert since - 2 <= tick <= now, (since, job.idempotency_key, now)
        assert tick <= job.created_at.timestamp() < tick + 3, job.idempotency_key


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@SKEWED_CLOCKS[0]
@SKEWED_CLOCKS[1]
@pytest.mark.skipif(
    connection.vendor == "mysql",
    reason="libfaketime 0.9.10 hangs Python's timed waits (threading.Event.wait) in a process "
    "whose clock it moves; a worker waits on them between polls except on PostgreSQL, where "
    "it waits on its LISTEN socket. The watcher test below covers MariaDB/MySQL.",
)
def test_schedules__workers_hours_off_tick_by_the_database_clock(processes: Processes) -> None:
    since = database_now(connection.alias).timestamp()
    skewed = [
        start(processes, f"skewed{n}", EVERY_SECOND, "faketime", "-f", offset)
        for n, offset in enumerate(["+5h", "-3h"])
    ]
    settled_ticks(6)
    stop(*skewed)

    assert_one_job_per_tick()
    assert_ticks_follow_the_database_clock(since)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@SKEWED_CLOCKS[0]
@SKEWED_CLOCKS[1]
def test_schedules__watchers_hours_off_tick_by_the_database_clock(processes: Processes) -> None:
    since = database_now(connection.alias).timestamp()
    # Only the skewed watchers enqueue; a worker without schedules runs the jobs.
    runner = start(processes, "runner", {})
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(EVERY_SECOND))
    for offset in ["+5h", "-3h", "+5h", "-3h"]:
        wait_for_database_clock(1)  # a new tick for each pass
        watcher = processes.manage(
            "watch_stuck_jobs", "--once", "-v", "2", env=env, prefix=["faketime", "-f", offset]
        )
        out, _ = watcher.communicate(timeout=60)
        assert watcher.returncode == 0 and "enqueued schedule=beat" in out, out
    wait_for(
        lambda: (
            not PaymentJob.objects.filter(kind="noop").exclude(status=Status.COMPLETED).exists()
        ),
        timeout=30,
    )
    stop(runner)

    assert len(set(ticks())) == len(ticks()) >= 4
    assert set(JobAttempt.objects.values_list("owner", "outcome")) == {("runner", "completed")}
    assert_ticks_follow_the_database_clock(since)


def wait_for_database_clock(seconds: float) -> None:
    start = database_now(connection.alias)
    wait_for(
        lambda: database_now(connection.alias) >= start + timedelta(seconds=seconds),
        timeout=seconds + 30,
        interval=0.2,
    )


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("catch_up", [True, False])
def test_schedules__ticks_missed_while_nothing_ran_are_caught_up_once_or_skipped(
    processes: Processes, catch_up: bool
) -> None:
    settings = {"SCHEDULES": {"beat": {"kind": "noop", "every": 1, "catch_up": catch_up}}}
    first = start(processes, "first", settings)
    settled_ticks(1)
    stop(first)
    before = ticks()
    wait_for_database_clock(4)  # nothing runs for four ticks or more

    later = start(processes, "later", settings)
    settled_ticks(len(before) + 3)
    [out] = stop(later)

    after = ticks()[len(before) :]
    late = re.findall(r"enqueued schedule=beat tick=(\d+) job_id=\d+ kind=noop late=True", out)
    if catch_up:
        # The gap's latest tick was enqueued once, late, by the first pass of the later worker;
        # the ticks before it were skipped all the same.
        assert after == list(range(after[0], after[-1] + 1))
        assert late[0] == str(after[0]) and after[0] - before[-1] - 1 >= 2, (before, after, out)
    else:
        assert late == [] and after[0] - before[-1] - 1 >= 3, (before, after, out)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_schedules__a_removed_schedule_stops_enqueueing(processes: Processes) -> None:
    first = start(processes, "first", EVERY_SECOND)
    settled_ticks(2)
    stop(first)
    before = ticks()

    # A job due in four seconds: when the worker has run it, four ticks have passed under it.
    marker = PaymentJob.objects.enqueue("noop", run_at=4)
    later = start(processes, "later", {"SCHEDULES": {}})
    wait_for(lambda: PaymentJob.objects.get(pk=marker.pk).status == Status.COMPLETED, timeout=60)
    stop(later)

    assert ticks() == before
    assert PaymentJob.objects.get(pk=marker.pk).lease_owner == "later"
