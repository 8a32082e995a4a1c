"""The schedules' own rows: the series each schedule runs and the last tick it enqueued, the
one record that decides whether a tick's job is due, whatever `prune_jobs` deleted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from django.db import IntegrityError, models, transaction
from django.db.models.functions import Now

from django_leases.querysets.base import retry_deadlocks

T = TypeVar("T")

# The longest cron expression and time zone name a state row holds.
CRON_LENGTH = 200
TZ_LENGTH = 64

Series = tuple[str, float, str, str]
"""(schedule name, `every` in seconds, `cron`, `tz`): one series of ticks or fire times. A new
`every`, expression or time zone starts a new one."""


class Recorded(NamedTuple):
    """What a schedule's row holds: the series it runs and the last tick it covered."""

    series: Series
    last_tick: int
    start_tick: int | None
    """The tick the series started at, covered without a job (None: unknown, older rows)."""


class ScheduleStateQuerySet(models.QuerySet[Any]):
    """One row per job table and schedule: its series and its last enqueued tick (or fire
    time), moved by one conditional write."""

    def of(self, job_model: type[models.Model]) -> ScheduleStateQuerySet:
        """The rows of the schedules that enqueue into `job_model`'s table."""
        return self.filter(job_model=job_model._meta.label_lower)

    def recorded(self, job_model: type[models.Model], names: Iterable[str]) -> dict[str, Recorded]:
        """Return the row of each schedule of `names` that has one, by name (one SELECT)."""
        rows = self.of(job_model).filter(name__in=set(names))
        found = rows.values_list("name", "every", "cron", "tz", "last_tick", "start_tick")
        return {row[0]: Recorded(row[:4], row[4], row[5]) for row in found}

    @retry_deadlocks
    def advance(
        self,
        job_model: type[models.Model],
        series: Series,
        *,
        seen: Recorded | None,
        to: int,
        enqueue: Callable[[], T],
    ) -> T | None:
        """Move the schedule's row from `seen` (None: no row yet) to tick `to` of `series` and
        call `enqueue` in the same transaction; return what it returned, or None (and call
        nothing) if the row no longer holds `seen`: another process moved it first.

        A row of another series is moved to `series` as the start of it: `to` is then
        recorded as the series' start tick. Of processes racing with the same `seen`, exactly
        one moves the row: the others' UPDATE matches no row, or their INSERT meets the unique
        constraint.
        """
        name, every, cron, tz = series
        same = seen is not None and seen.series == series
        if seen is not None and same and to <= seen.last_tick:
            return None
        # The row and the ticks' jobs commit together or not at all: a tick is enqueued exactly
        # when its schedule's row moved past it, never twice, and never skipped by a rollback.
        with transaction.atomic(using=self.db):
            if seen is None:
                try:
                    with transaction.atomic(using=self.db):
                        self.create(
                            job_model=job_model._meta.label_lower,
                            name=name,
                            every=every,
                            cron=cron,
                            tz=tz,
                            last_tick=to,
                            start_tick=to,
                        )
                except IntegrityError:
                    return None
            else:
                # Restates the series and the tick it read, as a claim restates the lease: a
                # row another process moved meanwhile (to this tick or further, or to another
                # definition) is not this caller's to move.
                _, was_every, was_cron, was_tz = seen.series
                row = self.of(job_model).filter(
                    name=name, every=was_every, cron=was_cron, tz=was_tz, last_tick=seen.last_tick
                )
                moved: dict[str, Any] = {"last_tick": to, "enqueued_at": Now()}
                if not same:
                    moved.update(every=every, cron=cron, tz=tz, start_tick=to)
                if not row.update(**moved):
                    return None
            return enqueue()
