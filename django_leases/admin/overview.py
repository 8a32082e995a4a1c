"""The queue overview page: counts, a table per kind, the history charts, stuck jobs, workers
and the schedules, refreshed in place from a server-rendered fragment of itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.translation import gettext

from django_leases import schedules, stats
from django_leases.admin.charts import SPANS, charts, span_of
from django_leases.admin.counts import tally_html
from django_leases.admin.display import human_duration, last_pass
from django_leases.admin.mixins import DatabaseMixin
from django_leases.conf import leases_settings
from django_leases.kind_stats import idle, kind_rows
from django_leases.models import Worker
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.history import ALL_KINDS
from django_leases.status import JobStatus
from django_leases.tables import queue_history


class OverviewMixin(DatabaseMixin, admin.ModelAdmin):
    """Adds the overview page (`overview/`) to a job admin, which shows its stuck jobs with the
    admin's own `lease` and `heartbeat` columns, and counts its database's jobs and workers.

    The page refreshes itself every `refresh_every` seconds from `overview/live/`, the same
    view's content alone (server-rendered, behind the same permission); `?span=day` or
    `week` and `?kind=` choose the history charts."""

    lease: Callable[[Any], str]
    heartbeat: Callable[[Any], str]
    refresh_every: float = 5.0

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_overview"
        view = self.admin_site.admin_view
        overview = path("overview/", view(self.overview_view), name=name)
        live = path("overview/live/", view(self.live_view), name=f"{name}_live")
        return [overview, live, *super().get_urls()]  # before the catch-all "<object_id>/" routes

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            **self.live_context(request),
            "title": gettext("Queue overview"),
            "refresh_every": self.refresh_every,
        }
        return TemplateResponse(request, "admin/django_leases/overview.html", context)

    def live_view(self, request: HttpRequest) -> TemplateResponse:
        """The overview's content alone: what the page fetches to refresh itself."""
        # Not cached: `admin_view()` marks every admin view so.
        return TemplateResponse(
            request, "admin/django_leases/overview_live.html", self.live_context(request)
        )

    def live_context(self, request: HttpRequest) -> dict[str, Any]:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        near_expiry = leases_settings.NEAR_EXPIRY
        jobs = cast(LeaseQuerySet[Any], self.all_rows())
        data = stats.overview(
            jobs, Worker.objects.db_manager(jobs.db).all(), near_expiry=near_expiry
        )
        history = queue_history(jobs.db)
        kind = request.GET.get("kind", ALL_KINDS)
        span = span_of(request.GET.get("span"))
        kinds = kind_rows(jobs, data.fleet, history)
        return {
            "opts": self.opts,
            "overview": data,
            "statuses": [
                (value, label, tally_html(data.by_status[value]))
                for value, label in JobStatus.choices
            ],
            "total": tally_html(data.total),
            "under_review": tally_html(data.under_review),
            "blocked_by_lock": tally_html(data.blocked_by_lock),
            "oldest_due_wait": human_duration(data.oldest_due.wait),
            "oldest_due_kind": data.oldest_due.kind,
            "near_expiry_seconds": near_expiry,
            "kinds": [(row, human_duration(row.oldest_wait)) for row in kinds],
            "idle_kinds": idle(kinds),
            "chart": charts(history, jobs.model, kind, span),
            "chart_kind": kind,
            "spans": SPANS.values(),
            "stuck_jobs": [(job, self.lease(job), self.heartbeat(job)) for job in data.stuck_jobs],
            "long_runners": [
                (job, human_duration(job.running_for), self.lease(job), self.heartbeat(job))
                for job in data.long_runners
            ],
            "workers": [(worker, human_duration(worker.seen_ago)) for worker in data.fleet.workers],
            "late_workers": data.fleet.late,
            "watchers": [
                (watcher, human_duration(watcher.seen_ago), last_pass(watcher.last_pass))
                for watcher in data.fleet.watchers
            ],
            "last_pass_ago": (
                None
                if data.fleet.last_pass_ago is None
                else human_duration(data.fleet.last_pass_ago)
            ),
            "unserved": data.unserved,
            "schedules": schedules.upcoming(jobs),
        }
