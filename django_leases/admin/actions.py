"""Operator actions: each makes ONE queryset operator call and says what it skipped, and why."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases import stats
from django_leases.querysets import LeaseQuerySet
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    REVIEW,
    STOPPING,
    WAITING,
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


def operator_action(
    description: Any,
    write: Callable[[LeaseQuerySet[Any], str], int],
    done: Callable[[int], str],
    skipped: dict[str, Any],
    *,
    confirm: Any = None,
) -> AdminAction:
    """Build an admin action that makes ONE `LeaseQuerySet` operator call on the selected jobs.

    Args:
        write: the call, given the selected jobs and the operator's name for the ledger; it
            returns how many jobs changed.
        done: the message for that number.
        skipped: why a job of a `stats.selection()` category is skipped by `write`.
        confirm: if given, the warning of a confirmation page shown first (`write` runs once
            the operator confirms it).
    """

    @admin.action(description=description, permissions=["change"])
    def action(
        model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        # On the database the action writes, not on a replica (a read/write-split router's
        # `db_for_read`): the jobs confirmed and counted are those the write changes.
        jobs = cast(LeaseQuerySet[Any], queryset.order_by()).writing_to()
        if confirm is not None and request.POST.get("post") != "yes":
            return confirmation(model_admin, request, jobs, description, confirm)
        before = stats.selection(jobs)
        changed = write(jobs, operator(request))
        model_admin.message_user(request, *report(before, changed, done, skipped))
        return None

    return action


def confirmation(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    queryset: QuerySet[Any],
    title: Any,
    warning: Any,
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
        "pks": pks,
        "select_across": across,
        "selected": queryset.count() if across else len(pks),
        "action": request.POST.get("action", ""),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
    }
    return TemplateResponse(request, "admin/django_leases/confirm_action.html", context)
