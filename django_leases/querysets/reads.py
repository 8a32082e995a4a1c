"""Reads of a job table: the lease states by the database clock, and what a claim may take."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Self, TypeVar

from django.apps import apps
from django.db import connections, models
from django.db.models import (
    Case,
    DurationField,
    Exists,
    F,
    OuterRef,
    Q,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Now

from django_leases.conf import leases_settings, to_seconds
from django_leases.dialects import dialect_of
from django_leases.dialects import statements as sql
from django_leases.handlers import lease_lengths_of, near_window
from django_leases.querysets.base import after, ago
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    WAITING,
    StuckPolicy,
)

if TYPE_CHECKING:
    from django_leases.models import AbstractJobAttempt, AbstractLeasedJob

J = TypeVar("J", bound="AbstractLeasedJob")


class LeaseReads(models.QuerySet[J]):
    """The chainable reads of `LeaseQuerySet`."""

    # ---- reads -------------------------------------------------------------------------------

    def pending(self) -> Self:
        return self.filter(status=PENDING)

    def processing(self) -> Self:
        return self.filter(status=PROCESSING)

    def due(self) -> Self:
        """Pending jobs whose `run_at` has passed by the database clock."""
        return self.filter(status=PENDING, run_at__lte=Now())

    def expired(self) -> Self:
        """Processing jobs whose lease already ended: stuck, until a claim or the watcher acts."""
        return self.filter(status=PROCESSING, lease_until__lt=Now())

    def near_expiry(self, within: float | timedelta) -> Self:
        """Processing jobs whose lease is still live but ends within `within` (scaled to the
        kind's own `ttl=`: `handlers.near_window()`)."""
        ends = _ends_within(to_seconds(within, "within"), before=True)
        return self.filter(ends, status=PROCESSING, lease_until__gte=Now())

    def healthy(self, within: float | timedelta) -> Self:
        """Processing jobs whose lease ends later than `within` from now (scaled as in
        `near_expiry()`)."""
        return self.filter(
            _ends_within(to_seconds(within, "within"), before=False), status=PROCESSING
        )

    def finished_within(self, within: float | timedelta) -> Self:
        """Jobs that reached a final status (completed, failed, cancelled) within the last
        `within`, by the database clock; a range of the (status, completed_at) index."""
        seconds = to_seconds(within, "within")
        return self.filter(
            status__in=[COMPLETED, FAILED, CANCELLED],
            completed_at__gte=Now() - timedelta(seconds=seconds),
        )

    def claimable(self, kinds: Collection[str] | None = None) -> Self:
        """Due pending jobs and expired leases that still have an attempt left."""
        guard, _ = takeover_guard()
        qs = self.filter(
            Q(status=PENDING, run_at__lte=Now())
            | (Q(status=PROCESSING, lease_until__lt=Now()) & guard),
            attempts__lt=F("max_attempts"),
        )
        return qs.filter(kind__in=list(kinds)) if kinds is not None else qs

    def _claimable_pass(self, kinds: Collection[str] | None, takeover: bool) -> Self:
        qs = self.expired().filter(takeover_guard()[0]) if takeover else self.due()
        qs = qs.filter(attempts__lt=F("max_attempts"))
        return qs.filter(kind__in=list(kinds)) if kinds is not None else qs

    def waiting(self) -> Self:
        """Jobs waiting for an earlier job of their lock to finish (`locks`)."""
        return self.filter(status=WAITING)

    def lock_holders(self) -> Self:
        """Jobs that hold their lock: next in line, running or under review."""
        return self.filter(lock_holder__isnull=False)

    def under_review(self) -> Self:
        """Jobs the watcher held for review: an operator or a reconcile hook decides."""
        return self.filter(status=REVIEW)

    def held_by(self, owner: str) -> Self:
        """Processing jobs whose lease `owner` holds (live or expired)."""
        return self.filter(status=PROCESSING, lease_owner=owner)

    def orphaned(self, owners: Collection[str] | models.QuerySet[Any]) -> Self:
        """Processing jobs with a live lease whose owner is one of `owners` (workers known gone).

        `owners` is a collection of worker ids, or a one-column queryset of them (e.g. the
        registry's `gone().values("worker_id")`), which stays a subquery in the database.
        """
        if not isinstance(owners, models.QuerySet):
            owners = list(owners)
        return self.filter(status=PROCESSING, lease_until__gte=Now(), lease_owner__in=owners)

    def held(self, pk: int, owner: str, token: int) -> Self:
        """The one row `owner` holds under `token`, or nothing: the filter of every holder write."""
        return self.filter(pk=pk, status=PROCESSING, lease_owner=owner, lease_token=token)

    def running_longer_than(
        self, seconds: float | timedelta, *, by_kind: Mapping[str, float | timedelta] | None = None
    ) -> Self:
        """Processing jobs whose current attempt started more than `seconds` ago (`by_kind`:
        other limits for some kinds), by the database clock, however often they heartbeat.

        The attempt's start is its ledger row's `claimed_at`, found by the unique (job_ref,
        token) index; a job table without a ledger has no long runners.
        """
        default = to_seconds(seconds, "seconds")
        limits = {
            kind: to_seconds(limit, f"by_kind[{kind!r}]") for kind, limit in (by_kind or {}).items()
        }
        ledger = self._ledger()
        if ledger is None:
            return self.none()

        def started_before(seconds: float) -> Q:
            return Q(Exists(self._open_attempt(ledger).filter(claimed_at__lt=ago(seconds))))

        kinds_by_limit: dict[float, list[str]] = {}
        for kind, limit in sorted(limits.items()):
            kinds_by_limit.setdefault(limit, []).append(kind)
        # One EXISTS per distinct limit: each compares claimed_at with a constant "now - limit".
        started = started_before(default) & ~Q(kind__in=list(limits))
        for limit, kinds in kinds_by_limit.items():
            started |= Q(kind__in=kinds) & started_before(limit)
        return self.filter(started, status=PROCESSING)

    def with_running_for(self) -> Self:
        """Annotate `running_for`: how long the current attempt of a processing job has run, by
        the database clock (None for other jobs, and without a ledger)."""
        ledger = self._ledger()
        if ledger is None:
            return self.annotate(running_for=Value(None, output_field=DurationField()))
        claimed_at = Subquery(self._open_attempt(ledger).values("claimed_at")[:1])
        return self.annotate(
            running_for=Case(
                When(status=PROCESSING, then=Now() - claimed_at),
                default=None,
                output_field=DurationField(),
            )
        )

    def capped_count(self, cap: int) -> int:
        """Count the rows, reading no more than `cap + 1` of them: above `cap` means "more than
        `cap`". The cost is bounded by `cap` however large the table, where plain `count()`
        reads every matching index entry."""
        return self.order_by().values("pk")[: cap + 1].count()

    def estimated_count(self, status: str | None = None) -> int | None:
        """Return the database's estimate of the rows of this table (of its rows in `status`),
        read from its statistics without counting, or None where it keeps none (SQLite).

        The estimate is of the table: this queryset's own filters are not applied.
        """
        connection = connections[self.db]
        table = connection.ops.quote_name(self.model._meta.db_table)
        # SQLite keeps no statistics by default: its callers fall back to a capped count.
        return dialect_of(connection).estimated_count(connection, table, status)

    def _enqueue_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Return `enqueue()`'s keyword arguments as this table's enqueue takes them; a subclass
        derives the lock from its own columns (`PaymentJobQuerySet`)."""
        return options

    def _ledger(self) -> type[AbstractJobAttempt] | None:
        return attempt_ledger(self.model)

    @staticmethod
    def _open_attempt(ledger: type[AbstractJobAttempt]) -> models.QuerySet[Any]:
        """The open ledger row of the outer job's current lease."""
        return ledger._default_manager.filter(
            job_ref=OuterRef("pk"), token=OuterRef("lease_token"), ended_at__isnull=True
        )


def attempt_ledger(model: type[AbstractLeasedJob]) -> type[AbstractJobAttempt] | None:
    """Return the attempt ledger that `model.attempt_model` names, or None for none: the one
    lookup of a job table's ledger (`tables.ledger_model()` checks what it finds; the raw
    statements' `ledger.ledger_names()` quote its names)."""
    label = model.attempt_model
    return apps.get_model(label, require_ready=False) if label else None


def takeover_guard() -> tuple[Q, tuple[str, sql.Params]]:
    """Return the filter (as a Q and as an SQL fragment) of expired leases a claim may take over.

    A job of a kind under the review stuck policy that reached a checkpoint may have done its
    risky external step (a PSP call): it is left for the watcher to hold for review, never
    re-run blindly by whichever worker polls first.
    """
    by_kind: dict[str, str] = leases_settings.STUCK_POLICY_BY_KIND
    review_by_default = leases_settings.STUCK_POLICY == StuckPolicy.REVIEW
    other = StuckPolicy.RETRY if review_by_default else StuckPolicy.REVIEW
    exceptions = tuple(sorted(kind for kind, policy in by_kind.items() if policy == other))
    guard, (fragment, params) = takeover_guard_of(review_by_default, exceptions)
    return guard, (fragment, dict(params))


def _ends_within(seconds: float, *, before: bool) -> Q:
    """The leases that end before (`before`), or not before, `seconds` from now, each kind
    with a `ttl=` of its own by its `near_window()`."""
    lookup = "lease_until__lt" if before else "lease_until__gte"
    lengths = lease_lengths_of(float(leases_settings.TTL), None)
    if not lengths:
        return Q(**{lookup: after(seconds)})
    own = [kind for kind, _ in lengths]
    ends = ~Q(kind__in=own) & Q(**{lookup: after(seconds)})
    for kind in own:
        ends |= Q(kind=kind, **{lookup: after(near_window(kind, seconds))})
    return ends


@lru_cache(maxsize=16)
def takeover_guard_of(
    review_by_default: bool, exceptions: tuple[str, ...]
) -> tuple[Q, tuple[str, sql.Params]]:
    """Build `takeover_guard()` once per policy: every claim needs it."""
    fragment = sql.takeover_guard(review_by_default=review_by_default, exceptions=exceptions)
    if review_by_default:
        guard = Q(kind__in=exceptions) | Q(checkpoint="") if exceptions else Q(checkpoint="")
    else:
        guard = ~Q(kind__in=exceptions) | Q(checkpoint="") if exceptions else Q()
    return guard, fragment
