"""`Lease`, what a handler holds: its deadline, its writes, `atomic()` and the async forms."""

import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db.models.functions import Now

from django_leases.exceptions import LeaseLost
from django_leases.lease import Lease
from django_leases.models import JobAttempt, PaymentJob

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


def held(owner: str = "w1", ttl: float = 60) -> Lease:
    job = PaymentJob.objects.enqueue("capture")
    (claimed,) = PaymentJob.objects.claim(owner, ttl=ttl)
    assert claimed.pk == job.pk
    return Lease(claimed, ttl=ttl)


def take_over(lease: Lease, owner: str = "w2") -> PaymentJob:
    """Expire the lease by the database clock and let `owner` claim the job."""
    PaymentJob.objects.filter(pk=lease.pk).update(lease_until=Now() - timedelta(seconds=1))
    (job,) = PaymentJob.objects.claim(owner, ttl=60)
    assert (job.pk, job.lease_token) == (lease.pk, lease.token + 1)
    return job


def test_lease__lost_once_a_whole_ttl_passed_without_a_renewal() -> None:
    lease = held()
    assert not lease.lost
    late = Lease(lease.job, ttl=0.5, renewed_at=time.monotonic() - 1)
    assert late.lost
    with pytest.raises(LeaseLost, match="not renewed for a whole TTL"):
        late.check()


def test_lease__heartbeat_renews_in_the_database_and_moves_the_deadline() -> None:
    lease = held(ttl=30)
    before = PaymentJob.objects.get(pk=lease.pk).lease_until
    lease.ttl = 300  # the next renewal asks for more
    lease.heartbeat()
    assert PaymentJob.objects.get(pk=lease.pk).lease_until > before + timedelta(seconds=200)
    assert not lease.lost


def test_lease__a_refused_heartbeat_marks_it_lost_and_changes_nothing() -> None:
    lease = held()
    job = take_over(lease)
    with pytest.raises(LeaseLost):
        lease.heartbeat()
    assert lease.lost
    fresh = PaymentJob.objects.get(pk=lease.pk)
    assert (fresh.lease_owner, fresh.lease_token, fresh.lease_until) == (
        "w2",
        job.lease_token,
        job.lease_until,
    )


def test_lease__atomic_commits_the_handlers_writes_with_the_completion() -> None:
    lease = held()
    other = PaymentJob.objects.enqueue("refund", run_at=3600)
    with lease.atomic():
        PaymentJob.objects.filter(pk=other.pk).update(priority=7)
    assert (lease.finished, lease.outcome) == (True, "completed")
    assert PaymentJob.objects.get(pk=lease.pk).status == Status.COMPLETED
    assert PaymentJob.objects.get(pk=other.pk).priority == 7
    assert JobAttempt.objects.get(job_ref=lease.pk).outcome == "completed"


def test_lease__atomic_rolls_the_writes_back_when_the_lease_was_lost() -> None:
    lease = held()
    other = PaymentJob.objects.enqueue("refund", run_at=3600)
    take_over(lease)
    with pytest.raises(LeaseLost), lease.atomic():
        PaymentJob.objects.filter(pk=other.pk).update(priority=7)
    assert lease.lost and not lease.finished
    assert PaymentJob.objects.get(pk=other.pk).priority == 0
    assert PaymentJob.objects.get(pk=lease.pk).lease_owner == "w2"


def test_lease__async_forms_write_through_the_same_conditional_updates() -> None:
    lease = held()
    other = PaymentJob.objects.enqueue("refund", run_at=3600)
    async_to_sync(lease.acheckpoint)("psp_called")
    assert PaymentJob.objects.get(pk=lease.pk).checkpoint == "psp_called"
    changed = async_to_sync(lease.aatomic)(
        PaymentJob.objects.filter(pk=other.pk).update, priority=3
    )
    assert changed == 1
    assert PaymentJob.objects.get(pk=lease.pk).status == Status.COMPLETED
    with pytest.raises(LeaseLost):
        async_to_sync(lease.aheartbeat)()
