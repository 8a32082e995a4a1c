"""Periodic jobs: `DJANGO_LEASES["SCHEDULES"]`, exactly one job per tick by the database clock.

Tick `n` of a schedule run `every` seconds is the span from `n * every` to `(n + 1) * every`
seconds of the database clock's Unix time. Its job carries the idempotency key
`schedule:<name>:<every>:<n>`: whichever process enqueues it first creates it, and every other
one gets that row back (the unique index decides, see `enqueue()`), however many workers,
watchers and hosts run. Workers enqueue due ticks from their loop (a `Ticker`: one database
clock read per tick boundary), the watcher on each pass (`enqueue_due()`).

A tick whose whole span passed while no process looked is missed. With `catch_up` (the
default) the latest missed tick is enqueued once, late, whatever the number missed; without,
missed ticks are skipped. The current tick is always enqueued, late or not.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import InterfaceError, OperationalError
from django.db.models.functions import Now
from django.db.models.sql import Query

from django_leases.conf import leases_settings, to_seconds
from django_leases.querysets import leased_jobs

logger = logging.getLogger("django_leases.schedules")

SCHEDULE_KEYS = ("kind", "every", "payload", "catch_up")
# Room for "schedule:<name>:<every>:<tick>" within the 255 characters of an idempotency key.
SCHEDULE_NAME_LENGTH = 100
# Shortest period: each tick is a row and a wake-up of every worker.
MIN_EVERY = 1.0
# Spreads the workers that wake up at one tick boundary, so that the first one's INSERT is
# usually seen by the others' look-up instead of racing it (the unique index settles the rest).
BOUNDARY_SPREAD = 0.2


@dataclass(frozen=True)
class Schedule:
    """One entry of `DJANGO_LEASES["SCHEDULES"]`."""

    name: str
    kind: str
    every: float
    payload: Any
    catch_up: bool

    @classmethod
    def from_setting(cls, name: str, entry: dict[str, Any]) -> Schedule:
        return cls(
            name=name,
            kind=entry["kind"],
            every=to_seconds(entry["every"], f"SCHEDULES[{name!r}]['every']"),
            payload=entry.get("payload"),
            catch_up=entry.get("catch_up", True),
        )

    @property
    def prefix(self) -> str:
        """The start of every idempotency key of this schedule (and this period)."""
        every = f"{self.every:.0f}" if self.every.is_integer() else repr(self.every)
        return f"schedule:{self.name}:{every}:"

    def key(self, tick: int) -> str:
        return f"{self.prefix}{tick}"

    def tick(self, epoch: float) -> int:
        """Return the index of the tick that contains `epoch` (Unix seconds)."""
        return math.floor(epoch / self.every)

    def start(self, tick: int) -> datetime:
        return datetime.fromtimestamp(tick * self.every, tz=UTC)


def configured() -> list[Schedule]:
    """Return the schedules of the settings (the system checks validate them)."""
    entries: dict[str, dict[str, Any]] = leases_settings.SCHEDULES
    return [Schedule.from_setting(name, entry) for name, entry in sorted(entries.items())]


def database_now(using: str) -> datetime:
    """Return the database clock's current time (one `SELECT` of `Now()`, no table read)."""
    query = Query(None)
    query.add_annotation(Now(), "now")
    row = next(query.get_compiler(using).results_iter())
    now: datetime = row[0]
    return now


def enqueue_due(using: str | None = None, *, model: type[Any] | None = None) -> list[Any]:
    """Enqueue the job of each schedule's current tick (and of a missed one) that is missing.

    Returns the jobs this call found missing and enqueued; a process racing this one may have
    created some of them, and both get the same row.
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
        except (OperationalError, InterfaceError) as exc:
            # The claim that follows meets the same outage and backs off; look again soon.
            logger.warning("could not enqueue periodic jobs: %s", type(exc).__name__)
            self.next_check = time.monotonic() + 1.0
            return []
        spread = random.uniform(0, min(BOUNDARY_SPREAD, wait / 10))  # noqa: S311 - not a secret
        self.next_check = time.monotonic() + wait + spread
        return jobs


def _enqueue_due(model: type[Any] | None, using: str | None) -> tuple[list[Any], float]:
    """Enqueue the missing due ticks; return them and the seconds until the next boundary."""
    schedules = configured()
    if not schedules:
        return [], math.inf
    jobs = leased_jobs(model, using)
    epoch = database_now(jobs.db).timestamp()
    current = {schedule.name: schedule.tick(epoch) for schedule in schedules}
    wanted = [s.key(current[s.name] - back) for s in schedules for back in (0, 1)]
    # Most passes find every tick enqueued already: one indexed look-up instead of an INSERT
    # that the unique index refuses.
    existing = set(
        jobs.filter(idempotency_key__in=wanted).values_list("idempotency_key", flat=True)
    )
    enqueued = []
    for schedule in schedules:
        tick = current[schedule.name]
        ticks = [tick] if schedule.key(tick) not in existing else []
        if schedule.catch_up and schedule.key(tick - 1) not in existing:
            # Missed only if the schedule ran before; a new one (or a new period) starts now.
            earlier = jobs.filter(idempotency_key__startswith=schedule.prefix).exclude(
                idempotency_key=schedule.key(tick)
            )
            if earlier.exists():
                ticks.insert(0, tick - 1)
        for due in ticks:
            job = jobs.enqueue(
                schedule.kind,
                schedule.payload,
                idempotency_key=schedule.key(due),
                run_at=schedule.start(due),
            )
            logger.info(
                "enqueued schedule=%s tick=%s job_id=%s kind=%s late=%s",
                schedule.name,
                due,
                job.pk,
                schedule.kind,
                due < tick,
            )
            enqueued.append(job)
    wait = min((current[s.name] + 1) * s.every - epoch for s in schedules)
    return enqueued, wait
