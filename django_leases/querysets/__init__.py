"""Querysets of the job table, the attempt ledger and the worker registry.

`leases.LeaseQuerySet` is the one door to a job table: its reads (`reads`) and every lease
transition, its own holder writes and, bound as methods, the functions of `claims`, `acks`,
`operators`, `enqueue`, `groups` and `prune`, which share the ledger writes (`ledger`), the
taking of a lock (`locks`), the throttles (`throttles`) and the one seam where an execution
ends (`endings`). `payments` is `PaymentJob`'s enqueue with a payment id; `workers` the worker
registry; `schedules` the schedules' state rows; `history` the queue history's rows. Their raw
SQL is in `dialects/`, run by each database's dialect. The models are built on this package,
which never imports them; `django_leases.tables` finds a queue's tables.
"""

from django_leases.dialects import deadlocked
from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.history import QueueMinuteQuerySet
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.querysets.ledger import AttemptQuerySet, describe_error
from django_leases.querysets.payments import PaymentJobQuerySet
from django_leases.querysets.prune import PrunedBatch
from django_leases.querysets.schedules import ScheduleStateQuerySet
from django_leases.querysets.workers import WorkerQuerySet

__all__ = [
    "AttemptQuerySet",
    "LeaseQuerySet",
    "PaymentJobQuerySet",
    "PrunedBatch",
    "QueueMinuteQuerySet",
    "ScheduleStateQuerySet",
    "WorkerQuerySet",
    "deadlocked",
    "describe_error",
    "retry_deadlocks",
]
