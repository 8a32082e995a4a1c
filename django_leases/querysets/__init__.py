"""Querysets of the job table, the attempt ledger and the worker registry."""

from django_leases.querysets.leases import (
    AttemptQuerySet,
    LeaseQuerySet,
    PaymentJobQuerySet,
    WorkerQuerySet,
)

__all__ = ["AttemptQuerySet", "LeaseQuerySet", "PaymentJobQuerySet", "WorkerQuerySet"]
