"""`PaymentJob`'s queryset: `enqueue()` with the payment id, locked by payment by default."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django_leases.conf import leases_settings
from django_leases.limits import PAYMENT_ID_LENGTH, check_text
from django_leases.querysets.leases import LeaseQuerySet

if TYPE_CHECKING:
    from django_leases.models import PaymentJob


class PaymentJobQuerySet(LeaseQuerySet["PaymentJob"]):
    """`LeaseQuerySet` whose `enqueue()` takes the payment a job is about."""

    def enqueue(
        self,
        kind: str,
        payload: Any = None,
        *,
        payment_id: str | None = None,
        using: str | None = None,
        idempotency_key: str | None = None,
        run_at: datetime | float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        lock: str | None = None,
        **fields: Any,
    ) -> PaymentJob:
        """Add a pending payment job (waiting, behind an earlier job of its lock) and return
        it; see `LeaseQuerySet.enqueue()`.

        `payment_id` (at most 64 characters; None: none) is stored for handlers and searches.
        By default (`LOCK_BY_PAYMENT`) a job with a `payment_id` is locked by its payment
        ("payment:<id>"): one job of a payment at a time, in enqueue order; `lock=""` opts it
        out.
        """
        return super().enqueue(
            kind,
            payload,
            using=using,
            idempotency_key=idempotency_key,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            **self._enqueue_options({"payment_id": payment_id, "lock": lock, **fields}),
        )

    def _enqueue_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Check `payment_id` and derive the lock from it (`LOCK_BY_PAYMENT`) unless one is
        given."""
        options = dict(options)
        payment_id = options.pop("payment_id", None)
        lock = options.pop("lock", None)
        if payment_id is not None:
            check_text(payment_id, "payment_id", PAYMENT_ID_LENGTH, blank=True)
        if lock is None:
            by_payment = payment_id and leases_settings.LOCK_BY_PAYMENT
            lock = f"payment:{payment_id}" if by_payment else ""
        return {**options, "lock": lock, "payment_id": payment_id or ""}
