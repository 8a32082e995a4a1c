"""Periodic jobs: `DJANGO_LEASES["SCHEDULES"]`, exactly one job per tick by the database clock.

Tick `n` of a schedule run `every` seconds is the span from `n * every` to `(n + 1) * every`
seconds of the database clock's Unix time. Each schedule (per job table) has a row of its own,
`ScheduleState`, holding its series (its `every`, or `cron` and `tz`) and the last tick it
enqueued. A process enqueues tick `n` only if its conditional UPDATE moved that row from the
tick it read to `n`, in the transaction that enqueues the job: of racing workers, watchers and
hosts exactly one does, and pruning the jobs takes nothing from the row, so a tick never runs
twice. The job also carries an idempotency key, `schedule:<name>:<n>:<mac>`, to find it by: the
MAC (an HMAC of the name, series and tick under SECRET_KEY) keeps other code from taking a
future tick's key in advance. Workers enqueue due ticks from their loop (a `Ticker`: one
database clock read per tick boundary), the watcher on each pass (`enqueue_due()`).

A tick after the row's that is not the current one was missed (no process looked during its
whole span). With `catch_up` (the default) the latest missed tick is enqueued once, late,
whatever the number missed; without, missed ticks are skipped. The current tick is enqueued,
late or not. A schedule without a row, or whose row holds another series (its `every`, `cron`
or `tz` was edited, or rolled back), starts a new series at its next tick: the row moves to the
current tick without a job, so an edit never enqueues a tick before it. A clock that went back
enqueues nothing until it passes the row's tick again.

A schedule given `cron` (and `tz`, default UTC) instead of `every` has fire times instead of
ticks, numbered by their Unix seconds: the same row, compare-and-set and catch-up, the latest
fire time at or before the database clock's now being the current one. cronsim parses the
expression and walks the local calendar; each local time it matches fires once: a repeated one
(the clocks go back) at its first pass, one skipped by a gap (the clocks go forward) at the end
of the gap, where the gap's other skipped times and the gap's end itself fire with it, once.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError
from django.db import DatabaseError
from django.utils.crypto import salted_hmac

from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import InvalidArgument
from django_leases.limits import shown
from django_leases.outages import is_outage
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.base import database_now
from django_leases.querysets.schedules import CRON_LENGTH, Recorded, Series
from django_leases.tables import leased_jobs, schedule_states

logger = logging.getLogger("django_leases.schedules")

SCHEDULE_KEYS = ("kind", "every", "cron", "tz", "payload", "catch_up")
# Minute, hour, day of month, month, day of week: cronsim's optional sixth field (seconds) is
# for `every`.
CRON_FIELDS = 5
# Room for "schedule:<name>:<tick>:<mac>" within the 255 characters of an idempotency key.
SCHEDULE_NAME_LENGTH = 100
KEY_SALT = "django_leases.schedules.key"
# Hex digits of the key's MAC: 128 bits, not to be guessed.
MAC_LENGTH = 32
# The longest request of `run_now()`: its key stays within 255 characters.
REQUEST_LENGTH = 64
# Shortest period: each tick is a row and a wake-up of every worker.
MIN_EVERY = 1.0
# Spreads the workers that wake up at one tick boundary, so that the first one's INSERT is
# usually seen by the others' look-up instead of racing it (the unique index settles the rest).
BOUNDARY_SPREAD = 0.2
# Times one pass reads a schedule's row again after another process moved it first: enough for
# processes whose passes began in different ticks; a later pass takes over after that.
RACES = 3


@dataclass(frozen=True)
class Schedule:
    """One entry of `DJANGO_LEASES["SCHEDULES"]`: ticks of `every` seconds, or the fire times
    of `cron` in `tz` (`every` 0.0 then; `cron` and `tz` empty for ticks).

    Either way each tick is an integer, its jobs keyed by it: the tick's index, or the fire
    time's Unix seconds.
    """

    name: str
    kind: str
    payload: Any
    catch_up: bool
    every: float = 0.0
    cron: str = ""
    tz: str = ""

    @classmethod
    def from_setting(cls, name: str, entry: dict[str, Any]) -> Schedule:
        common = {
            "name": name,
            "kind": entry["kind"],
            "payload": entry.get("payload"),
            "catch_up": entry.get("catch_up", True),
        }
        if "cron" in entry:
            # One spelling per expression: extra spaces or lower-case names start no new series.
            cron = " ".join(entry["cron"].upper().split())
            return cls(**common, cron=cron, tz=entry.get("tz", "UTC"))
        return cls(**common, every=to_seconds(entry["every"], f"SCHEDULES[{name!r}]['every']"))

    @property
    def series(self) -> Series:
        """What its state row records: a new period, expression or time zone is a new series."""
        return (self.name, self.every, self.cron, self.tz)

    def key(self, tick: int) -> str:
        """Return the idempotency key of the tick's job: stable across the processes and hosts
        of one project (one SECRET_KEY), not derivable without it."""
        message = f"{self.name}|{self.every!r}|{self.cron}|{self.tz}|{tick}"
        mac = salted_hmac(KEY_SALT, message, algorithm="sha256").hexdigest()[:MAC_LENGTH]
        return f"schedule:{self.name}:{tick}:{mac}"

    def tick(self, epoch: float) -> int | None:
        """Return the tick current at `epoch` (Unix seconds): the one containing it, or the
        latest fire time at or before it (None if the expression matched none in 50 years)."""
        if not self.cron:
            return math.floor(epoch / self.every)
        second = math.floor(epoch)
        back = CronSim(self.cron, self._local(second + 1), reverse=True)
        latest = next((fire for fire in map(self._instant, back) if fire <= second), None)
        if latest is None:
            return None
        # Walking back in local time meets a repeated hour's first pass only after its second:
        # the forward walk, which defines the fire times, settles which one is the latest.
        for fire in self.fires_after(latest):
            if fire > second:
                break
            latest = fire
        return latest

    def previous(self, tick: int) -> int | None:
        """Return the tick before `tick` (None if there was none in 50 years)."""
        return self.tick(tick - 1) if self.cron else tick - 1

    def boundary(self, epoch: float) -> float:
        """Return the Unix seconds at which the tick after the one current at `epoch` begins
        (`math.inf` if none does)."""
        if not self.cron:
            return (math.floor(epoch / self.every) + 1) * self.every
        return float(next(self.fires_after(math.floor(epoch)), math.inf))

    def fires_after(self, second: int) -> Iterator[int]:
        """Yield a cron schedule's fire times after `second` (Unix seconds), in order, once each."""
        last = second
        for fire in map(self._instant, CronSim(self.cron, self._local(second))):
            # A gap's local times all fire at its end; a start in a repeated hour's second
            # pass meets local times whose first pass is already over.
            if fire > last:
                last = fire
                yield fire

    def _local(self, second: int) -> datetime:
        """Return the local wall time of `second`, naive: cronsim walks local calendar time."""
        return datetime.fromtimestamp(second, self.zone).replace(tzinfo=None)

    def _instant(self, local: datetime) -> int:
        """Return the Unix seconds a matching local time fires at: a repeated one at its first
        pass (fold 0), one skipped by a gap at the gap's end (the first minute that exists)."""
        when = local.replace(tzinfo=self.zone)
        # Aware datetimes of one zone compare by wall time: a skipped time comes back moved.
        while when != when.astimezone(UTC).astimezone(self.zone):
            when += timedelta(minutes=1)
        return int(when.timestamp())

    def start(self, tick: int) -> datetime:
        """Return the tick's start (its jobs' `run_at`): the fire time itself for cron."""
        return datetime.fromtimestamp(tick if self.cron else tick * self.every, tz=UTC)

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)


def cron_problem(cron: Any) -> str:
    """Return what is wrong with a cron expression of `SCHEDULES` ("" for nothing)."""
    if not isinstance(cron, str) or not 0 < len(cron) <= CRON_LENGTH:
        return f"must be a string of 1-{CRON_LENGTH} characters, got {shown(cron)}"
    if len(cron.split()) != CRON_FIELDS:
        return f"must have {CRON_FIELDS} fields, got {len(cron.split())} in {cron!r}"
    try:
        next(CronSim(cron, datetime.now(UTC).replace(tzinfo=None)))
    except CronSimError as exc:
        return f"is not a valid cron expression ({str(exc).lower()}): {cron!r}"
    except StopIteration:
        return f"matches no time in the next 50 years: {cron!r}"
    return ""


def configured() -> list[Schedule]:
    """Return the schedules of the settings (the system checks validate them)."""
    entries: dict[str, dict[str, Any]] = leases_settings.SCHEDULES
    return [Schedule.from_setting(name, entry) for name, entry in sorted(entries.items())]


@dataclass(frozen=True)
class Upcoming:
    """A schedule as the admin's overview shows it."""

    schedule: Schedule
    next_at: datetime | None
    """When its next tick begins (its next fire time), by the database clock; None for never."""
    last_job: Any | None
    """The job of the last tick its row records; None if none was enqueued, or it was pruned."""
    last_at: datetime | None
    """That tick's start, whatever became of its job."""


def upcoming(jobs: LeaseQuerySet[Any]) -> list[Upcoming]:
    """Return each schedule's next tick and last job on `jobs`' table, in three queries (the
    clock, the state rows, the jobs by key), none without schedules."""
    schedules = configured()
    if not schedules:
        return []
    epoch = database_now(jobs.db).timestamp()
    recorded = schedule_states(jobs.db).recorded(jobs.model, [s.name for s in schedules])
    last = {s.name: _last_enqueued(s, recorded.get(s.name)) for s in schedules}
    keys = {s.name: s.key(tick) for s in schedules if (tick := last[s.name]) is not None}
    found = {job.idempotency_key: job for job in jobs.filter(idempotency_key__in=keys.values())}
    shown = []
    for schedule in schedules:
        boundary = schedule.boundary(epoch)
        tick = last[schedule.name]
        shown.append(
            Upcoming(
                schedule=schedule,
                next_at=None if math.isinf(boundary) else datetime.fromtimestamp(boundary, UTC),
                last_job=found.get(keys.get(schedule.name, "")),
                last_at=None if tick is None else schedule.start(tick),
            )
        )
    return shown


def run_now(
    name: str,
    *,
    by: str,
    request: str | None = None,
    model: type[Any] | None = None,
    using: str | None = None,
) -> Any:
    """Enqueue the job of schedule `name` at once, outside its ticks, and record who asked (a
    `run_now` operator event); return the job. The schedule's own ticks go on as before.

    The job's idempotency key is `schedule:<name>:now:<request>`, apart from every tick's:
    the same `request` again returns the job it enqueued and records nothing; without one, a
    random request is made up. An unknown schedule, or a request longer than
    REQUEST_LENGTH, raises `InvalidArgument` and enqueues nothing.
    """
    schedule = next((s for s in configured() if s.name == name), None)
    if schedule is None:
        raise InvalidArgument(f"no schedule is named {shown(name)} in DJANGO_LEASES['SCHEDULES']")
    request = secrets.token_hex(8) if request is None else request
    if not request or len(request) > REQUEST_LENGTH:
        raise InvalidArgument(
            f"a run's request must be 1 to {REQUEST_LENGTH} characters, got {shown(request)}"
        )
    return leased_jobs(model, using).enqueue_now(
        schedule.kind,
        schedule.payload,
        key=f"schedule:{name}:now:{request}",
        by=by,
        reason=f"schedule {name}",
    )


def _last_enqueued(schedule: Schedule, recorded: Recorded | None) -> int | None:
    """Return the last tick `schedule`'s series enqueued a job for, by its row (None: none)."""
    if recorded is None or recorded.series != schedule.series:
        return None  # new or edited: its series has not begun
    if recorded.last_tick == recorded.start_tick:
        return None  # the tick the series started at, covered without a job
    return recorded.last_tick


def enqueue_due(using: str | None = None, *, model: type[Any] | None = None) -> list[Any]:
    """Enqueue the job of each schedule's current tick (and of a missed one) not enqueued yet.

    Returns the jobs this call enqueued; a process racing it enqueues none of them.
    """
    return _enqueue_due(model, using)[0]


class Ticker:
    """Enqueue due ticks from a loop, reading the database clock only when a tick may be due."""

    def __init__(self, *, model: type[Any] | None = None, using: str | None = None) -> None:
        self.model = model
        self.using = using
        self.next_check = 0.0 if leases_settings.SCHEDULES else math.inf
        """Monotonic time of the next tick boundary; `math.inf` without schedules."""

    def poll(self) -> list[Any]:
        """Enqueue what is due if a tick boundary has passed; return the jobs enqueued."""
        if time.monotonic() < self.next_check:
            return []
        try:
            jobs, wait = _enqueue_due(self.model, self.using)
        except DatabaseError as exc:
            if not is_outage(exc, leased_jobs(self.model, self.using).db):
                raise
            # The claim that follows meets the same outage and backs off; look again soon.
            logger.warning("could not enqueue periodic jobs: %s", type(exc).__name__)
            self.next_check = time.monotonic() + 1.0
            return []
        spread = random.uniform(0, min(BOUNDARY_SPREAD, wait / 10))  # noqa: S311 - not a secret
        self.next_check = time.monotonic() + wait + spread
        return jobs


def _enqueue_due(model: type[Any] | None, using: str | None) -> tuple[list[Any], float]:
    """Enqueue the due ticks; return their jobs and the seconds until the next boundary."""
    schedules = configured()
    if not schedules:
        return [], math.inf
    jobs = leased_jobs(model, using)
    # On the job table's database: a state row commits with its ticks' jobs.
    states = schedule_states(jobs.db)
    epoch = database_now(jobs.db).timestamp()
    # Most passes find every schedule at its current tick already: one indexed look-up.
    recorded = states.recorded(jobs.model, [s.name for s in schedules])
    enqueued = []
    for schedule in schedules:
        tick = schedule.tick(epoch)
        if tick is not None:
            enqueued += _enqueue_schedule(schedule, tick, recorded.get(schedule.name), jobs)
    wait = min(s.boundary(epoch) for s in schedules) - epoch
    return enqueued, wait


def _enqueue_schedule(
    schedule: Schedule, tick: int, seen: Recorded | None, jobs: LeaseQuerySet[Any]
) -> list[Any]:
    """Enqueue `schedule`'s due ticks, current `tick`, if this process moves its state row from
    `seen` (what it read, None for no row); return the jobs."""
    states = schedule_states(jobs.db)
    for _ in range(RACES):
        if seen is None or seen.series != schedule.series:
            # New, edited or rolled back: the series starts at its next tick. The current one
            # is covered without a job, or a deploy would run a tick before the edit that the
            # previous definition had not (a second settlement today, last Friday's again).
            enqueue = partial(_start_series, schedule, seen, tick)
        elif seen.last_tick >= tick:
            # Enqueued already, or the clock went back: a tick is never enqueued twice.
            return []
        else:
            due = [tick]
            missed = schedule.previous(tick) if schedule.catch_up else None
            if missed is not None and missed > seen.last_tick:
                due = [missed, tick]
            enqueue = partial(_enqueue_ticks, schedule, due, tick, jobs)
        done = states.advance(jobs.model, schedule.series, seen=seen, to=tick, enqueue=enqueue)
        if done is not None:
            return done
        # Another process moved the row first, most often to this same tick.
        seen = states.recorded(jobs.model, [schedule.name]).get(schedule.name)
    return []


def _start_series(schedule: Schedule, seen: Recorded | None, tick: int) -> list[Any]:
    """Log the start of `schedule`'s series after `tick`; enqueue nothing."""
    logger.info(
        "schedule=%s starts at its next tick: tick=%s covered without a job (%s)",
        schedule.name,
        tick,
        "new" if seen is None else f"edited, was {_described(seen.series)}",
    )
    return []


def _described(series: Series) -> str:
    _, every, cron, tz = series
    return f"cron {cron!r} in {tz}" if cron else f"every {every:g} s"


def _enqueue_ticks(
    schedule: Schedule, due: list[int], current: int, jobs: LeaseQuerySet[Any]
) -> list[Any]:
    enqueued = []
    for tick in due:
        key = schedule.key(tick)
        # This process moved the row past the tick: a job already under its key was enqueued
        # by other code, which a tick must not be skipped for. It gets a key of its own, which
        # no one could know in advance.
        taken = jobs.filter(idempotency_key=key).values_list("pk", flat=True).first()
        if taken is not None:
            logger.error(
                "schedule=%s tick=%s: its key is taken by job_id=%s, which the schedule did not "
                "enqueue; the tick's job gets a random key",
                schedule.name,
                tick,
                taken,
            )
            key = f"schedule:{schedule.name}:{tick}:{secrets.token_hex(MAC_LENGTH // 2)}"
        job = jobs.enqueue(
            schedule.kind, schedule.payload, idempotency_key=key, run_at=schedule.start(tick)
        )
        logger.info(
            "enqueued schedule=%s tick=%s job_id=%s kind=%s late=%s",
            schedule.name,
            tick,
            job.pk,
            schedule.kind,
            tick < current,
        )
        enqueued.append(job)
    return enqueued
