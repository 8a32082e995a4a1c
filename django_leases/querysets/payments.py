"""`PaymentJob`'s queryset: `enqueue()` with the payment id."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

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
        idempotency_key: str | None = None,
        run_at: datetime | float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        **fields: Any,
    ) -> PaymentJob:
        """Add a pending payment job and return it; see `LeaseQuerySet.enqueue()`.

        `payment_id` (at most 64 characters; None: none) is stored for handlers and searches.
        """
        if payment_id is not None:
            check_text(payment_id, "payment_id", PAYMENT_ID_LENGTH, blank=True)
        return super().enqueue(
            kind,
            payload,
            idempotency_key=idempotency_key,
            run_at=run_at,
            priority=priority,
            max_attempts=max_attempts,
            payment_id=payment_id or "",
            **fields,
        )
