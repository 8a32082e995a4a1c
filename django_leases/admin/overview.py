"""The queue overview page: counts, throughput chart, stuck jobs, workers, the kinds'
limits and the schedules."""

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
from django_leases.admin.counts import tally_html
from django_leases.admin.display import human_duration, last_pass
from django_leases.admin.mixins import DatabaseMixin
from django_leases.conf import leases_settings
from django_leases.handlers import throttles
from django_leases.models import Worker
from django_leases.querysets import LeaseQuerySet
from django_leases.status import JobStatus


class OverviewMixin(DatabaseMixin, admin.ModelAdmin):
    """Adds the overview page (`overview/`) to a job admin, which shows its stuck jobs with the
    admin's own `lease` and `heartbeat` columns, and counts its database's jobs and workers."""

    lease: Callable[[Any], str]
    heartbeat: Callable[[Any], str]

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_overview"
        overview = path("overview/", self.admin_site.admin_view(self.overview_view), name=name)
        return [overview, *super().get_urls()]  # before the catch-all "<object_id>/" routes

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        near_expiry = leases_settings.NEAR_EXPIRY
        jobs = cast(LeaseQuerySet[Any], self.all_rows())
        data = stats.overview(
            jobs, Worker.objects.db_manager(jobs.db).all(), near_expiry=near_expiry
        )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Queue overview"),
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
            "chart": chart(data.chart),
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
            # This process's registry (its jobs.py modules): what every worker enforces.
            "throttles": sorted(throttles().items()),
            "schedules": schedules.upcoming(jobs),
        }
        return TemplateResponse(request, "admin/django_leases/overview.html", context)


CHART_HEIGHT = 120
BAR_WIDTH = 10


def chart(minutes: list[stats.Minute]) -> dict[str, Any]:
    """Lay the throughput out as SVG bars: completed below, failed stacked on top."""
    peak = max((minute.total for minute in minutes), default=0) or 1

    def height(n: int) -> int:
        return max(1, round(n * CHART_HEIGHT / peak)) if n else 0  # one job still shows

    bars = []
    for i, minute in enumerate(minutes):
        completed, failed = height(minute.completed), height(minute.failed)
        bars.append(
            {
                "x": i * BAR_WIDTH,
                "completed_y": CHART_HEIGHT - completed,
                "completed_h": completed,
                "failed_y": CHART_HEIGHT - completed - failed,
                "failed_h": failed,
                "minute": minute,
            }
        )
    return {
        "bars": bars,
        "width": len(minutes) * BAR_WIDTH,
        "height": CHART_HEIGHT,
        "peak": peak,
    }
