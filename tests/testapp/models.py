from django.db import models

from django_leases.models import (
    AbstractJobAttempt,
    AbstractLeasedJob,
    attempt_constraints,
    attempt_indexes,
    lease_constraints,
    lease_indexes,
)


class Charge(models.Model):
    """A business write made by a handler inside `lease.atomic()`."""

    job_ref = models.BigIntegerField()
    token = models.PositiveBigIntegerField()
    owner = models.CharField(max_length=255)

    def __str__(self) -> str:
        return f"charge for job {self.job_ref} by {self.owner}"


class PayoutJob(AbstractLeasedJob):
    """A project's own job table: leases, enqueue() and the admin on its own columns."""

    recipient = models.CharField(max_length=64, blank=True, default="")
    idempotency_key = models.CharField(max_length=255, null=True, blank=True, unique=True)

    attempt_model = "testapp.PayoutAttempt"

    class Meta:
        indexes = lease_indexes("tp_payout")
        constraints = lease_constraints("tp_payout")

    def __str__(self) -> str:
        return f"payout {self.pk} to {self.recipient}"


class PayoutAttempt(AbstractJobAttempt):
    """The attempt ledger of `PayoutJob`."""

    job = models.ForeignKey(
        PayoutJob, null=True, on_delete=models.SET_NULL, related_name="attempt_log"
    )

    class Meta:
        indexes = attempt_indexes("tp_payout_attempt")
        constraints = attempt_constraints("tp_payout_attempt")

    def __str__(self) -> str:
        return f"payout {self.job_ref} attempt {self.attempt}: {self.outcome}"


class BareJob(AbstractLeasedJob):
    """A job table without a ledger and without an idempotency key."""

    class Meta:
        indexes = lease_indexes("tp_bare")
        constraints = lease_constraints("tp_bare")

    def __str__(self) -> str:
        return f"bare job {self.pk}"
