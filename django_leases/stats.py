"""Read-only numbers for the admin, built on the `LeaseQuerySet` reads.

Nothing here writes, and nothing reads one row per job into Python: every query is a count, a
GROUP BY or a bounded list, each served by an index of `PaymentJob` — per-status counts walk
`dl_job_finished_idx (status, completed_at)`, lease counts the processing-only `dl_job_lease_idx`,
the oldest due job the pending-only `dl_job_due_idx` and the last hour's throughput a range of
`dl_job_finished_idx`. So the overview costs the same number of queries however many rows pile up.
Every "now" is the database clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Case, Count, DurationField, ExpressionWrapper, F, Min, When
from django.db.models.functions import Now, TruncMinute

from django_leases.handlers import registered_kinds
from django_leases.querysets import LeaseQuerySet, WorkerQuerySet
from django_leases.status import COMPLETED, FAILED, PROCESSING, REVIEW

STUCK, NEAR_EXPIRY, HEALTHY = "stuck", "near_expiry", "healthy"
# The categories of `selection()`: a status, or a processing job split by its lease.
LIVE_LEASE = "live_lease"


def with_lease_clock(jobs: LeaseQuerySet[Any]) -> LeaseQuerySet[Any]:
    """Annotate `lease_left` (lease end minus now; processing jobs only) and `heartbeat_age`
    (now minus the last heartbeat), both by the database clock."""
    return jobs.annotate(
        # A finished job keeps its last lease end; only a processing job's is a live deadline.
        lease_left=Case(
            When(status=PROCESSING, then=F("lease_until") - Now()),
            default=None,
            output_field=DurationField(),
        ),
        heartbeat_age=ExpressionWrapper(Now() - F("heartbeat_at"), output_field=DurationField()),
    )


def with_seen_ago(workers: WorkerQuerySet) -> WorkerQuerySet:
    """Annotate `seen_ago`: how long ago each worker last refreshed its row, by the database
    clock."""
    return workers.annotate(
        seen_ago=ExpressionWrapper(Now() - F("last_seen_at"), output_field=DurationField())
    )


def lease_state(lease_left: timedelta | None, near_expiry: float) -> str | None:
    """Return STUCK, NEAR_EXPIRY or HEALTHY for a `lease_left` of `with_lease_clock()`.

    The bounds are those of `expired()`, `near_expiry()` and `healthy()`: a lease that ends now
    is near expiry, one that ends `near_expiry` seconds from now is healthy.
    """
    if lease_left is None:
        return None
    if lease_left < timedelta(0):
        return STUCK
    if lease_left < timedelta(seconds=near_expiry):
        return NEAR_EXPIRY
    return HEALTHY


def status_counts(jobs: LeaseQuerySet[Any]) -> dict[str, int]:
    """Return {status: number of jobs} in one GROUP BY."""
    # COUNT(*) rather than COUNT(id): the (status, completed_at) index alone can answer it.
    rows = jobs.order_by().values_list("status").annotate(n=Count("*"))
    return dict(rows)


def selection(jobs: LeaseQuerySet[Any]) -> Counter[str]:
    """Count `jobs` by status, with processing jobs split into STUCK and LIVE_LEASE.

    The admin's actions read it before they write, to say why the jobs they skipped were
    skipped. Two queries.
    """
    counts = Counter(status_counts(jobs))
    processing = counts.pop(PROCESSING, 0)
    if processing:
        stuck = jobs.expired().count()
        counts[STUCK] = stuck
        counts[LIVE_LEASE] = processing - stuck
    return +counts


def kinds(jobs: LeaseQuerySet[Any]) -> list[str]:
    """Return the registered handler kinds and the kinds of pending and processing jobs.

    The kinds of finished jobs are left out: finding them would scan the whole table.
    """
    live = (jobs.pending() | jobs.processing()).order_by().values_list("kind", flat=True)
    return sorted(set(registered_kinds()) | set(live.distinct()))


@dataclass(frozen=True)
class Minute:
    """Jobs finished in one minute of the throughput chart."""

    start: datetime
    completed: int = 0
    failed: int = 0

    @property
    def total(self) -> int:
        return self.completed + self.failed


def throughput(jobs: LeaseQuerySet[Any], *, minutes: int = 60) -> tuple[list[Minute], Counter[str]]:
    """Return the jobs completed and failed per minute over the last `minutes`, oldest first,
    and the number of jobs per final status over the same window. One query.

    Minutes are aligned to the database clock: the query groups by the minute of each
    `completed_at` and also returns the database's current minute.
    """
    rows = (
        jobs.finished_within(timedelta(minutes=minutes))
        .annotate(
            minute=TruncMinute("completed_at", tzinfo=UTC),
            now_minute=TruncMinute(Now(), tzinfo=UTC),
        )
        .order_by()
        .values_list("status", "minute", "now_minute")
        .annotate(n=Count("*"))
    )
    totals: Counter[str] = Counter()
    per_minute: dict[datetime, Counter[str]] = {}
    now_minute: datetime | None = None
    for status, minute, current, n in rows:
        totals[status] += n
        per_minute.setdefault(minute, Counter())[status] += n
        now_minute = current if now_minute is None else max(now_minute, current)
    if now_minute is None:
        # Nothing finished in the window: every bar is empty, whatever the clock says.
        now_minute = datetime.now(UTC).replace(second=0, microsecond=0)
    chart = []
    for back in range(minutes - 1, -1, -1):
        start = now_minute - timedelta(minutes=back)
        counts = per_minute.get(start, Counter())
        chart.append(Minute(start, counts[COMPLETED], counts[FAILED]))
    return chart, totals


@dataclass(frozen=True)
class Overview:
    """The numbers of the admin's queue overview."""

    by_status: dict[str, int]
    stuck: int
    near_expiry: int
    oldest_due_wait: timedelta | None
    chart: list[Minute]
    finished: Counter[str]
    workers: list[Any]
    stuck_jobs: list[Any]

    @property
    def total(self) -> int:
        return sum(self.by_status.values())

    @property
    def under_review(self) -> int:
        return self.by_status.get(REVIEW, 0)


def overview(
    jobs: LeaseQuerySet[Any],
    workers: WorkerQuerySet,
    *,
    near_expiry: float,
    minutes: int = 60,
    stuck_sample: int = 10,
) -> Overview:
    """Read the queue overview in seven queries, whatever the number of jobs."""
    oldest = jobs.due().aggregate(
        wait=ExpressionWrapper(Now() - Min("run_at"), output_field=DurationField())
    )
    chart, finished = throughput(jobs, minutes=minutes)
    return Overview(
        by_status=status_counts(jobs),
        stuck=jobs.expired().count(),
        near_expiry=jobs.near_expiry(near_expiry).count(),
        oldest_due_wait=oldest["wait"],
        chart=chart,
        finished=finished,
        # The registry holds a row per worker process; the live ones are the fleet.
        workers=list(with_seen_ago(workers.alive()).order_by("worker_id")),
        stuck_jobs=list(with_lease_clock(jobs.expired()).order_by("lease_until")[:stuck_sample]),
    )
