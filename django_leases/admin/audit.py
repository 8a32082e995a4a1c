"""The audit of operator actions: each changed job's admin history (Django's `LogEntry`, so that
"History" and "Recent actions" show it) and the read-only list of operator events (`JobEvent`).

The operator events are the record: written in the transaction of the change itself, with who,
when, why and, for an edit, each field's old and new value. The history entry is written right
after, by the admin, for the admin's own pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.text import Truncator
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases.admin.display import EMPTY, payment_job_link, short_text, to_the_second
from django_leases.admin.mixins import (
    DatabaseMixin,
    IndexedSearchMixin,
    OfferedFiltersMixin,
    ReadOnlyMixin,
    job_id,
)
from django_leases.models import JobEvent
from django_leases.status import EventAction

# Jobs whose history entries are written per statement: an action on every page of a long list
# changes thousands.
HISTORY_BATCH = 500
# How much of an old or new value a history entry shows; the operator event keeps it whole.
SHOWN_VALUE = 120


def described(changes: dict[str, list[Any]]) -> list[str]:
    """Return each change as "field: old → new"."""
    return [
        f"{name}: {Truncator(repr(old)).chars(SHOWN_VALUE)} → "
        f"{Truncator(repr(new)).chars(SHOWN_VALUE)}"
        for name, (old, new) in changes.items()
    ]


def history_message(action: str, reason: str, changes: dict[str, list[Any]] | None = None) -> str:
    """Return the history entry of `action`: what was done, each change (old -> new), why."""
    parts = [str(EventAction(action).label), *described(changes or {})]
    if reason:
        parts.append(gettext("reason: %(reason)s") % {"reason": reason})
    return "; ".join(parts)


def log_history(
    model_admin: Any,
    request: HttpRequest,
    pks: Sequence[int],
    action: str,
    reason: str,
    changes: dict[str, list[Any]] | None = None,
) -> None:
    """Add `action` by the request's user to the admin history of each job of `pks`."""
    message = history_message(action, reason, changes)
    for start in range(0, len(pks), HISTORY_BATCH):
        # Only what `str(job)` reads: a payload may be up to MAX_PAYLOAD_BYTES.
        jobs = model_admin.all_rows().filter(pk__in=pks[start : start + HISTORY_BATCH])
        LogEntry.objects.log_actions(
            user_id=cast(int, request.user.pk),
            queryset=jobs.only("pk", "kind", "status"),
            action_flag=CHANGE,
            change_message=message,
        )


class OperatorFilter(admin.AllValuesFieldListFilter):
    """The operators who acted (the `by` of the events)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.title = gettext("operator")


class RecentFilter(admin.SimpleListFilter):
    """Events of the last hour, day or week (by the database clock)."""

    title = _("when")
    parameter_name = "within"
    WINDOWS = {"hour": timedelta(hours=1), "day": timedelta(days=1), "week": timedelta(days=7)}

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("hour", _("Last hour")), ("day", _("Last 24 hours")), ("week", _("Last 7 days"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any] | None:
        window = self.WINDOWS.get(self.value() or "")
        return None if window is None else queryset.filter(at__gte=Now() - window)


@admin.register(JobEvent)
class JobEventAdmin(
    DatabaseMixin, OfferedFiltersMixin, IndexedSearchMixin, ReadOnlyMixin, admin.ModelAdmin
):
    """Every operator action on a job, append-only: who, when, why, what changed."""

    list_display = ("shown_at", "job_link", "action", "by", "why", "changed", "attempts", "token")
    list_filter = (RecentFilter, "action", ("by", OperatorFilter))
    change_list_template = "admin/django_leases/change_list.html"
    search_help_text = _("A job id.")
    search_fields = ("job_ref",)  # shows the search box; search() does the search
    ordering = ("-id",)
    show_full_result_count = False
    readonly_fields = ("shown_at", "job_ref", "action", "by", "reason", "changes", "attempts")
    fields = (*readonly_fields, "token")

    shown_at = to_the_second("at", _("at"))

    @admin.display(description=_("job"), ordering="job_ref")
    def job_link(self, event: JobEvent) -> str:
        return payment_job_link(self.admin_site.name, event)

    @admin.display(description=_("reason"))
    def why(self, event: JobEvent) -> str:
        return short_text(event.reason)

    @admin.display(description=_("changes"))
    def changed(self, event: JobEvent) -> str:
        if not event.changes:
            return EMPTY
        return short_text("; ".join(described(event.changes)))

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        pk = job_id(term)
        # (job_ref, at) is indexed.
        return queryset.filter(job_ref=pk) if pk is not None else queryset.none()
