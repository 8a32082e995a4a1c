"""Operator actions: each makes ONE queryset operator call and says what it skipped, and why;
each records who, when and why, in the job's operator events and in its admin history. The
dangerous ones need a reason and a permission of their own (`models.GUARDED_ACTIONS`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.admin.audit import log_history
from django_leases.limits import MAX_ERROR_LENGTH as REASON_LENGTH
from django_leases.querysets import LeaseQuerySet
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    REVIEW,
    STOPPING,
    WAITING,
    EventAction,
    Verdict,
)


def operator(request: HttpRequest) -> str:
    """Name the operator in the ledger: "admin:<username>"."""
    return f"admin:{request.user.get_username()}"


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
    NOT_PENDING = _("only pending or waiting jobs can be cancelled — use “Force cancel”")
    NOT_CANCELLABLE = _("already finished or under review")
    STOPPING = _("its handler may still run until it stops — use “Force requeue”")
    WAITING = _("it waits for an earlier job of its lock")
    NOT_IN_REVIEW = _("not under review")


ALL_CATEGORIES = (
    PENDING,
    WAITING,
    stats.LIVE_LEASE,
    stats.STUCK,
    STOPPING,
    COMPLETED,
    FAILED,
    REVIEW,
    CANCELLED,
)


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


AdminAction = Callable[[admin.ModelAdmin, HttpRequest, QuerySet[Any]], TemplateResponse | None]
# The selected jobs, the operator's name for the ledger and the reason given: how many changed,
# and which (`Changed`).
Write = Callable[[LeaseQuerySet[Any], str, str], Any]


class ReasonActionForm(helpers.ActionForm):
    """The action bar, with the reason every action records (required by the dangerous ones)."""

    reason = forms.CharField(
        label=_("Reason:"),
        required=False,
        max_length=REASON_LENGTH,
        widget=forms.TextInput(attrs={"size": 40, "placeholder": _("why (kept in the audit)")}),
    )


def operator_action(
    description: Any,
    write: Write,
    done: Callable[[int], str],
    skipped: dict[str, Any],
    *,
    event: EventAction,
    reason_required: bool = False,
    permission: str = "change",
    confirm: Any = None,
) -> AdminAction:
    """Build an admin action that makes ONE `LeaseQuerySet` operator call on the selected jobs.

    Args:
        write: the call, given the selected jobs, the operator's name for the ledger and the
            reason; it returns which jobs changed (`operators.Changed`).
        done: the message for that number.
        skipped: why a job of a `stats.selection()` category is skipped by `write`.
        event: what the call records, for the jobs' admin history.
        reason_required: the action is dangerous: it is refused without a reason.
        permission: what the user needs (`has_<permission>_permission()`): "change", or one
            of `models.GUARDED_ACTIONS`.
        confirm: if given, the warning of a confirmation page shown first (`write` runs once
            the operator confirms it).
    """

    def action(
        model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        reason = request.POST.get("reason", "").strip()[:REASON_LENGTH]
        if reason_required and not reason:
            model_admin.message_user(
                request,
                gettext("“%(action)s” needs a reason: nothing was changed.")
                % {"action": description},
                messages.ERROR,
            )
            return None
        # On the database the action writes, not on a replica (a read/write-split router's
        # `db_for_read`): the jobs confirmed and counted are those the write changes.
        jobs = cast(LeaseQuerySet[Any], queryset.order_by()).writing_to()
        if confirm is not None and request.POST.get("post") != "yes":
            return confirmation(model_admin, request, jobs, description, confirm, reason)
        before = stats.selection(jobs)
        changed = write(jobs, operator(request), reason)
        log_history(model_admin, request, changed.pks, event, reason)
        model_admin.message_user(request, *report(before, changed, done, skipped))
        return None

    return admin.action(description=description, permissions=[permission])(action)


def confirmation(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    title: Any,
    warning: Any,
    reason: str,
) -> TemplateResponse:
    """The page that asks the operator to confirm an action on the selected jobs.

    A selection across every page of the list ("select all N") is posted back as such, and the
    list's query string names it again: one id per job would not pass Django's
    DATA_UPLOAD_MAX_NUMBER_FIELDS beyond about 1,000 jobs.
    """
    across = request.POST.get("select_across") == "1"
    ordered = queryset.order_by("pk").values_list("pk", flat=True)
    # Across the pages, one id only: Django runs an action only if some job is checked.
    pks = list(ordered[:1] if across else ordered)
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.model._meta,
        "title": title,
        "warning": warning,
        "reason": reason,
        "pks": pks,
        "select_across": across,
        "selected": queryset.count() if across else len(pks),
        "action": request.POST.get("action", ""),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
    }
    return TemplateResponse(request, "admin/django_leases/confirm_action.html", context)


OPERATOR_ACTIONS = (
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


class OperatorActionsMixin:
    """The operator actions of a job admin, each behind "change", the dangerous ones also
    behind their own permission (`<action>_<model name>`, `models.job_permissions()`): a user
    without it is offered no such action, and a POST that names it anyway gets a 403."""

    action_form = ReasonActionForm

    def may(self, request: HttpRequest, action: str) -> bool:
        """Whether the user may change jobs and has the permission of the guarded `action`."""
        opts: Any = self.opts  # type: ignore[attr-defined]
        codename = get_permission_codename(action, opts)
        return bool(
            self.has_change_permission(request)  # type: ignore[attr-defined]
            and request.user.has_perm(f"{opts.app_label}.{codename}")
        )

    def has_force_requeue_permission(self, request: HttpRequest) -> bool:
        return self.may(request, "force_requeue")

    def has_force_cancel_permission(self, request: HttpRequest) -> bool:
        return self.may(request, "force_cancel")

    def has_resolve_review_completed_permission(self, request: HttpRequest) -> bool:
        return self.may(request, "resolve_review_completed")

    def has_resolve_review_failed_permission(self, request: HttpRequest) -> bool:
        return self.may(request, "resolve_review_failed")

    def has_edit_payload_permission(self, request: HttpRequest) -> bool:
        return self.may(request, "edit_payload")

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        name = request.POST.get("action") if request.method == "POST" else None
        offered = self.get_actions(request)  # type: ignore[attr-defined]
        if name in OPERATOR_ACTIONS and name not in offered:
            raise PermissionDenied  # an action the page never offered this user
        return cast(HttpResponse, super().changelist_view(request, extra_context))  # type: ignore[misc]

    requeue = operator_action(
        _("Requeue now"),
        lambda jobs, by, why: jobs.requeue(by=by, reason=why),
        lambda n: ngettext("%d job requeued", "%d jobs requeued", n) % n,
        {
            stats.LIVE_LEASE: Skip.LIVE,
            STOPPING: Skip.STOPPING,
            COMPLETED: Skip.NEVER_REQUEUED,
            WAITING: Skip.WAITING,
        },
        event=EventAction.REQUEUED,
    )
    force_requeue = operator_action(
        _("Force requeue — takes a live lease, fencing out its holder"),
        lambda jobs, by, why: jobs.requeue(force=True, by=by, reason=why),
        lambda n: ngettext("%d job requeued by force", "%d jobs requeued by force", n) % n,
        {COMPLETED: Skip.NEVER_REQUEUED, WAITING: Skip.WAITING},
        event=EventAction.FORCE_REQUEUED,
        reason_required=True,
        permission="force_requeue",
    )
    release_stuck = operator_action(
        _("Release stuck lease (back to pending)"),
        lambda jobs, by, why: jobs.release_stuck(by=by, reason=why),
        lambda n: ngettext("%d stuck job released", "%d stuck jobs released", n) % n,
        {
            stats.LIVE_LEASE: Skip.NOT_STUCK,
            **skip_all_but([stats.LIVE_LEASE, stats.STUCK], Skip.NOT_PROCESSING),
        },
        event=EventAction.RELEASED,
    )
    mark_failed = operator_action(
        _("Mark failed (no live lease)"),
        lambda jobs, by, why: jobs.mark_failed(reason=f"marked failed by {by}: {why}", by=by),
        lambda n: ngettext("%d job marked failed", "%d jobs marked failed", n) % n,
        {
            stats.LIVE_LEASE: Skip.HOLDER_WORKING,
            STOPPING: Skip.HOLDER_WORKING,
            **dict.fromkeys([COMPLETED, FAILED, CANCELLED], Skip.FINISHED),
        },
        event=EventAction.FAILED,
        reason_required=True,
    )
    cancel = operator_action(
        _("Cancel (pending or waiting jobs only)"),
        lambda jobs, by, why: jobs.cancel(running=False, by=by, reason=why),
        lambda n: ngettext("%d job cancelled", "%d jobs cancelled", n) % n,
        skip_all_but([PENDING, WAITING], Skip.NOT_PENDING),
        event=EventAction.CANCELLED,
    )
    force_cancel = operator_action(
        _("Force cancel — running jobs too: tells their holders to stop"),
        lambda jobs, by, why: jobs.cancel(by=by, reason=why),
        lambda n: ngettext("%d job cancelled by force", "%d jobs cancelled by force", n) % n,
        skip_all_but([PENDING, WAITING, stats.LIVE_LEASE, stats.STUCK], Skip.NOT_CANCELLABLE),
        event=EventAction.FORCE_CANCELLED,
        reason_required=True,
        permission="force_cancel",
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
        lambda jobs, by, why: jobs.resolve_review(COMPLETED, by=by, reason=why),
        lambda n: (
            ngettext("%d job under review completed", "%d jobs under review completed", n) % n
        ),
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
        event=EventAction.REVIEW_COMPLETED,
        reason_required=True,
        permission="resolve_review_completed",
    )
    resolve_review_retry = operator_action(
        _("Resolve review: retry"),
        lambda jobs, by, why: jobs.resolve_review(Verdict.RETRY, by=by, reason=why),
        lambda n: (
            ngettext(
                "%d job under review sent back to pending",
                "%d jobs under review sent back to pending",
                n,
            )
            % n
        ),
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
        event=EventAction.REVIEW_RETRY,
        reason_required=True,
    )
    resolve_review_failed = operator_action(
        _("Resolve review: failed"),
        lambda jobs, by, why: jobs.resolve_review(FAILED, by=by, reason=why),
        lambda n: ngettext("%d job under review failed", "%d jobs under review failed", n) % n,
        skip_all_but([REVIEW], Skip.NOT_IN_REVIEW),
        event=EventAction.REVIEW_FAILED,
        reason_required=True,
        permission="resolve_review_failed",
    )
