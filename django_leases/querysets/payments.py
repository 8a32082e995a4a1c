"""Enqueueing: the checked arguments of a new job, the idempotency key, the NOTIFY."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connections, models, transaction

from django_leases.conf import leases_settings, to_seconds
from django_leases.limits import (
    IDEMPOTENCY_KEY_LENGTH,
    KIND_LENGTH,
    MAX_ATTEMPTS,
    PAYMENT_ID_LENGTH,
    PRIORITY,
    check_datetime,
    check_int,
    check_json,
    check_text,
)
from django_leases.querysets.base import after
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.sql import postgresql as statements

if TYPE_CHECKING:
    from django_leases.models import PaymentJob


class PaymentJobQuerySet(LeaseQuerySet["PaymentJob"]):
    """`LeaseQuerySet` plus enqueueing of payment jobs."""

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
    ) -> PaymentJob:
        """Add a pending job and return it.

        Enqueueing an `idempotency_key` that already exists returns the first job and creates
        nothing. `run_at` is a datetime, or a delay (seconds or `timedelta`) from the database
        clock; None means now. Raises `InvalidPayload` (and writes nothing) if `payload` is not
        JSON.
        """
        fields = _job_fields(kind, payload, payment_id, run_at, priority, max_attempts)
        if idempotency_key is not None:
            check_text(idempotency_key, "idempotency_key", IDEMPOTENCY_KEY_LENGTH)
        with transaction.atomic(using=self.db):
            if idempotency_key is None:
                job = self.create(**fields)
            else:
                # The unique index decides between racing enqueues of one key, not a prior read:
                # the loser's INSERT fails inside its savepoint and it returns the winner's row.
                try:
                    with transaction.atomic(using=self.db):
                        job = self.create(idempotency_key=idempotency_key, **fields)
                except IntegrityError:
                    existing = self.filter(idempotency_key=idempotency_key).first()
                    if existing is None:
                        raise
                    return existing
            self._notify(kind)
        return job

    def _notify(self, kind: str) -> None:
        # NOTIFY is transactional on PostgreSQL: listeners hear it when the enqueue commits.
        connection = connections[self.db]
        if connection.vendor == "postgresql" and leases_settings.USE_NOTIFY:
            with connection.cursor() as cursor:
                cursor.execute(*statements.notify(notify_channel(self.model), kind))


def notify_channel(model: type[models.Model]) -> str:
    """Return the LISTEN/NOTIFY channel on which enqueues of `model` are announced."""
    return f"django_leases_{model._meta.db_table}"[:63]


def _job_fields(
    kind: str,
    payload: Any,
    payment_id: str | None,
    run_at: datetime | float | timedelta | None,
    priority: int,
    max_attempts: int | None,
) -> dict[str, Any]:
    """Check every argument of `enqueue()` against `limits` and return the job's fields.

    Raises `InvalidArgument` (`InvalidPayload`, `InvalidDuration`) naming the argument; nothing
    has been written then.
    """
    check_text(kind, "kind", KIND_LENGTH)
    payload = {} if payload is None else payload
    check_json(payload, "payload")
    check_int(priority, "priority", PRIORITY)
    if max_attempts is None:
        max_attempts = leases_settings.MAX_ATTEMPTS
    check_int(max_attempts, "max_attempts", MAX_ATTEMPTS)
    if payment_id is not None:
        check_text(payment_id, "payment_id", PAYMENT_ID_LENGTH, blank=True)
    fields: dict[str, Any] = {
        "kind": kind,
        "payload": payload,
        "payment_id": payment_id or "",
        "priority": priority,
        "max_attempts": max_attempts,
    }
    if isinstance(run_at, datetime):
        fields["run_at"] = check_datetime(run_at, "run_at")
    elif run_at is not None:
        fields["run_at"] = after(to_seconds(run_at, "run_at"))
    return fields
