"""What comes of each lease (`worker/outcomes.py`): written once, noted fenced once."""

import sys
import time
from functools import partial
from unittest import mock

import pytest

from django_leases.lease import Lease
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import LeaseQuerySet
from django_leases.worker import LeaseWorker
from django_leases.worker.outcomes import TAKEOVER_EVERY
from tests.leasing import claim_one, expire


@pytest.mark.django_db
@pytest.mark.parametrize(("outcome", "noted_by_worker"), [("completed", 0), ("failed", 1)])
def test_outcomes__a_refused_outcome_is_noted_fenced_once(
    outcome: str, noted_by_worker: int
) -> None:
    """A completion refused after a takeover is noted in the ledger by the queryset's own
    write; the worker adds no second note. A refused failure (the queryset notes none) the
    worker notes itself."""
    PaymentJob.objects.enqueue("noop")
    zombie = claim_one("w1")
    expire(zombie)
    claim_one("w2")
    outcomes = LeaseWorker(worker_id="w1", ttl=30, heartbeat=5)._outcomes
    lease = Lease(zombie, ttl=30)
    write = lease.complete if outcome == "completed" else partial(lease.fail, "boom")
    notes: list[str] = []
    real = LeaseQuerySet.record_fenced

    def record_fenced(self: LeaseQuerySet, pk: int, token: int) -> None:
        notes.append("worker" if calls_from_outcomes() else "queryset")
        real(self, pk, token)

    with mock.patch.object(LeaseQuerySet, "record_fenced", record_fenced):
        outcomes.record(lease, outcome, write)

    assert notes.count("worker") == noted_by_worker
    assert len(notes) == 1
    assert outcomes.stats.lost == 1
    row = JobAttempt.objects.get(job_ref=zombie.pk, token=zombie.lease_token)
    assert row.fenced_at is not None


def calls_from_outcomes() -> bool:
    """Whether `record_fenced()` was called by `Outcomes` (the worker), not the queryset."""
    return sys._getframe(2).f_code.co_filename.endswith("outcomes.py")


@pytest.mark.django_db(transaction=True)
def test_outcomes__a_worker_looks_for_expired_leases_each_interval_and_after_a_takeover() -> None:
    """A worker's claims look for expired leases to take over at most every `TAKEOVER_EVERY`
    (the claims between walk no expired lease's index range: under a pinned vacuum horizon that
    range fills with dead versions), and at once again after a claim that took one over."""
    worker = LeaseWorker(worker_id="w1", ttl=30, heartbeat=5)
    outcomes = worker._outcomes
    first, second = PaymentJob.objects.enqueue("noop"), PaymentJob.objects.enqueue("noop")
    dead = claim_one("dead")
    expire(dead)
    assert outcomes.takes_over(), "a new worker's first claim looks"
    jobs = PaymentJob.objects.claim("w1", ttl=30, takeover=outcomes.takes_over())
    assert [(job.pk, job.taken_over) for job in jobs] == [(dead.pk, True)]
    outcomes.note_claimed(jobs, looked=True)
    assert outcomes.takes_over(), "it took one over: the next claim looks again"
    jobs = PaymentJob.objects.claim("w1", ttl=30, takeover=True)
    assert [(job.pk, job.taken_over) for job in jobs] == [(second.pk, False)]
    outcomes.note_claimed(jobs, looked=True)
    assert not outcomes.takes_over(), "none expired: not again before the interval"
    expire(PaymentJob.objects.get(pk=first.pk))
    third = PaymentJob.objects.enqueue("noop")
    jobs = PaymentJob.objects.claim("w1", ttl=30, limit=5, takeover=outcomes.takes_over())
    assert [job.pk for job in jobs] == [third.pk], "the expired lease waits for a look"
    outcomes.note_claimed(jobs, looked=False)
    time.sleep(TAKEOVER_EVERY)
    assert outcomes.takes_over()
    jobs = PaymentJob.objects.claim("w1", ttl=30, limit=5, takeover=outcomes.takes_over())
    assert [job.pk for job in jobs] == [first.pk]


@pytest.mark.django_db(transaction=True)
def test_outcomes__a_burst_worker_looks_for_expired_leases_before_it_ends() -> None:
    """A `--burst` worker whose claims did not look for expired leases lately does not end on
    the claim that found nothing due: its next claim looks, and takes the expired lease over."""
    PaymentJob.objects.enqueue("noop")
    expired = claim_one("dead")
    expire(expired)
    due = PaymentJob.objects.enqueue("noop")
    worker = LeaseWorker(worker_id="w1", ttl=30, heartbeat=5, burst=True, concurrency=1)
    worker._outcomes._takeover_at = time.monotonic() + 3600  # looked a moment ago
    stats = worker.run()
    assert stats.claimed == 2
    done = PaymentJob.objects.filter(status=PaymentJob.Status.COMPLETED)
    assert set(done.values_list("pk", flat=True)) == {expired.pk, due.pk}
