"""List filters: each one calls a queryset read; no lease WHERE clause is written here."""

from __future__ import annotations

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
        known = stats.kinds(model_admin.model._default_manager.all())
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
