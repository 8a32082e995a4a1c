"""List filters: each one calls a queryset read; no lease WHERE clause is written here."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.conf import leases_settings
from django_leases.limits import bad_character
from django_leases.querysets import AttemptQuerySet, LeaseQuerySet, WorkerQuerySet
from django_leases.status import JobStatus


class LeaseStateFilter(admin.SimpleListFilter):
    title = _("lease state")
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            (stats.STUCK, _("Stuck (lease expired)")),
            (stats.NEAR_EXPIRY, _("Near expiry")),
            (stats.HEALTHY, _("Healthy")),
            (stats.RUNNING_LONG, _("Running long")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        jobs = cast(LeaseQuerySet[Any], queryset)
        value = self.value()
        if value == stats.STUCK:
            return jobs.expired()
        if value == stats.NEAR_EXPIRY:
            return jobs.near_expiry(leases_settings.NEAR_EXPIRY)
        if value == stats.HEALTHY:
            return jobs.healthy(leases_settings.NEAR_EXPIRY)
        if value == stats.RUNNING_LONG:
            default, by_kind = stats.long_running_limits()
            return jobs.running_longer_than(default, by_kind=by_kind)
        return None


class TimeFilter(admin.SimpleListFilter):
    """What the overview's time-bound cards count: the jobs due now, the jobs finished within
    its window."""

    title = _("time")
    parameter_name = "when"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            (stats.DUE, _("Due now (pending, run_at passed)")),
            (stats.LAST_HOUR, _("Finished in the last hour")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        jobs = cast(LeaseQuerySet[Any], queryset)
        if self.value() == stats.DUE:
            return jobs.due()
        if self.value() == stats.LAST_HOUR:
            return jobs.finished_within(timedelta(minutes=stats.RECENT_MINUTES))
        return None


class LockFilter(admin.SimpleListFilter):
    title = _("lock")
    parameter_name = "locked"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [
            ("blocked", _("Blocked by a lock (waiting)")),
            ("holding", _("Holding a lock")),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        jobs = cast(LeaseQuerySet[Any], queryset)
        if self.value() == "blocked":
            return jobs.waiting()
        if self.value() == "holding":
            return jobs.lock_holders()
        return None


class StatusFilter(admin.SimpleListFilter):
    title = _("status")
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return list(JobStatus.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        return queryset.filter(status=value) if value in JobStatus.values else None


class KindFilter(admin.SimpleListFilter):
    title = _("kind")
    parameter_name = "kind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        known = stats.kinds(model_admin.all_rows())
        value = self.value()
        if value and value not in known:
            known.append(value)
        return [(kind, kind) for kind in known]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        value = self.value()
        if value and bad_character(value):  # no kind has one; PostgreSQL would raise
            return queryset.none()
        return queryset.filter(kind=value) if value else None


class OpenAttemptFilter(admin.SimpleListFilter):
    title = _("attempt")
    parameter_name = "open"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("1", _("Open (still running)"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        return cast(AttemptQuerySet, queryset).open() if self.value() == "1" else None


class WorkerStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("alive", _("Alive")), ("gone", _("Gone or stopped"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        workers = cast(WorkerQuerySet, queryset)
        if self.value() == "alive":
            return workers.alive()
        if self.value() == "gone":
            return workers.gone()
        return None
