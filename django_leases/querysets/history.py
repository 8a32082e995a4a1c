"""The queue's history: one row per kind and minute (and one for every kind, `ALL_KINDS`) of
jobs completed, failed and retried, their wait and run times, and the backlog, written by the
watcher once a minute after the minute closed.

A minute's numbers are read from index ranges, never from the whole table: its completed and
failed jobs from the `(status, completed_at)` range, their final attempts by the ledger's
unique `(job_ref, token)` index, its retried attempts from the ledger's `claimed_at` range
(attempts claimed at most LONG_RUNNING seconds before the minute: a retried attempt that ran
longer is not counted), the backlog from the pending-only due index. Wait and run times are
counted in `BOUNDS` buckets by the database (one GROUP BY), so minutes merge exactly into hours
and days and the percentiles are read from the merged counts, as Prometheus reads a histogram.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Self

from django.db import IntegrityError, models, transaction
from django.db.models import (
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Now

from django_leases.conf import leases_settings
from django_leases.querysets.base import database_now, retry_deadlocks
from django_leases.querysets.reads import attempt_ledger
from django_leases.status import COMPLETED, FAILED, HISTORY_COUNTS, PENDING, AttemptOutcome

if TYPE_CHECKING:
    from django_leases.querysets.reads import LeaseReads

# The row of a minute that sums every kind; written for every minute, with jobs or without, so
# it also marks the minute as recorded.
ALL_KINDS = ""
# Upper bounds (seconds) of the wait and run time buckets; a last bucket holds the rest.
BOUNDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 21600.0, 86400.0,
)  # fmt: skip
MINUTE = timedelta(minutes=1)
# A minute is recorded once this long past its end: a transaction that wrote a time inside it
# by the database clock has committed by then.
SETTLE = timedelta(seconds=5)
# How far back a watcher that was away fills in missed minutes (their backlog unknown).
BACKFILL = 60
# Seconds of history prune_jobs keeps: the longest chart (a week) and a day.
KEPT = 8 * 86400


def quantile(counts: Sequence[int], q: float) -> float | None:
    """Return the `q` quantile (0..1) of the bucket `counts` (over `BOUNDS`), interpolated
    linearly inside its bucket; None for no counts. The last bucket answers its lower bound."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(BOUNDS):
                return BOUNDS[-1]
            lower = BOUNDS[i - 1] if i else 0.0
            return lower + (BOUNDS[i] - lower) * (rank - seen) / n
        seen += n
    return BOUNDS[-1]


def merged(rows: Iterable[Sequence[int] | None]) -> list[int]:
    """Add bucket counts up, bucket by bucket."""
    total = [0] * (len(BOUNDS) + 1)
    for counts in rows:
        for i, n in enumerate(counts or ()):
            total[i] += n
    return total


def bucket_of(seconds: float) -> int:
    """The bucket a duration of `seconds` falls in (for tests and Python-side counts)."""
    return bisect_left(BOUNDS, seconds) if seconds > BOUNDS[0] else 0


def _bucket(duration: Any) -> Case:
    """The database's bucket index of a duration expression (a negative one counts as 0)."""
    whens = [
        When(**{f"{duration}__lte": timedelta(seconds=bound)}, then=Value(i))
        for i, bound in enumerate(BOUNDS)
    ]
    return Case(*whens, default=Value(len(BOUNDS)), output_field=models.IntegerField())


@dataclass
class KindMinute:
    """What one kind (or every kind) did in one minute, as the history row holds it."""

    completed: int = 0
    failed: int = 0
    retried: int = 0
    depth: int | None = None
    wait: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    run: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))

    def add(self, other: KindMinute) -> None:
        self.completed += other.completed
        self.failed += other.failed
        self.retried += other.retried
        if other.depth is not None:
            self.depth = (self.depth or 0) + other.depth
        # In place: a week's chart adds 10,080 minutes up.
        for mine, theirs in ((self.wait, other.wait), (self.run, other.run)):
            for i, n in enumerate(theirs):
                mine[i] += n

    def fields(self) -> dict[str, Any]:
        """The history row's columns."""
        counts = (self.completed, self.failed, self.retried)
        return {
            **dict(zip(HISTORY_COUNTS, counts, strict=True)),
            "depth": self.depth,
            "wait_counts": self.wait,
            "run_counts": self.run,
            "wait_p50": quantile(self.wait, 0.5),
            "wait_p95": quantile(self.wait, 0.95),
            "run_p50": quantile(self.run, 0.5),
            "run_p95": quantile(self.run, 0.95),
        }


def aggregate_minute(
    jobs: LeaseReads[Any], start: datetime, *, depth: bool
) -> dict[str, KindMinute]:
    """Read what each kind did in the minute from `start`: two queries over index ranges
    (three with the backlog, `depth`: the due pending jobs now, per kind)."""
    end = start + MINUTE
    by_kind: defaultdict[str, KindMinute] = defaultdict(KindMinute)
    finished = jobs.filter(
        status__in=[COMPLETED, FAILED], completed_at__gte=start, completed_at__lt=end
    ).order_by()
    names = ["kind", "status"]
    ledger = attempt_ledger(jobs.model)
    if ledger is not None:
        attempts: Any = ledger._default_manager.using(jobs.db)
        # The attempt that finished each job (its fencing token is the job's last), one probe
        # of the ledger's unique (job_ref, token) index per job: a join let the planner hash
        # the whole ledger.
        final = attempts.filter(
            job_ref=OuterRef("pk"), token=OuterRef("lease_token"), ended_at__isnull=False
        )
        waited = ExpressionWrapper(F("claimed_at") - OuterRef("run_at"), DurationField())
        ran = ExpressionWrapper(F("ended_at") - F("claimed_at"), DurationField())
        finished = finished.annotate(
            w=Subquery(final.annotate(d=waited, b=_bucket("d")).values("b")[:1]),
            r=Subquery(final.annotate(d=ran, b=_bucket("d")).values("b")[:1]),
        )
        names += ["w", "r"]
    for kind, status, *buckets, n in finished.values_list(*names).annotate(n=Count("*")):
        row = by_kind[kind]
        setattr(row, status, getattr(row, status) + n)
        if buckets and buckets[0] is not None:
            row.wait[buckets[0]] += n
            row.run[buckets[1]] += n
    if ledger is not None:
        retried = attempts.filter(
            claimed_at__gte=start - timedelta(seconds=leases_settings.LONG_RUNNING),
            claimed_at__lt=end,
            ended_at__gte=start,
            ended_at__lt=end,
            outcome=AttemptOutcome.RETRIED,
        )
        for kind, n in retried.order_by().values_list("job__kind").annotate(n=Count("*")):
            by_kind[kind].retried = n
    if depth:
        due = jobs.filter(status=PENDING, run_at__lte=Now()).order_by()
        for kind, n in due.values_list("kind").annotate(n=Count("*")):
            by_kind[kind].depth = n
    return dict(by_kind)


class QueueMinuteQuerySet(models.QuerySet[Any]):
    """The history rows of the job tables, one per job table, kind and minute."""

    def of(self, job_model: type[models.Model]) -> Self:
        """The rows of `job_model`'s queue."""
        return self.filter(job_model=job_model._meta.label_lower)

    def due_minutes(self, job_model: type[models.Model]) -> list[datetime]:
        """The closed minutes not recorded yet, oldest first: at most BACKFILL of them, after
        the last recorded one."""
        now = database_now(self.db)
        newest = now.replace(second=0, microsecond=0) - MINUTE
        if now - newest - MINUTE < SETTLE:
            newest -= MINUTE
        last = self.of(job_model).filter(kind=ALL_KINDS).aggregate(last=Max("minute"))["last"]
        first = newest - (BACKFILL - 1) * MINUTE
        if last is not None:
            first = max(first, last + MINUTE)
        count = int((newest - first) / MINUTE) + 1
        return [first + i * MINUTE for i in range(max(count, 0))]

    def record(self, jobs: LeaseReads[Any]) -> list[datetime]:
        """Record every due minute of `jobs`' queue; return the minutes this call wrote (those
        another process wrote first are left out)."""
        minutes = self.due_minutes(jobs.model)
        newest = minutes[-1] if minutes else None
        return [
            minute
            for minute in minutes
            if self.record_minute(
                jobs,
                minute,
                aggregate_minute(jobs, minute, depth=minute == newest),
                depth=minute == newest,
            )
        ]

    @retry_deadlocks
    def record_minute(
        self,
        jobs: LeaseReads[Any],
        minute: datetime,
        kinds: dict[str, KindMinute],
        *,
        depth: bool,
    ) -> bool:
        """Write the minute's rows (`depth`: with the backlog its `kinds` were read with), unless
        a row of it exists: False then, nothing written."""
        label = jobs.model._meta.label_lower
        total = KindMinute(depth=0 if depth else None)
        for row in kinds.values():
            total.add(row)
        # The every-kinds row first, alone: of processes racing for the minute, one inserts it
        # and the others meet the unique constraint (waiting for the first one's commit on
        # PostgreSQL and MariaDB) and write nothing, so each minute is written once, whole.
        with transaction.atomic(using=self.db):
            try:
                with transaction.atomic(using=self.db):
                    self.create(job_model=label, kind=ALL_KINDS, minute=minute, **total.fields())
            except IntegrityError:
                return False
            self.bulk_create(
                self.model(job_model=label, kind=kind, minute=minute, **row.fields())
                for kind, row in sorted(kinds.items())
            )
        return True

    def prunable(self, job_model: type[models.Model], older_than: float = KEPT) -> Self:
        """The rows of `job_model`'s minutes more than `older_than` seconds old (database
        clock): a range of the (job_model, minute) index."""
        return self.of(job_model).filter(minute__lt=Now() - timedelta(seconds=older_than))

    def prune(self, job_model: type[models.Model], older_than: float = KEPT) -> int:
        """Delete `prunable()` rows in one statement; return how many."""
        return self.prunable(job_model, older_than)._raw_delete(self.db)

    def series(
        self, job_model: type[models.Model], kind: str, since: datetime
    ) -> list[tuple[datetime, KindMinute]]:
        """The recorded minutes of `kind` (`ALL_KINDS`: every kind) since `since`, oldest first:
        one range of the (job_model, kind, minute) unique index."""
        rows = self.of(job_model).filter(kind=kind, minute__gte=since).order_by("minute")
        names = ("minute", *HISTORY_COUNTS, "depth", "wait_counts", "run_counts")
        return [
            (minute, KindMinute(completed, failed, retried, depth, list(wait), list(run)))
            for minute, completed, failed, retried, depth, wait, run in rows.values_list(*names)
        ]

    def recent(self, job_model: type[models.Model], minutes: int) -> dict[str, KindMinute]:
        """Each kind's last `minutes` minutes (database clock), added up (its wait and run
        counts merged): a range of the (job_model, minute) index."""
        since = Now() - minutes * MINUTE
        rows = self.of(job_model).filter(minute__gte=since).exclude(kind=ALL_KINDS)
        names = ("kind", *HISTORY_COUNTS, "wait_counts", "run_counts")
        totals: defaultdict[str, KindMinute] = defaultdict(KindMinute)
        for kind, completed, failed, retried, wait, run in rows.values_list(*names):
            totals[kind].add(KindMinute(completed, failed, retried, None, wait, run))
        return dict(totals)
