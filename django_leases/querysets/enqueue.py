"""Enqueueing on any job table: the checked arguments of a new job, the idempotency key, the
project's own columns, the NOTIFY."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db import IntegrityError, connections, models, transaction

from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import InvalidArgument
from django_leases.limits import (
    IDEMPOTENCY_KEY_LENGTH,
    KIND_LENGTH,
    MAX_ATTEMPTS,
    PRIORITY,
    bad_character,
    check_datetime,
    check_int,
    check_json,
    check_text,
    shown,
)
from django_leases.querysets.base import after
from django_leases.querysets.ledger import J
from django_leases.querysets.operators import OperatorActions
from django_leases.sql import postgresql as statements


class Enqueueing(OperatorActions[J]):
    """`enqueue()` of a job table; `LeaseQuerySet` builds on it."""

    def enqueue(
        self,
        kind: str,
        payload: Any = None,
        *,
        idempotency_key: str | None = None,
        run_at: datetime | float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
        **fields: Any,
    ) -> J:
        """Add a pending job and return it.

        Enqueueing an `idempotency_key` that already exists returns the first job and creates
        nothing; the model needs a unique `idempotency_key` field for it. `run_at` is a
        datetime, or a delay (seconds or `timedelta`) from the database clock; None means now.
        `fields` fills the model's own columns (`payout=payout`, `payout_id=7`); the lease
        fields are not among them. Raises `InvalidArgument` (`InvalidPayload`, ...) naming the
        argument, and writes nothing, for anything out of bounds.
        """
        values = {
            **_job_fields(kind, payload, run_at, priority, max_attempts),
            **_own_fields(self.model, fields),
        }
        if idempotency_key is not None:
            _check_idempotency_field(self.model)
            check_text(idempotency_key, "idempotency_key", IDEMPOTENCY_KEY_LENGTH)
        with transaction.atomic(using=self.db):
            if idempotency_key is None:
                job = self.create(**values)
            else:
                # The unique index decides between racing enqueues of one key, not a prior read:
                # the loser's INSERT fails inside its savepoint and it returns the winner's row.
                try:
                    with transaction.atomic(using=self.db):
                        job = self.create(idempotency_key=idempotency_key, **values)
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
    run_at: datetime | float | timedelta | None,
    priority: int,
    max_attempts: int | None,
) -> dict[str, Any]:
    """Check the lease arguments of `enqueue()` against `limits` and return the job's fields.

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
    fields: dict[str, Any] = {
        "kind": kind,
        "payload": payload,
        "priority": priority,
        "max_attempts": max_attempts,
    }
    if isinstance(run_at, datetime):
        fields["run_at"] = check_datetime(run_at, "run_at")
    elif run_at is not None:
        fields["run_at"] = after(to_seconds(run_at, "run_at"))
    return fields


def _own_fields(model: type[models.Model], fields: dict[str, Any]) -> dict[str, Any]:
    """Check the values `enqueue(**fields)` gives the model's own columns; raise
    `InvalidArgument` naming the first bad one, before anything is written."""
    # Imported here: models.py imports this package.
    from django_leases.models import AbstractLeasedJob

    reserved = {field.name for field in AbstractLeasedJob._meta.local_fields}
    for name, value in fields.items():
        try:
            field = model._meta.get_field(name)
        except FieldDoesNotExist:
            field = None
        if (
            not isinstance(field, models.Field)
            or not field.concrete
            or field.many_to_many
            or field.primary_key
            or field.name in reserved
        ):
            raise InvalidArgument(
                f"{name} is not a column of {model._meta.label} that enqueue() can set "
                f"(its own fields, not the lease's), got {name}={shown(value)}"
            )
        if isinstance(value, str) and bad_character(value):
            check_text(value, name, len(value), blank=True)  # raises, naming the character
        if isinstance(field, models.JSONField):
            check_json(value, name)
        elif field.is_relation and isinstance(value, models.Model):
            if not isinstance(value, field.related_model):  # type: ignore[arg-type]
                raise InvalidArgument(
                    f"{name} must be a {field.related_model._meta.label}, got {shown(value)}"  # type: ignore[union-attr]
                )
        else:
            try:
                field.clean(value, None)
            except ValidationError as exc:
                raise InvalidArgument(
                    f"{name}: {' '.join(exc.messages)} Got {shown(value)}."
                ) from None
    return fields


def _check_idempotency_field(model: type[models.Model]) -> None:
    try:
        field = model._meta.get_field("idempotency_key")
    except FieldDoesNotExist:
        field = None
    if not isinstance(field, models.Field) or not field.unique:
        raise InvalidArgument(
            f"idempotency_key needs a unique idempotency_key field on {model._meta.label}"
        )
