"""Handlers the worker tests run. Behaviour is steered by the payload, never by globals."""

import time

from django_leases import PermanentError, job_handler
from django_leases.models import PaymentJob

from .models import Charge


def duration(job, lease) -> float:
    """Seconds this attempt should take: payload "durations" per attempt, or "seconds"."""
    durations = job.payload.get("durations")
    if durations:
        return float(durations[min(lease.attempt, len(durations)) - 1])
    return float(job.payload.get("seconds", 0))


@job_handler("noop")
def noop(job, lease):
    return None


@job_handler("sleep")
def sleep(job, lease):
    """Sleep without looking at the lease, like a blocking PSP call."""
    time.sleep(duration(job, lease))


@job_handler("boom")
def boom(job, lease):
    raise RuntimeError(job.payload.get("message", "boom"))


@job_handler("permanent")
def permanent(job, lease):
    raise PermanentError("card declined")


@job_handler("charge")
def charge(job, lease):
    """Sleep, then record a charge and complete the job in one transaction."""
    time.sleep(duration(job, lease))
    with lease.atomic():
        Charge.objects.create(job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("risky")
def risky(job, lease):
    """Reach the risky checkpoint, then take as long as the payload says."""
    lease.checkpoint("psp_called")
    time.sleep(duration(job, lease))


def ask_the_psp(job):
    return job.payload.get("psp_says", "completed")


@job_handler("risky_reconciled", reconcile=ask_the_psp)
def risky_reconciled(job, lease):
    lease.checkpoint("psp_called")
    time.sleep(duration(job, lease))


@job_handler("self_fail")
def self_fail(job, lease):
    """Record the failure itself, then return."""
    lease.fail("declined by the PSP", permanent=True)


@job_handler("leaky")
def leaky(job, lease):
    """Insert a job whose idempotency key already exists: the IntegrityError quotes the card."""
    PaymentJob.objects.create(kind="noop", idempotency_key=job.payload["card"])
