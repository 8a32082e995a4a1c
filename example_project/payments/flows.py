"""The demo's audit of its multi-job and multi-step flows, held against the fake PSP's books.

- Checkouts (`jobs.checkout`) run authorize -> capture -> notify as resumable steps. Every PSP
  call of a step carries the attempt that made it; a call from an attempt later than the one
  that recorded the step would be a step run again after its record: there must be none.
- Webhooks and ledger postings wait for their capture (`after=`): each writes one follow-up,
  with the payment's status as it found it on starting, which must be settled. A dependent of a
  capture that failed is held (waiting) for an operator: settled, as far as the demo goes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from django.db.models import QuerySet

from django_leases.lease import step_key
from django_leases.models import JobStep, PaymentJob
from example_project.payments.models import FakePspCall, Followup, Payment

Status = PaymentJob.Status
CHECKOUT_STEPS = ("authorize", "capture", "notify")
# The steps that call the PSP, under their step keys.
PSP_STEPS = ("authorize", "capture")
FOLLOW_UPS = (Followup.Kind.WEBHOOK, Followup.Kind.LEDGER)
# What a dependent of a capture may find: the capture completed (captured or declined), and a
# refund that waited for it too may have completed since.
SETTLED = {Payment.Status.CAPTURED, Payment.Status.DECLINED, Payment.Status.REFUNDED}


@dataclass(frozen=True)
class FlowAudit:
    """What the checkouts' steps and the captures' dependents did."""

    steps_recorded: int
    resumed: int
    """Checkouts that completed in a later attempt, skipping steps an earlier one recorded."""
    steps_skipped: int
    step_reruns: int
    """PSP calls of a recorded step from an attempt later than the one that recorded it."""
    step_replays: int
    """PSP calls of a step answered from its key: the step ran again before it was recorded."""
    follow_ups: int
    started_early: int
    """Webhooks and ledger postings that found their payment not settled yet."""
    ran_twice: int
    """Jobs with more than one follow-up."""
    held: int


def held(jobs: QuerySet[PaymentJob]) -> int:
    """Count the jobs of `jobs` waiting for a prerequisite that failed or was cancelled."""
    waiting = [
        pks or [] for pks in jobs.filter(status=Status.WAITING).values_list("waits_for", flat=True)
    ]
    named = {pk for pks in waiting for pk in pks}
    stopped = set(
        PaymentJob.objects.filter(
            pk__in=named, status__in=[Status.FAILED, Status.CANCELLED]
        ).values_list("pk", flat=True)
    )
    return sum(1 for pks in waiting if stopped.intersection(pks))


def audit_flows(jobs: QuerySet[PaymentJob]) -> FlowAudit:
    """Hold the checkouts' recorded steps against the PSP's calls, and the dependents'
    follow-ups against their payments."""
    checkouts = list(jobs.filter(kind="checkout"))
    recorded = {
        (job_ref, name): attempt
        for job_ref, name, attempt in JobStep.objects.filter(
            job_ref__in=[job.pk for job in checkouts]
        ).values_list("job_ref", "name", "attempt")
    }
    keys = {step_key(job, name): (job.pk, name) for job in checkouts for name in PSP_STEPS}
    calls = FakePspCall.objects.filter(idempotency_key__in=list(keys))
    reruns = replays = 0
    for key, metadata, replayed in calls.values_list("idempotency_key", "metadata", "replayed"):
        replays += replayed
        recorded_in = recorded.get(keys[key])
        reruns += recorded_in is not None and int(metadata.get("attempt", 0)) > recorded_in
    skipped = Counter(
        job.pk
        for job in checkouts
        for name in CHECKOUT_STEPS
        if job.status == Status.COMPLETED
        and recorded.get((job.pk, name), job.attempts) < job.attempts
    )
    dependents = jobs.filter(kind__in=FOLLOW_UPS).values("pk")
    follow_ups = Followup.objects.filter(job_ref__in=dependents, kind__in=FOLLOW_UPS)
    per_job = Counter(follow_ups.values_list("job_ref", flat=True))
    return FlowAudit(
        steps_recorded=len(recorded),
        resumed=len(skipped),
        steps_skipped=skipped.total(),
        step_reruns=reruns,
        step_replays=replays,
        follow_ups=follow_ups.count(),
        started_early=follow_ups.exclude(payment_status__in=SETTLED).count(),
        ran_twice=sum(1 for count in per_job.values() if count > 1),
        held=held(jobs),
    )
