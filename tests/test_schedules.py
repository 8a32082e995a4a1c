"""Periodic jobs: one job per tick of the database clock, whatever the number of processes."""

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.db.migrations.executor import MigrationExecutor
from django.test import override_settings
from django.utils import timezone

from django_leases.exceptions import InvalidArgument
from django_leases.models import JobAttempt, JobEvent, PaymentJob, ScheduleState, Worker
from django_leases.schedules import (
    Schedule,
    Ticker,
    configured,
    database_now,
    enqueue_due,
    run_now,
)
from django_leases.watcher import StuckWatcher

from .conftest import ON_SQLITE, Processes, subprocess_env, wait_for
from .ticking import (
    DatabaseClock,
    begin,
    database_clock,
    moved,
    prune_finished,
    run,
    tick_of,
    ticks_pass,
)

Status = PaymentJob.Status
# Ticks of about 115 days: no test here runs across a boundary by chance.
LONG = {"kind": "noop", "every": 10**7}
# Fire times a year apart (in local time), for the same.
YEARLY = {"kind": "noop", "cron": "0 0 1 1 *", "tz": "Europe/Berlin"}
EVERY_KIND = pytest.mark.parametrize("entry", [LONG, YEARLY], ids=["every", "cron"])


def schedules(**entries: object) -> override_settings:
    return override_settings(DJANGO_LEASES={"SCHEDULES": entries})


def earlier(schedule: Schedule, tick: int, count: int = 1) -> int:
    return moved(schedule, tick, count)


def ticks(name: str = "beat") -> list[int]:
    """Return the tick of every job of schedule `name`, in order."""
    keys = PaymentJob.objects.filter(idempotency_key__startswith=f"schedule:{name}:")
    return sorted(tick_of(key) for key in keys.values_list("idempotency_key", flat=True))


def current_tick(schedule: Schedule) -> int:
    tick = schedule.tick(database_now(connection.alias).timestamp())
    assert tick is not None
    return tick


# ---- one pass -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_due__enqueues_the_current_tick_once() -> None:
    with schedules(beat={**LONG, "payload": {"report": "daily"}}):
        [schedule] = configured()
        tick = current_tick(schedule)
        begin()
        [job] = enqueue_due()
        assert enqueue_due() == []
        assert StuckWatcher().run_once() == []
    assert PaymentJob.objects.count() == 1
    assert re.fullmatch(rf"schedule:beat:{tick}:[0-9a-f]{{32}}", job.idempotency_key)
    assert job.idempotency_key == schedule.key(tick)
    assert (job.kind, job.payload, job.status) == ("noop", {"report": "daily"}, Status.PENDING)
    # Due at once: the tick started before now, by the database clock.
    assert job.run_at == schedule.start(tick) <= database_now(connection.alias)


@pytest.mark.django_db
def test_enqueue_due__accepts_a_timedelta_and_keys_by_period() -> None:
    with schedules(beat={"kind": "noop", "every": timedelta(days=200)}):
        [schedule] = configured()
        begin()
        [job] = enqueue_due()
    assert schedule.every == 200 * 86400.0
    assert job.idempotency_key == schedule.key(current_tick(schedule))
    assert Schedule("beat", "noop", None, True, every=10**7).key(current_tick(schedule)) != (
        job.idempotency_key
    )


@pytest.mark.django_db
@EVERY_KIND
@pytest.mark.parametrize("catch_up", [True, False])
def test_enqueue_due__missed_ticks_are_caught_up_once_or_skipped(
    entry: dict[str, object], catch_up: bool
) -> None:
    with schedules(beat={**entry, "catch_up": catch_up}):
        [schedule] = configured()
        tick = current_tick(schedule)
        begin()
        enqueue_due()
        # The schedule last ran five ticks ago; nothing ran during the four ticks since.
        ticks_pass(schedule, 5)
        jobs = enqueue_due()
        assert enqueue_due() == []
    caught_up = [earlier(schedule, tick)] if catch_up else []
    assert [job.idempotency_key for job in jobs] == [schedule.key(t) for t in [*caught_up, tick]]
    assert ticks() == [earlier(schedule, tick, 5), *caught_up, tick]
    assert ScheduleState.objects.get().last_tick == tick
    assert [job.run_at for job in jobs] == [schedule.start(t) for t in [*caught_up, tick]]


@pytest.mark.django_db
def test_enqueue_due__a_new_edited_or_rolled_back_schedule_starts_at_its_next_tick() -> None:
    """A period edited between ticks, a schedule added, then the edit rolled back: none of them
    enqueues a tick that began before it (the rolled-back series' missed ticks included), and
    each enqueues its next tick once it comes."""
    with schedules(beat=LONG):
        [old] = configured()
        tick = current_tick(old)
        begin()
        enqueue_due()
        ticks_pass(old, 3)  # its last job three ticks back; the ticks since missed
    with schedules(beat={**LONG, "every": 2 * 10**7}, fresh=LONG):
        assert enqueue_due() == []
        assert enqueue_due() == []
    with schedules(beat=LONG, fresh=LONG):
        [_, fresh] = configured()
        assert enqueue_due() == []
        assert ticks() == [tick - 3]
        # One row per schedule, at the tick its series started at (covered without a job).
        assert sorted(
            ScheduleState.objects.values_list("name", "every", "last_tick", "start_tick")
        ) == [("beat", 10**7, tick, tick), ("fresh", 10**7, tick, tick)]
        ticks_pass(old, 1)
        ticks_pass(fresh, 1)
        jobs = enqueue_due()
        assert enqueue_due() == []
    assert [job.idempotency_key for job in jobs] == [old.key(tick), fresh.key(tick)]
    assert ticks() == [tick - 4, tick]


@pytest.mark.django_db
def test_enqueue_due__a_tick_enqueued_under_the_old_key_is_not_enqueued_again() -> None:
    """The deploy that changes the keys: a tick the previous release enqueued (its row at the
    tick, its job under `schedule:<name>:<every>:<tick>`) gets no second job under the new key;
    the next tick gets one, under the new key."""
    with schedules(beat=LONG):
        [schedule] = configured()
        tick = current_tick(schedule)
        ScheduleState.objects.create(
            job_model="django_leases.paymentjob", name="beat", every=10**7, last_tick=tick
        )
        old = PaymentJob.objects.enqueue("noop", idempotency_key=f"schedule:beat:10000000:{tick}")
        assert enqueue_due() == []
        ScheduleState.objects.update(last_tick=tick - 1)  # as if the next tick had begun
        PaymentJob.objects.filter(pk=old.pk).update(
            idempotency_key=f"schedule:beat:10000000:{tick - 1}"
        )
        [job] = enqueue_due()
    assert job.idempotency_key == schedule.key(tick)
    assert PaymentJob.objects.count() == 2


@pytest.mark.django_db
def test_enqueue_due__a_key_taken_in_advance_skips_no_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Other code that enqueued a job under a tick's key (knowing SECRET_KEY: without it the
    key cannot be derived) does not make the schedule skip the tick: the tick gets its own job,
    under a random key, and an error names the job that took the key."""
    with schedules(beat=LONG):
        [schedule] = configured()
        tick = current_tick(schedule)
        begin()
        squatter = PaymentJob.objects.enqueue("other", {"x": 1}, idempotency_key=schedule.key(tick))
        with override_settings(SECRET_KEY="another project's secret"):  # noqa: S106 - a test key
            assert schedule.key(tick) != squatter.idempotency_key
        [job] = enqueue_due()
        assert enqueue_due() == []
    assert job.pk != squatter.pk and job.kind == "noop"
    assert re.fullmatch(rf"schedule:beat:{tick}:[0-9a-f]{{32}}", job.idempotency_key)
    assert job.idempotency_key != schedule.key(tick)
    assert PaymentJob.objects.filter(pk=squatter.pk, kind="other").exists()
    assert f"its key is taken by job_id={squatter.pk}" in caplog.text


@pytest.mark.django_db
@EVERY_KIND
@pytest.mark.parametrize("catch_up", [True, False])
def test_enqueue_due__a_pruned_tick_is_never_enqueued_again(
    entry: dict[str, object], catch_up: bool
) -> None:
    """Each tick runs and is pruned before the next one (RETENTION["completed"] shorter than
    `every`), beside a failed tick's job that stays: every tick is enqueued exactly once."""
    with schedules(beat={**entry, "catch_up": catch_up}):
        [schedule] = configured()
        first = current_tick(schedule)
        begin()
        [failed] = enqueue_due()
        run(failed, fail=True)
        for _ in range(5):
            ticks_pass(schedule, 1)
            # Only the new current tick: not the one before it, whose job was pruned.
            jobs = enqueue_due()
            assert [job.idempotency_key for job in jobs] == [schedule.key(first)]
            run(jobs[0])
            assert prune_finished() == {"completed": 1}
            assert enqueue_due() == []
    # Of the six ticks' jobs only the failed one is left, five ticks back.
    assert ticks() == [earlier(schedule, first, 5)]


@pytest.mark.django_db
@EVERY_KIND
def test_enqueue_due__a_clock_that_goes_back_enqueues_nothing_again(
    entry: dict[str, object],
) -> None:
    with schedules(beat=entry):
        [schedule] = configured()
        tick = current_tick(schedule)
        begin()
        [job] = enqueue_due()
        run(job)
        prune_finished()
        # The database clock is set back two ticks: as if the row had been written in the future.
        ticks_pass(schedule, -2)
        assert enqueue_due() == []
    assert PaymentJob.objects.count() == 0
    assert ScheduleState.objects.get().last_tick == earlier(schedule, tick, -2)


@pytest.mark.django_db
def test_enqueue_due__a_removed_schedule_enqueues_nothing() -> None:
    with schedules(beat=LONG, other=LONG):
        begin()
        assert len(enqueue_due()) == 2
    with schedules(other=LONG):
        assert enqueue_due() == []
    with schedules():
        assert enqueue_due() == []
        assert Ticker().poll() == []
    assert PaymentJob.objects.count() == 2


BEFORE_PER_NAME = ("django_leases", "0012_ledger_without_open_index")


@pytest.mark.django_db(transaction=True)
def test_migration_0013__keeps_each_schedules_latest_series_and_enqueues_no_tick_again() -> None:
    """The rows of a release with one row per series (an edit left the old one behind): each
    schedule keeps the row its current series moved last, which goes on without enqueueing a
    tick the previous release enqueued (under its old key), and catches up what it missed."""
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_leases")
    with schedules(beat=LONG):
        [beat] = configured()
        tick = current_tick(beat)
    model = "django_leases.paymentjob"
    try:
        executor.migrate([BEFORE_PER_NAME])
        old = MigrationExecutor(connection).loader.project_state(BEFORE_PER_NAME).apps
        states = old.get_model("django_leases", "ScheduleState").objects
        month_ago = timezone.now() - timedelta(days=30)
        states.create(job_model=model, name="beat", every=2e7, last_tick=0, enqueued_at=month_ago)
        states.create(job_model=model, name="beat", every=1e7, last_tick=tick)
        states.create(job_model=model, name="other", every=1e7, last_tick=tick - 2)
        old.get_model("django_leases", "PaymentJob").objects.create(
            kind="noop", idempotency_key=f"schedule:beat:10000000:{tick}"
        )
        MigrationExecutor(connection).migrate(latest)
        assert sorted(ScheduleState.objects.values_list("name", "every", "last_tick")) == [
            ("beat", 1e7, tick),
            ("other", 1e7, tick - 2),
        ]
        with schedules(beat=LONG, other=LONG):
            [_, other] = configured()
            jobs = enqueue_due()
        assert [job.idempotency_key for job in jobs] == [other.key(tick - 1), other.key(tick)]
        # Back and forth: one row per schedule fits the older constraint too.
        MigrationExecutor(connection).migrate([BEFORE_PER_NAME])
    finally:
        MigrationExecutor(connection).migrate(latest)
    assert ScheduleState.objects.count() == 2 and PaymentJob.objects.count() == 3


# Each test schedule edited: another period, or another zone.
EDITED = {"every": {**LONG, "every": 2 * 10**7}, "cron": {**YEARLY, "tz": "Europe/London"}}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@EVERY_KIND
def test_enqueue_due__six_schedulers_racing_for_each_tick_enqueue_it_once(
    entry: dict[str, object],
) -> None:
    """Six schedulers (threads, each with its own connection) pass at the same instant, tick
    after tick, the last tick's job pruned before each, the schedule edited in round 3 and
    rolled back in round 5: one job per tick of each series, from one of them, and none in the
    round of an edit."""
    rounds, count = 9, 6
    together = threading.Barrier(count + 1)
    won: list[list[str]] = [[] for _ in range(count)]
    failures: list[BaseException] = []

    def scheduler(n: int) -> None:
        try:
            for _ in range(rounds):
                together.wait(timeout=60)  # all pass at once
                won[n] += [job.idempotency_key for job in enqueue_due()]
                together.wait(timeout=60)  # the tick is checked, run, pruned; time passes
        except BaseException as exc:
            failures.append(exc)
            together.abort()
        finally:
            connections.close_all()

    edited = EDITED["cron" if "cron" in entry else "every"]
    definitions = [entry] * 3 + [edited] * 2 + [entry] * 4
    with schedules(beat=entry):
        [schedule] = configured()
        first = current_tick(schedule)
        begin()
    with schedules(beat=edited):
        [other] = configured()
        other_first = current_tick(other)
    settings = schedules(beat=entry)
    settings.enable()
    threads = [threading.Thread(target=scheduler, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    per_round = []
    try:
        for number, definition in enumerate(definitions):
            if number and definition != definitions[number - 1]:
                settings.disable()  # an edit, or its rollback, between two ticks
                settings = schedules(beat=definition)
                settings.enable()
            together.wait(timeout=60)
            together.wait(timeout=60)
            per_round.append(sorted(sum(won, [])))
            for keys in won:
                keys.clear()
            # The first tick's job fails and stays (kept 30 days); the others are pruned.
            for job in PaymentJob.objects.filter(status=Status.PENDING):
                run(job, fail=number == 0)
            prune_finished()
            ticks_pass(configured()[0], 1)
    except threading.BrokenBarrierError:
        pass  # a scheduler failed and broke the barrier: `failures` says how
    except BaseException:
        together.abort()  # let the schedulers go
        raise
    finally:
        settings.disable()
        # No abort once every round is through: a scheduler let go by the last wait may
        # not have left it yet, and an abort then breaks the wait it already passed.
        for thread in threads:
            thread.join(timeout=60)
    assert failures == []
    assert per_round == (
        [[schedule.key(first)]] * 3
        + [[], [other.key(other_first)]]
        + [[], *[[schedule.key(first)]] * 3]
    )
    # The failed job of round 0, moved back by the seven ticks that passed for its series.
    assert ticks() == [earlier(schedule, first, 7)]


@pytest.mark.django_db
def test_ticker__reads_the_clock_once_per_tick(django_assert_num_queries: object) -> None:
    with schedules(beat=LONG):
        begin()
        ticker = Ticker()
        [job] = ticker.poll()
        # The next boundary is months away: the loop's later passes ask the database nothing.
        with django_assert_num_queries(0):  # type: ignore[operator]
            assert ticker.poll() == []
        assert 0 < ticker.next_check < float("inf")
    with schedules():
        assert Ticker().next_check == float("inf")
    assert PaymentJob.objects.get() == job


# ---- cron schedules: local time, DST ---------------------------------------------------------

DAILY = {"kind": "noop", "cron": "30 2 * * *", "tz": "Europe/Berlin"}
HALF_HOURLY = {"kind": "noop", "cron": "*/30 * * * *", "tz": "Europe/Berlin"}


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def walk(clock: DatabaseClock, start: str, end: str) -> list[tuple[datetime, datetime]]:
    """Move the database clock from `start` to `end` in steps of ten minutes, a scheduler
    passing at each; return (the clock, the job's `run_at`) of each job the walk enqueued."""
    enqueued = []
    moment = utc(start)
    while moment <= utc(end):
        clock.set(moment)
        enqueued += [(moment, job.run_at) for job in enqueue_due()]
        moment += timedelta(minutes=10)
    return enqueued


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
@pytest.mark.parametrize(
    ("entry", "start", "end", "fires"),
    [
        # 2027-03-28, 02:00 CET becomes 03:00 CEST: 02:30 fires once, at the gap's end.
        (DAILY, "2027-03-27 12:00", "2027-03-29 12:00", ["2027-03-28 01:00", "2027-03-29 00:30"]),
        # 2027-10-31, 03:00 CEST becomes 02:00 CET: 02:30 comes twice, fires at the first.
        (DAILY, "2027-10-30 12:00", "2027-11-01 12:00", ["2027-10-31 00:30", "2027-11-01 01:30"]),
        # The gap's 02:00 and 02:30 fire with 03:00, once.
        (
            HALF_HOURLY,
            "2027-03-27 23:10",
            "2027-03-28 02:00",
            ["2027-03-27 23:30", "2027-03-28 00:00", "2027-03-28 00:30", "2027-03-28 01:00"]
            + ["2027-03-28 01:30", "2027-03-28 02:00"],
        ),
        # The repeated hour's 02:00 and 02:30 fire in its first pass only.
        (
            HALF_HOURLY,
            "2027-10-30 23:10",
            "2027-10-31 02:30",
            ["2027-10-30 23:30", "2027-10-31 00:00", "2027-10-31 00:30", "2027-10-31 02:00"]
            + ["2027-10-31 02:30"],
        ),
    ],
    ids=["daily-spring", "daily-autumn", "half-hourly-spring", "half-hourly-autumn"],
)
def test_cron__a_local_time_skipped_or_repeated_by_dst_fires_once(
    entry: dict[str, object], start: str, end: str, fires: list[str]
) -> None:
    with schedules(beat=entry), database_clock() as clock:
        [schedule] = configured()
        enqueued = walk(clock, start, end)  # the first pass starts the series: no job
    # Each job at its fire time (the first pass at or after it), its run_at the fire time.
    assert enqueued == [(utc(fire), utc(fire)) for fire in fires]
    last = int(utc(fires[-1]).timestamp())
    assert ScheduleState.objects.get().last_tick == last
    assert PaymentJob.objects.filter(idempotency_key=schedule.key(last)).exists()


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
@pytest.mark.parametrize("catch_up", [True, False])
def test_cron__a_fire_time_missed_across_a_dst_change_is_caught_up_once(catch_up: bool) -> None:
    with schedules(beat={**DAILY, "catch_up": catch_up}), database_clock() as clock:
        clock.set(utc("2027-03-27 12:00"))
        begin()
        [saturday] = enqueue_due()
        # Nothing runs from Saturday noon to Monday noon: Sunday's 02:30 (03:00 CEST) is missed.
        clock.set(utc("2027-03-29 12:00"))
        jobs = enqueue_due()
        assert enqueue_due() == []
    late = [utc("2027-03-28 01:00")] if catch_up else []
    assert saturday.run_at == utc("2027-03-27 01:30")
    assert [job.run_at for job in jobs] == [*late, utc("2027-03-29 00:30")]


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
def test_cron__keys_name_the_fire_instant_and_series() -> None:
    weekdays = {"kind": "noop", "cron": "30 2 * * 1-5", "tz": "Europe/Berlin"}
    name = "n" * 100
    with database_clock() as clock, schedules(**{name: weekdays}):
        [berlin] = configured()
        clock.set(utc("2027-01-13 12:00"))  # a Wednesday
        begin()
        [job] = enqueue_due()
        # The same expression spelled with other spaces and case: the same series.
        with schedules(**{name: {**weekdays, "cron": " 30  2 *  * 1-5 "}}):
            assert enqueue_due() == []
    assert job.run_at == utc("2027-01-13 01:30")
    assert job.idempotency_key == berlin.key(1799803800)
    assert re.fullmatch(rf"schedule:{name}:1799803800:[0-9a-f]{{32}}", job.idempotency_key)
    assert len(job.idempotency_key) <= 255
    # Another zone or expression: another series, keyed apart (the same instant included).
    others = [{**weekdays, "tz": "America/New_York"}, {**weekdays, "cron": "30 2 * * *"}]
    for other in others:
        with schedules(**{name: other}):
            assert configured()[0].key(1799803800) != job.idempotency_key


# The schedules: a weekday settlement at 02:30 in Berlin, edited to 02:45, and a monthly
# one added mid-month.
SETTLEMENT = {"kind": "noop", "cron": "30 2 * * 1-5", "tz": "Europe/Berlin"}
EDITED_SETTLEMENT = {**SETTLEMENT, "cron": "45 2 * * 1-5"}
MONTHLY = {"kind": "noop", "cron": "0 6 1 * *", "tz": "Europe/Berlin"}


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
def test_cron__an_edit_a_rollback_or_a_new_schedule_starts_at_the_next_fire_time() -> None:
    """A settlement at 02:30 edited to 02:45 at 10:00 (today's 02:45 is not run), rolled back
    on Monday at 10:00 (neither last Friday's nor today's 02:30 is run), and a monthly schedule
    added on the 20th (the 1st's job is not run): each runs from its next fire time on, once
    per fire time (times in CET, UTC+1)."""
    steps = [
        # (the database clock, UTC; the definitions; the jobs' run_at, UTC)
        ("2027-01-12 12:00", {"settle": SETTLEMENT}, []),  # Tuesday: added
        ("2027-01-13 01:40", {"settle": SETTLEMENT}, ["2027-01-13 01:30"]),  # Wednesday
        ("2027-01-13 09:00", {"settle": EDITED_SETTLEMENT}, []),  # edited at 10:00
        ("2027-01-14 01:50", {"settle": EDITED_SETTLEMENT}, ["2027-01-14 01:45"]),
        ("2027-01-15 01:50", {"settle": EDITED_SETTLEMENT}, ["2027-01-15 01:45"]),  # Friday
        ("2027-01-18 01:50", {"settle": EDITED_SETTLEMENT}, ["2027-01-18 01:45"]),  # Monday
        ("2027-01-18 09:00", {"settle": SETTLEMENT}, []),  # rolled back at 10:00
        ("2027-01-19 01:40", {"settle": SETTLEMENT}, ["2027-01-19 01:30"]),
        # The monthly one added on the 20th (a Wednesday: the settlement's 02:30 is due).
        ("2027-01-20 09:00", {"settle": SETTLEMENT, "monthly": MONTHLY}, ["2027-01-20 01:30"]),
        ("2027-01-20 09:10", {"settle": SETTLEMENT, "monthly": MONTHLY}, []),
        # A Monday: the settlement catches its Friday up (late), the monthly one fires.
        (
            "2027-02-01 05:10",
            {"settle": SETTLEMENT, "monthly": MONTHLY},
            ["2027-01-29 01:30", "2027-02-01 01:30", "2027-02-01 05:00"],
        ),
    ]
    with database_clock() as clock:
        for moment, entries, expected in steps:
            clock.set(utc(moment))
            with schedules(**entries):
                jobs = enqueue_due()
                assert enqueue_due() == []
            assert sorted(job.run_at for job in jobs) == [utc(at) for at in expected], moment
    assert PaymentJob.objects.count() == 9
    assert sorted(ScheduleState.objects.values_list("name", "cron", "last_tick")) == [
        ("monthly", "0 6 1 * *", int(utc("2027-02-01 05:00").timestamp())),
        ("settle", "30 2 * * 1-5", int(utc("2027-02-01 01:30").timestamp())),
    ]


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
def test_ticker__waits_until_the_next_fire_time() -> None:
    with schedules(beat=DAILY), database_clock() as clock:
        clock.set(utc("2027-01-13 12:00"))
        begin()
        ticker = Ticker()
        before = time.monotonic()
        [job] = ticker.poll()
        after = time.monotonic()
    # Tomorrow's 02:30 CET is 13.5 hours away (and the spread of the boundary, 0.2 s at most).
    assert before + 13.5 * 3600 <= ticker.next_check <= after + 13.5 * 3600 + 0.2
    assert job.run_at == utc("2027-01-13 01:30")


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
@pytest.mark.slow
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
        tick = tick_of(job.idempotency_key)
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


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_schedules__ticks_pruned_as_they_finish_run_once_each(processes: Processes) -> None:
    """Two workers tick every second while each tick's job is pruned half a second after it
    completes (`RETENTION["completed"]` shorter than `every`), beside a failed tick's job kept
    for days: every tick is enqueued once and run once."""
    now = database_now(connection.alias).timestamp()
    failed = PaymentJob.objects.enqueue("noop", idempotency_key=f"schedule:beat:1:{int(now) - 60}")
    assert PaymentJob.objects.filter(pk=failed.pk).mark_failed(reason="psp down", by="op") == 1
    workers = [start(processes, f"w{n}", EVERY_SECOND) for n in range(2)]
    completed = JobAttempt.objects.filter(outcome="completed")
    pruned = 0
    while completed.count() < 6:
        # The ledger stays (job set to NULL): it counts the runs of pruned jobs.
        pruned += PaymentJob.objects.prune({"completed": 0.5}, keep_ledger=True)["completed"]
        assert database_now(connection.alias).timestamp() < now + 60, "ticks did not run"
        wait_for_database_clock(0.1)
    outputs = stop(*workers)

    logged = [
        (int(tick), int(pk))
        for out in outputs
        for tick, pk in re.findall(r"enqueued schedule=beat tick=(\d+) job_id=(\d+)", out)
    ]
    tick_numbers = [tick for tick, _ in logged]
    assert len(tick_numbers) == len(set(tick_numbers)) >= 6, sorted(logged)
    assert pruned >= 4
    # Each job ran once, and only the jobs of logged ticks ran.
    runs = list(JobAttempt.objects.values_list("job_ref", flat=True))
    assert len(runs) == len(set(runs)) and set(runs) <= {pk for _, pk in logged}
    assert PaymentJob.objects.filter(pk=failed.pk, status=Status.FAILED).exists()


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
        tick = tick_of(job.idempotency_key)
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
    # The first pass meets a new schedule, which starts at its next tick (an edit's rule).
    for offset, said in [("-3h", "starts at its next tick")] + [
        (offset, "enqueued schedule=beat") for offset in ["+5h", "-3h", "+5h", "-3h"]
    ]:
        wait_for_database_clock(1)  # a new tick for each pass
        watcher = processes.manage(
            "watch_stuck_jobs", "--once", "-v", "2", env=env, prefix=["faketime", "-f", offset]
        )
        out, _ = watcher.communicate(timeout=60)
        assert watcher.returncode == 0 and said in out, out
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
@pytest.mark.slow
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


CRON_YEARLY: dict[str, object] = {"SCHEDULES": {"beat": YEARLY}}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_cron__workers_enqueue_and_run_the_current_fire_time_once(processes: Processes) -> None:
    with schedules(beat=YEARLY):
        [schedule] = configured()
        current = current_tick(schedule)
        begin()
    workers = [start(processes, f"w{n}", CRON_YEARLY) for n in range(2)]
    # Both in the registry: their signal handlers are in place before they register.
    wait_for(lambda: Worker.objects.filter(worker_id__in=["w0", "w1"]).count() == 2, timeout=60)
    settled_ticks(1)
    stop(*workers)

    [job] = PaymentJob.objects.all()
    # This year's 1 January, 00:00 in Berlin: 23:00 UTC the day before.
    assert job.idempotency_key == schedule.key(current)
    assert job.run_at == schedule.start(current) == datetime.fromtimestamp(current, UTC)
    assert job.run_at.astimezone(schedule.zone).strftime("%m-%d %H:%M") == "01-01 00:00"
    assert job.status == Status.COMPLETED and job.attempts == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_cron__watchers_catch_up_a_missed_fire_time_once(processes: Processes) -> None:
    """Three watchers pass over a cron schedule whose row is three fire times behind: the
    missed one (late) and the current one are enqueued, once, by one of them."""
    with schedules(beat=YEARLY):
        [schedule] = configured()
        current = current_tick(schedule)
        begin()
        enqueue_due()
        ticks_pass(schedule, 3)
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(CRON_YEARLY))
    watchers = [
        processes.manage("watch_stuck_jobs", "--once", "-v", "2", env=env) for _ in range(3)
    ]
    outputs = []
    for watcher in watchers:
        out, _ = watcher.communicate(timeout=60)
        assert watcher.returncode == 0, out
        outputs.append(out)

    missed = earlier(schedule, current)
    assert ticks() == [earlier(schedule, current, 3), missed, current]
    logged = [
        re.findall(r"enqueued schedule=beat tick=(\d+) job_id=\d+ kind=noop late=(\w+)", out)
        for out in outputs
    ]
    assert sorted(sum(logged, [])) == [(str(missed), "True"), (str(current), "False")]
    assert sum(1 for lines in logged if lines) == 1, outputs


@pytest.mark.django_db
def test_schedule_state_admin__shows_the_last_tick_read_only(admin_client: Any) -> None:
    with schedules(beat=LONG):
        [schedule] = configured()
        enqueue_due()
    url = "/admin/django_leases/schedulestate/"
    response = admin_client.get(url)
    assert response.status_code == 200
    assert str(current_tick(schedule)) in response.content.decode()
    state = ScheduleState.objects.get()
    assert admin_client.get(f"{url}add/").status_code == 403
    assert admin_client.post(f"{url}{state.pk}/delete/", {"post": "yes"}).status_code == 403
    assert ScheduleState.objects.get() == state


@pytest.mark.django_db(transaction=True)  # the database clock (SQLite: see DatabaseClock)
def test_overview__shows_each_schedules_next_fire_time_and_last_job(admin_client: Any) -> None:
    url = "/admin/django_leases/paymentjob/overview/"
    with (
        schedules(hourly={"kind": "noop", "every": 3600}, nightly=DAILY),
        database_clock() as clock,
    ):
        clock.set(utc("2027-01-13 12:10"))
        assert admin_client.get(url).context["schedules"][0].last_at is None  # nothing yet
        assert enqueue_due() == []
        # Started: the ticks it covered had no job, which the overview does not call pruned.
        assert [row.last_at for row in admin_client.get(url).context["schedules"]] == [None] * 2
        for schedule in configured():
            ticks_pass(schedule, 1)
        hourly_job, nightly_job = enqueue_due()
        run(hourly_job)
        shown = {row.schedule.name: row for row in admin_client.get(url).context["schedules"]}
        page = admin_client.get(url).content.decode()
        prune_finished()
        after_prune = admin_client.get(url).content.decode()
    hourly, nightly = shown["hourly"], shown["nightly"]
    assert (hourly.next_at, hourly.last_job, hourly.last_at) == (
        utc("2027-01-13 13:00"),
        hourly_job,
        utc("2027-01-13 12:00"),
    )
    # Tomorrow's 02:30 in Berlin; the last job is today's.
    assert (nightly.next_at, nightly.last_job, nightly.last_at) == (
        utc("2027-01-14 01:30"),
        nightly_job,
        utc("2027-01-13 01:30"),
    )
    assert "<code>30 2 * * *</code> (Europe/Berlin)" in page and "every 3600 s" in page
    assert "2027-01-14 02:30 CET / 2027-01-14 01:30:00 UTC" in page
    assert f"/admin/django_leases/paymentjob/{nightly_job.pk}/change/" in page
    assert "of 2027-01-13 12:00:00 UTC, pruned" in after_prune
    assert "of 2027-01-13 12:00:00 UTC, pruned" not in page


# ---- run a schedule now ---------------------------------------------------------------------


@pytest.mark.django_db
@schedules(beat={"kind": "noop", "every": 10**7, "payload": {"report": "daily"}})
def test_run_now__enqueues_at_once_with_a_key_of_its_own_and_records_who() -> None:
    ticked = enqueue_due()  # the schedule's series starts: its current tick has no job
    first = run_now("beat", by="ops:alice", request="r1")
    again = run_now("beat", by="ops:bob", request="r1")
    other = run_now("beat", by="ops:alice")

    assert ticked == []
    assert first.pk == again.pk != other.pk
    assert (first.kind, first.payload, first.status) == ("noop", {"report": "daily"}, "pending")
    assert first.idempotency_key == "schedule:beat:now:r1"
    assert re.fullmatch(r"schedule:beat:now:[0-9a-f]{16}", other.idempotency_key)
    assert PaymentJob.objects.get(pk=first.pk).run_at <= database_now(connection.alias)
    # One event per job enqueued, naming who asked; the repeat recorded nothing.
    events = JobEvent.objects.filter(action="run_now").order_by("id")
    assert [(e.job_ref, e.by, e.reason) for e in events] == [
        (first.pk, "ops:alice", "schedule beat"),
        (other.pk, "ops:alice", "schedule beat"),
    ]
    # The schedule's own state is untouched: its ticks go on as before.
    assert (
        ScheduleState.objects.get(name="beat").start_tick
        == ScheduleState.objects.get(name="beat").last_tick
    )


@pytest.mark.django_db
@schedules(beat=LONG)
@pytest.mark.parametrize(
    ("name", "request_id", "error"),
    [
        ("nightly", None, "no schedule is named 'nightly'"),
        ("beat", "x" * 65, "a run's request must be 1 to 64 characters"),
        ("beat", "", "a run's request must be 1 to 64 characters"),
    ],
)
def test_run_now__refuses_bad_input_and_writes_nothing(
    name: str, request_id: str | None, error: str
) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(error)):
        run_now(name, by="ops", request=request_id)
    assert not PaymentJob.objects.exists() and not JobEvent.objects.exists()


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@schedules(beat=LONG)
def test_run_now__the_same_request_at_once_from_two_connections_enqueues_one_job() -> None:
    start = threading.Barrier(2)
    jobs: list[int] = []
    errors: list[BaseException] = []

    def operator() -> None:
        try:
            start.wait()
            jobs.append(run_now("beat", by="ops", request="double-click").pk)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=operator) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(jobs) == 2 and jobs[0] == jobs[1]
    assert PaymentJob.objects.count() == 1
    assert JobEvent.objects.filter(job_ref=jobs[0], action="run_now").count() == 1
