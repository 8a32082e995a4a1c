"""Paused kinds: a kind no worker starts while its row exists (`PausedKind`).

`pause_kind()` and `resume_kind()` are bound on `LeaseQuerySet` (the job table they concern is
the queryset's): each writes or deletes the kind's row and its audit row (`KindEvent`) in one
transaction. Every claim statement leaves the paused kinds of its table out
(`paused_clause()`); the worker reads them again as it starts each job (`paused_now()`), so a
job claimed before the pause committed (ahead of a free slot, or by a claim racing the pause)
is given back unstarted, never run.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, cast

from django.apps import apps
from django.db import IntegrityError, connections, models, transaction
from django.utils.translation import gettext_lazy as _

from django_leases.dialects import statements as sql
from django_leases.exceptions import InvalidArgument
from django_leases.handlers import registered_kinds
from django_leases.limits import check_kind
from django_leases.querysets.ledger import J
from django_leases.querysets.reads import LeaseReads

FRESH_CLAIM = 0.05
"""Seconds within which a job claimed by a statement sent that long before its start starts
unchecked (`worker.attempt.Attempts.paused()`), and for which `pause_kind()` waits after its
commit: a job that starts later than that after a pause either comes from a claim sent after
the pause committed, whose statement left the kind out, or is checked as it starts. One read per
job start would cost 2.5 times the throughput (bench/README.md, "Pausing a kind")."""

REASON_LENGTH = 1000
"""The longest reason an operator may give for a pause or a resume."""


class KindAction(models.TextChoices):
    """What an operator did to a kind."""

    PAUSED = "paused", _("paused")
    """No worker starts a job of the kind from now on."""
    RESUMED = "resumed", _("resumed")
    """Workers start the kind's jobs again."""


class PausedKindQuerySet(models.QuerySet[Any]):
    """The paused kinds, one row per job table and kind."""

    def of_table(self, job_model: type[models.Model]) -> PausedKindQuerySet:
        return self.filter(job_model=job_model._meta.label_lower)


def paused_rows(using: str) -> PausedKindQuerySet:
    """The `PausedKind` rows on `using`."""
    # From the app registry: models.py is built on this package, never imported by it.
    paused: Any = apps.get_model("django_leases", "PausedKind")
    return cast(PausedKindQuerySet, paused._default_manager.db_manager(using).all())


@lru_cache(maxsize=64)
def paused_clause(job_model: type[models.Model], using: str) -> tuple[str, sql.Params]:
    """Return the claims' subquery of the paused kinds of `job_model`'s table on `using`
    (`sql.paused_kinds()`) and its parameters: built once per table and database. Do not
    change the result."""
    paused: Any = apps.get_model("django_leases", "PausedKind")
    table = connections[using].ops.quote_name(paused._meta.db_table)
    return sql.paused_kinds(table), {"paused_model": job_model._meta.label_lower}


def kind_events(using: str) -> models.QuerySet[Any]:
    """The `KindEvent` rows on `using`."""
    # From the app registry, as `paused_rows()`.
    events: Any = apps.get_model("django_leases", "KindEvent")
    return cast(models.QuerySet[Any], events._default_manager.db_manager(using).all())


def paused_kinds(qs: LeaseReads[J]) -> frozenset[str]:
    """Return the kinds of `qs`'s table paused now: one read of a table of a few rows."""
    return frozenset(paused_rows(qs.db).of_table(qs.model).values_list("kind", flat=True))


def paused_now(qs: LeaseReads[J], kind: str) -> bool:
    """Whether `kind` of `qs`'s table is paused now (the worker's check as it starts a job)."""
    return paused_rows(qs.db).of_table(qs.model).filter(kind=kind).exists()


def _checked(kind: str, by: str, reason: str) -> str:
    kind = check_kind(kind, "kind")
    if kind not in registered_kinds():
        raise InvalidArgument(f"no handler is registered for kind {kind!r}")
    if not by:
        raise InvalidArgument("by: who pauses or resumes the kind must be named")
    if len(reason) > REASON_LENGTH:
        raise InvalidArgument(f"reason: at most {REASON_LENGTH} characters, not {len(reason)}")
    return kind


def pause_kind(qs: LeaseReads[J], kind: str, *, by: str, reason: str = "") -> bool:
    """Pause `kind` of `qs`'s table: no worker starts a job of it until `resume_kind()`.
    Running jobs finish; enqueueing and schedules go on. Return False if it was paused
    already (nothing written).

    Raises `InvalidArgument` (nothing written) for a kind no handler is registered for.
    """
    kind = _checked(kind, by, reason)
    label = qs.model._meta.label_lower
    # The row and its audit row commit together; of racing pauses one INSERT wins.
    with transaction.atomic(using=qs.db):
        try:
            with transaction.atomic(using=qs.db):
                paused_rows(qs.db).create(job_model=label, kind=kind, paused_by=by, reason=reason)
        except IntegrityError:
            return False
        kind_events(qs.db).create(
            job_model=label, kind=kind, action=KindAction.PAUSED, by=by, reason=reason
        )
        # Once committed, wait out the claims sent before it (FRESH_CLAIM): no job of the kind
        # starts after this function returned (or, inside a caller's transaction, its commit).
        transaction.on_commit(lambda: time.sleep(FRESH_CLAIM), using=qs.db)
    return True


def resume_kind(qs: LeaseReads[J], kind: str, *, by: str, reason: str = "") -> bool:
    """Resume `kind` of `qs`'s table. Return False if it was not paused (nothing written)."""
    kind = _checked(kind, by, reason)
    label = qs.model._meta.label_lower
    # The delete and its audit row commit together; of racing resumes one DELETE wins.
    with transaction.atomic(using=qs.db):
        deleted, _ = paused_rows(qs.db).filter(job_model=label, kind=kind).delete()
        if not deleted:
            return False
        kind_events(qs.db).create(
            job_model=label, kind=kind, action=KindAction.RESUMED, by=by, reason=reason
        )
    return True
