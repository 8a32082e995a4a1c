"""Reads of a job table: the lease states by the database clock, and what a claim may take."""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now

from django_leases import sql
from django_leases.conf import leases_settings, to_seconds
from django_leases.querysets.base import after
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    StuckPolicy,
)

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob

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
        """Processing jobs whose lease is still live but ends within `within`."""
        seconds = to_seconds(within, "within")
        return self.filter(
            status=PROCESSING, lease_until__gte=Now(), lease_until__lt=after(seconds)
        )

    def healthy(self, within: float | timedelta) -> Self:
        """Processing jobs whose lease ends later than `within` from now."""
        seconds = to_seconds(within, "within")
        return self.filter(status=PROCESSING, lease_until__gte=after(seconds))

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


def takeover_guard() -> tuple[Q, tuple[str, sql.Params]]:
    """Return the filter (as a Q and as an SQL fragment) of expired leases a claim may take over.

    A job of a kind under the review stuck policy that reached a checkpoint may have done its
    risky external step (a PSP call): it is left for the watcher to hold for review, never
    re-run blindly by whichever worker polls first.
    """
    by_kind: dict[str, str] = leases_settings.STUCK_POLICY_BY_KIND
    review_by_default = leases_settings.STUCK_POLICY == StuckPolicy.REVIEW
    other = StuckPolicy.RETRY if review_by_default else StuckPolicy.REVIEW
    exceptions = sorted(kind for kind, policy in by_kind.items() if policy == other)
    fragment = sql.takeover_guard(review_by_default=review_by_default, exceptions=exceptions)
    if review_by_default:
        guard = Q(kind__in=exceptions) | Q(checkpoint="") if exceptions else Q(checkpoint="")
    else:
        guard = ~Q(kind__in=exceptions) | Q(checkpoint="") if exceptions else Q()
    return guard, fragment
