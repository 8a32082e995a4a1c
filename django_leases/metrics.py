"""Prometheus metrics, with the `prometheus` extra: `pip install "django-leases[prometheus]"`.

- `WorkerMetrics`: one worker process's counters and histograms per job kind, and its busy
  slots per kind, served by
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

import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from wsgiref.simple_server import make_server

from django.db import DatabaseError, connections
from django.http import HttpRequest, HttpResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import (
    CONTENT_TYPE_LATEST,
    ThreadingWSGIServer,
    _SilentHandler,
    generate_latest,
)
from prometheus_client.registry import Collector

from django_leases import stats
from django_leases.conf import leases_settings
from django_leases.handlers import throttles
from django_leases.horizon import HorizonPin
from django_leases.status import TIMED_OUT, AttemptOutcome
from django_leases.tables import job_model, leased_jobs

# No `_created` series beside every counter and histogram: a second series per label set that
# no dashboard reads (prometheus_client's own switch; it holds for the whole process).
disable_created_metrics()

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

    def __init__(
        self,
        *,
        model: type[Any] | None = None,
        using: str | None = None,
        kinds: Iterable[str] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        self.kinds = tuple(kinds)
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
        # Each series of the kinds served exists from the start, at 0: `increase()` and an
        # alert on a counter see the process's first event, not only the ones after it.
        for kind in self.kinds:
            for metric in (*self.counters.values(), self.run_seconds, self.wait_seconds):
                metric.labels(kind=kind)

    def count(self, event: str, kind: str, n: int) -> None:
        counter = self.counters.get(event)
        if counter is not None:
            counter.labels(kind=kind).inc(n)

    def ran(self, kind: str, seconds: float) -> None:
        self.run_seconds.labels(kind=kind).observe(seconds)

    def waited(self, kind: str, seconds: float) -> None:
        self.wait_seconds.labels(kind=kind).observe(seconds)

    def serve_slots(self, busy: Callable[[], Mapping[str, int]], total: int) -> None:
        self.registry.register(SlotCollector(busy, total, self.kinds))


class SlotCollector(Collector):
    """A worker's slots, read at each scrape: `slots` (its `--concurrency`) and `busy_slots`
    per kind (a job handed to the slot or running), 0 for each kind it serves."""

    def __init__(
        self, busy: Callable[[], Mapping[str, int]], total: int, kinds: Iterable[str]
    ) -> None:
        self.busy = busy
        self.total = total
        self.kinds = tuple(kinds)

    def collect(self) -> Iterable[Metric]:
        busy = self.busy()
        yield GaugeMetricFamily(
            f"{PREFIX}_slots", "Jobs this worker process runs at once, at most", value=self.total
        )
        family = GaugeMetricFamily(
            f"{PREFIX}_busy_slots",
            "Slots of this worker process holding a job now (running or about to), per kind",
            labels=["kind"],
        )
        for kind in sorted({*self.kinds, *busy}):
            family.add_metric([kind], busy.get(kind, 0))
        yield family


class GaugeCache:
    """The last read of each job table's gauges, per process: scrapes within METRICS_MAX_AGE
    seconds of a read share it, and concurrent ones wait for one read instead of each opening
    a connection (Prometheus servers in pairs, several dashboards, a scrape loop gone wrong)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: dict[tuple[str, str], tuple[float, stats.QueueGauges | None]] = {}

    def get(self, model: type[Any] | None, using: str | None) -> stats.QueueGauges | None:
        """The gauges of `model` on `using`, read now or at most METRICS_MAX_AGE seconds ago;
        None if the read failed (a database error), which is kept as long."""
        jobs = leased_jobs(model, using)
        key = (jobs.db, jobs.model._meta.label)
        # One lock for every table: a read is a few index-range counts, and the scrapes of one
        # process serve one or two tables.
        with self._lock:
            read_at, gauges = self._reads.get(key, (-float("inf"), None))
            if time.monotonic() - read_at < leases_settings.METRICS_MAX_AGE:
                return gauges
            try:
                gauges = stats.queue_gauges(jobs, near_expiry=leases_settings.NEAR_EXPIRY)
            except DatabaseError:
                gauges = None
            self._reads[key] = (time.monotonic(), gauges)
            return gauges

    def clear(self) -> None:
        with self._lock:
            self._reads.clear()


GAUGES = GaugeCache()


class QueueCollector(Collector):
    """The gauges of the job table `model` (default: `JOB_MODEL`) on `using` (default: its
    write database), read at a scrape (eight index-backed queries) unless read within
    METRICS_MAX_AGE seconds (see `GaugeCache`); `django_leases_database_up` is 0 and the others
    absent when that read failed.

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
            gauges = GAUGES.get(self.model, self.using)
        finally:
            if self.close_connections:
                connections.close_all()
        if gauges is None:
            up.add_metric([], 0)
            yield up
            return
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
        kinds = sorted({kind for _, kind in gauges.by_status_and_kind})
        for name, text, counts in (
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
        ):
            # Every kind with live jobs has a series, 0 included: an alert on `> 0` sees a kind
            # before its first stuck job, and a series does not vanish when its count drops.
            family = GaugeMetricFamily(f"{PREFIX}_{name}", text, labels=["kind"])
            for kind in sorted({*kinds, *counts}):
                family.add_metric([kind], counts.get(kind, 0))
            yield family
        yield from fleet_gauges(gauges)
        yield from throttle_gauges()
        yield from horizon_gauges(gauges.horizon)


def fleet_gauges(gauges: stats.QueueGauges) -> Iterable[Metric]:
    """The oldest due job and its kind, the kinds no live worker serves, the workers live and
    late, and the watchers' last pass."""
    oldest = GaugeMetricFamily(
        f"{PREFIX}_oldest_due_job_wait_seconds",
        "How long the oldest due pending job, of the kind labelled, has waited since due "
        '(0 with kind "": none waits)',
        labels=["kind"],
    )
    wait = gauges.oldest_due.wait
    oldest.add_metric([gauges.oldest_due.kind or ""], wait.total_seconds() if wait else 0.0)
    yield oldest
    unserved = GaugeMetricFamily(
        f"{PREFIX}_unserved_jobs",
        "Pending jobs of a kind no live worker serves (no worker, or only late ones)",
        labels=["kind"],
    )
    for kind, n in sorted(gauges.unserved().items()):
        unserved.add_metric([kind], n)
    yield unserved
    workers = GaugeMetricFamily(
        f"{PREFIX}_workers",
        "Live worker processes of the registry, by state: late ones missed two heartbeats",
        labels=["state"],
    )
    workers.add_metric(["live"], len(gauges.fleet.workers) - gauges.fleet.late)
    workers.add_metric(["late"], gauges.fleet.late)
    yield workers
    ago = gauges.fleet.last_pass_ago
    if ago is not None:
        yield GaugeMetricFamily(
            f"{PREFIX}_watcher_last_pass_age_seconds",
            "Seconds since the last pass of any watcher (absent: no watcher ever made one)",
            value=ago.total_seconds(),
        )


def horizon_gauges(pin: HorizonPin | None) -> Iterable[Metric]:
    """How long, and how many transactions, the oldest holder of the vacuum horizon (InnoDB's
    purge on MariaDB/MySQL) has held it: 0 when nothing does, or the database has no horizon
    (SQLite)."""
    age = GaugeMetricFamily(
        f"{PREFIX}_horizon_pin_age_seconds",
        "How long the oldest transaction, replication slot or prepared transaction holding "
        "back the removal of dead rows has held it (0: none; one without a start time: 0)",
        labels=["source"],
    )
    xids = GaugeMetricFamily(
        f"{PREFIX}_horizon_pin_age_transactions",
        "How many transactions old that holder is (PostgreSQL)",
        labels=["source"],
    )
    source = pin.source if pin is not None else ""
    age.add_metric([source], (pin.seconds or 0.0) if pin is not None else 0.0)
    xids.add_metric([source], (pin.xids or 0) if pin is not None else 0)
    yield from (age, xids)


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


# Connections an `Endpoint` serves at once, each on a thread of its own; more are closed at
# once. A scrape is answered in milliseconds, so these are only ever taken by clients that
# send nothing.
MAX_CONNECTIONS = 8
# Seconds an `Endpoint` waits for a client to send its request (or read the answer) before it
# closes the connection: a half-open socket does not keep a thread for ever.
CLIENT_TIMEOUT = 5.0


class BoundedServer(ThreadingWSGIServer):
    """prometheus_client's server, with at most MAX_CONNECTIONS threads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class TimedHandler(_SilentHandler):
    """prometheus_client's request handler, with a socket timeout of CLIENT_TIMEOUT."""

    timeout = CLIENT_TIMEOUT


class Endpoint:
    """An HTTP server of `registry` at http://`address`:`port`/metrics, on a thread of its own,
    serving at most MAX_CONNECTIONS clients at once, each for CLIENT_TIMEOUT seconds at most.

    Raises `OSError` when the port cannot be bound. `port` is the one bound (the system chose it
    for port 0).
    """

    def __init__(self, registry: CollectorRegistry, port: int, address: str) -> None:
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("Server", (BoundedServer,), {"address_family": family})
        self._server: BoundedServer = make_server(
            address, port, make_wsgi_app(registry), server_class, handler_class=TimedHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-endpoint", daemon=True
        )
        self._thread.start()
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
