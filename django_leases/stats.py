"""Read-only numbers for the admin and the Prometheus gauges, built on the `LeaseQuerySet` reads.

Nothing here writes, and nothing reads one row per job into Python: every query is a count, a
GROUP BY or a bounded list, each served by an index of `PaymentJob` — the overview's per-status
counts stop at a limit (`status_tallies()`: partial indexes of live rows, `dl_job_finished_idx
(status, completed_at)` for the others, the database's statistics beyond), lease counts walk
the processing-only `dl_job_lease_idx`, the oldest due job the pending-only `dl_job_due_idx`
and the last hour's finished jobs a range of `dl_job_finished_idx`; long runners are processing
jobs, each probing the ledger's unique (job_ref, token) index for its open attempt. So the
overview costs the same number of queries however many rows pile up. Every "now" is the
database clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db.models import (
    Case,
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    OuterRef,
    Subquery,
    When,
)
from django.db.models.functions import Now

from django_leases.conf import leases_settings
from django_leases.handlers import get_handler, registered_kinds
from django_leases.horizon import HorizonPin, oldest_pin
from django_leases.querysets import LeaseQuerySet, WorkerQuerySet
from django_leases.querysets.workers import LATE_AFTER, Role
from django_leases.status import (
    FINAL_STATUSES,
    LEASED_STATUSES,
    PENDING,
    PROCESSING,
    REVIEW,
    STOPPING,
    WAITING,
    JobStatus,
)
from django_leases.tables import registered_workers

STUCK, NEAR_EXPIRY, HEALTHY = "stuck", "near_expiry", "healthy"
# Not a lease state of its own: a processing job whose attempt has run longer than its limit.
RUNNING_LONG = "running_long"
# The overview's window: the jobs it counts as completed or failed lately, and its table per kind.
RECENT_MINUTES = 60
# The admin's time filter: due pending jobs, and jobs finished within RECENT_MINUTES (what the
# overview's cards count).
DUE, LAST_HOUR = "due", "last_hour"
# The categories of `selection()`: a status, or a processing job split by its lease.
LIVE_LEASE = "live_lease"
# The statuses of jobs not finished yet; each is a range of an index of live rows.
LIVE_STATUSES = (PENDING, PROCESSING, STOPPING, REVIEW)


def with_lease_clock(jobs: LeaseQuerySet[Any]) -> LeaseQuerySet[Any]:
    """Annotate `lease_left` (lease end minus now; processing and stopping jobs only),
    `heartbeat_age` (now minus the last heartbeat) and `running_for` (see
    `with_running_for()`), all by the database clock."""
    return jobs.with_running_for().annotate(
        # A finished job keeps its last lease end; only a leased job's is a live deadline.
        lease_left=Case(
            When(status__in=LEASED_STATUSES, then=F("lease_until") - Now()),
            default=None,
            output_field=DurationField(),
        ),
        heartbeat_age=ExpressionWrapper(Now() - F("heartbeat_at"), output_field=DurationField()),
    )


def with_lock_holder(jobs: LeaseQuerySet[Any]) -> LeaseQuerySet[Any]:
    """Annotate `waiting_for`: for a waiting job, the id of the job that holds its lock (one
    probe of the lock holder's unique index per row shown)."""
    holder = jobs.model._base_manager.filter(lock_holder=OuterRef("lock")).values("pk")[:1]
    return jobs.annotate(waiting_for=Case(When(status=WAITING, then=Subquery(holder))))


def with_seen_ago(workers: WorkerQuerySet) -> WorkerQuerySet:
    """Annotate `seen_ago`: how long ago each worker last refreshed its row, by the database
    clock."""
    return workers.annotate(
        seen_ago=ExpressionWrapper(Now() - F("last_seen_at"), output_field=DurationField())
    )


@dataclass(frozen=True)
class Fleet:
    """The registry's live processes (not stopped, seen within WORKER_GONE_AFTER), each row
    annotated with `seen_ago` and `late` (`is_late()`), and the last pass of any watcher."""

    workers: list[Any]
    watchers: list[Any]
    last_pass_ago: timedelta | None

    @property
    def late(self) -> int:
        return sum(worker.late for worker in self.workers)

    def serves(self) -> set[str]:
        """The kinds a worker that is not late serves."""
        return {kind for worker in self.workers if not worker.late for kind in worker.kinds}

    def unserved(self, pending: Iterable[str]) -> list[str]:
        """The kinds of `pending` that no worker serves: their jobs wait until one does."""
        served = self.serves()
        return sorted(set(pending) - served)


def is_late(worker: Any) -> bool:
    """Whether the process of a `with_seen_ago()` registry row missed LATE_AFTER reports: it
    may be frozen or dead, though not yet gone (WORKER_GONE_AFTER). A row without an interval
    (written by an older release, or a watcher run once) is never late."""
    if worker.heartbeat is None or worker.seen_ago is None:
        return False
    return bool(worker.seen_ago > timedelta(seconds=LATE_AFTER * worker.heartbeat))


def fleet(workers: WorkerQuerySet) -> Fleet:
    """Read the live processes of the registry `workers` and the watchers' last pass, in two
    queries."""
    rows = list(with_seen_ago(workers.alive()).order_by("worker_id"))
    for row in rows:
        row.late = is_late(row)
    last = workers.watchers().aggregate(
        ago=ExpressionWrapper(Now() - Max("last_pass_at"), output_field=DurationField())
    )
    return Fleet(
        workers=[row for row in rows if row.role == Role.WORKER],
        watchers=[row for row in rows if row.role == Role.WATCHER],
        last_pass_ago=last["ago"],
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


# How a `Tally` was arrived at.
EXACT, MORE_THAN, ESTIMATED = "exact", "more_than", "estimated"


@dataclass(frozen=True)
class Tally:
    """A number of jobs as the admin shows it: counted (`EXACT`), counted up to a limit and
    found beyond it (`MORE_THAN`: more than `n`), or the database's estimate (`ESTIMATED`)."""

    n: int
    how: str = EXACT

    @classmethod
    def sum(cls, tallies: Iterable[Tally]) -> Tally:
        """Add `tallies` up: estimated if one is, else more than the sum if one is."""
        parts = list(tallies)
        hows = {tally.how for tally in parts}
        how = next((how for how in (ESTIMATED, MORE_THAN) if how in hows), EXACT)
        return cls(sum(tally.n for tally in parts), how)


def tally(
    jobs: LeaseQuerySet[Any], limit: int, estimate: Callable[[], int | None] | None = None
) -> Tally:
    """Count `jobs` exactly up to `limit` (reading at most `limit + 1` rows); beyond it, return
    `estimate()` if it gives one above `limit`, else "more than `limit`"."""
    counted = jobs.capped_count(limit)
    if counted <= limit:
        return Tally(counted)
    guess = estimate() if estimate is not None else None
    # An estimate at or below what was just counted is stale statistics: say what is known.
    if guess is not None and guess > limit:
        return Tally(guess, ESTIMATED)
    return Tally(limit, MORE_THAN)


def status_tallies(jobs: LeaseQuerySet[Any], limit: int) -> dict[str, Tally]:
    """Return {status: Tally} for every status, each counted up to `limit`.

    One capped count per status: the live statuses are ranges of their partial indexes, the
    others of the (status, completed_at) index, each read for at most `limit + 1` entries.
    Beyond `limit`, a final status (completed, failed, cancelled: they grow without bound) is
    the database's estimate; a live status, which moves too fast for statistics, is "more than
    `limit`". So the cost stays flat however many rows pile up.
    """
    tallies = {}
    for status in JobStatus.values:
        estimate = (lambda s=status: jobs.estimated_count(s)) if status in FINAL_STATUSES else None
        tallies[status] = tally(jobs.filter(status=status), limit, estimate)
    return tallies


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


def finished_counts(jobs: LeaseQuerySet[Any], *, minutes: int = RECENT_MINUTES) -> Counter[str]:
    """Return the number of jobs per final status that reached it within the last `minutes`, by
    the database clock. One GROUP BY over a range of the (status, completed_at) index."""
    rows = jobs.finished_within(timedelta(minutes=minutes)).order_by().values_list("status")
    return Counter(dict(rows.annotate(n=Count("*"))))


@dataclass(frozen=True)
class Overview:
    """The numbers of the admin's queue overview."""

    by_status: dict[str, Tally]
    stuck: int
    near_expiry: int
    oldest_due: OldestDue
    finished: Counter[str]
    fleet: Fleet
    unserved: list[str]
    stuck_jobs: list[Any]
    running_long: int
    long_runners: list[Any]
    horizon: HorizonPin | None

    @property
    def total(self) -> Tally:
        return Tally.sum(self.by_status.values())

    @property
    def under_review(self) -> Tally:
        return self.by_status.get(REVIEW, Tally(0))

    @property
    def blocked_by_lock(self) -> Tally:
        return self.by_status.get(WAITING, Tally(0))


@dataclass(frozen=True)
class OldestDue:
    """The oldest due pending job's kind and how long it has waited since its `run_at`; both
    None when none is due."""

    kind: str | None = None
    wait: timedelta | None = None


def oldest_due(jobs: LeaseQuerySet[Any]) -> OldestDue:
    """Return the oldest due pending job's wait (database clock) and kind. One query on the
    pending-only due index."""
    waits = jobs.due().annotate(
        wait=ExpressionWrapper(Now() - F("run_at"), output_field=DurationField())
    )
    oldest = waits.order_by("run_at").values_list("kind", "wait").first()
    return OldestDue() if oldest is None else OldestDue(*oldest)


def pending_kinds(jobs: LeaseQuerySet[Any]) -> list[str]:
    """Return the kinds of the pending jobs (one DISTINCT over the pending-only due index)."""
    return sorted(jobs.pending().order_by().values_list("kind", flat=True).distinct())


def long_running_limits() -> tuple[float, dict[str, float]]:
    """Return when an attempt runs long: `DJANGO_LEASES["LONG_RUNNING"]` seconds, and per kind
    whose handler has a `timeout`, that timeout (`running_longer_than()`'s arguments)."""
    timeouts = {kind: get_handler(kind).timeout for kind in registered_kinds()}
    by_kind = {kind: timeout for kind, timeout in timeouts.items() if timeout is not None}
    return float(leases_settings.LONG_RUNNING), by_kind


def running_long(jobs: LeaseQuerySet[Any]) -> LeaseQuerySet[Any]:
    """Processing jobs whose current attempt has run longer than `long_running_limits()`."""
    default, by_kind = long_running_limits()
    return jobs.running_longer_than(default, by_kind=by_kind)


def long_running_limit(kind: str) -> float:
    """Return the seconds after which an attempt of `kind` runs long."""
    default, by_kind = long_running_limits()
    return by_kind.get(kind, default)


@dataclass(frozen=True)
class QueueGauges:
    """The queue's numbers for Prometheus (`django_leases.metrics`)."""

    by_status_and_kind: dict[tuple[str, str], int]
    stuck: dict[str, int]
    near_expiry: dict[str, int]
    under_review: dict[str, int]
    running_long: dict[str, int]
    oldest_due: OldestDue
    fleet: Fleet
    horizon: HorizonPin | None

    def unserved(self) -> dict[str, int]:
        """The pending jobs of each kind that no live worker serves (`Fleet.unserved()`)."""
        pending = {
            kind: n for (status, kind), n in self.by_status_and_kind.items() if status == PENDING
        }
        return {kind: pending[kind] for kind in self.fleet.unserved(pending)}


def per_kind(jobs: LeaseQuerySet[Any]) -> dict[str, int]:
    """How many of `jobs` there are of each kind (kinds with none left out), in one query."""
    return dict(jobs.order_by().values_list("kind").annotate(n=Count("*")).values_list("kind", "n"))


def queue_gauges(jobs: LeaseQuerySet[Any], *, near_expiry: float) -> QueueGauges:
    """Read the queue's gauges in eight queries (nine with the horizon's, on PostgreSQL and
    MariaDB/MySQL), each over an index range of live rows or the
    registry's live rows (`fleet()`, on the job table's database).

    Jobs are counted per kind in the live statuses only (pending, processing, stopping,
    review): counting
    finished jobs per kind would scan the whole table; the workers' counters count them.
    """
    live = jobs.filter(status__in=LIVE_STATUSES).order_by().values_list("status", "kind")
    by_status_and_kind = {(status, kind): n for status, kind, n in live.annotate(n=Count("*"))}
    return QueueGauges(
        by_status_and_kind=by_status_and_kind,
        stuck=per_kind(jobs.expired()),
        near_expiry=per_kind(jobs.near_expiry(near_expiry)),
        under_review=per_kind(jobs.under_review()),
        running_long=per_kind(running_long(jobs)),
        oldest_due=oldest_due(jobs),
        fleet=fleet(registered_workers(jobs.db)),
        horizon=oldest_pin(jobs.db),
    )


def overview(
    jobs: LeaseQuerySet[Any],
    workers: WorkerQuerySet,
    *,
    near_expiry: float,
    minutes: int = RECENT_MINUTES,
    stuck_sample: int = 10,
) -> Overview:
    """Read the queue overview in seventeen queries (and the horizon's), whatever the number
    of jobs (and one estimate per final status beyond ADMIN_EXACT_COUNT_LIMIT)."""
    finished = finished_counts(jobs, minutes=minutes)
    live = fleet(workers)
    long_runners = with_lease_clock(running_long(jobs))
    return Overview(
        by_status=status_tallies(jobs, leases_settings.ADMIN_EXACT_COUNT_LIMIT),
        stuck=jobs.expired().count(),
        near_expiry=jobs.near_expiry(near_expiry).count(),
        oldest_due=oldest_due(jobs),
        finished=finished,
        # The registry holds a row per worker process; the live ones are the fleet.
        fleet=live,
        unserved=live.unserved(pending_kinds(jobs)),
        stuck_jobs=list(with_lease_clock(jobs.expired()).order_by("lease_until")[:stuck_sample]),
        running_long=long_runners.count(),
        long_runners=list(long_runners.order_by("-running_for", "pk")[:stuck_sample]),
        horizon=oldest_pin(jobs.db),
    )
