"""The demo's shop side (`Payment`, `Followup`) and the fake PSP's own books (`FakePspCharge`,
`FakePspCall`), which live in a database of their own (`routers.py`)."""

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class PaymentStatus(models.TextChoices):
    NEW = "new", _("New")
    """The customer placed the order; its checkout job has not authorized the card yet."""
    PENDING = "pending", _("Pending")
    """Checkout started; the shop has not heard back from the PSP yet."""
    AUTHORIZED = "authorized", _("Authorized")
    """The card was authorized; the money still has to be captured."""
    CAPTURED = "captured", _("Captured")
    """The PSP took the money."""
    DECLINED = "declined", _("Declined")
    """The PSP refused the capture."""
    REFUNDED = "refunded", _("Refunded")
    """The money went back to the customer."""
    EXPIRED = "expired", _("Expired")
    """Checkout was abandoned: the PSP never charged."""


class Payment(models.Model):
    """A customer's payment as the shop sees it."""

    Status = PaymentStatus

    amount = models.PositiveBigIntegerField(
        _("amount"), help_text=_("In minor units: 1250 is 12.50.")
    )
    currency = models.CharField(_("currency"), max_length=3)
    status = models.CharField(
        _("status"), max_length=20, choices=PaymentStatus.choices, default=PaymentStatus.AUTHORIZED
    )
    psp_reference = models.CharField(_("PSP reference"), max_length=64, blank=True, default="")
    created_at = models.DateTimeField(_("created at"), db_default=Now())
    updated_at = models.DateTimeField(_("updated at"), db_default=Now())

    class Meta:
        verbose_name = _("payment")
        verbose_name_plural = _("payments")
        constraints = [
            models.CheckConstraint(condition=Q(amount__gt=0), name="payment_amount_positive"),
            models.CheckConstraint(
                condition=Q(status__in=PaymentStatus.values),
                name="payment_status_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"payment {self.pk}: {self.amount} {self.currency} ({self.status})"


class FakePspCharge(models.Model):
    """One money movement the fake PSP made, or refused, under one idempotency key.

    It lives in the shop's database only so that separate worker processes share it; the shop
    itself never writes it (see `psp.py`).
    """

    class Operation(models.TextChoices):
        AUTHORIZE = "authorize", _("Authorize")
        CAPTURE = "capture", _("Capture")
        REFUND = "refund", _("Refund")

    class Outcome(models.TextChoices):
        SUCCEEDED = "succeeded", _("Succeeded")
        DECLINED = "declined", _("Declined")
        REJECTED = "rejected", _("Rejected")

    idempotency_key = models.CharField(_("idempotency key"), max_length=255, unique=True)
    operation = models.CharField(_("operation"), max_length=10, choices=Operation.choices)
    payment_ref = models.CharField(_("merchant reference"), max_length=64, db_index=True)
    amount = models.PositiveBigIntegerField(_("amount"))
    currency = models.CharField(_("currency"), max_length=3)
    outcome = models.CharField(_("outcome"), max_length=10, choices=Outcome.choices)
    reference = models.CharField(_("PSP reference"), max_length=64, unique=True)
    message = models.CharField(_("message"), max_length=255, blank=True, default="")
    replays = models.PositiveIntegerField(
        _("replays"),
        default=0,
        help_text=_("Later calls with this key: answered again, no money moved."),
    )
    created_at = models.DateTimeField(_("created at"), db_default=Now())

    class Meta:
        verbose_name = _("fake PSP charge")
        verbose_name_plural = _("fake PSP charges")

    def __str__(self) -> str:
        return f"{self.operation} {self.reference}: {self.outcome}"


class FakePspCall(models.Model):
    """One call that reached the fake PSP, answered afresh or replayed from its idempotency key.

    `metadata` is what the caller sent along (the demo's checkout sends its attempt), as a real
    PSP keeps a request's metadata: the audit holds the calls of each step against its record.
    """

    idempotency_key = models.CharField(_("idempotency key"), max_length=255, db_index=True)
    operation = models.CharField(
        _("operation"), max_length=10, choices=FakePspCharge.Operation.choices
    )
    replayed = models.BooleanField(_("replayed"))
    metadata = models.JSONField(_("metadata"), default=dict, blank=True)
    created_at = models.DateTimeField(_("created at"), db_default=Now())

    class Meta:
        verbose_name = _("fake PSP call")
        verbose_name_plural = _("fake PSP calls")

    def __str__(self) -> str:
        return f"{self.operation} {self.idempotency_key}{' (replayed)' if self.replayed else ''}"


class Followup(models.Model):
    """What the shop did once a payment moved: a webhook sent, a ledger posting, a receipt.

    Written with the completion of the job (or the step) that did it, so it exists once per
    completed job; `payment_status` is the payment's status as the job found it when it started.
    """

    class Kind(models.TextChoices):
        WEBHOOK = "webhook", _("Webhook")
        LEDGER = "ledger", _("Ledger posting")
        RECEIPT = "receipt", _("Receipt")

    kind = models.CharField(_("kind"), max_length=10, choices=Kind.choices)
    payment = models.ForeignKey(Payment, on_delete=models.CASCADE, verbose_name=_("payment"))
    job_ref = models.BigIntegerField(_("job id"))
    payment_status = models.CharField(
        _("payment status seen"), max_length=20, choices=PaymentStatus.choices
    )
    amount = models.PositiveBigIntegerField(_("amount posted"), default=0)
    created_at = models.DateTimeField(_("created at"), db_default=Now())

    class Meta:
        verbose_name = _("follow-up")
        verbose_name_plural = _("follow-ups")

    def __str__(self) -> str:
        return f"{self.kind} of payment {self.payment_id} (job {self.job_ref})"
