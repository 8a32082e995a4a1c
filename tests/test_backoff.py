"""Retry backoff: capped exponential with full jitter, whatever the attempt number."""

import pytest
from django.db.models.functions import Now
from django.test import override_settings

from django_leases.backoff import retry_delay
from django_leases.models import JobAttempt, PaymentJob

from .conftest import Processes

Status = PaymentJob.Status


@override_settings(DJANGO_LEASES={"BACKOFF_BASE": 2.0, "BACKOFF_MAX": 600.0})
@pytest.mark.parametrize("attempt", [0, 1, 2, 10, 1024, 1025, 1100, 10**6, 10**18])
def test_retry_delay__stays_between_base_and_cap_at_any_attempt(attempt: int) -> None:
    delays = [retry_delay(attempt) for _ in range(50)]
    assert all(2.0 <= delay <= 600.0 for delay in delays)


@override_settings(DJANGO_LEASES={"BACKOFF_BASE": 0.001, "BACKOFF_MAX": 3e9})
def test_retry_delay__reaches_a_huge_cap_without_overflow() -> None:
    assert retry_delay(1) == 0.001
    assert max(retry_delay(10**6) for _ in range(50)) > 3e9 / 2


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__retries_a_job_on_its_1025th_attempt(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("boom", max_attempts=5)
    # Attempt 1024 already used (never reset); the next acquisition is the 1025th.
    PaymentJob.objects.filter(pk=job.pk).update(attempts=1024, lease_token=1024, max_attempts=2000)

    proc = processes.manage(
        "run_lease_worker", "--burst", "--kind", "boom", "--ttl", "5", "--heartbeat", "1"
    )
    out = proc.communicate(timeout=120)[0]

    assert proc.returncode == 0, out
    job.refresh_from_db()
    assert (job.status, job.attempts) == (Status.PENDING, 1025)
    # Due after the capped delay (BACKOFF_MAX 600 s by default), by the database clock.
    assert PaymentJob.objects.filter(pk=job.pk, run_at__gt=Now()).exists()
    row = JobAttempt.objects.get(job_ref=job.pk)
    assert (row.attempt, row.outcome, row.error_class) == (1025, "retried", "RuntimeError")
