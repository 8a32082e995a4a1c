"""Enqueueing: the checked arguments of a new job, the idempotency key, the NOTIFY."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, connections, models, transaction

from django_leases.conf import leases_settings, to_seconds
from django_leases.limits import (
    IDEMPOTENCY_KEY_LENGTH,
    KIND_LENGTH,
    LOCK_LENGTH,
    MAX_ATTEMPTS,
    PAYMENT_ID_LENGTH,
    PRIORITY,
    check_datetime,
    check_int,
    check_json,
    check_text,
)
from django_leases.querysets.base import after, retry_deadlocks
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.sql import postgresql as statements

if TYPE_CHECKING:
    from django_leases.models import PaymentJob


class PaymentJobQuerySet(LeaseQuerySet["PaymentJob"]):
    """`LeaseQuerySet` plus enqueueing of payment jobs."""

    # InnoDB may pick an enqueue of a locked job as a deadlock victim among the enqueues and
    # completions of its lock; the whole transaction was rolled back, so it runs again.
    @retry_deadlocks
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
        lock: str | None = None,
    ) -> PaymentJob:
        """Add a pending job (waiting, behind an earlier job of its `lock`) and return it.

        Enqueueing an `idempotency_key` that already exists returns the first job and creates
        nothing. `run_at` is a datetime, or a delay (seconds or `timedelta`) from the database
        clock; None means now. Jobs sharing a `lock` run one at a time, in enqueue order; by
        default (`LOCK_BY_PAYMENT`) a job with a `payment_id` is locked by its payment, and
        `lock=""` opts it out. Raises `InvalidPayload` (and writes nothing) if `payload` is not
        JSON.
        """
        fields = _job_fields(kind, payload, payment_id, run_at, priority, max_attempts)
        fields["lock"] = _lock(lock, fields["payment_id"])
        if idempotency_key is not None:
            check_text(idempotency_key, "idempotency_key", IDEMPOTENCY_KEY_LENGTH)
            fields["idempotency_key"] = idempotency_key
        with transaction.atomic(using=self.db):
            if idempotency_key is None:
                job = self._add_job(fields)
            else:
                # The unique index decides between racing enqueues of one key, not a prior read:
                # the loser's INSERT fails inside its savepoint and it returns the winner's row.
                try:
                    with transaction.atomic(using=self.db):
                        job = self._add_job(fields)
                except IntegrityError:
                    existing = self.filter(idempotency_key=idempotency_key).first()
                    if existing is None:
                        raise
                    return existing
            self._notify(kind)
        return job

    def _add_job(self, fields: dict[str, Any]) -> PaymentJob:
        return self._enqueue_locked(fields) if fields["lock"] else self.create(**fields)

    def _notify(self, kind: str) -> None:
        # NOTIFY is transactional on PostgreSQL: listeners hear it when the enqueue commits.
        connection = connections[self.db]
        if connection.vendor == "postgresql" and leases_settings.USE_NOTIFY:
            with connection.cursor() as cursor:
                cursor.execute(*statements.notify(notify_channel(self.model), kind))


def notify_channel(model: type[models.Model]) -> str:
    """Return the LISTEN/NOTIFY channel on which enqueues of `model` are announced."""
    return f"django_leases_{model._meta.db_table}"[:63]


def _lock(lock: str | None, payment_id: str) -> str:
    """Return the lock of a new job: `lock` as given, or by default its payment's."""
    if lock is not None:
        return check_text(lock, "lock", LOCK_LENGTH, blank=True)
    if payment_id and leases_settings.LOCK_BY_PAYMENT:
        return f"payment:{payment_id}"
    return ""


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
