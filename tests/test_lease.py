"""`Lease`, what a handler holds: its deadline, its writes, `atomic()` and the async forms."""

import threading
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction
from django.db.models.functions import Now

from django_leases.exceptions import LeaseError, LeaseLost
from django_leases.lease import Lease, Presence
from django_leases.models import JobAttempt, PaymentJob
from django_leases.worker.counters import WorkerStats
from django_leases.worker.heartbeat import Heartbeat, RegistryRow

from .owner_rules import check

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
    assert job.pk == lease.pk and job.lease_token > lease.token
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


def test_lease__lost_once_its_worker_may_look_gone_before_its_ttl() -> None:
    """A worker's registry beat is WORKER_GONE_AFTER old: the watcher may rescue its jobs, so
    its leases are lost then too, however long their TTL."""
    job = held().job
    now = time.monotonic()
    presence = Presence(gone_after=5)
    presence.confirmed(now - 4)
    lease = Lease(job, ttl=60, renewed_at=now, presence=presence)
    assert not lease.lost and lease.valid_until == pytest.approx(now + 1)
    presence.confirmed(now - 6)  # an older beat moves nothing back
    assert not lease.lost
    stale = Presence(gone_after=5)
    stale.confirmed(now - 6)
    gone = Lease(job, ttl=60, renewed_at=now, presence=stale)
    assert gone.lost
    with pytest.raises(LeaseLost, match="WORKER_GONE_AFTER"):
        gone.check()
    with pytest.raises(LeaseLost), gone.atomic():
        pass
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PROCESSING


@pytest.mark.django_db(transaction=True)
def test_lease__atomic_refuses_to_run_inside_another_atomic_block() -> None:
    """Inside an outer block the completion would commit or roll back with that block: the
    lease must not be marked finished by a completion that may still roll back."""
    lease = held()
    with pytest.raises(LeaseError, match="inside another atomic block"):
        with transaction.atomic():
            with lease.atomic():
                pass
    assert not lease.finished and lease.outcome is None
    assert PaymentJob.objects.get(pk=lease.pk).status == Status.PROCESSING
    with lease.atomic():
        pass
    assert lease.finished
    assert PaymentJob.objects.get(pk=lease.pk).status == Status.COMPLETED


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lease__a_finished_lease_is_never_lost_by_the_clock() -> None:
    """The database took its outcome under its token: nobody owned the job before, so the
    clock passing its deadline later (a lease clock reading it late) marks nothing."""
    clock = FakeClock()
    job = held().job
    lease = Lease(job, ttl=2, presence=_presence(clock))
    lease.complete()
    clock.now += 10
    assert not lease.lost and lease.lost_reason == ""
    unfinished = Lease(held().job, ttl=2, presence=_presence(clock))
    clock.now += 10
    assert unfinished.lost  # the rule still holds for a lease not finished


def test_heartbeat__its_lease_clock_leaves_a_lease_being_written_to_that_write() -> None:
    """A thousand completions behind one SQLite writer: a lease whose outcome is being
    written passes its deadline during the write; the write decides, the clock says nothing
    (it logged "lease lost" for jobs that then completed)."""
    clock = FakeClock()
    writing = Lease(held().job, ttl=2, presence=_presence(clock))
    running = Lease(held().job, ttl=2, presence=_presence(clock))
    writing.ending = True
    clock.now += 3
    beat = Heartbeat(
        PaymentJob.objects.all(),
        RegistryRow(
            using="default",
            worker_id="w1",
            instance="i",
            kinds=["capture"],
            concurrency=2,
            presence=_presence(clock),
        ),
        held=lambda: [writing, running],
        tidy=lambda: None,
        taken=lambda why: None,
        stats=WorkerStats(),
        ttl=2,
        interval=0.5,
        stopped=threading.Event(),
    )
    beat._until_deadline()  # the clock's wait, read first, marks nothing either
    assert not writing.marked_lost and not running.marked_lost
    assert beat._live([writing, running]) == [writing]
    assert not writing.marked_lost and running.marked_lost
    writing.mark_lost("refused")  # the write found it lost: the clock reports it then
    assert beat._live([writing]) == []


def _presence(clock: FakeClock) -> Presence:
    presence = Presence(gone_after=3600, clock=clock)
    presence.confirmed(clock.now)
    return presence


@pytest.mark.parametrize("rule", ["Lease", "Lease lost", "Lease.ending"])
def test_lease__its_state_is_written_by_its_own_methods_under_its_lock(rule: str) -> None:
    assert check(rule) == []


class SlowSum(float):
    """A monotonic time whose sum with the TTL takes `delay` seconds: the thread computing the
    new deadline lets the other run meanwhile, as the scheduler may at any bytecode."""

    delay = 0.0

    def __add__(self, other: object) -> float:
        time.sleep(self.delay)
        return float(self) + float(other)  # type: ignore[arg-type]


def at(seconds: float, delay: float) -> SlowSum:
    started = SlowSum(seconds)
    started.delay = delay
    return started


@pytest.mark.django_db(transaction=False)
def test_lease__two_threads_renewing_never_lower_its_deadline() -> None:
    """The heartbeat and the handler's own `heartbeat()` renew one lease on two threads: the
    earlier renewal, its deadline computed more slowly, must not overwrite the later one."""
    job = PaymentJob(pk=1, lease_owner="w", lease_token=1, attempts=1)
    for round_ in range(5):
        lease = Lease(job, ttl=30, renewed_at=0.0)
        early, late = at(100.0 + round_, 0.05), at(200.0 + round_, 0.0)
        start = threading.Barrier(2)

        def renew(started: SlowSum, lease: Lease = lease, start: threading.Barrier = start) -> None:
            start.wait()
            lease.renewed(started)

        threads = [threading.Thread(target=renew, args=(t,)) for t in (early, late)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert lease._renewed_until == 230.0 + round_
