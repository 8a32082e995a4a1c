"""The attempt ledger, the operator events and the recorded steps: read-only, inline on each job;
the ledger also as its own list."""

from __future__ import annotations

from functools import cache
from typing import Any

from django.apps import apps
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from django_leases.admin.display import attempt_error, payment_job_link, to_the_second
from django_leases.admin.filters import OpenAttemptFilter
from django_leases.admin.mixins import (
    DatabaseMixin,
    IndexedSearchMixin,
    OfferedFiltersMixin,
    ReadOnlyMixin,
    job_id,
)
from django_leases.models import (
    AbstractJobAttempt,
    AbstractJobEvent,
    AbstractLeasedJob,
    JobAttempt,
    JobEvent,
    JobStep,
)


class AttemptInline(DatabaseMixin, ReadOnlyMixin, admin.TabularInline):
    model = JobAttempt
    fk_name = "job"
    verbose_name = _("attempt")
    verbose_name_plural = _("attempt ledger (newest first)")
    fields = readonly_fields = (
        "attempt",
        "token",
        "owner",
        "shown_claimed_at",
        "shown_last_heartbeat_at",
        "shown_ended_at",
        "outcome",
        "ended_by",
        "checkpoint",
        "error",
        "shown_fenced_at",
        "resolution",
        "resolved_by",
    )
    # Tokens only grow: the highest is the latest acquisition.
    ordering = ("-token",)
    extra = 0
    shown_claimed_at = to_the_second("claimed_at", _("claimed at"))
    shown_last_heartbeat_at = to_the_second("last_heartbeat_at", _("last heartbeat at"))
    shown_ended_at = to_the_second("ended_at", _("ended at"))
    shown_fenced_at = to_the_second("fenced_at", _("fenced out at"))

    @admin.display(description=_("error"))
    def error(self, attempt: JobAttempt) -> str:
        return attempt_error(attempt)


class EventInline(DatabaseMixin, ReadOnlyMixin, admin.TabularInline):
    """The operator actions on the job, beside (never over) its attempt ledger."""

    model = JobEvent
    fk_name = "job"
    verbose_name = _("operator event")
    verbose_name_plural = _("operator events (newest first)")
    fields = readonly_fields = (
        "shown_at",
        "action",
        "by",
        "attempts",
        "token",
        "reason",
        "changes",
    )
    ordering = ("-id",)
    extra = 0
    shown_at = to_the_second("at", _("at"))


class StepInline(DatabaseMixin, ReadOnlyMixin, admin.TabularInline):
    """The steps the job's handler recorded (`lease.step()`), in the order they were recorded,
    each with the attempt and fencing token it was recorded under."""

    model = JobStep
    fk_name = "job"
    verbose_name = _("recorded step")
    verbose_name_plural = _("recorded steps (in order)")
    fields = readonly_fields = ("name", "attempt", "token", "shown_recorded_at", "result")
    ordering = ("id",)
    extra = 0
    shown_recorded_at = to_the_second("recorded_at", _("recorded at"))


@cache
def step_inline(jobs: type[AbstractLeasedJob], using: str | None) -> type[StepInline]:
    """Return the recorded steps inline of the job table `jobs` (its `step_model`) on database
    `using` (one class for each)."""
    steps = apps.get_model(jobs.step_model or "")
    return type(f"{steps.__name__}Inline", (StepInline,), {"model": steps, "using": using})


class RecordedStepsMixin:
    """Read with the job whether it has recorded steps (`has_recorded_steps`, an EXISTS in the
    same query), so that the steps inline is offered on the page of a job that has some, and
    the page of any other job costs no query (and its form no inline) more."""

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Any:
        # ModelAdmin.get_object(), with the EXISTS beside the job's columns.
        jobs: QuerySet[Any] = self.get_queryset(request)  # type: ignore[attr-defined]
        model = jobs.model
        if model.step_model:
            steps = apps.get_model(model.step_model)._default_manager.filter(job_ref=OuterRef("pk"))
            jobs = jobs.annotate(has_recorded_steps=Exists(steps))
        field = model._meta.pk if from_field is None else model._meta.get_field(from_field)
        try:
            return jobs.get(**{field.name: field.to_python(object_id)})
        except (model.DoesNotExist, ValidationError, ValueError):
            return None


@admin.register(JobAttempt)
class JobAttemptAdmin(
    DatabaseMixin, OfferedFiltersMixin, IndexedSearchMixin, ReadOnlyMixin, admin.ModelAdmin
):
    list_display = (
        "id",
        "job_link",
        "attempt",
        "token",
        "owner",
        "outcome",
        "shown_claimed_at",
        "shown_ended_at",
        "ended_by",
        "shown_fenced_at",
        "error",
    )
    list_filter = (OpenAttemptFilter, "outcome")
    search_help_text = _("A job id, or the start of an owner.")
    search_fields = ("owner",)  # shows the search box; search() does the search
    # The primary key, not Meta.ordering's claimed_at, which has no index.
    ordering = ("-id",)
    show_full_result_count = False
    shown_claimed_at = AttemptInline.shown_claimed_at
    shown_ended_at = AttemptInline.shown_ended_at
    shown_fenced_at = AttemptInline.shown_fenced_at

    @admin.display(description=_("job"), ordering="job_ref")
    def job_link(self, attempt: JobAttempt) -> str:
        return payment_job_link(self.admin_site.name, attempt)

    @admin.display(description=_("error"))
    def error(self, attempt: JobAttempt) -> str:
        return attempt_error(attempt)

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        pk = job_id(term)
        if pk is not None:  # (job_ref, ended_at) is indexed
            return queryset.filter(job_ref=pk)
        return queryset.filter(owner__startswith=term)


@cache
def attempt_inline(ledger: type[AbstractJobAttempt], using: str | None) -> type[AttemptInline]:
    """Return the attempt inline of `ledger` on database `using` (one class for each)."""
    return type(f"{ledger.__name__}Inline", (AttemptInline,), {"model": ledger, "using": using})


@cache
def event_inline(events: type[AbstractJobEvent], using: str | None) -> type[EventInline]:
    """Return the operator events inline of `events` on database `using` (one class for each)."""
    return type(f"{events.__name__}Inline", (EventInline,), {"model": events, "using": using})
