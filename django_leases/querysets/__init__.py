"""Querysets of the job table, the attempt ledger and the worker registry.

`leases.LeaseQuerySet` is the one door to a job table: its reads (`reads`) and every lease
transition, its own holder writes and, bound as methods, the functions of `claims`, `acks`,
`operators`, `enqueue` and `prune`, which share the ledger writes (`ledger`), the lock queue
(`locks`) and the throttles (`throttles`). `payments` is `PaymentJob`'s enqueue with a payment
id; `workers` the worker registry; `schedules` the schedules' state rows. Their raw SQL is in
`sql/`, chosen per database by `dialects.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models, router

from django_leases.conf import leases_settings
from django_leases.dialects import deadlocked
from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.querysets.ledger import AttemptQuerySet, describe_error
from django_leases.querysets.payments import PaymentJobQuerySet
from django_leases.querysets.prune import PrunedBatch
from django_leases.querysets.schedules import ScheduleStateQuerySet
from django_leases.querysets.workers import WorkerQuerySet

if TYPE_CHECKING:
    from django_leases.models import AbstractJobAttempt, AbstractLeasedJob


def job_model(label: str | None = None) -> type[AbstractLeasedJob]:
    """Return the job model named `label`, "app_label.ModelName" (default:
    `DJANGO_LEASES["JOB_MODEL"]`).

    Raises:
        ImproperlyConfigured: saying why `label` names no installed `AbstractLeasedJob` model.
    """
    # Imported here: models.py imports this package, and models need the app registry.
    from django_leases.models import AbstractLeasedJob

    label = leases_settings.JOB_MODEL if label is None else label
    if not isinstance(label, str) or label.count(".") != 1 or not all(label.split(".")):
        raise ImproperlyConfigured(f"{label!r} is not of the form 'app_label.ModelName'")
    try:
        model = apps.get_model(label, require_ready=False)
    except LookupError:
        raise ImproperlyConfigured(f"{label!r} is not an installed model") from None
    if not issubclass(model, AbstractLeasedJob) or model._meta.abstract:
        raise ImproperlyConfigured(
            f"{label!r} is not a concrete subclass of django_leases.models.AbstractLeasedJob"
        )
    return model


def leased_job_models() -> list[type[AbstractLeasedJob]]:
    """Return every installed concrete job model: `PaymentJob` and the project's own."""
    # Imported here: as in `job_model()`.
    from django_leases.models import AbstractLeasedJob

    return [model for model in apps.get_models() if issubclass(model, AbstractLeasedJob)]


def ledger_model(model: type[AbstractLeasedJob]) -> type[AbstractJobAttempt] | None:
    """Return the attempt ledger that `model.attempt_model` names, or None for none.

    Raises:
        ImproperlyConfigured: saying why it names no `AbstractJobAttempt` model with a nullable
            foreign key `job` to `model`.
    """
    # Imported here: as in `job_model()`.
    from django_leases.models import AbstractJobAttempt

    label = model.attempt_model
    if label is None:
        return None
    if not isinstance(label, str) or label.count(".") != 1:
        raise ImproperlyConfigured(f"must be None or 'app_label.ModelName', got {label!r}")
    try:
        ledger = apps.get_model(label, require_ready=False)
    except LookupError:
        raise ImproperlyConfigured(f"{label!r} is not an installed model") from None
    if not issubclass(ledger, AbstractJobAttempt) or ledger._meta.abstract:
        raise ImproperlyConfigured(
            f"{label!r} is not a concrete subclass of django_leases.models.AbstractJobAttempt"
        )
    try:
        job = ledger._meta.get_field("job")  # type: ignore[misc]
    except FieldDoesNotExist:
        job = None
    if not isinstance(job, models.ForeignKey) or job.related_model is not model or not job.null:
        raise ImproperlyConfigured(
            f"{label!r} has no nullable foreign key `job` to {model._meta.label}"
        )
    return ledger


def leased_jobs(model: type[Any] | None = None, using: str | None = None) -> LeaseQuerySet[Any]:
    """Return the jobs of `model` (default: `job_model()`, the `JOB_MODEL` setting) on `using`
    (default: its write database).

    The one way the worker, the watcher, `Lease`, the Tasks backend and the commands reach the
    job table, typed so that a reader (and mypy) can follow them into `LeaseQuerySet`.
    """
    if model is None:
        model = job_model()
    manager: Any = model._default_manager.db_manager(using or router.db_for_write(model))
    return cast(LeaseQuerySet[Any], manager.all())


def queue_models(model: type[Any]) -> list[type[models.Model]]:
    """Return the models whose tables the queue of job model `model` needs: itself, its
    attempt ledger (if any) and the worker registry."""
    ledger = ledger_model(model)
    return [model, *([ledger] if ledger is not None else []), registered_workers().model]


def registered_workers(using: str | None = None) -> WorkerQuerySet:
    """Return the worker registry on `using` (default: its write database)."""
    # Imported here: as in `leased_jobs()`.
    from django_leases.models import Worker

    return cast(
        WorkerQuerySet, Worker.objects.db_manager(using or router.db_for_write(Worker)).all()
    )


def schedule_states(using: str) -> ScheduleStateQuerySet:
    """Return the schedules' state rows on `using`: the database of the job table they serve."""
    # Imported here: as in `leased_jobs()`.
    from django_leases.models import ScheduleState

    return cast(ScheduleStateQuerySet, ScheduleState.objects.db_manager(using).all())


__all__ = [
    "AttemptQuerySet",
    "LeaseQuerySet",
    "PaymentJobQuerySet",
    "PrunedBatch",
    "ScheduleStateQuerySet",
    "WorkerQuerySet",
    "deadlocked",
    "describe_error",
    "job_model",
    "leased_job_models",
    "leased_jobs",
    "ledger_model",
    "registered_workers",
    "retry_deadlocks",
    "schedule_states",
]
