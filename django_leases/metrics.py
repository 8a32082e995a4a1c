"""Prometheus metrics, with the `prometheus` extra: `pip install "django-leases[prometheus]"`.

- `WorkerMetrics`: one worker process's counters and histograms per job kind, served by
  `run_lease_worker --metrics-port N` (one port per process: several processes on a host each
  get their own, and Prometheus adds the `instance` label).
- `QueueCollector`: gauges read from the database at each scrape (jobs per status and kind, stuck,
  near expiry, under review, running long, the oldest due job's wait), served with the watcher's
  rescue counter by `watch_stuck_jobs --metrics-port N`, or by the view `queue_metrics` where the
  watcher runs from cron. Every query is a count over an index range of live rows.

Each endpoint serves one job table on one database, named by `django_leases_queue_info{database,
table}` (value 1; join it on `instance` to label any series by database) rather than by a label on
every series, so that splitting the queue across databases changes no series a dashboard reads.

Only this module imports prometheus_client, and only those two commands (given the option) and
a project that routes the view import this module: without the extra nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from django_leases import stats
from django_leases.conf import leases_settings
from django_leases.handlers import throttles
from django_leases.status import TIMED_OUT, AttemptOutcome
from django_leases.tables import job_model, leased_jobs

PREFIX = "django_leases"
# Seconds, from a quick API call to a batch that runs for an hour.
RUN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)
# The worker's events (`WorkerStats` fields and the heartbeat's refusals) that are exported.
WORKER_COUNTERS = {
    "claimed": ("claims", "Leases acquired (attempts started)"),
    AttemptOutcome.COMPLETED: ("completions", "Attempts that completed their job"),
    AttemptOutcome.FAILED: ("failures", "Attempts that failed their job for good"),
    AttemptOutcome.RETRIED: ("retries", "Attempts that failed and scheduled a retry"),
    AttemptOutcome.LEASE_LOST: (
        "leases_lost",
        "Leases the worker found lost: a renewal refused, or none confirmed for a whole TTL",
    ),
    "lost": (
        "fenced_out_writes",
        "Attempts whose outcome was refused or discarded: the lease had passed on",
    ),
    TIMED_OUT: ("timeouts", "Attempts ended at their kind's timeout"),
    AttemptOutcome.CANCELLED: ("cancellations", "Attempts stopped: an operator cancelled the job"),
}


def describe_queue(registry: CollectorRegistry, model: type[Any] | None, using: str | None) -> None:
    """Register `django_leases_queue_info`: the database alias and job table `registry` serves."""
    jobs = leased_jobs(model, using)
    Info(
        f"{PREFIX}_queue", "The database and job table this endpoint serves", registry=registry
    ).info({"database": jobs.db, "table": jobs.model._meta.db_table})


class WorkerMetrics:
    """A worker's `Recorder`: its counters and histograms, in a registry of its own, for the job
    table `model` on `using` (their defaults as for `leased_jobs()`)."""

    def __init__(self, *, model: type[Any] | None = None, using: str | None = None) -> None:
        self.registry = CollectorRegistry()
        describe_queue(self.registry, model, using)
        self.counters = {
            str(event): Counter(f"{PREFIX}_{name}", text, ["kind"], registry=self.registry)
            for event, (name, text) in WORKER_COUNTERS.items()
        }
        self.run_seconds, self.wait_seconds = (
            Histogram(f"{PREFIX}_{name}", text, ["kind"], buckets=buckets, registry=self.registry)
            for name, text, buckets in (
                ("job_run_seconds", "How long handlers ran, per attempt", RUN_BUCKETS),
                (
                    "job_wait_seconds",
                    "How long jobs waited from due (enqueued, or their retry delay over) to "
                    "their claim",
                    WAIT_BUCKETS,
                ),
            )
        )

    def count(self, event: str, kind: str, n: int) -> None:
        counter = self.counters.get(event)
        if counter is not None:
            counter.labels(kind=kind).inc(n)

    def ran(self, kind: str, seconds: float) -> None:
        self.run_seconds.labels(kind=kind).observe(seconds)

    def waited(self, kind: str, seconds: float) -> None:
        self.wait_seconds.labels(kind=kind).observe(seconds)


class QueueCollector(Collector):
    """The gauges of the job table `model` (default: `JOB_MODEL`) on `using` (default: its
    write database), read at each scrape (six index-backed queries);
    `django_leases_database_up` is 0 and the others absent when that fails.

    With `close_connections`, each scrape closes the connections it opened: an `Endpoint`
    answers each scrape on a new thread, which would leave its connection behind.
    """

    def __init__(
        self,
        *,
        model: type[Any] | None = None,
        using: str | None = None,
        close_connections: bool = False,
    ) -> None:
        self.model = model
        self.using = using
        self.close_connections = close_connections

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            f"{PREFIX}_database_up", "Whether the last scrape could read the job table"
        )
        try:
            gauges = stats.queue_gauges(
                leased_jobs(self.model, self.using), near_expiry=leases_settings.NEAR_EXPIRY
            )
        except DatabaseError:
            up.add_metric([], 0)
            yield up
            return
        finally:
            if self.close_connections:
                connections.close_all()
        up.add_metric([], 1)
        yield up
        jobs = GaugeMetricFamily(
            f"{PREFIX}_jobs",
            "Jobs per status and kind, live statuses only (pending, processing, stopping, review)",
            labels=["status", "kind"],
        )
        for (status, kind), n in sorted(gauges.by_status_and_kind.items()):
            jobs.add_metric([status, kind], n)
        yield jobs
        for name, text, value in (
            ("jobs_stuck", "Processing jobs whose lease has expired", gauges.stuck),
            (
                "jobs_near_expiry",
                "Processing jobs whose lease ends within DJANGO_LEASES['NEAR_EXPIRY']",
                gauges.near_expiry,
            ),
            ("jobs_under_review", "Jobs held for review", gauges.under_review),
            (
                "jobs_running_long",
                "Processing jobs whose attempt has run longer than their kind's limit",
                gauges.running_long,
            ),
            (
                "oldest_due_job_wait_seconds",
                "How long the oldest due pending job has waited since due (0: none waits)",
                gauges.oldest_due_wait.total_seconds() if gauges.oldest_due_wait else 0.0,
            ),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)
        yield from throttle_gauges()


def throttle_gauges() -> Iterable[Metric]:
    """The limits per kind of this process's registry (`limit=`, `rate=` of `@job_handler`)."""
    limit = GaugeMetricFamily(
        f"{PREFIX}_kind_limit", "Jobs of the kind processing at once, at most", labels=["kind"]
    )
    rate = GaugeMetricFamily(
        f"{PREFIX}_kind_rate_jobs",
        "Jobs of the kind started within its rate window, at most",
        labels=["kind"],
    )
    window = GaugeMetricFamily(
        f"{PREFIX}_kind_rate_window_seconds", "The kind's rate window", labels=["kind"]
    )
    for kind, throttle in sorted(throttles().items()):
        if throttle.limit is not None:
            limit.add_metric([kind], throttle.limit)
        if throttle.rate is not None:
            rate.add_metric([kind], throttle.rate[0])
            window.add_metric([kind], throttle.rate[1])
    yield from (limit, rate, window)


class WatcherMetrics:
    """The watcher's rescue counter and the gauges of its job table (`model` on `using`), in a
    registry of their own."""

    def __init__(self, *, model: type[Any] | None = None, using: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.rescues = Counter(
            f"{PREFIX}_rescues",
            "Jobs the watcher acted on: expired or orphaned leases, and reviews a reconcile "
            "hook resolved, per kind and action",
            ["kind", "action"],
            registry=self.registry,
        )
        self.registry.register(QueueCollector(model=model, using=using, close_connections=True))
        describe_queue(self.registry, model, using)

    def rescued(self, kind: str, action: str) -> None:
        self.rescues.labels(kind=kind, action=action).inc()


class Endpoint:
    """An HTTP server of `registry` at http://`address`:`port`/metrics, on a thread of its own.

    Raises `OSError` when the port cannot be bound. `port` is the one bound (the system chose it
    for port 0).
    """

    def __init__(self, registry: CollectorRegistry, port: int, address: str) -> None:
        self._server, self._thread = start_http_server(port, addr=address, registry=registry)
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def queue_metrics(
    request: HttpRequest, model: str | type[Any] | None = None, using: str | None = None
) -> HttpResponse:
    """Serve the gauges of the job table `model` ("app_label.ModelName" or the model; default:
    `JOB_MODEL`) on the database `using` (default: the routers' choice) to Prometheus; route it
    behind your own access control.

    Choose the table and the database in the URLconf: `path("metrics/payouts/", queue_metrics,
    {"model": "payouts.PayoutJob", "using": "eu"})`.
    """
    table = job_model(model) if isinstance(model, str) else model
    registry = CollectorRegistry()
    registry.register(QueueCollector(model=table, using=using))
    describe_queue(registry, table, using)
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
