"""The queue history: a minute's rows per kind as the watcher writes them, written once by
racing watchers, and pruned by prune_jobs."""

import threading
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.db.models.functions import Now

from django_leases.models import JobAttempt, PaymentJob, QueueMinute
from django_leases.querysets.base import database_now
from django_leases.querysets.history import (
    ALL_KINDS,
    BACKFILL,
    BOUNDS,
    KEPT,
    MINUTE,
    SETTLE,
    aggregate_minute,
    bucket_of,
    quantile,
)
from django_leases.tables import queue_history
from django_leases.watcher import StuckWatcher

pytestmark = pytest.mark.django_db


def closed_minute(back: int = 3) -> datetime:
    """The start of the minute `back` minutes before the database clock's current one."""
    return database_now(connection.alias).replace(second=0, microsecond=0) - back * MINUTE


def ran(
    kind: str, start: datetime, *, waited: float, took: float, outcome: str = "completed"
) -> PaymentJob:
    """A job of `kind` due at `start`, claimed `waited` s later and ended after `took` s with
    `outcome` ("completed", "failed": final; "retried": back to pending), through the lease API,
    its times then moved to those."""
    job = PaymentJob.objects.enqueue(kind)
    claimed = PaymentJob.objects.claim_job(job.pk, "w1", ttl=60)
    assert claimed is not None
    if outcome == "completed":
        PaymentJob.objects.complete(job.pk, "w1", claimed.lease_token)
    else:
        error = ValueError("declined")
        PaymentJob.objects.fail(
            job.pk, "w1", claimed.lease_token, error, permanent=outcome == "failed"
        )
    claimed_at = start + timedelta(seconds=waited)
    ended_at = claimed_at + timedelta(seconds=took)
    PaymentJob.objects.filter(pk=job.pk).update(
        run_at=start, completed_at=ended_at if outcome != "retried" else None
    )
    JobAttempt.objects.filter(job_ref=job.pk).update(claimed_at=claimed_at, ended_at=ended_at)
    job.refresh_from_db()
    assert job.status == ("pending" if outcome == "retried" else outcome)
    return job


def test_quantile__interpolates_inside_the_bucket() -> None:
    counts = [0] * (len(BOUNDS) + 1)
    counts[bucket_of(0.3)] = 10  # (0.25, 0.5]
    assert quantile(counts, 0.5) == pytest.approx(0.375)
    assert quantile(counts, 1.0) == pytest.approx(0.5)
    counts[-1] = 10  # beyond the last bound
    assert quantile(counts, 0.95) == BOUNDS[-1]
    assert quantile([0] * len(counts), 0.5) is None
    assert bucket_of(0.0) == bucket_of(-1.0) == 0 and bucket_of(1.0) == BOUNDS.index(1.0)


def test_aggregate_minute__counts_each_kind_and_every_kind(settings: Any) -> None:
    minute = closed_minute()
    for took in (0.2, 0.2, 0.2, 4.0):
        ran("capture", minute, waited=0.03, took=took)
    ran("capture", minute, waited=20, took=1, outcome="failed")
    ran("capture", minute, waited=1, took=0.1, outcome="retried")
    ran("refund", minute + timedelta(seconds=30), waited=2, took=7)
    # Outside the minute: ended at its end (the next minute's), or a minute before.
    ran("refund", minute, waited=58, took=2)
    ran("refund", minute - MINUTE, waited=1, took=1)
    # A retried attempt claimed longer than LONG_RUNNING before the minute is not counted.
    settings.DJANGO_LEASES = {"LONG_RUNNING": 600}
    ran("refund", minute - timedelta(seconds=700), waited=0, took=710, outcome="retried")
    due = PaymentJob.objects.enqueue("refund")
    PaymentJob.objects.filter(pk=due.pk).update(run_at=Now() - timedelta(minutes=1))

    kinds = aggregate_minute(PaymentJob.objects.all(), minute, depth=True)

    capture, refund = kinds["capture"], kinds["refund"]
    assert (capture.completed, capture.failed, capture.retried) == (4, 1, 1)
    assert (refund.completed, refund.failed, refund.retried) == (1, 0, 0)
    # Wait and run times of the attempts that finished the jobs (the retried one is not).
    assert capture.wait[bucket_of(0.03)] == 4 and capture.wait[bucket_of(20)] == 1
    assert capture.run[bucket_of(0.2)] == 3 and capture.run[bucket_of(4.0)] == 1
    assert sum(capture.run) == sum(capture.wait) == 5
    assert refund.wait[bucket_of(2)] == refund.run[bucket_of(7)] == sum(refund.run) == 1
    # The backlog: due pending jobs now (the retried capture is due again, at once).
    assert (capture.depth, refund.depth) == (1, 2)

    history = queue_history(connection.alias)
    assert history.record_minute(PaymentJob.objects.all(), minute, kinds, depth=True)
    # A second writer of the minute writes nothing.
    assert not history.record_minute(PaymentJob.objects.all(), minute, kinds, depth=True)
    rows = {row.kind: row for row in QueueMinute.objects.filter(minute=minute)}
    assert set(rows) == {ALL_KINDS, "capture", "refund"}
    every = rows[ALL_KINDS]
    assert (every.completed, every.failed, every.retried, every.depth) == (5, 1, 1, 3)
    assert every.run_counts == [a + b for a, b in zip(capture.run, refund.run, strict=True)]
    assert rows["capture"].run_p50 == pytest.approx(quantile(capture.run, 0.5))
    assert 0.1 < rows["capture"].run_p50 <= 0.25 and 2.5 < rows["capture"].run_p95 <= 5.0
    assert 10 < rows["capture"].wait_p95 <= 30


def test_record__closed_minutes_once_the_open_one_never() -> None:
    history = queue_history(connection.alias)
    jobs = PaymentJob.objects.all()
    now = database_now(connection.alias)

    written = history.record(jobs)

    # A fresh table fills in the last BACKFILL closed minutes, oldest first, each once.
    assert len(written) == BACKFILL and written == sorted(written)
    assert written[-1] + MINUTE <= now - SETTLE  # closed, and settled
    assert written[-1] >= now.replace(second=0, microsecond=0) - 2 * MINUTE
    assert QueueMinute.objects.filter(kind=ALL_KINDS).count() == BACKFILL
    # Only the newest minute knows its backlog; later passes write nothing more until the next.
    newest = QueueMinute.objects.get(kind=ALL_KINDS, minute=written[-1])
    assert newest.depth == 0
    assert QueueMinute.objects.get(kind=ALL_KINDS, minute=written[0]).depth is None
    again = history.record(jobs)
    assert len(again) <= 1 and set(again).isdisjoint(written)


def test_watcher__records_the_history_in_its_pass() -> None:
    ran("capture", closed_minute(2), waited=0.1, took=0.1)
    StuckWatcher(using=connection.alias).run_once()
    assert QueueMinute.objects.filter(kind="capture", completed=1).count() == 1
    assert QueueMinute.objects.filter(kind=ALL_KINDS).count() >= BACKFILL


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_record__racing_watchers_write_each_minute_once() -> None:
    minute = closed_minute(2)
    for i in range(6):
        ran("capture", minute, waited=0.1 * i, took=0.5)
    racers = 4
    start = threading.Barrier(racers)
    written: list[list[datetime]] = []
    errors: list[BaseException] = []

    def watcher() -> None:
        try:
            start.wait()
            written.append(queue_history(connection.alias).record(PaymentJob.objects.all()))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=watcher) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    minutes = [minute for each in written for minute in each]
    # Every minute written by exactly one of them, whole.
    assert len(minutes) == len(set(minutes)) == BACKFILL
    rows = QueueMinute.objects.filter(kind=ALL_KINDS)
    assert rows.count() == BACKFILL
    capture = QueueMinute.objects.get(kind="capture")
    assert (capture.minute, capture.completed, sum(capture.run_counts)) == (minute, 6, 6)


def test_prune_jobs__deletes_history_past_a_week_and_a_day() -> None:
    now = database_now(connection.alias).replace(second=0, microsecond=0)
    label = PaymentJob._meta.label_lower
    for age in (timedelta(seconds=KEPT) + MINUTE, timedelta(days=7), timedelta(minutes=5)):
        QueueMinute.objects.create(job_model=label, kind=ALL_KINDS, minute=now - age)
    QueueMinute.objects.create(
        job_model="other.job", kind=ALL_KINDS, minute=now - timedelta(days=9)
    )

    out = StringIO()
    call_command("prune_jobs", "--dry-run", stdout=out)
    assert "1 history row(s) would be pruned" in out.getvalue()
    assert QueueMinute.objects.count() == 4
    call_command("prune_jobs", stdout=out)
    assert "1 history row(s) pruned" in out.getvalue()

    kept = QueueMinute.objects.filter(job_model=label).values_list("minute", flat=True)
    assert sorted(kept) == [now - timedelta(days=7), now - timedelta(minutes=5)]
    # Another job table's history is its own prune's.
    assert QueueMinute.objects.filter(job_model="other.job").count() == 1
