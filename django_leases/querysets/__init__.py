"""Querysets of the job table, the attempt ledger and the worker registry.

`leases` holds every lease transition; `ledger` the attempt rows they open and close; `prune`
retention; `payments` enqueueing; `workers` the worker registry. Their raw SQL is in `sql/`.
"""

from django_leases.querysets.base import deadlocked, retry_deadlocks
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.querysets.ledger import AttemptQuerySet, describe_error
from django_leases.querysets.payments import PaymentJobQuerySet
from django_leases.querysets.prune import PrunedBatch
from django_leases.querysets.workers import WorkerQuerySet

__all__ = [
    "AttemptQuerySet",
    "LeaseQuerySet",
    "PaymentJobQuerySet",
    "PrunedBatch",
    "WorkerQuerySet",
    "deadlocked",
    "describe_error",
    "retry_deadlocks",
]
