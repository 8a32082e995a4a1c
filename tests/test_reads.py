"""The lease reads (querysets/reads.py): lease states by the database clock."""

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_leases.models import JobAttempt, PaymentJob

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


def expire(job: PaymentJob, seconds: float = 5) -> None:
    """Make the job's lease end `seconds` ago, by the database clock."""
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=seconds))


def claim_one(owner: str = "w1", **kwargs: object) -> PaymentJob:
    (job,) = PaymentJob.objects.claim(owner, ttl=60, **kwargs)  # type: ignore[arg-type]
    return job


def statements(ctx: CaptureQueriesContext) -> list[str]:
    """The SQL statements captured, without transaction and savepoint bookkeeping."""
    bookkeeping = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK")
    return [q["sql"] for q in ctx.captured_queries if not q["sql"].startswith(bookkeeping)]


def ledger(job: PaymentJob) -> list[tuple[int, int, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "token", "owner", "outcome")
    )


def test_expired_and_near_expiry__split_processing_jobs_by_time_left() -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("a")
    stale, near, healthy = PaymentJob.objects.claim("w1", ttl=600, limit=3)
    expire(stale)
    PaymentJob.objects.filter(pk=near.pk).update(lease_until=Now() + timedelta(seconds=10))
    assert list(PaymentJob.objects.expired().values_list("pk", flat=True)) == [stale.pk]
    assert list(PaymentJob.objects.near_expiry(20).values_list("pk", flat=True)) == [near.pk]
    assert (
        list(PaymentJob.objects.near_expiry(timedelta(seconds=5)).values_list("pk", flat=True))
        == []
    )
    assert list(PaymentJob.objects.healthy(20).values_list("pk", flat=True)) == [healthy.pk]
