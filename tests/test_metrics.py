"""Prometheus metrics: scraped from real `run_lease_worker` and `watch_stuck_jobs` processes."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db.backends.signals import connection_created
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import path
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from django_leases import metrics, stats
from django_leases.models import JobAttempt, PaymentJob

from . import throttled
from .conftest import (
    HORIZON_READS,
    ROOT,
    Processes,
    finish,
    modules_importing,
    read_until,
    subprocess_env,
    wait_for,
)
from .testapp.models import PayoutJob

Status = PaymentJob.Status
LOCAL = ("--metrics-port", "0", "--metrics-address", "127.0.0.1")
# Scrapes a moment apart each read the database here: the tests change rows between them.
NEAR_EXPIRY = {"NEAR_EXPIRY": 300, "METRICS_MAX_AGE": 0.001}
# The view, routed as a project would route it: for JOB_MODEL, and for an own table.
urlpatterns = [
    path("metrics/", metrics.queue_metrics),
    path("metrics/payouts/", metrics.queue_metrics, {"model": "testapp.PayoutJob"}),
]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(autouse=True)
def _no_gauges_of_another_test() -> None:
    metrics.GAUGES.clear()


def parse(text: str) -> Samples:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a local URL
        return parse(response.read().decode())


def endpoint(proc: "subprocess.Popen[str]") -> str:
    out = read_until(proc, "metrics at http://127.0.0.1:")
    match = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", out)
    assert match, out
    return match.group(1)


def command(*args: str) -> "subprocess.CompletedProcess[str]":
    """Run a management command to its end; what it printed is in `stdout` and `stderr`."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics__only_the_metrics_module_imports_prometheus_client() -> None:
    assert modules_importing("prometheus_client") == ["django_leases/metrics.py"]


# ---- a real worker process ---------------------------------------------------------------


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker_metrics__counters_move_with_the_jobs_it_ran(processes: Processes) -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("noop")
    retried = PaymentJob.objects.enqueue("boom", max_attempts=3)
    failed = PaymentJob.objects.enqueue("boom", max_attempts=1)
    declined = PaymentJob.objects.enqueue("permanent")
    # A backoff of minutes: the retried job is not claimed again while the test looks.
    slow_backoff = json.dumps({"BACKOFF_BASE": 300, "BACKOFF_MAX": 600})
    proc = processes.manage(
        "run_lease_worker",
        "--worker-id",
        "metered",
        "--poll-interval",
        "0.1",
        *LOCAL,
        env=subprocess_env(LEASES_TEST_SETTINGS=slow_backoff),
    )
    url = endpoint(proc)

    def counted(expected: dict[tuple[str, str], float]) -> Callable[[], Samples | None]:
        def check() -> Samples | None:
            samples = scrape(url)
            got = {(name, kind): value(samples, name, kind=kind) for name, kind in expected}
            return samples if got == expected else None

        return check

    first = {
        ("django_leases_claims_total", "noop"): 3,
        ("django_leases_claims_total", "boom"): 2,
        ("django_leases_claims_total", "permanent"): 1,
        ("django_leases_completions_total", "noop"): 3,
        ("django_leases_retries_total", "boom"): 1,
        ("django_leases_failures_total", "boom"): 1,
        ("django_leases_failures_total", "permanent"): 1,
        ("django_leases_job_run_seconds_count", "noop"): 3,
        ("django_leases_job_wait_seconds_count", "noop"): 3,
    }
    samples = wait_for(counted(first))
    assert isinstance(samples, dict)
    assert PaymentJob.objects.get(pk=retried.pk).status == Status.PENDING
    assert PaymentJob.objects.get(pk=failed.pk).status == Status.FAILED
    assert PaymentJob.objects.get(pk=declined.pk).status == Status.FAILED
    assert value(samples, "django_leases_completions_total", kind="boom") == 0
    assert value(samples, "django_leases_retries_total", kind="noop") == 0
    for name in ("fenced_out_writes", "leases_lost", "timeouts"):
        assert value(samples, f"django_leases_{name}_total", kind="noop") == 0

    # Two more jobs: the same process's counters move by two.
    for _ in range(2):
        PaymentJob.objects.enqueue("noop")
    wait_for(
        counted(
            {
                **first,
                ("django_leases_claims_total", "noop"): 5,
                ("django_leases_completions_total", "noop"): 5,
                ("django_leases_job_run_seconds_count", "noop"): 5,
                ("django_leases_job_wait_seconds_count", "noop"): 5,
            }
        )
    )
    assert PaymentJob.objects.filter(kind="noop", status=Status.COMPLETED).count() == 5

    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    with pytest.raises(OSError):  # the endpoint went with the process
        scrape(url)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker_metrics__busy_slots_per_kind_while_handlers_run(processes: Processes) -> None:
    sleeping = [PaymentJob.objects.enqueue("sleep", {"seconds": 4}) for _ in range(2)]
    proc = processes.manage(
        "run_lease_worker",
        "--concurrency",
        "3",
        "--poll-interval",
        "0.1",
        "--kind",
        "sleep",
        "--kind",
        "noop",
        *LOCAL,
    )
    url = endpoint(proc)

    def busy(samples: Samples) -> dict[str, float | None]:
        keys = {kind: ("django_leases_busy_slots", (("kind", kind),)) for kind in ("sleep", "noop")}
        return {kind: samples.get(key) for kind, key in keys.items()}

    def both_busy() -> Samples | None:
        samples = scrape(url)
        return samples if busy(samples)["sleep"] == 2 else None

    samples = wait_for(both_busy)
    assert isinstance(samples, dict)
    # The kind it serves and runs nothing of is there, at 0; the slots it has, beside.
    assert busy(samples) == {"sleep": 2, "noop": 0}
    assert value(samples, "django_leases_slots") == 3
    assert (
        PaymentJob.objects.filter(pk__in=[j.pk for j in sleeping], status="processing").count() == 2
    )
    # Once the handlers return, the slots are free again.
    wait_for(lambda: busy(scrape(url)) == {"sleep": 0, "noop": 0}, timeout=30)
    assert PaymentJob.objects.filter(kind="sleep", status=Status.COMPLETED).count() == 2


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker_metrics__a_timeout_is_counted(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("hangs", {"seconds": 30}, max_attempts=1)
    proc = processes.manage(
        "run_lease_worker",
        "--worker-id",
        "timed",
        "--poll-interval",
        "0.1",
        "--kind",
        "hangs",
        *LOCAL,
    )
    url = endpoint(proc)
    wait_for(lambda: value(scrape(url), "django_leases_timeouts_total", kind="hangs") == 1)
    # Its handler still runs: stopping (lock and limit slot kept) until it returns, then failed.
    row = PaymentJob.objects.get(pk=job.pk)
    assert (row.status, row.ends_as) == (Status.STOPPING, Status.FAILED)
    assert value(scrape(url), "django_leases_completions_total", kind="hangs") == 0


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker_metrics__a_paused_worker_counts_its_lost_lease_and_fenced_out_write(
    processes: Processes,
) -> None:
    # The paused holder's attempt sleeps 20 s, so it is still running when the process resumes
    # (its heartbeat is refused), and ends later (its outcome is fenced out).
    job = PaymentJob.objects.enqueue("sleep", {"durations": [20, 1]})
    zombie = processes.manage(
        "run_lease_worker", "--worker-id", "zombie", "--ttl", "2", "--heartbeat", "0.4",
        "--poll-interval", "0.1", "--kind", "sleep", "-v", "2", *LOCAL,
    )  # fmt: skip
    url = endpoint(zombie)
    # Paused in the handler: a lease found run out before its start is never started.
    read_until(zombie, f"started job_id={job.pk} ")
    os.killpg(zombie.pid, signal.SIGSTOP)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())
    processes.manage(
        "run_lease_worker", "--worker-id", "owner", "--ttl", "3", "--heartbeat", "0.5",
        "--poll-interval", "0.1", "--kind", "sleep",
    )  # fmt: skip
    wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, lease_owner="owner", attempts=2).exists())
    os.killpg(zombie.pid, signal.SIGCONT)

    wait_for(lambda: value(scrape(url), "django_leases_leases_lost_total", kind="sleep") == 1)
    samples = wait_for(
        lambda: (
            (samples := scrape(url))
            and value(samples, "django_leases_fenced_out_writes_total", kind="sleep") == 1
            and samples
        ),
        timeout=60,
    )
    assert isinstance(samples, dict)
    assert value(samples, "django_leases_claims_total", kind="sleep") == 1
    assert value(samples, "django_leases_completions_total", kind="sleep") == 0
    assert value(samples, "django_leases_leases_lost_total", kind="sleep") == 1
    wait_for(lambda: PaymentJob.objects.get(pk=job.pk).status == Status.COMPLETED, timeout=60)
    assert list(
        JobAttempt.objects.filter(job_ref=job.pk).order_by("token").values_list("owner", "outcome")
    ) == [("zombie", "lease_lost"), ("owner", "completed")]


def test_worker_metrics__port_in_use_is_a_one_line_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = command(
            "run_lease_worker", "--metrics-port", str(port), "--metrics-address", "127.0.0.1"
        )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"CommandError: --metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_worker_metrics__bad_port_is_refused(port: str) -> None:
    proc = command("run_lease_worker", "--metrics-port", port)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("CommandError: run_lease_worker: argument --metrics-port:"), line


# ---- without the extra ----------------------------------------------------------------------

# Runs a management command in a Python where prometheus_client cannot be imported.
WITHOUT_PROMETHEUS = (
    "import sys; sys.modules['prometheus_client'] = None; "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_without_prometheus_client__worker_runs_and_metrics_port_is_refused(
    processes: Processes,
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    refused = processes.start("-c", WITHOUT_PROMETHEUS, "run_lease_worker", "--metrics-port", "0")
    out = finish(refused)
    assert refused.returncode == 1
    assert out.strip().splitlines() == [
        "CommandError: --metrics-port needs prometheus_client: "
        'pip install "django-leases[prometheus]"'
    ]
    assert PaymentJob.objects.get(pk=job.pk).attempts == 0  # refused before any claim

    plain = processes.start("-c", WITHOUT_PROMETHEUS, "run_lease_worker", "--burst")
    out = finish(plain)
    assert plain.returncode == 0, out
    assert PaymentJob.objects.get(pk=job.pk).status == Status.COMPLETED

    watcher = processes.start("-c", WITHOUT_PROMETHEUS, "watch_stuck_jobs", "--once")
    out = finish(watcher)
    assert watcher.returncode == 0, out


def test_watcher_metrics__refused_with_once() -> None:
    proc = command("watch_stuck_jobs", "--once", *LOCAL)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert "--metrics-port needs a watcher that keeps running" in line


# ---- the queue's gauges ---------------------------------------------------------------------


def backdate_attempt(job: PaymentJob, ago: timedelta) -> None:
    JobAttempt.objects.filter(job_ref=job.pk, ended_at__isnull=True).update(claimed_at=Now() - ago)


def make_queue() -> None:
    """Due and future pending jobs of two kinds, live, near-expiry and long leases, a review."""
    for kind in ("capture", "capture", "refund"):
        PaymentJob.objects.enqueue(kind)
    future = PaymentJob.objects.enqueue("refund")
    PaymentJob.objects.filter(pk=future.pk).update(run_at=Now() + timedelta(hours=1))
    oldest = PaymentJob.objects.enqueue("capture")
    PaymentJob.objects.filter(pk=oldest.pk).update(run_at=Now() - timedelta(minutes=10))
    for name in ("live", "near", "long"):
        job = PaymentJob.objects.enqueue("capture", payment_id=name)
        PaymentJob.objects.claim_job(job.pk, f"w-{name}", ttl=600)
    # Near expiry by NEAR_EXPIRY, yet minutes away from expiring on a slow run.
    PaymentJob.objects.filter(payment_id="near").update(lease_until=Now() + timedelta(seconds=240))
    backdate_attempt(PaymentJob.objects.get(payment_id="long"), timedelta(hours=2))
    review = PaymentJob.objects.enqueue("refund")
    PaymentJob.objects.filter(pk=review.pk).update(status=Status.REVIEW)
    done = PaymentJob.objects.enqueue("capture")
    PaymentJob.objects.filter(pk=done.pk).update(status=Status.COMPLETED, completed_at=Now())


def expected_gauges() -> Samples:
    """The gauges as counted in Python from every row (not the SQL under test)."""
    rows = list(PaymentJob.objects.all())
    expected: Samples = {}
    for job in rows:
        if job.status in stats.LIVE_STATUSES:
            key = ("django_leases_jobs", (("kind", job.kind), ("status", job.status)))
            expected[key] = expected.get(key, 0) + 1
    for job in rows:
        key = ("django_leases_jobs_under_review", (("kind", job.kind),))
        if job.status in stats.LIVE_STATUSES:
            expected[key] = expected.get(key, 0) + (job.status == Status.REVIEW)
    return expected


@pytest.mark.django_db
@pytest.mark.urls(__name__)
@override_settings(DJANGO_LEASES=NEAR_EXPIRY)
def test_queue_metrics__gauges_match_the_rows(
    client: Client, django_assert_num_queries: Any
) -> None:
    make_queue()
    with django_assert_num_queries(8 + HORIZON_READS):  # stats.queue_gauges(), once a scrape
        response = client.get("/metrics/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    samples = parse(response.content.decode())
    gauges = {key: n for key, n in samples.items() if key[0] == "django_leases_jobs"}
    expected = expected_gauges()
    assert gauges == {key: n for key, n in expected.items() if key[0] == "django_leases_jobs"}
    assert gauges[("django_leases_jobs", (("kind", "capture"), ("status", "pending")))] == 3
    assert value(samples, "django_leases_database_up") == 1
    assert value(samples, "django_leases_jobs_under_review", kind="refund") == 1
    assert value(samples, "django_leases_jobs_stuck", kind="capture") == 0
    assert value(samples, "django_leases_jobs_near_expiry", kind="capture") == 1
    assert value(samples, "django_leases_jobs_running_long", kind="capture") == 1
    wait = value(samples, "django_leases_oldest_due_job_wait_seconds", kind="capture")
    assert 600 <= wait < 3600

    PaymentJob.objects.filter(payment_id="live").update(lease_until=Now() - timedelta(seconds=1))
    samples = parse(client.get("/metrics/").content.decode())
    assert value(samples, "django_leases_jobs_stuck", kind="capture") == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_watcher_metrics__rescues_and_gauges_of_a_real_watcher(processes: Processes) -> None:
    make_queue()
    PaymentJob.objects.filter(payment_id="live").update(lease_until=Now() - timedelta(seconds=1))
    proc = processes.manage(
        "watch_stuck_jobs",
        "--interval",
        "3600",
        *LOCAL,
        env=subprocess_env(LEASES_TEST_SETTINGS=json.dumps(NEAR_EXPIRY)),
    )
    url = endpoint(proc)
    read_until(proc, "1 job(s) acted on")  # its first pass rescued the stuck job
    samples = scrape(url)
    assert value(samples, "django_leases_rescues_total", kind="capture", action="retry") == 1
    expected = expected_gauges()
    assert {key: n for key, n in samples.items() if key[0] == "django_leases_jobs"} == {
        key: n for key, n in expected.items() if key[0] == "django_leases_jobs"
    }
    assert value(samples, "django_leases_jobs_stuck", kind="capture") == 0

    # A lease that expires after the pass shows at the next scrape, by the database clock.
    PaymentJob.objects.filter(payment_id="near").update(lease_until=Now() - timedelta(seconds=1))
    samples = scrape(url)
    assert value(samples, "django_leases_jobs_stuck", kind="capture") == 1
    assert value(samples, "django_leases_jobs_near_expiry", kind="capture") == 0
    assert value(samples, "django_leases_jobs_running_long", kind="capture") == 1

    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["run_lease_worker", "watch_stuck_jobs"])
def test_metrics_endpoint__listens_on_this_host_only_by_default(
    processes: Processes, name: str
) -> None:
    # The endpoint is unauthenticated: without --metrics-address it must not face the network.
    proc = processes.manage(name, "--metrics-port", "0", env=subprocess_env())
    out = read_until(proc, "/metrics")
    match = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", out)
    assert match, out
    with urllib.request.urlopen(match.group(1), timeout=10) as response:  # noqa: S310 - local
        assert response.status == 200  # it answers there


def two_tables() -> None:
    """Jobs of JOB_MODEL (one of them stuck) and of the own table PayoutJob (one held)."""
    for _ in range(3):
        PaymentJob.objects.enqueue("capture")
    stuck = PaymentJob.objects.enqueue("capture", payment_id="stuck")
    PaymentJob.objects.claim_job(stuck.pk, "w-gone", ttl=600)
    PaymentJob.objects.filter(pk=stuck.pk).update(lease_until=Now() - timedelta(seconds=1))
    for recipient in ("a", "b", "held"):
        PayoutJob.objects.enqueue("payout.send", recipient=recipient)
    held = PayoutJob.objects.get(recipient="held")
    PayoutJob.objects.claim_job(held.pk, "w-live", ttl=600)


def job_series(samples: Samples) -> Samples:
    return {key: n for key, n in samples.items() if key[0] == "django_leases_jobs"}


PAYOUT_SERIES = {
    ("django_leases_jobs", (("kind", "payout.send"), ("status", "pending"))): 2,
    ("django_leases_jobs", (("kind", "payout.send"), ("status", "processing"))): 1,
}


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_queue_metrics__the_urlconf_chooses_the_job_table(client: Client) -> None:
    two_tables()
    payouts = parse(client.get("/metrics/payouts/").content.decode())
    assert job_series(payouts) == PAYOUT_SERIES
    assert value(payouts, "django_leases_jobs_stuck", kind="payout.send") == 0
    default = parse(client.get("/metrics/").content.decode())
    assert job_series(default) == {
        ("django_leases_jobs", (("kind", "capture"), ("status", "pending"))): 3,
        ("django_leases_jobs", (("kind", "capture"), ("status", "processing"))): 1,
    }
    assert value(default, "django_leases_jobs_stuck", kind="capture") == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_watcher_metrics__the_gauges_of_its_model(processes: Processes) -> None:
    """`watch_stuck_jobs --model X --metrics-port N` serves X's gauges (it served JOB_MODEL's)."""
    two_tables()
    proc = processes.manage(
        "watch_stuck_jobs", "--model", "testapp.PayoutJob", "--interval", "3600", *LOCAL
    )
    samples = scrape(endpoint(proc))
    assert job_series(samples) == PAYOUT_SERIES
    # JOB_MODEL's stuck job is neither counted nor rescued by a watcher of another table.
    assert value(samples, "django_leases_jobs_stuck", kind="capture") == 0
    proc.send_signal(signal.SIGTERM)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert "0 job(s) acted on" in out, out
    assert PaymentJob.objects.expired().filter(payment_id="stuck").exists()


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_queue_metrics__report_the_limits_per_kind(client: Client) -> None:
    throttled.register()
    try:
        samples = parse(client.get("/metrics/").content.decode())
    finally:
        throttled.unregister()
    limits = {key: n for key, n in samples.items() if key[0].startswith("django_leases_kind_")}
    assert limits == {
        ("django_leases_kind_limit", (("kind", "capped"),)): 2,
        ("django_leases_kind_rate_jobs", (("kind", "rated"),)): 3,
        ("django_leases_kind_rate_window_seconds", (("kind", "rated"),)): 1.0,
    }


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
# Long enough for every scrape of the test to fall within one read, however slow the host.
@override_settings(DJANGO_LEASES={"METRICS_MAX_AGE": 600})
def test_metrics_endpoint__concurrent_scrapes_share_one_database_read() -> None:
    make_queue()
    exporter = metrics.WatcherMetrics()
    endpoint = metrics.Endpoint(exporter.registry, 0, "127.0.0.1")
    opened: list[str] = []

    def count(sender: object, connection: Any, **kwargs: object) -> None:
        # Which request opened it: MySQLdb's backend may open a second, short connection on
        # the same thread to read the server's version.
        opened.append(threading.current_thread().name)

    connection_created.connect(count)
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        with ThreadPoolExecutor(max_workers=8) as pool:
            scrapes = list(pool.map(lambda _: scrape(url), range(24)))
    finally:
        connection_created.disconnect(count)
        endpoint.close()
    # One request read the database for 24 scrapes (before: each of them).
    assert len(set(opened)) == 1, opened
    assert {value(samples, "django_leases_database_up") for samples in scrapes} == {1}
    assert {
        value(samples, "django_leases_jobs_under_review", kind="refund") for samples in scrapes
    } == {1}


def serving_threads() -> int:
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


@pytest.mark.django_db(transaction=True)
def test_metrics_endpoint__half_open_sockets_hold_a_bounded_number_of_threads_for_a_while() -> None:
    endpoint = metrics.Endpoint(metrics.WatcherMetrics().registry, 0, "127.0.0.1")
    idle = []
    try:
        for _ in range(40):  # connect, and send nothing
            idle.append(socket.create_connection(("127.0.0.1", endpoint.port), timeout=10))
        # Each thread gives up its silent client after CLIENT_TIMEOUT; until then, never more
        # than MAX_CONNECTIONS of them (before: one per socket, 40).
        counts: list[int] = []
        wait_for(lambda: counts.append(serving_threads()) or counts[-1] == 0 and max(counts))
        assert 1 <= max(counts) <= metrics.MAX_CONNECTIONS, counts
        samples = scrape(f"http://127.0.0.1:{endpoint.port}/metrics")
        assert value(samples, "django_leases_database_up") == 1
    finally:
        for sock in idle:
            sock.close()
        endpoint.close()


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_queue_metrics__late_workers_unserved_kinds_and_the_oldest_due_kind(
    client: Client,
) -> None:
    from .test_admin import fleet_of_two

    fleet_of_two()
    samples = parse(client.get("/metrics/").content.decode())

    assert value(samples, "django_leases_workers", state="live") == 1
    assert value(samples, "django_leases_workers", state="late") == 1
    unserved = {k: n for k, n in samples.items() if k[0] == "django_leases_unserved_jobs"}
    assert unserved == {
        ("django_leases_unserved_jobs", (("kind", "captur"),)): 1,
        ("django_leases_unserved_jobs", (("kind", "refund"),)): 1,
    }
    assert 170 < value(samples, "django_leases_oldest_due_job_wait_seconds", kind="captur") < 600
    assert ("django_leases_watcher_last_pass_age_seconds", ()) not in samples


@pytest.mark.django_db
def test_worker_metrics__every_series_of_the_kinds_served_exists_from_the_start() -> None:
    exporter = metrics.WorkerMetrics(kinds=["capture", "refund"])
    samples = parse(generate_latest(exporter.registry).decode())
    for kind in ("capture", "refund"):
        for name, _ in metrics.WORKER_COUNTERS.values():
            assert (f"django_leases_{name}_total", (("kind", kind),)) in samples
        assert value(samples, "django_leases_job_run_seconds_count", kind=kind) == 0
    assert not [key for key in samples if key[0].endswith("_created")], samples


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_docs__alert_rules_pass_promtool(tmp_path: Path) -> None:
    """The alert rules of docs/metrics.md, as a user copies them, are valid Prometheus rules."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    match = re.search(r"```yaml\n(# leases-rules\.yml\n.*?)```", text, re.S)
    assert match, "docs/metrics.md has no leases-rules.yml block"
    rules = tmp_path / "leases-rules.yml"
    rules.write_text(match.group(1))
    checked = subprocess.run(
        ["promtool", "check", "rules", str(rules)],  # noqa: S607 - found on PATH above
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 8 rules found" in checked.stdout
