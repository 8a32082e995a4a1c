"""The demo's shop side (`Payment`) and the fake PSP's own books (`FakePspCharge`)."""

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _


class PaymentStatus(models.TextChoices):
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
