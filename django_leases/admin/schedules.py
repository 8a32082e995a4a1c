"""The schedules' state: the last tick (or fire time) each schedule enqueued, read-only."""

from __future__ import annotations

from django.contrib import admin

from django_leases.admin.mixins import DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin
from django_leases.models import ScheduleState


@admin.register(ScheduleState)
class ScheduleStateAdmin(DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("name", "every", "cron", "tz", "last_tick", "enqueued_at", "job_model")
    search_fields = ("name",)
