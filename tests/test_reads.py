"""The lease reads (querysets/reads.py): lease states by the database clock."""

from datetime import timedelta

import pytest
from django.db.models.functions import Now

from django_leases.models import PaymentJob
from tests.leasing import expire

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


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
