"""The schedules' own rows: the last tick each schedule enqueued, the one record that decides
whether a tick's job is due, whatever `prune_jobs` deleted."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

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


class ScheduleStateQuerySet(models.QuerySet[Any]):
    """One row per job table and series: its last enqueued tick (or fire time), moved by one
    conditional write."""

    def of(self, job_model: type[models.Model]) -> ScheduleStateQuerySet:
        """The rows of the schedules that enqueue into `job_model`'s table."""
        return self.filter(job_model=job_model._meta.label_lower)

    def last_ticks(
        self, job_model: type[models.Model], series: Iterable[Series]
    ) -> dict[Series, int]:
        """Return the last enqueued tick of each of `series` that has a row (one SELECT)."""
        wanted = set(series)
        rows = self.of(job_model).filter(name__in={s[0] for s in wanted})
        found = rows.values_list("name", "every", "cron", "tz", "last_tick")
        return {row[:4]: row[4] for row in found if row[:4] in wanted}

    @retry_deadlocks
    def advance(
        self,
        job_model: type[models.Model],
        series: Series,
        *,
        seen: int | None,
        to: int,
        enqueue: Callable[[], T],
    ) -> T | None:
        """Move the last enqueued tick of `series` from `seen` (None: no row yet) to `to` and
        call `enqueue` in the same transaction; return what it returned, or None (and call
        nothing) if the row is no longer at `seen`: another process moved it first.

        Of processes racing with the same `seen`, exactly one moves the row: the others'
        UPDATE matches no row, or their INSERT meets the unique constraint.
        """
        name, every, cron, tz = series
        if seen is not None and to <= seen:
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
                        )
                except IntegrityError:
                    return None
            else:
                # Restates the tick it read, as a claim restates the lease: a row another process
                # moved meanwhile (to this tick or further) is not this caller's to move.
                row = self.of(job_model).filter(
                    name=name, every=every, cron=cron, tz=tz, last_tick=seen
                )
                if not row.update(last_tick=to, enqueued_at=Now()):
                    return None
            return enqueue()
