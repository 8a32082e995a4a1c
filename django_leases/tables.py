"""The tables of a queue, found in the app registry: the job model that `JOB_MODEL` names, its
attempt ledger, the worker registry and the schedules' state, each reached as its queryset on
one database. The one way the worker, the watcher, `Lease`, the Tasks backend, the checks, the
admin and the commands find them.

Each function imports the models when called: importing this module (and the Tasks backend,
`Lease` or the commands) loads no model, so a project may do it while its apps load."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models, router

from django_leases.conf import leases_settings
from django_leases.querysets import (
    LeaseQuerySet,
    QueueMinuteQuerySet,
    ScheduleStateQuerySet,
    WorkerQuerySet,
)
from django_leases.querysets.reads import attempt_ledger

if TYPE_CHECKING:
    from django_leases.models import AbstractJobAttempt, AbstractLeasedJob


def job_model(label: str | None = None) -> type[AbstractLeasedJob]:
    """Return the job model named `label`, "app_label.ModelName" (default:
    `DJANGO_LEASES["JOB_MODEL"]`).

    Raises:
        ImproperlyConfigured: saying why `label` names no installed `AbstractLeasedJob` model.
    """
    label = leases_settings.JOB_MODEL if label is None else label
    if not isinstance(label, str) or label.count(".") != 1 or not all(label.split(".")):
        raise ImproperlyConfigured(f"{label!r} is not of the form 'app_label.ModelName'")
    from django_leases.models import AbstractLeasedJob

    return installed(label, AbstractLeasedJob)


def installed(label: str, base: type[models.Model]) -> type[Any]:
    """Return the installed concrete subclass of `base` that `label` names.

    Raises:
        ImproperlyConfigured: saying why there is none.
    """
    try:
        model = apps.get_model(label, require_ready=False)
    except LookupError:
        raise ImproperlyConfigured(f"{label!r} is not an installed model") from None
    return concrete(model, label, base)


def concrete(model: type[Any], label: str, base: type[models.Model]) -> type[Any]:
    """Return `model`, found by `label`, if it is a concrete subclass of `base`.

    Raises:
        ImproperlyConfigured: saying why not.
    """
    if not issubclass(model, base) or model._meta.abstract:
        raise ImproperlyConfigured(
            f"{label!r} is not a concrete subclass of django_leases.models.{base.__name__}"
        )
    return model


def leased_job_models() -> list[type[AbstractLeasedJob]]:
    """Return every installed concrete job model: `PaymentJob` and the project's own."""
    from django_leases.models import AbstractLeasedJob

    return [model for model in apps.get_models() if issubclass(model, AbstractLeasedJob)]


def ledger_model(model: type[AbstractLeasedJob]) -> type[AbstractJobAttempt] | None:
    """Return the attempt ledger that `model.attempt_model` names, or None for none.

    Raises:
        ImproperlyConfigured: saying why it names no `AbstractJobAttempt` model with a nullable
            foreign key `job` to `model`.
    """
    label = model.attempt_model
    if label is None:
        return None
    if not isinstance(label, str) or label.count(".") != 1:
        raise ImproperlyConfigured(f"must be None or 'app_label.ModelName', got {label!r}")
    from django_leases.models import AbstractJobAttempt

    try:
        found: type[Any] | None = attempt_ledger(model)
    except LookupError:
        found = None
    if found is None:
        raise ImproperlyConfigured(f"{label!r} is not an installed model")
    ledger = concrete(found, label, AbstractJobAttempt)
    try:
        job = ledger._meta.get_field("job")
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
    from django_leases.models import Worker

    return cast(
        WorkerQuerySet, Worker.objects.db_manager(using or router.db_for_write(Worker)).all()
    )


def schedule_states(using: str) -> ScheduleStateQuerySet:
    """Return the schedules' state rows on `using`: the database of the job table they serve."""
    from django_leases.models import ScheduleState

    return cast(ScheduleStateQuerySet, ScheduleState.objects.db_manager(using).all())


def queue_history(using: str) -> QueueMinuteQuerySet:
    """Return the queue history's rows on `using`: the database of the job table they count."""
    from django_leases.models import QueueMinute

    return cast(QueueMinuteQuerySet, QueueMinute.objects.db_manager(using).all())
