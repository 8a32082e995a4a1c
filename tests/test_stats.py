"""The admin's read-only numbers, and the `finished_within()` read they use."""

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from django_leases import stats
from django_leases.exceptions import InvalidDuration
from django_leases.handlers import registered_kinds
from django_leases.models import JobAttempt, PaymentJob, Worker

pytestmark = pytest.mark.django_db


def job_in(status: str, *, kind: str = "capture", **values: Any) -> PaymentJob:
    """A job set straight to `status` (times by the database clock, given as expressions)."""
    job = PaymentJob.objects.enqueue(kind)
    if status == "processing":
        values = {"lease_owner": "w1", "lease_until": Now() + timedelta(seconds=60), **values}
    if status in ("completed", "failed", "cancelled"):
        values = {"completed_at": Now(), **values}
    PaymentJob.objects.filter(pk=job.pk).update(status=status, **values)
    return job


def running_since(ago: timedelta, *, kind: str = "capture") -> PaymentJob:
    """A job claimed now whose attempt's ledger row says it started `ago` (database clock)."""
    job = PaymentJob.objects.enqueue(kind)
    claimed = PaymentJob.objects.claim_job(job.pk, "w-long", ttl=60)
    assert claimed is not None
    JobAttempt.objects.filter(job_ref=job.pk, token=claimed.lease_token).update(
        claimed_at=Now() - ago
    )
    return claimed


def test_finished_within__final_statuses_inside_the_window() -> None:
    inside = [job_in(status) for status in ("completed", "failed", "cancelled")]
    job_in("completed", completed_at=Now() - timedelta(hours=2))
    job_in("pending")
    job_in("processing")
    job_in("review")
    expected = {job.pk for job in inside}
    assert set(PaymentJob.objects.finished_within(3600).values_list("pk", flat=True)) == expected
    within = timedelta(minutes=30)
    assert set(PaymentJob.objects.finished_within(within).values_list("pk", flat=True)) == expected
    with pytest.raises(InvalidDuration):
        PaymentJob.objects.finished_within(0)


def test_lease_state__agrees_with_the_queryset_reads() -> None:
    offsets = [-3600, -5, 3, 10, 17, 24, 60, 3600]
    jobs = [job_in("processing", lease_until=Now() + timedelta(seconds=s)) for s in offsets]
    job_in("completed", lease_until=Now() + timedelta(seconds=600))  # a finished job's old lease
    annotated = stats.with_lease_clock(PaymentJob.objects.all())
    states = {job.pk: stats.lease_state(job.lease_left, 20) for job in annotated}
    reads = {
        stats.STUCK: PaymentJob.objects.expired(),
        stats.NEAR_EXPIRY: PaymentJob.objects.near_expiry(20),
        stats.HEALTHY: PaymentJob.objects.healthy(20),
    }
    for state, queryset in reads.items():
        assert {pk for pk, s in states.items() if s == state} == set(
            queryset.values_list("pk", flat=True)
        )
    assert [states[job.pk] for job in jobs] == ["stuck"] * 2 + ["near_expiry"] * 3 + ["healthy"] * 3
    assert list(states.values()).count(None) == 1


def test_with_lease_clock__times_by_the_database_clock() -> None:
    job = job_in(
        "processing",
        lease_until=Now() + timedelta(seconds=45),
        heartbeat_at=Now() - timedelta(seconds=15),
    )
    annotated = stats.with_lease_clock(PaymentJob.objects.filter(pk=job.pk)).get()
    assert annotated.lease_left.total_seconds() == pytest.approx(45, abs=2)
    assert annotated.heartbeat_age.total_seconds() == pytest.approx(15, abs=2)


def test_selection__splits_processing_jobs_by_lease() -> None:
    job_in("processing")
    job_in("processing", lease_until=Now() - timedelta(seconds=1))
    job_in("processing", lease_until=Now() - timedelta(seconds=1))
    job_in("pending")
    job_in("completed")
    assert stats.selection(PaymentJob.objects.all()) == {
        stats.LIVE_LEASE: 1,
        stats.STUCK: 2,
        "pending": 1,
        "completed": 1,
    }
    assert stats.selection(PaymentJob.objects.none()) == {}


def test_kinds__registered_and_live_only() -> None:
    job_in("pending", kind="refund")
    job_in("processing", kind="webhook")
    job_in("failed", kind="archived")
    kinds = stats.kinds(PaymentJob.objects.all())
    assert kinds == sorted({*registered_kinds(), "refund", "webhook"})


def test_throughput__per_database_minute() -> None:
    job_in("completed")
    job_in("completed")
    job_in("completed", completed_at=Now() - timedelta(minutes=5))
    job_in("failed", completed_at=Now() - timedelta(minutes=30))
    job_in("cancelled")
    job_in("completed", completed_at=Now() - timedelta(minutes=90))
    chart, totals = stats.throughput(PaymentJob.objects.all())
    assert totals == {"completed": 3, "failed": 1, "cancelled": 1}
    assert len(chart) == 60
    assert [m.start for m in chart] == sorted(m.start for m in chart)
    assert chart[-1].start - chart[0].start == timedelta(minutes=59)
    # A minute may turn between the writes and the read: allow the later bucket.
    busy = {i: (m.completed, m.failed) for i, m in enumerate(chart) if m.total}
    assert busy in (
        {59: (2, 0), 54: (1, 0), 29: (0, 1)},
        {58: (2, 0), 53: (1, 0), 28: (0, 1)},
    )


def test_overview__nine_queries(django_assert_num_queries: Any) -> None:
    job_in("processing", lease_until=Now() - timedelta(seconds=5))
    job_in("pending", run_at=Now() - timedelta(minutes=2))
    job_in("review")
    long_runner = running_since(timedelta(hours=2))
    Worker.objects.register("w1", instance="test", hostname="h", pid=1, kinds=[], concurrency=1)
    with django_assert_num_queries(9):
        data = stats.overview(PaymentJob.objects.all(), Worker.objects.all(), near_expiry=20)
    assert (data.total, data.stuck, data.near_expiry, data.under_review) == (4, 1, 0, 1)
    assert data.running_long == 1 and [job.pk for job in data.long_runners] == [long_runner.pk]
    assert data.long_runners[0].running_for >= timedelta(hours=2)
    assert data.oldest_due_wait is not None
    assert data.oldest_due_wait.total_seconds() == pytest.approx(120, abs=5)
    assert [w.worker_id for w in data.workers] == ["w1"]
    assert len(data.stuck_jobs) == 1 and data.stuck_jobs[0].lease_left < timedelta(0)
