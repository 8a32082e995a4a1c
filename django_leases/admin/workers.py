"""The worker registry: which workers run, where, and when they were last seen."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin
from django.db.models import DurationField, Exists, ExpressionWrapper, F, OuterRef, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.admin.display import EMPTY, human_duration, last_pass, stamped
from django_leases.admin.filters import WorkerStateFilter
from django_leases.admin.mixins import DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin
from django_leases.models import Worker
from django_leases.querysets import WorkerQuerySet


@admin.register(Worker)
class WorkerAdmin(DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "worker_id",
        "role",
        "state",
        "hostname",
        "pid",
        "kinds",
        "concurrency",
        "heartbeat",
        "last_seen",
        "pass_outcome",
        stamped(Worker, "started_at"),
        stamped(Worker, "stopped_at"),
    )
    list_filter = (WorkerStateFilter,)
    search_fields = ("worker_id", "hostname")
    ordering = ("-last_seen_at",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        workers = cast(WorkerQuerySet, super().get_queryset(request))
        # alive() decides, in the same query: no second definition of "alive" here.
        return stats.with_seen_ago(workers).annotate(
            is_alive=Exists(workers.alive().filter(pk=OuterRef("pk"))),
            pass_ago=ExpressionWrapper(Now() - F("last_pass_at"), output_field=DurationField()),
        )

    @admin.display(description=_("state"))
    def state(self, worker: Worker) -> str:
        if getattr(worker, "is_alive", False):
            if stats.is_late(worker):
                # Alive by WORKER_GONE_AFTER, yet two reports overdue: frozen, or killed.
                return format_html('<span class="dl-badge dl-warn">{}</span>', gettext("late"))
            return format_html('<span class="dl-badge dl-healthy">{}</span>', gettext("alive"))
        label = gettext("stopped") if worker.stopped_at else gettext("gone")
        return format_html('<span class="dl-badge dl-quiet">{}</span>', label)

    @admin.display(description=_("last seen"), ordering="-last_seen_at")
    def last_seen(self, worker: Worker) -> str:
        return gettext("%(age)s ago") % {"age": human_duration(getattr(worker, "seen_ago", None))}

    @admin.display(description=_("last pass"), ordering="-last_pass_at")
    def pass_outcome(self, worker: Worker) -> str:
        if worker.last_pass_at is None:
            return EMPTY
        return gettext("%(age)s ago: %(outcome)s") % {
            "age": human_duration(getattr(worker, "pass_ago", None)),
            "outcome": last_pass(worker.last_pass),
        }
