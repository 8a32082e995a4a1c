"""The operators' admin: lease-aware job lists, the attempt ledger, the worker registry and a
queue overview.

No lease SQL lives here. Every filter calls a `LeaseQuerySet` read (`expired()`,
`near_expiry()`, `healthy()`), every action one `LeaseQuerySet` operator method on the selected
jobs — the conditional UPDATEs the workers and the watcher use — so an action never takes a live
lease from its holder unless its name says it forces. Lease times shown are computed by the
database clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, cast
from weakref import WeakKeyDictionary

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Exists, OuterRef, QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.conf import leases_settings
from django_leases.exceptions import InvalidArgument, InvalidPayload
from django_leases.limits import JOB_ID, PRIORITY, bad_character, check_int, check_json
from django_leases.models import JobAttempt, JobEvent, JobStatus, PaymentJob, Worker
from django_leases.querysets import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    REVIEW,
    AttemptQuerySet,
    LeaseQuerySet,
    WorkerQuerySet,
)

EMPTY = "—"
SHORT_ERROR = 60

# The index shows a link to the overview through this template (it extends the stock one),
# unless the project already gave the default site an index template of its own.
if admin.site.index_template is None:
    admin.site.index_template = "admin/django_leases/index.html"


def duration(value: timedelta | None) -> str:
    """Return `value` as a short human duration: "4 s", "2 min 5 s", "3 h 10 min", "2 d 1 h"."""
    if value is None:
        return EMPTY
    seconds = int(abs(value.total_seconds()))
    if seconds < 60:
        return gettext("%(s)d s") % {"s": seconds}
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return gettext("%(m)d min %(s)d s") % {"m": minutes, "s": seconds}
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return gettext("%(h)d h %(m)d min") % {"h": hours, "m": minutes}
    days, hours = divmod(hours, 24)
    return gettext("%(d)d d %(h)d h") % {"d": days, "h": hours}


def operator(request: HttpRequest) -> str:
    """Name the operator in the ledger: "admin:<username>"."""
    return f"admin:{request.user.get_username()}"


# ---- list filters -------------------------------------------------------------------------------


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


# ---- the attempt ledger -------------------------------------------------------------------------


class ReadOnlyMixin:
    """Nothing is added, changed or deleted here: the rows are written by the lease layer."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class IndexedSearchMixin:
    """Search with `search(queryset, term)`, lookups an index serves, instead of Django's
    icontains on every search field, which scans the whole table."""

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        raise NotImplementedError

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        return (self.search(queryset, term) if term else queryset), False


def job_id(term: str) -> int | None:
    """Return `term` as a job id if it is one: ASCII digits within the BIGINT range."""
    # Not str.isdigit() alone: it is true for "²" and other digits int() refuses. The length
    # bound keeps int() from parsing (or refusing) thousands of digits.
    if not term.isascii() or not term.isdigit() or len(term) > len(str(JOB_ID[1])):
        return None
    number = int(term)
    return number if JOB_ID[0] <= number <= JOB_ID[1] else None


def short_text(text: str) -> str:
    """Return `text` cut to SHORT_ERROR characters, whole in its tooltip."""
    if not text:
        return EMPTY
    return format_html('<span title="{}">{}</span>', text, Truncator(text).chars(SHORT_ERROR))


def attempt_error(attempt: JobAttempt) -> str:
    return short_text(": ".join(filter(None, [attempt.error_class, attempt.error_message])))


class AttemptInline(ReadOnlyMixin, admin.TabularInline):
    model = JobAttempt
    fk_name = "job"
    verbose_name = _("attempt")
    verbose_name_plural = _("attempt ledger (newest first)")
    fields = readonly_fields = (
        "attempt",
        "token",
        "owner",
        "claimed_at",
        "last_heartbeat_at",
        "ended_at",
        "outcome",
        "ended_by",
        "checkpoint",
        "error",
        "fenced_at",
        "resolution",
        "resolved_by",
    )
    # Tokens only grow: the highest is the latest acquisition.
    ordering = ("-token",)
    extra = 0

    @admin.display(description=_("error"))
    def error(self, attempt: JobAttempt) -> str:
        return attempt_error(attempt)


class EventInline(ReadOnlyMixin, admin.TabularInline):
    """The operator actions on the job, beside (never over) its attempt ledger."""

    model = JobEvent
    fk_name = "job"
    verbose_name = _("operator event")
    verbose_name_plural = _("operator events (newest first)")
    fields = readonly_fields = ("at", "action", "by", "attempts", "token", "reason")
    ordering = ("-id",)
    extra = 0


class OpenAttemptFilter(admin.SimpleListFilter):
    title = _("attempt")
    parameter_name = "open"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("1", _("Open (still running)"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        return cast(AttemptQuerySet, queryset).open() if self.value() == "1" else None


@admin.register(JobAttempt)
class JobAttemptAdmin(IndexedSearchMixin, ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "id",
        "job_link",
        "attempt",
        "token",
        "owner",
        "outcome",
        "claimed_at",
        "ended_at",
        "ended_by",
        "fenced_at",
        "error",
    )
    list_filter = (OpenAttemptFilter, "outcome")
    search_help_text = _("A job id, or the start of an owner.")
    search_fields = ("owner",)  # shows the search box; search() does the search
    # The primary key, not Meta.ordering's claimed_at, which has no index.
    ordering = ("-id",)
    show_full_result_count = False

    @admin.display(description=_("job"), ordering="job_ref")
    def job_link(self, attempt: JobAttempt) -> str:
        if attempt.job_id is None:  # the job was pruned; the ledger keeps its id
            return str(attempt.job_ref)
        url = reverse("admin:django_leases_paymentjob_change", args=[attempt.job_ref])
        return format_html('<a href="{}">{}</a>', url, attempt.job_ref)

    @admin.display(description=_("error"))
    def error(self, attempt: JobAttempt) -> str:
        return attempt_error(attempt)

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        pk = job_id(term)
        if pk is not None:  # (job_ref, ended_at) is indexed
            return queryset.filter(job_ref=pk)
        return queryset.filter(owner__startswith=term)


# ---- the worker registry ------------------------------------------------------------------------


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


@admin.register(Worker)
class WorkerAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = (
        "worker_id",
        "state",
        "hostname",
        "pid",
        "kinds",
        "concurrency",
        "last_seen",
        "started_at",
        "stopped_at",
    )
    list_filter = (WorkerStateFilter,)
    search_fields = ("worker_id", "hostname")
    ordering = ("-last_seen_at",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        workers = cast(WorkerQuerySet, super().get_queryset(request))
        # alive() decides, in the same query: no second definition of "alive" here.
        return stats.with_seen_ago(workers).annotate(
            is_alive=Exists(workers.alive().filter(pk=OuterRef("pk")))
        )

    @admin.display(description=_("state"))
    def state(self, worker: Worker) -> str:
        if getattr(worker, "is_alive", False):
            return format_html('<span class="dl-badge dl-healthy">{}</span>', gettext("alive"))
        label = gettext("stopped") if worker.stopped_at else gettext("gone")
        return format_html('<span class="dl-badge dl-quiet">{}</span>', label)

    @admin.display(description=_("last seen"), ordering="-last_seen_at")
    def last_seen(self, worker: Worker) -> str:
        return gettext("%(age)s ago") % {"age": duration(getattr(worker, "seen_ago", None))}


# ---- payment jobs -------------------------------------------------------------------------------

LEASE_FIELDS = (
    "status",
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

STATE_LABELS = {
    stats.STUCK: _("Stuck"),
    stats.NEAR_EXPIRY: _("Near expiry"),
    stats.HEALTHY: _("Healthy"),
}


class Skip:
    """Why an action skipped a job in some category of `stats.selection()`."""

    LIVE = _("its lease is live — use “Force requeue”")
    NEVER_REQUEUED = _("completed jobs are never requeued")
    NOT_STUCK = _("its lease is live, so it is not stuck")
    NOT_PROCESSING = _("not processing, so there is no lease to release")
    HOLDER_WORKING = _("its lease is live and its holder may still be working")
    FINISHED = _("already finished")
    NOT_PENDING = _("only pending jobs can be cancelled")
    NOT_IN_REVIEW = _("not under review")


ALL_CATEGORIES = (PENDING, stats.LIVE_LEASE, stats.STUCK, COMPLETED, FAILED, REVIEW, CANCELLED)


def skip_all_but(keep: Iterable[str], reason: Any) -> dict[str, Any]:
    return {category: reason for category in ALL_CATEGORIES if category not in keep}


def report(
    before: Counter[str],
    changed: int,
    done: Callable[[int], str],
    skipped: dict[str, Any],
) -> tuple[str, int]:
    """Return the message and level that say how many jobs changed and why the others, counted
    by category in `before` (read just before the write), were skipped."""
    message = done(changed)
    missed = sum(before.values()) - changed
    if missed <= 0:
        return message, messages.SUCCESS
    # Only the categories the action skips, in the action's order of reasons.
    reasons: Counter[str] = Counter()
    for category, reason in skipped.items():
        if before[category]:
            reasons[str(reason)] += before[category]
    explained = sum(reasons.values())
    if missed > explained:
        reasons[gettext("it changed state while the action ran")] += missed - explained
    if len(reasons) == 1:
        why = next(iter(reasons))
    else:
        why = "; ".join(f"{reason} ({n})" for reason, n in reasons.items())
    message = gettext("%(done)s; %(n)d skipped: %(why)s") % {
        "done": message,
        "n": missed,
        "why": why,
    }
    return message, messages.WARNING


Action = Callable[[admin.ModelAdmin, HttpRequest, QuerySet[Any]], None]


def operator_action(
    description: Any,
    write: Callable[[LeaseQuerySet[Any], str], int],
    done: Callable[[int], str],
    skipped: dict[str, Any],
) -> Action:
    """Build an admin action that makes ONE `LeaseQuerySet` operator call on the selected jobs.

    Args:
        write: the call, given the selected jobs and the operator's name for the ledger; it
            returns how many jobs changed.
        done: the message for that number.
        skipped: why a job of a `stats.selection()` category is skipped by `write`.
    """

    @admin.action(description=description, permissions=["change"])
    def action(
        model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]
    ) -> None:
        jobs = cast(LeaseQuerySet[Any], queryset.order_by())
        before = stats.selection(jobs)
        changed = write(jobs, operator(request))
        model_admin.message_user(request, *report(before, changed, done, skipped))

    return action


class PaymentJobForm(ModelForm):
    """The change form: the bounds of `enqueue()`, the same on every database (SQLite would
    store a priority PostgreSQL refuses)."""

    def clean_payload(self) -> Any:
        payload = self.cleaned_data["payload"]
        try:
            check_json(payload, "payload")
        except InvalidPayload as exc:
            raise ValidationError(str(exc)) from None
        return payload

    def clean_priority(self) -> Any:
        priority = self.cleaned_data["priority"]
        try:
            check_int(priority, "priority", PRIORITY)
        except InvalidArgument as exc:
            raise ValidationError(str(exc)) from None
        return priority


@admin.register(PaymentJob)
class PaymentJobAdmin(IndexedSearchMixin, admin.ModelAdmin):
    # Status and lease state first: they are what an operator scans for.
    list_display = (
        "id",
        "status_badge",
        "lease",
        "kind",
        "payment_id",
        "owner",
        "attempts_of_max",
        "heartbeat",
        "last_error_short",
    )
    list_display_links = ("id", "kind")
    list_filter = (LeaseStateFilter, StatusFilter, KindFilter)
    search_help_text = _(
        "An exact payment id or idempotency key, or the start of the owner of a processing job."
    )
    search_fields = ("payment_id",)  # shows the search box; search() does the search
    # The primary key index serves the default order, however large the table.
    ordering = ("-id",)
    # One COUNT of the filtered rows per page, not a second one of the whole table.
    show_full_result_count = False
    inlines = (AttemptInline, EventInline)
    form = PaymentJobForm
    readonly_fields = ("kind", "payment_id", "idempotency_key", *LEASE_FIELDS, "lease", "heartbeat")
    fieldsets = (
        (None, {"fields": ("kind", "payment_id", "idempotency_key", "priority", "payload")}),
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
        "resolve_review_completed",
        "resolve_review_retry",
        "resolve_review_failed",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        jobs = cast(LeaseQuerySet[Any], super().get_queryset(request))
        return stats.with_lease_clock(jobs)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # jobs are added with PaymentJob.objects.enqueue()

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
        jobs = cast(LeaseQuerySet[Any], self.model._default_manager.all()).pending()
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
    def status_badge(self, job: PaymentJob) -> str:
        return format_html(
            '<span class="dl-badge dl-{}">{}</span>', job.status, job.get_status_display()
        )

    @admin.display(description=_("owner"), ordering="lease_owner")
    def owner(self, job: PaymentJob) -> str:
        if not job.lease_owner:
            return EMPTY
        if job.status == JobStatus.PROCESSING:
            return job.lease_owner
        # A job keeps the owner of its last lease; it holds none now.
        return format_html(
            '<span class="dl-quiet" title="{}">{}</span>', gettext("last holder"), job.lease_owner
        )

    @admin.display(description=_("attempts"), ordering="attempts")
    def attempts_of_max(self, job: PaymentJob) -> str:
        exhausted = " dl-exhausted" if job.attempts >= job.max_attempts else ""
        return format_html(
            '<span class="dl-attempts{}">{} / {}</span>', exhausted, job.attempts, job.max_attempts
        )

    @admin.display(description=_("lease"), ordering="lease_left")
    def lease(self, job: PaymentJob) -> str:
        left: timedelta | None = getattr(job, "lease_left", None)
        state = stats.lease_state(left, leases_settings.NEAR_EXPIRY)
        if state is None or left is None:
            return EMPTY
        if state == stats.STUCK:
            when = gettext("expired %(age)s ago") % {"age": duration(left)}
        else:
            when = gettext("%(left)s left") % {"left": duration(left)}
        return format_html(
            '<span class="dl-badge dl-{}">{}</span> <span class="dl-when">{}</span>',
            state,
            STATE_LABELS[state],
            when,
        )

    @admin.display(description=_("last heartbeat"), ordering="-heartbeat_at")
    def heartbeat(self, job: PaymentJob) -> str:
        age: timedelta | None = getattr(job, "heartbeat_age", None)
        if age is None:
            return EMPTY
        return gettext("%(age)s ago") % {"age": duration(age)}

    @admin.display(description=_("last error"))
    def last_error_short(self, job: PaymentJob) -> str:
        return short_text(job.last_error)

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        jobs = cast(LeaseQuerySet[Any], queryset)
        # Three index probes ORed together: the payment id and idempotency key indexes, and the
        # processing-only lease index for the owner. A job that no longer holds a lease is found
        # by its owner in the attempt ledger.
        found = jobs.filter(payment_id=term) | jobs.filter(idempotency_key=term)
        return found | jobs.processing().filter(lease_owner__startswith=term)

    # ---- actions ------------------------------------------------------------------------------

    requeue = operator_action(
        _("Requeue now"),
        lambda jobs, by: jobs.requeue(by=by),
        lambda n: ngettext("%d job requeued", "%d jobs requeued", n) % n,
        {stats.LIVE_LEASE: Skip.LIVE, COMPLETED: Skip.NEVER_REQUEUED},
    )
    force_requeue = operator_action(
        _("Force requeue — takes a live lease, fencing out its holder"),
        lambda jobs, by: jobs.requeue(force=True, by=by),
        lambda n: ngettext("%d job requeued by force", "%d jobs requeued by force", n) % n,
        {COMPLETED: Skip.NEVER_REQUEUED},
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
            **dict.fromkeys([COMPLETED, FAILED, CANCELLED], Skip.FINISHED),
        },
    )
    cancel = operator_action(
        _("Cancel (pending jobs only)"),
        lambda jobs, by: jobs.cancel(by=by),
        lambda n: ngettext("%d job cancelled", "%d jobs cancelled", n) % n,
        skip_all_but([PENDING], Skip.NOT_PENDING),
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
        lambda jobs, by: jobs.resolve_review("retry", by=by),
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

    # ---- the overview -------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_overview"
        overview = path("overview/", self.admin_site.admin_view(self.overview_view), name=name)
        return [overview, *super().get_urls()]  # before the catch-all "<object_id>/" routes

    def overview_view(self, request: HttpRequest) -> TemplateResponse:
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        near_expiry = leases_settings.NEAR_EXPIRY
        data = stats.overview(
            self.model._default_manager.all(),
            Worker.objects.all(),
            near_expiry=near_expiry,
        )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": gettext("Queue overview"),
            "overview": data,
            "statuses": [
                (value, label, data.by_status.get(value, 0)) for value, label in JobStatus.choices
            ],
            "oldest_due_wait": duration(data.oldest_due_wait),
            "near_expiry_seconds": near_expiry,
            "chart": chart(data.chart),
            "stuck_jobs": [(job, self.lease(job), self.heartbeat(job)) for job in data.stuck_jobs],
            "workers": [(worker, duration(worker.seen_ago)) for worker in data.workers],
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
