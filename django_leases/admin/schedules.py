"""The schedules' state: the last tick (or fire time) each schedule enqueued, read-only; and
"Run now", which enqueues a schedule's job at once (`schedules.run_now()`), behind the
`django_leases.run_schedule` permission."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_leases import schedules
from django_leases.admin.display import stamped
from django_leases.admin.mixins import DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin
from django_leases.models import ScheduleState
from django_leases.tables import job_model

PERMISSION = "django_leases.run_schedule"


@admin.register(ScheduleState)
class ScheduleStateAdmin(DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "name",
        "every",
        "cron",
        "tz",
        "last_tick",
        stamped(ScheduleState, "enqueued_at"),
        "job_model",
    )
    search_fields = ("name",)
    actions = ["run_now"]

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSION)

    @admin.action(description=_("Run the selected schedules now"), permissions=["run"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        configured = {schedule.name for schedule in schedules.configured()}
        label = job_model()._meta.label_lower
        ran, refused = [], []
        for row in queryset:
            if row.name not in configured or row.job_model != label:
                refused.append(row.name)
                continue
            job = schedules.run_now(row.name, by=request.user.get_username(), using=self.using)
            ran.append(f"{row.name} (#{job.pk})")
        if ran:
            self.message_user(
                request,
                ngettext("Enqueued now: %(jobs)s.", "Enqueued now: %(jobs)s.", len(ran))
                % {"jobs": ", ".join(ran)},
                messages.SUCCESS,
            )
        if refused:
            self.message_user(
                request,
                gettext("Not run, no such schedule in the settings for this job table: %(names)s.")
                % {"names": ", ".join(refused)},
                messages.WARNING,
            )
