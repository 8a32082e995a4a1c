"""What comes of each lease (`worker/outcomes.py`): written once, noted fenced once."""

import sys
from functools import partial
from unittest import mock

import pytest

from django_leases.lease import Lease
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import LeaseQuerySet
from django_leases.worker import LeaseWorker
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
