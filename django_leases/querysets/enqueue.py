"""Enqueueing on any job table: one job or many, awaitable too, on the database chosen; the
checked arguments of a new job, the idempotency key, the project's own columns (the NOTIFY:
`notices.py`)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast

from asgiref.sync import sync_to_async
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db import IntegrityError, models, transaction

from django_leases.conf import leases_settings, to_seconds
from django_leases.constraints import is_unique
from django_leases.exceptions import InvalidArgument
from django_leases.handlers import max_attempts_of
from django_leases.limits import (
    IDEMPOTENCY_KEY_LENGTH,
    LOCK_LENGTH,
    MAX_ATTEMPTS,
    PRIORITY,
    bad_character,
    check_datetime,
    check_int,
    check_json,
    check_json_size,
    check_kind,
    check_text,
    shown,
)
from django_leases.querysets import inserts
from django_leases.querysets.base import retry_deadlocks, writing_to
from django_leases.querysets.dependencies import enqueue_after, prerequisite_pks
from django_leases.querysets.keys import check_bound, undo_if_reused
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import in_lock_rounds, table_jobs
from django_leases.querysets.notices import announced_by_insert, notify
from django_leases.querysets.savepoints import enqueue_with_savepoints
from django_leases.status import PENDING, WAITING
from django_leases.tracing import current_context

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob
    from django_leases.querysets.reads import LeaseReads


def enqueue(
    qs: LeaseReads[J],
    kind: str,
    payload: Any = None,
    *,
    using: str | None = None,
    idempotency_key: str | None = None,
    run_at: datetime | float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    lock: str = "",
    after: Iterable[Any] | None = None,
    **fields: Any,
) -> J:
    """Add a pending job (waiting, behind an earlier job of its `lock`) and return it.

    The job goes to the database `using` (default: this queryset's, else where the routers
    send writes of the model). Enqueueing an `idempotency_key` that already exists returns
    the first job and creates nothing; the model needs a unique `idempotency_key` field for
    it. `run_at` is a datetime, or a delay (seconds or `timedelta`) from the database clock;
    None means now. `max_attempts` defaults to the kind's (`@job_handler(max_attempts=)`),
    else MAX_ATTEMPTS. Jobs sharing a `lock` run one at a time, in enqueue order. `after`
    (jobs or ids of this table and database) makes the job wait until each of them has
    completed (`dependencies`); an idempotency key that exists returns its job. `fields`
    fills the model's own columns (`payout=payout`, `payout_id=7`); the lease fields are not
    among them. Raises `InvalidArgument` (`InvalidPayload`, ...) naming the argument, and
    writes nothing, for anything out of bounds.
    """
    return enqueue_one(
        writing_to(qs, using),
        kind,
        payload,
        idempotency_key=idempotency_key,
        run_at=run_at,
        priority=priority,
        max_attempts=max_attempts,
        lock=lock,
        after=after,
        fields=fields,
    )


def enqueue_many(
    qs: LeaseReads[J],
    kind: str,
    payloads: Iterable[Any],
    *,
    using: str | None = None,
    idempotency_keys: Iterable[str | None] | None = None,
    **options: Any,
) -> list[J]:
    """Enqueue one job of `kind` per payload, in order, all or nothing, and return them.

    Every job takes the same `options` and follows the same rules as `enqueue()`: jobs
    sharing a `lock` run one at a time in the payloads' order. `idempotency_keys` gives
    each payload its own key (None: none); a key that exists already returns its first job
    in that place and creates nothing, as does a key repeated in the batch after its first
    payload. Every job is checked before the first is written; then the batch is one INSERT
    (per run of payloads with keys and without; SQLite: per its parameter limit), no
    savepoint. Raises `InvalidArgument` naming the payload's position, and writes nothing,
    if any job is out of bounds.
    """
    if "idempotency_key" in options:
        raise InvalidArgument(
            "enqueue_many() takes idempotency_keys=[...], one key (or None) per payload: "
            "one idempotency_key would name every job of the batch"
        )
    if isinstance(payloads, (str, bytes, dict)) or not isinstance(payloads, Iterable):
        raise InvalidArgument(f"payloads must be a list of payloads, got {shown(payloads)}")
    payloads = list(payloads)
    keys = [None] * len(payloads) if idempotency_keys is None else list(idempotency_keys)
    if len(keys) != len(payloads):
        raise InvalidArgument(
            f"idempotency_keys must have one key (or None) per payload: got {len(keys)} "
            f"for {len(payloads)} payloads"
        )
    jobs = writing_to(qs, using)
    return enqueue_all(jobs, kind, list(zip(payloads, keys, strict=True)), options)


class Enqueues(Protocol[J]):
    """A queryset with `enqueue()` and `enqueue_many()`, which a subclass of `LeaseQuerySet` may
    extend (`PaymentJobQuerySet`): the awaitable forms call its own."""

    def enqueue(self, kind: str, payload: Any = None, **options: Any) -> J: ...

    def enqueue_many(self, kind: str, payloads: Iterable[Any], **options: Any) -> list[J]: ...


async def aenqueue(qs: Enqueues[J], kind: str, payload: Any = None, **options: Any) -> J:
    """`enqueue()`, awaitable: the same arguments, rules and errors."""
    return await sync_to_async(qs.enqueue)(kind, payload, **options)


async def aenqueue_many(
    qs: Enqueues[J], kind: str, payloads: Iterable[Any], **options: Any
) -> list[J]:
    """`enqueue_many()`, awaitable: the same arguments, rules and errors."""
    return await sync_to_async(qs.enqueue_many)(kind, payloads, **options)


# InnoDB may pick an enqueue as a deadlock victim among the enqueues and completions of its
# lock; the whole transaction was rolled back, so it runs again.
@retry_deadlocks
def enqueue_all(
    qs: LeaseReads[J], kind: str, jobs: list[tuple[Any, str | None]], options: dict[str, Any]
) -> list[J]:
    if not jobs:
        return []
    options = dict(options)
    after = options.pop("after", None)
    try:
        values, delay = job_values(qs, kind, **qs._enqueue_options(options))
        pks = None if after is None else prerequisite_pks(qs, after)
    except InvalidArgument as exc:
        raise type(exc)(f"payloads[0]: {exc}") from None
    keyed = next((i for i, (_, key) in enumerate(jobs) if key is not None), None)
    if keyed is not None:
        try:
            check_idempotency_field(qs.model)
        except InvalidArgument as exc:
            raise type(exc)(f"payloads[{keyed}]: {exc}") from None
    rows = []
    for position, (payload, key) in enumerate(jobs):
        try:
            rows.append(job_row(payload, key))
        except InvalidArgument as exc:
            raise type(exc)(f"payloads[{position}]: {exc}") from None
    if pks:
        return enqueue_after(qs, kind, values, rows, delay, pks)
    if not inserts.returns_rows(qs.db):
        # One transaction: a job that fails rolls back the ones before it.
        with transaction.atomic(using=qs.db):
            done = [enqueue_with_savepoints(qs, values, row, delay)[0] for row in rows]
            reused = undo_if_reused(qs, kind, rows, done)
    else:
        with transaction.atomic(using=qs.db, savepoint=False):
            done, created = insert_all(qs, values, rows, delay)
            reused = undo_if_reused(qs, kind, rows, done)
        if created and reused is None:
            notify(qs, kind)
    if reused is not None:
        raise reused
    return done


@retry_deadlocks
def enqueue_one(
    qs: LeaseReads[J],
    kind: str,
    payload: Any,
    *,
    idempotency_key: str | None,
    run_at: datetime | float | timedelta | None,
    priority: int,
    max_attempts: int | None,
    lock: str,
    after: Iterable[Any] | None,
    fields: dict[str, Any],
) -> J:
    values, delay = job_values(
        qs, kind, run_at=run_at, priority=priority, max_attempts=max_attempts, lock=lock, **fields
    )
    if idempotency_key is not None:
        check_idempotency_field(qs.model)
    row = job_row(payload, idempotency_key)
    pks = None if after is None else prerequisite_pks(qs, after)
    if pks:
        return enqueue_after(qs, kind, values, [row], delay, pks)[0]
    if not inserts.returns_rows(qs.db):
        return check_bound(enqueue_with_savepoints(qs, values, row, delay)[0], kind, row)
    if idempotency_key is None and not values["lock"]:
        # Nothing can conflict: a plain INSERT, in the caller's transaction or on its own; on
        # its own, the INSERT announces the job too (one statement, one commit).
        announce = announced_by_insert(qs, kind)
        [new] = inserts.insert(
            qs.model, qs.db, values, [row], skip_conflicts=False, delay=delay, notify=announce
        )
        job = cast("J", new)  # inserted without skipping
        if announce is not None:
            return job
    else:
        with transaction.atomic(using=qs.db, savepoint=False):
            [job], created = insert_all(qs, values, [row], delay)
        if not created:
            # Nothing was written: checked after the transaction, which stays usable.
            return check_bound(job, kind, row)
    notify(qs, kind)
    return job


def job_values(
    qs: LeaseReads[J],
    kind: str,
    *,
    run_at: datetime | float | timedelta | None = None,
    priority: int = 0,
    max_attempts: int | None = None,
    lock: str = "",
    **fields: Any,
) -> tuple[dict[str, Any], float | None]:
    """Check the arguments every job of an enqueue shares; return its fields (with the
    caller's trace context, if traced) and the delay of its `run_at` from the database clock
    (None: a datetime given, or now)."""
    values, delay = _job_fields(kind, run_at, priority, max_attempts)
    values["lock"] = check_text(lock, "lock", LOCK_LENGTH, blank=True)
    trace_context = current_context()
    if trace_context is not None:
        values["trace_context"] = trace_context
    return {**values, **_own_fields(qs.model, fields)}, delay


def job_row(payload: Any, key: str | None) -> inserts.Row:
    """Return the checked payload (None: `{}`) and idempotency key of one job."""
    payload = {} if payload is None else payload
    check_json(payload, "payload")
    check_json_size(payload, "payload", leases_settings.MAX_PAYLOAD_BYTES)
    if key is not None:
        check_text(key, "idempotency_key", IDEMPOTENCY_KEY_LENGTH)
    return payload, key


def insert_all(
    qs: LeaseReads[J], values: dict[str, Any], rows: list[inserts.Row], delay: float | None
) -> tuple[list[J], bool]:
    """Add a job of the fields `values` per row (payload and key; all of one lock, or of
    none), in enqueue order; return them, the first job of an idempotency key in each place
    of that key, and whether any is new.

    One INSERT per batch: the jobs of no lock at once, those of a lock after its first new
    job, which alone may take the lock. No savepoint: a conflict skips the row.
    """
    first_of: dict[str, int] = {}
    new = []
    for position, (_, key) in enumerate(rows):
        if key is None or key not in first_of:
            new.append(position)
            if key is not None:
                first_of[key] = position
    saved: dict[int, J] = {}
    created = False
    if values["lock"]:
        if len(new) > 1 and first_of:
            # Jobs of keys that exist already are not new: they take no place in the lock.
            for job in table_jobs(qs).filter(idempotency_key__in=list(first_of)):
                saved[first_of[str(_key(job))]] = job
            new = [position for position in new if position not in saved]
        # The first new job may take the lock (a racer may add its key first: the next
        # one then may), the later ones wait behind it.
        while new and not created:
            position = new.pop(0)
            saved[position], created = insert_locked(qs, values, rows[position], delay)
        values = {**values, "status": WAITING}
    jobs, added = insert_or_existing(qs, values, [rows[position] for position in new], delay)
    saved.update(zip(new, jobs, strict=True))
    ordered = []
    for position, (_, key) in enumerate(rows):
        ordered.append(saved[position if key is None else first_of[key]])
    return ordered, bool(created or added)


def insert_or_existing(
    qs: LeaseReads[J], values: dict[str, Any], rows: list[inserts.Row], delay: float | None
) -> tuple[list[J], int]:
    """Insert a job of `values` per row (none of them taking a lock); return them, each job
    whose idempotency key exists already replaced by the first job of that key, and how many
    are new.

    One INSERT, in order: ids follow the order of `rows`, which is a lock's order."""
    keyed = any(key is not None for _, key in rows)
    inserted = inserts.insert(qs.model, qs.db, values, rows, skip_conflicts=keyed, delay=delay)
    skipped = [position for position, job in enumerate(inserted) if job is None]
    if not skipped:
        return cast("list[J]", inserted), len(rows)
    keys = [rows[position][1] for position in skipped]
    existing = {_key(job): job for job in table_jobs(qs).filter(idempotency_key__in=keys)}
    missing = [position for position in skipped if rows[position][1] not in existing]
    if missing:
        # Another unique column refused them: inserted again without skipping, the database
        # raises its own error, in a savepoint that the caller's transaction survives.
        refused = [rows[position] for position in missing]
        with transaction.atomic(using=qs.db):
            again = inserts.insert(
                qs.model, qs.db, values, refused, skip_conflicts=False, delay=delay
            )
            if any(key is None for _, key in refused):
                # Unless the refusing row went away meanwhile. The jobs without a key that
                # went in the first time are not told apart (RETURNING gave fewer of them):
                # none of the batch stands.
                raise IntegrityError(f"a unique index of {qs.model._meta.label} refused a job")
        for position, job in zip(missing, again, strict=True):
            inserted[position] = job
    found = [existing[rows[i][1]] if job is None else job for i, job in enumerate(inserted)]
    return found, len(rows) - len(skipped) + len(missing)


def insert_locked(
    qs: LeaseReads[J], values: dict[str, Any], row: inserts.Row, delay: float | None
) -> tuple[J, bool]:
    """Insert the job of `values` and `row` of the lock `values["lock"]` in the rounds of
    `locks.in_lock_rounds()`, conflicts skipped: pending and holding it if it is free, else
    waiting; return it, or the first job of its key, and whether it is new.
    """
    jobs, lock, key = table_jobs(qs), values["lock"], row[1]

    def wait() -> tuple[J, bool]:
        [found], added = insert_or_existing(qs, {**values, "status": WAITING}, [row], delay)
        return found, bool(added)

    def take() -> tuple[J, bool] | None:
        holding = {**values, "status": PENDING, "lock_holder": lock}
        [job] = inserts.insert(qs.model, qs.db, holding, [row], skip_conflicts=True, delay=delay)
        if job is not None:
            return cast("J", job), True
        existing = None if key is None else jobs.filter(idempotency_key=key).first()
        if existing is not None:
            return existing, False
        if jobs.filter(lock_holder=lock).exists():
            return None
        # Another unique column refused it: its own error, as in `insert_or_existing`.
        with transaction.atomic(using=qs.db):
            [job] = inserts.insert(
                qs.model, qs.db, holding, [row], skip_conflicts=False, delay=delay
            )
        return cast("J", job), True  # inserted without skipping

    return in_lock_rounds(qs, lock, wait, take)


def _key(job: models.Model) -> str | None:
    key: str | None = getattr(job, "idempotency_key", None)
    return key


def _job_fields(
    kind: str,
    run_at: datetime | float | timedelta | None,
    priority: int,
    max_attempts: int | None,
) -> tuple[dict[str, Any], float | None]:
    """Check the lease arguments of `enqueue()` against `limits`; return the job's fields and
    the delay of its `run_at` from the database clock in seconds (None: no delay).

    Raises `InvalidArgument` (`InvalidDuration`) naming the argument; nothing has been written
    then.
    """
    check_kind(kind)
    check_int(priority, "priority", PRIORITY)
    if max_attempts is None:
        max_attempts = max_attempts_of(kind) or leases_settings.MAX_ATTEMPTS
    check_int(max_attempts, "max_attempts", MAX_ATTEMPTS)
    fields: dict[str, Any] = {"kind": kind, "priority": priority, "max_attempts": max_attempts}
    if isinstance(run_at, datetime):
        fields["run_at"] = check_datetime(run_at, "run_at")
    elif run_at is not None:
        return fields, to_seconds(run_at, "run_at")
    return fields, None


def _own_fields(model: type[AbstractLeasedJob], fields: dict[str, Any]) -> dict[str, Any]:
    """Check the values `enqueue(**fields)` gives the model's own columns; raise
    `InvalidArgument` naming the first bad one, before anything is written."""
    reserved = model.lease_fields
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


def check_idempotency_field(model: type[models.Model]) -> None:
    try:
        unique = is_unique(model, "idempotency_key")
    except FieldDoesNotExist:
        unique = False
    if not unique:
        raise InvalidArgument(
            f"idempotency_key needs a unique idempotency_key field on {model._meta.label}"
        )
