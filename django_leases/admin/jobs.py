"""The job admin: lease-aware list, safe edits of pending jobs, operator actions.

`LeasedJobAdmin` serves any `AbstractLeasedJob` table (`payments.PaymentJobAdmin` adds the
payment fields).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast
from weakref import WeakKeyDictionary

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.options import InlineModelAdmin
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.admin.actions import (
    OPERATOR_ACTIONS,
    STATE_LABELS,
    OperatorActionsMixin,
    operator,
)
from django_leases.admin.audit import log_history
from django_leases.admin.counts import CountingChangeList, CountingPaginator
from django_leases.admin.dependencies import DEPENDENCY_FIELDS, DependenciesMixin
from django_leases.admin.display import (
    EMPTY,
    breakable,
    human_duration,
    short_text,
    stamp,
    to_the_second,
)
from django_leases.admin.filters import (
    KindFilter,
    LeaseStateFilter,
    LockFilter,
    StatusFilter,
    TimeFilter,
)
from django_leases.admin.forms import LeasedJobForm
from django_leases.admin.ledger import (
    RecordedStepsMixin,
    attempt_inline,
    event_inline,
    step_inline,
)
from django_leases.admin.mixins import IndexedSearchMixin, OfferedFiltersMixin, job_id
from django_leases.admin.overview import OverviewMixin
from django_leases.conf import leases_settings
from django_leases.handlers import near_window
from django_leases.models import (
    AbstractJobEvent,
    AbstractLeasedJob,
    PaymentJob,
)
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.edits import EDITABLE_FIELDS
from django_leases.status import LEASED_STATUSES, PENDING, EventAction, JobStatus
from django_leases.tables import ledger_model

# The job's times, shown to the second (`display.to_the_second()`) as "shown_<field>".
TIMES = {
    "run_at": _("run at"),
    "lease_until": _("lease until"),
    "heartbeat_at": _("last heartbeat at"),
    "created_at": _("created at"),
    "completed_at": _("completed at"),
}
LEASE_FIELDS = (
    "status",
    "ends_as",
    "attempts",
    "max_attempts",
    "lease_owner",
    "lease_token",
    "checkpoint",
    "last_error",
    *(f"shown_{name}" for name in TIMES),
)
# The kinds of `LeaseBackend` tasks (backends.TASK_KIND_PREFIX, not imported here: that module
# needs the Tasks framework). Their payload names the callable to run, so it is never edited.
TASK_KINDS = "tasks."
# Why a change form's save wrote nothing, per request, for `response_change()` to say.
NOT_SAVED: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()
# What a change form's save changed, per request (field -> [old, new]), for `log_change()`.
EDITED: WeakKeyDictionary[HttpRequest, tuple[dict[str, list[Any]], str]] = WeakKeyDictionary()


class JobChangeList(CountingChangeList):
    """The job list: no column reads the payload or the result, which may each be up to
    MAX_PAYLOAD_BYTES: a page of them is not loaded."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        return super().get_queryset(request, exclude_parameters).defer("payload", "result")


class LeasedJobAdmin(
    OperatorActionsMixin,
    RecordedStepsMixin,
    DependenciesMixin,
    OverviewMixin,
    OfferedFiltersMixin,
    IndexedSearchMixin,
    admin.ModelAdmin,
):
    """The admin of a job table: register it for your own `AbstractLeasedJob` model.

    Lease filters and columns, the operator actions, the attempt ledger inline (the model's
    `attempt_model`) and the queue overview (`overview/`). Add your own columns to
    `list_display` and `readonly_fields`, and extend `search()`. `using` names the database
    whose queue it shows (`mixins.DatabaseMixin`).
    """

    # Status and lease state first: they are what an operator scans for.
    list_display = [
        "id",
        "status_badge",
        "lease",
        "running_for",
        "kind",
        "lock_state",
        "owner",
        "attempts_of_max",
        "heartbeat",
        "last_error_short",
    ]
    list_display_links = ("id", "kind")
    list_filter = (LeaseStateFilter, StatusFilter, LockFilter, KindFilter, TimeFilter)
    search_help_text = _("A job id, or the start of the owner of a processing job.")
    search_fields = ("kind",)  # shows the search box; search() does the search
    # The primary key index serves the default order, however large the table.
    ordering = ("-id",)
    # One count of the filtered rows per page, not a second one of the whole table; and that
    # one stops at ADMIN_EXACT_COUNT_LIMIT (see get_paginator()).
    show_full_result_count = False
    form = LeasedJobForm
    change_list_template = "admin/django_leases/leasedjob/change_list.html"
    change_form_template = "admin/django_leases/change_form.html"
    readonly_fields = [
        "kind",
        "lock",
        "lock_position",
        *LEASE_FIELDS,
        "lease",
        "heartbeat",
        *DEPENDENCY_FIELDS,
    ]
    fieldsets = (
        (None, {"fields": ("kind", ("lock", "lock_position"), "priority", "payload")}),
        (_("Dependencies"), {"fields": DEPENDENCY_FIELDS}),
        (
            _("Lease"),
            {
                "fields": (
                    "status",
                    "lease",
                    "lease_owner",
                    "lease_token",
                    "shown_lease_until",
                    "heartbeat",
                    "checkpoint",
                    ("attempts", "max_attempts"),
                    "shown_run_at",
                )
            },
        ),
        (_("Outcome"), {"fields": ("last_error", "shown_created_at", "shown_completed_at")}),
    )
    actions = OPERATOR_ACTIONS
    shown_run_at, shown_lease_until, shown_heartbeat_at, shown_created_at, shown_completed_at = (
        to_the_second(name, text) for name, text in TIMES.items()
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        jobs = cast(LeaseQuerySet[Any], super().get_queryset(request))
        return stats.with_lock_holder(stats.with_lease_clock(jobs))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are added with enqueue()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[CountingChangeList]:
        return JobChangeList

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)  # a redirect has none
        changelist = context.get("cl") if context else None
        if isinstance(changelist, CountingChangeList):
            note = changelist.selection_note_all()
            if note is not None:
                context["selection_note_all"] = note  # type: ignore[index]
        return response

    def get_paginator(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        per_page: int,
        orphans: int = 0,
        allow_empty_first_page: bool = True,
    ) -> Paginator:
        if queryset.model is not self.model:
            # The history page pages the job's LogEntry rows through here too: a short list,
            # and no LeaseQuerySet to count with.
            return super().get_paginator(
                request, queryset, per_page, orphans, allow_empty_first_page
            )
        # Never below "Show all"'s bound: a list counted as short as that is loaded whole.
        limit = max(
            leases_settings.ADMIN_EXACT_COUNT_LIMIT, self.list_per_page, self.list_max_show_all
        )
        return CountingPaginator(queryset, per_page, orphans, allow_empty_first_page, limit=limit)

    def get_inlines(self, request: HttpRequest, obj: Any) -> list[type[InlineModelAdmin[Any, Any]]]:
        """The model's attempt ledger and operator events, where it has them, and the job's
        recorded steps, if it has any (`RecordedStepsMixin`)."""
        ledger = ledger_model(self.model)
        inlines: list[type[InlineModelAdmin[Any, Any]]] = []
        if ledger is not None:
            inlines.append(attempt_inline(ledger, self.using))
        if self.model.event_model:
            events = cast(type[AbstractJobEvent], apps.get_model(self.model.event_model))
            inlines.append(event_inline(events, self.using))
        if getattr(obj, "has_recorded_steps", False):
            inlines.append(step_inline(cast(type[AbstractLeasedJob], self.model), self.using))
        return inlines

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting a job would pull it from under a live worker and orphan its ledger;
        # finished jobs go with prune_jobs.
        return False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        # An operator edits EDITABLE_FIELDS only while the job is pending (a running job's payload
        # is in its handler's hands), the payload only with `edit_payload_<model name>`.
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is None or obj.status != PENDING:
            return (*fields, *EDITABLE_FIELDS, "reason")
        if obj.kind.startswith(TASK_KINDS) or not self.has_edit_payload_permission(request):
            return (*fields, "payload")
        return fields

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> list[Any]:
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is not None and obj.status == PENDING and self.has_change_permission(request, obj):
            # Why the operator edits: kept in the job's operator event and history.
            fieldsets.append((_("Reason"), {"fields": ("reason",)}))
        return fieldsets

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        if (
            request.method == "POST"
            and "payload" in request.POST
            and not self.has_edit_payload_permission(request)
        ):
            raise PermissionDenied  # a payload field the page never offered this user
        return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(
        self, request: HttpRequest, obj: Any, form: ModelForm[Any], change: bool
    ) -> None:
        # Fields the operator's (older) page posted that are read-only now: the job left pending.
        stale = [
            name for name in EDITABLE_FIELDS if name in request.POST and name not in form.fields
        ]
        edits = {
            name: form.cleaned_data[name] for name in form.changed_data if name in EDITABLE_FIELDS
        }
        if stale and obj.status == PENDING:  # a task job, whose payload names what it runs
            NOT_SAVED[request] = gettext(
                "Nothing was saved: the payload of task job %(id)s cannot be changed here."
            ) % {"id": obj.pk}
            return
        if stale:
            NOT_SAVED[request] = gettext(
                "Nothing was saved: job %(id)s is %(status)s now, and only a pending job's "
                "%(fields)s can be changed."
            ) % {"id": obj.pk, "status": obj.get_status_display(), "fields": ", ".join(stale)}
            return
        if not edits:
            return
        jobs = cast(LeaseQuerySet[Any], self.all_rows())
        if "payload" in edits:
            jobs = jobs.exclude(kind__startswith=TASK_KINDS)
        reason = form.cleaned_data.get("reason", "")
        changes = jobs.edit_pending(obj.pk, edits, by=operator(request), reason=reason)
        if changes:
            EDITED[request] = (changes, reason)
        if changes is None:
            NOT_SAVED[request] = gettext(
                "Nothing was saved: job %(id)s left pending (a worker claimed it, or an operator "
                "acted on it) while the form was open."
            ) % {"id": obj.pk}

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        edited = EDITED.pop(request, None)
        if request in NOT_SAVED or edited is None:
            return None  # nothing changed: the admin's history must not say otherwise
        changes, reason = edited
        return log_history(self, request, [obj.pk], EventAction.EDITED, reason, changes)

    def response_change(self, request: HttpRequest, obj: Any) -> HttpResponse:
        reason = NOT_SAVED.pop(request, None)
        if reason is None:
            return super().response_change(request, obj)
        self.message_user(request, reason, messages.WARNING)
        return HttpResponseRedirect(request.path)

    # ---- columns ------------------------------------------------------------------------------

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, job: Any) -> str:
        return format_html(
            '<span class="dl-badge dl-{}">{}</span>', job.status, job.get_status_display()
        )

    @admin.display(description=_("owner"), ordering="lease_owner")
    def owner(self, job: Any) -> str:
        if not job.lease_owner:
            return EMPTY
        if job.status in LEASED_STATUSES:
            return breakable(job.lease_owner)
        # A job keeps the owner of its last lease; it holds none now.
        return format_html(
            '<span class="dl-quiet" title="{}">{}</span>',
            gettext("last holder"),
            breakable(job.lease_owner),
        )

    @admin.display(description=_("attempts"), ordering="attempts")
    def attempts_of_max(self, job: Any) -> str:
        exhausted = " dl-exhausted" if job.attempts >= job.max_attempts else ""
        return format_html(
            '<span class="dl-attempts{}">{} / {}</span>', exhausted, job.attempts, job.max_attempts
        )

    @admin.display(description=_("lease"), ordering="lease_left")
    def lease(self, job: Any) -> str:
        left: timedelta | None = getattr(job, "lease_left", None)
        state = stats.lease_state(left, near_window(job.kind, leases_settings.NEAR_EXPIRY))
        if state is None or left is None:
            return EMPTY
        if state == stats.STUCK:
            when = gettext("expired %(age)s ago") % {"age": human_duration(left)}
        else:
            when = gettext("%(left)s left") % {"left": human_duration(left)}
        return format_html(
            '<span class="dl-badge dl-{}">{}</span> <span class="dl-when">{}</span>',
            state,
            STATE_LABELS[state],
            when,
        )

    @admin.display(description=_("lock"), ordering="lock")
    def lock_state(self, job: PaymentJob) -> str:
        """The list's lock column: the lock, and whether the job waits for it or holds it."""
        if job.status == JobStatus.WAITING:
            return format_html(
                '<span class="dl-badge dl-waiting" title="{}">{}</span>',
                job.lock,
                self._waiting_for(job),
            )
        if job.lock_holder:
            return format_html('<span title="{}">{}</span>', gettext("holds its lock"), job.lock)
        return job.lock or EMPTY

    @admin.display(description=_("lock state"))
    def lock_position(self, job: PaymentJob) -> str:
        """The change form's, beside the lock itself: whether the job waits for it or holds it."""
        if job.status == JobStatus.WAITING:
            return format_html(
                '<span class="dl-badge dl-waiting">{}</span>', self._waiting_for(job)
            )
        if job.lock_holder:
            return gettext("holds its lock")
        return EMPTY

    def _waiting_for(self, job: PaymentJob) -> str:
        if job.unmet:
            return gettext("waiting for the jobs it was enqueued after")
        holder = getattr(job, "waiting_for", None)
        if holder is None:
            return gettext("waiting for its lock")
        url = reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
            args=[holder],
            current_app=self.admin_site.name,
        )
        return format_html(
            gettext("waiting for job {} (same lock)"),
            format_html('<a href="{}">#{}</a>', url, holder),
        )

    @admin.display(description=_("last heartbeat"), ordering="-heartbeat_at")
    def heartbeat(self, job: Any) -> str:
        age: timedelta | None = getattr(job, "heartbeat_age", None)
        if age is None or job.heartbeat_at is None:
            return EMPTY
        # How long ago by the database clock, the lease's own.
        return stamp(job.heartbeat_at, job.heartbeat_at + age, short=True)

    @admin.display(description=_("attempt running for"), ordering="running_for")
    def running_for(self, job: PaymentJob) -> str:
        ran: timedelta | None = getattr(job, "running_for", None)
        if ran is None:
            return EMPTY
        if ran.total_seconds() <= stats.long_running_limit(job.kind):
            return human_duration(ran)
        return format_html(
            '<span class="dl-badge dl-running_long">{}</span> <span class="dl-when">{}</span>',
            gettext("Running long"),
            human_duration(ran),
        )

    @admin.display(description=_("last error"))
    def last_error_short(self, job: Any) -> str:
        return short_text(job.last_error)

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        jobs = cast(LeaseQuerySet[Any], queryset)
        # Index probes only: the primary key, and the processing-only lease index for the
        # owner. A job that no longer holds a lease is found by its owner in the attempt ledger.
        pk = job_id(term)
        by_owner = jobs.processing().filter(lease_owner__startswith=term)
        return by_owner if pk is None else jobs.filter(pk=pk) | by_owner
