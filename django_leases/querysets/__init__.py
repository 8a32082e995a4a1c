"""Querysets of the job table, the attempt ledger and the worker registry.

`leases` holds every lease transition; `ledger` the attempt rows they open and close; `prune`
retention; `payments` enqueueing; `workers` the worker registry. Their raw SQL is in `sql/`.
"""

from typing import Any, cast

from django.db import router

from django_leases.querysets.base import deadlocked, retry_deadlocks
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.querysets.ledger import AttemptQuerySet, describe_error
from django_leases.querysets.payments import PaymentJobQuerySet
from django_leases.querysets.prune import PrunedBatch
from django_leases.querysets.workers import WorkerQuerySet


def leased_jobs(model: type[Any] | None = None, using: str | None = None) -> LeaseQuerySet[Any]:
    """Return the jobs of `model` (default `PaymentJob`) on `using` (default: its write database).

    The one way the worker, the watcher, `Lease`, the Tasks backend and the commands reach the
    job table, typed so that a reader (and mypy) can follow them into `LeaseQuerySet`.
    """
    if model is None:
        # Imported here: models.py imports this package, and models need the app registry.
        from django_leases.models import PaymentJob

        model = PaymentJob
    manager: Any = model._default_manager.db_manager(using or router.db_for_write(model))
    return cast(LeaseQuerySet[Any], manager.all())


def registered_workers(using: str | None = None) -> WorkerQuerySet:
    """Return the worker registry on `using` (default: its write database)."""
    # Imported here: as in `leased_jobs()`.
    from django_leases.models import Worker

    return cast(
        WorkerQuerySet, Worker.objects.db_manager(using or router.db_for_write(Worker)).all()
    )


__all__ = [
    "AttemptQuerySet",
    "LeaseQuerySet",
    "PaymentJobQuerySet",
    "PrunedBatch",
    "WorkerQuerySet",
    "deadlocked",
    "describe_error",
    "leased_jobs",
    "registered_workers",
    "retry_deadlocks",
]
