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
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.admin.actions import STATE_LABELS, Skip, operator_action, skip_all_but
from django_leases.admin.counts import CountingChangeList, CountingPaginator
from django_leases.admin.dependencies import DEPENDENCY_FIELDS, DependenciesMixin
from django_leases.admin.display import EMPTY, human_duration, short_text
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
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    LEASED_STATUSES,
    PENDING,
    REVIEW,
    STOPPING,
    WAITING,
    JobStatus,
    Verdict,
)
from django_leases.tables import ledger_model

LEASE_FIELDS = (
    "status",
    "ends_as",
    "run_at",
    "attempts",
    "max_attempts",
    "lease_owner",
    "lease_until",
    "lease_token",
    "heartbeat_at",
    "checkpoint",
    "last_error",
    "created_at",
    "completed_at",
)
# The only fields an operator edits, and only while the job is pending: a running job's payload
# is in its handler's hands. The save is one UPDATE that restates `status = pending`, so a job
# claimed while the form was open is left alone, and it never writes a lease field.
EDITABLE_FIELDS = ("priority", "payload")
# The kinds of `LeaseBackend` tasks (backends.TASK_KIND_PREFIX, not imported here: that module
# needs the Tasks framework). Their payload names the callable to run, so it is never edited.
TASK_KINDS = "tasks."
# Why a change form's save wrote nothing, per request, for `response_change()` to say.
NOT_SAVED: WeakKeyDictionary[HttpRequest, str] = WeakKeyDictionary()


class JobChangeList(CountingChangeList):
    """The job list: no column reads the payload or the result, which may each be up to
    MAX_PAYLOAD_BYTES: a page of them is not loaded."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        return super().get_queryset(request, exclude_parameters).defer("payload", "result")


class LeasedJobAdmin(
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
                    "lease_until",
                    "heartbeat",
                    "heartbeat_at",
                    "checkpoint",
                    ("attempts", "max_attempts"),
                    "run_at",
                )
            },
        ),
        (_("Outcome"), {"fields": ("last_error", "created_at", "completed_at")}),
    )
    actions = (
        "requeue",
        "force_requeue",
        "release_stuck",
        "mark_failed",
        "cancel",
        "force_cancel",
        "resolve_review_completed",
        "resolve_review_retry",
        "resolve_review_failed",
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
        fields = tuple(super().get_readonly_fields(request, obj))
        if obj is None or obj.status != PENDING:
            return (*fields, *EDITABLE_FIELDS)
        if obj.kind.startswith(TASK_KINDS):
            return (*fields, "payload")
        return fields

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
        jobs = cast(LeaseQuerySet[Any], self.all_rows()).pending()
        if "payload" in edits:
            jobs = jobs.exclude(kind__startswith=TASK_KINDS)
        if not jobs.filter(pk=obj.pk).update(**edits):
            NOT_SAVED[request] = gettext(
                "Nothing was saved: job %(id)s left pending (a worker claimed it, or an operator "
                "acted on it) while the form was open."
            ) % {"id": obj.pk}

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        if request in NOT_SAVED:
            return None  # nothing changed: the admin's history must not say otherwise
        return super().log_change(request, obj, message)

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
            return job.lease_owner
        # A job keeps the owner of its last lease; it holds none now.
        return format_html(
            '<span class="dl-quiet" title="{}">{}</span>', gettext("last holder"), job.lease_owner
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
        if age is None:
            return EMPTY
        return gettext("%(age)s ago") % {"age": human_duration(age)}

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

    # ---- actions ------------------------------------------------------------------------------

    requeue = operator_action(
        _("Requeue now"),
        lambda jobs, by: jobs.requeue(by=by),
        lambda n: ngettext("%d job requeued", "%d jobs requeued", n) % n,
        {
            stats.LIVE_LEASE: Skip.LIVE,
            STOPPING: Skip.STOPPING,
            COMPLETED: Skip.NEVER_REQUEUED,
            WAITING: Skip.WAITING,
        },
    )
    force_requeue = operator_action(
        _("Force requeue — takes a live lease, fencing out its holder"),
        lambda jobs, by: jobs.requeue(force=True, by=by),
        lambda n: ngettext("%d job requeued by force", "%d jobs requeued by force", n) % n,
        {COMPLETED: Skip.NEVER_REQUEUED, WAITING: Skip.WAITING},
    )
    release_stuck = operator_action(
        _("Release stuck lease (back to pending)"),
        lambda jobs, by: jobs.release_stuck(by=by),
        lambda n: ngettext("%d stuck job released", "%d stuck jobs released", n) % n,
        {
            stats.LIVE_LEASE: Skip.NOT_STUCK,
            **skip_all_but([stats.LIVE_LEASE, stats.STUCK], Skip.NOT_PROCESSING),
        },
    )
    mark_failed = operator_action(
        _("Mark failed (no live lease)"),
        lambda jobs, by: jobs.mark_failed(reason=f"marked failed by {by}", by=by),
        lambda n: ngettext("%d job marked failed", "%d jobs marked failed", n) % n,
        {
            stats.LIVE_LEASE: Skip.HOLDER_WORKING,
            STOPPING: Skip.HOLDER_WORKING,
            **dict.fromkeys([COMPLETED, FAILED, CANCELLED], Skip.FINISHED),
        },
    )
    cancel = operator_action(
        _("Cancel (pending or waiting jobs only)"),
        lambda jobs, by: jobs.cancel(running=False, by=by),
        lambda n: ngettext("%d job cancelled", "%d jobs cancelled", n) % n,
        skip_all_but([PENDING, WAITING], Skip.NOT_PENDING),
    )
    force_cancel = operator_action(
        _("Force cancel — running jobs too: tells their holders to stop"),
        lambda jobs, by: jobs.cancel(by=by),
        lambda n: ngettext("%d job cancelled by force", "%d jobs cancelled by force", n) % n,
        skip_all_but([PENDING, WAITING, stats.LIVE_LEASE, stats.STUCK], Skip.NOT_CANCELLABLE),
        confirm=_(
            "Cancel the selected jobs, running ones included? Each running job's worker is "
            "told to stop within one heartbeat interval and is fenced out of every further "
            "write; a plain (sync) handler is not interrupted and may still finish a call it "
            "already started. A job of a review-policy kind past its checkpoint goes to review "
            "instead: it may have moved money."
        ),
    )
    resolve_review_completed = operator_action(
        _("Resolve review: completed"),
        lambda jobs, by: jobs.resolve_review(COMPLETED, by=by),
        lambda n: (
            ngettext("%d job under review completed", "%d jobs under review completed", n) % n
        ),
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
    )
    resolve_review_retry = operator_action(
        _("Resolve review: retry"),
        lambda jobs, by: jobs.resolve_review(Verdict.RETRY, by=by),
        lambda n: (
            ngettext(
                "%d job under review sent back to pending",
                "%d jobs under review sent back to pending",
                n,
            )
            % n
        ),
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
    )
    resolve_review_failed = operator_action(
        _("Resolve review: failed"),
        lambda jobs, by: jobs.resolve_review(FAILED, by=by),
        lambda n: ngettext("%d job under review failed", "%d jobs under review failed", n) % n,
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
    )
