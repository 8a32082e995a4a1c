"""The admin's read-only numbers, and the `finished_within()` read they use."""

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from django_leases import stats
from django_leases.exceptions import InvalidDuration
from django_leases.handlers import registered_kinds
from django_leases.models import JobAttempt, PaymentJob, Worker

from .conftest import HORIZON_READS

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


def test_finished_counts__per_final_status_in_the_window() -> None:
    job_in("completed")
    job_in("completed")
    job_in("completed", completed_at=Now() - timedelta(minutes=5))
    job_in("failed", completed_at=Now() - timedelta(minutes=30))
    job_in("cancelled")
    job_in("completed", completed_at=Now() - timedelta(minutes=90))
    totals = stats.finished_counts(PaymentJob.objects.all())
    assert totals == {"completed": 3, "failed": 1, "cancelled": 1}
    assert stats.finished_counts(PaymentJob.objects.all(), minutes=10) == {
        "completed": 3,
        "cancelled": 1,
    }


def test_overview__eighteen_queries(django_assert_num_queries: Any) -> None:
    job_in("processing", lease_until=Now() - timedelta(seconds=5))
    job_in("pending", run_at=Now() - timedelta(minutes=2))
    job_in("review")
    long_runner = running_since(timedelta(hours=2))
    Worker.objects.register("w1", instance="test", hostname="h", pid=1, kinds=[], concurrency=1)
    with django_assert_num_queries(18 + HORIZON_READS):
        data = stats.overview(PaymentJob.objects.all(), Worker.objects.all(), near_expiry=20)
    assert (data.total, data.under_review) == (stats.Tally(4), stats.Tally(1))
    assert (data.stuck, data.near_expiry) == (1, 0)
    assert data.running_long == 1 and [job.pk for job in data.long_runners] == [long_runner.pk]
    assert data.long_runners[0].running_for >= timedelta(hours=2)
    assert data.oldest_due.wait is not None
    assert data.oldest_due.wait.total_seconds() == pytest.approx(120, abs=5)
    assert [w.worker_id for w in data.fleet.workers] == ["w1"]
    assert len(data.stuck_jobs) == 1 and data.stuck_jobs[0].lease_left < timedelta(0)


# ---- long runners --------------------------------------------------------------------------


def test_running_longer_than__by_the_ledgers_claim_time_whatever_the_heartbeats() -> None:
    old = running_since(timedelta(minutes=30))
    young = running_since(timedelta(minutes=5))
    # A heartbeat renews the lease, not the attempt: it still runs long.
    PaymentJob.objects.heartbeat("w-long", {old.pk: old.lease_token}, ttl=600)
    finished = running_since(timedelta(hours=3))
    PaymentJob.objects.filter(pk=finished.pk).update(status="completed", completed_at=Now())
    job_in("pending")

    def long(seconds: float | timedelta) -> set[int]:
        return set(PaymentJob.objects.running_longer_than(seconds).values_list("pk", flat=True))

    assert long(600) == {old.pk}
    assert long(timedelta(minutes=1)) == {old.pk, young.pk}
    assert long(3600) == set()
    with pytest.raises(InvalidDuration, match="seconds"):
        PaymentJob.objects.running_longer_than(-1)


def test_running_longer_than__a_new_attempt_starts_the_clock_again() -> None:
    job = running_since(timedelta(hours=1))
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=1))
    taken = PaymentJob.objects.claim_job(job.pk, "w-next", ttl=60)  # takes the expired lease
    assert taken is not None and taken.attempts == 2
    assert not PaymentJob.objects.running_longer_than(600).exists()
    assert PaymentJob.objects.running_longer_than(600, by_kind={"capture": 3600}).count() == 0


def test_running_longer_than__per_kind_limits() -> None:
    capture = running_since(timedelta(minutes=20), kind="capture")
    refund = running_since(timedelta(minutes=20), kind="refund")
    webhook = running_since(timedelta(minutes=20), kind="webhook")

    def long(**by_kind: float) -> set[int]:
        jobs = PaymentJob.objects.running_longer_than(600, by_kind=by_kind)
        return set(jobs.values_list("pk", flat=True))

    assert long() == {capture.pk, refund.pk, webhook.pk}
    assert long(capture=3600) == {refund.pk, webhook.pk}
    assert long(capture=3600, refund=3600) == {webhook.pk}
    assert long(capture=60, refund=3600, webhook=7200) == {capture.pk}


def test_long_running_limits__handler_timeout_else_the_setting(settings: Any) -> None:
    settings.DJANGO_LEASES = {"LONG_RUNNING": 42}
    default, by_kind = stats.long_running_limits()
    assert default == 42.0
    assert by_kind["hangs"] == 1.5  # tests/testapp/jobs.py: @job_handler("hangs", timeout=1.5)
    assert "noop" not in by_kind
    assert stats.long_running_limit("noop") == 42.0
    assert stats.long_running_limit("hangs") == 1.5


def test_with_running_for__processing_jobs_only() -> None:
    job = running_since(timedelta(minutes=7))
    pending = job_in("pending")
    annotated = {j.pk: j.running_for for j in PaymentJob.objects.with_running_for()}
    assert annotated[pending.pk] is None
    assert timedelta(minutes=7) <= annotated[job.pk] < timedelta(minutes=8)


def test_queue_gauges__eight_queries(django_assert_num_queries: Any) -> None:
    running_since(timedelta(hours=1))
    job_in("pending", kind="refund")
    job_in("review", kind="refund")
    job_in("completed")
    with django_assert_num_queries(8 + HORIZON_READS):
        gauges = stats.queue_gauges(PaymentJob.objects.all(), near_expiry=20)
    assert gauges.by_status_and_kind == {
        ("processing", "capture"): 1,
        ("pending", "refund"): 1,
        ("review", "refund"): 1,
    }
    assert (gauges.stuck, gauges.near_expiry, gauges.under_review, gauges.running_long) == (
        {},
        {},
        {"refund": 1},
        {"capture": 1},
    )
