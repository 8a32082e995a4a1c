"""Retention: finished jobs deleted in bounded batches, with or without their ledger rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import reduce
from operator import or_
from typing import TYPE_CHECKING

from django.apps import apps
from django.db import connections, transaction
from django.db.models import Q

from django_leases.conf import leases_settings, to_seconds
from django_leases.querysets.base import ago, retry_deadlocks
from django_leases.querysets.ledger import J
from django_leases.status import FINAL_STATUSES

if TYPE_CHECKING:
    from django_leases.querysets.reads import LeaseReads


@dataclass(frozen=True)
class PrunedBatch:
    """One batch deleted by `prune()`, in its own transaction."""

    status: str
    jobs: int
    attempts: int
    """Ledger rows of those jobs: deleted, or kept with `job` set to NULL (`keep_ledger`)."""
    keep_ledger: bool


def prunable(
    qs: LeaseReads[J], retention: Mapping[str, float | timedelta] | None = None
) -> LeaseReads[J]:
    """Finished jobs whose `completed_at` is older than their status's retention.

    `retention` maps final statuses ("completed", "failed", "cancelled") to seconds or a
    `timedelta`; a status left out is never pruned. Default: `DJANGO_LEASES["RETENTION"]`.
    Ages are measured by the database clock.
    """
    ages = _retention(retention)
    if not ages:
        return qs.none()
    return qs.filter(
        reduce(or_, (Q(status=status, completed_at__lt=ago(s)) for status, s in ages.items()))
    )


def prune(
    qs: LeaseReads[J],
    retention: Mapping[str, float | timedelta] | None = None,
    *,
    batch_size: int | None = None,
    keep_ledger: bool | None = None,
    on_batch: Callable[[PrunedBatch], object] | None = None,
) -> dict[str, int]:
    """Delete the `prunable(retention)` jobs in batches; return how many went per status.

    Each batch reads at most `batch_size` ids by the `(status, completed_at)` index, then
    deletes them in one transaction with one DELETE that restates the whole precondition,
    so a job requeued meanwhile stays. Its attempt ledger (and its operator events and recorded
    steps) goes with it, unless `keep_ledger`: then the ledger rows stay, with `job` set to NULL
    and `job_ref` still naming the job.
    Pending, processing and under-review jobs are never touched. No delete signals are sent,
    as with `update()`.

    Args:
        retention: final status -> age; default `DJANGO_LEASES["RETENTION"]`.
        batch_size: jobs per batch; default `DJANGO_LEASES["PRUNE_BATCH_SIZE"]`.
        keep_ledger: keep the ledger rows; default `not DJANGO_LEASES["PRUNE_LEDGER"]`.
        on_batch: called after each committed batch.
    """
    ages = _retention(retention)
    size = leases_settings.PRUNE_BATCH_SIZE if batch_size is None else batch_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"batch_size must be a whole number of at least 1, got {size!r}")
    keep = not leases_settings.PRUNE_LEDGER if keep_ledger is None else keep_ledger
    deleted: dict[str, int] = {}
    for status, seconds in ages.items():
        stale = qs.filter(status=status, completed_at__lt=ago(seconds))
        deleted[status] = 0
        while True:
            # Oldest first, in index order: the read stops after `size` rows of the index.
            pks = list(stale.order_by("completed_at").values_list("pk", flat=True)[:size])
            if not pks:
                break
            batch = prune_batch(qs, status, stale.filter(pk__in=pks), keep)
            deleted[status] += batch.jobs
            if on_batch is not None:
                on_batch(batch)
    return deleted


@retry_deadlocks
def prune_batch(
    qs: LeaseReads[J], status: str, batch: LeaseReads[J], keep_ledger: bool
) -> PrunedBatch:
    # One transaction per batch: a batch's jobs and their ledger rows go (or are detached)
    # together, and a long prune never holds locks for longer than one batch.
    attempts = 0
    with transaction.atomic(using=qs.db):
        if connections[qs.db].features.has_select_for_update:
            # PostgreSQL, MariaDB/MySQL: lock the batch's rows first, so that an operator's
            # requeue of one of them waits for our commit instead of losing its ledger.
            locked = batch.select_for_update().values_list("pk", flat=True)
            batch = batch.filter(pk__in=list(locked))
        # SQLite has no row locks: the ledger write below is the transaction's first write
        # and takes the database's write lock, so the batch cannot change before the DELETE.
        ledger = qs._ledger()
        if ledger is not None:
            rows = ledger.objects.using(qs.db).filter(job_ref__in=batch.values("pk"))
            # `job` is the concrete ledger's foreign key (see AbstractJobAttempt).
            detach = {"job_id": None}
            attempts = rows.update(**detach) if keep_ledger else rows._raw_delete(qs.db)
        # The operator events and the recorded steps follow the ledger: deleted, or kept
        # detached.
        for label in (qs.model.event_model, qs.model.step_model):
            if label:
                beside = apps.get_model(label).objects.using(qs.db)
                beside = beside.filter(job_ref__in=batch.values("pk"))
                if keep_ledger:
                    beside.update(job_id=None)
                else:
                    beside._raw_delete(qs.db)
        # _raw_delete: ONE statement for the whole batch. QuerySet.delete() would collect
        # the ledger's SET_NULL relation and delete in chunks of 100 ids.
        jobs = batch._raw_delete(qs.db)
    return PrunedBatch(status, jobs, attempts, keep_ledger)


def _retention(retention: Mapping[str, float | timedelta] | None) -> dict[str, float]:
    if retention is None:
        retention = leases_settings.RETENTION
    unknown = sorted(set(retention) - set(FINAL_STATUSES))
    if unknown:
        raise ValueError(
            f"retention can only name final statuses {FINAL_STATUSES}, got {', '.join(unknown)}: "
            "pending, processing and under-review jobs are never pruned"
        )
    return {status: to_seconds(age, f"retention of {status}") for status, age in retention.items()}
