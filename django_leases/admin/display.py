"""How the admin shows times (to the second), durations and long texts."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils import timezone
from django.utils.html import conditional_escape, format_html
from django.utils.safestring import mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext

from django_leases.models import JobAttempt

EMPTY = "—"
SHORT_ERROR = 60


def human_duration(value: timedelta | None) -> str:
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


def payment_job_link(site: str, row: Any) -> str:
    """Return the link to the payment job of a ledger, event or step `row` on the admin site
    `site`: its id alone if the job was pruned (the row keeps `job_ref`)."""
    if row.job_id is None:
        return str(row.job_ref)
    url = reverse("admin:django_leases_paymentjob_change", args=[row.job_ref], current_app=site)
    return format_html('<a href="{}">{}</a>', url, row.job_ref)


def breakable(text: str) -> str:
    """Return `text` (an owner: host:pid:random) with a line break allowed after each colon."""
    return mark_safe(":<wbr>".join(conditional_escape(part) for part in text.split(":")))  # noqa: S308 - each part escaped


def short_text(text: str) -> str:
    """Return `text` cut to SHORT_ERROR characters, whole in its tooltip."""
    if not text:
        return EMPTY
    return format_html('<span title="{}">{}</span>', text, Truncator(text).chars(SHORT_ERROR))


def attempt_error(attempt: JobAttempt) -> str:
    return short_text(": ".join(filter(None, [attempt.error_class, attempt.error_message])))


def last_pass(outcome: dict[str, Any] | None) -> str:
    """Return a watcher's last pass as text: "error: …", the jobs per action ("retry 2,
    review 1"), or "nothing to do"."""
    if outcome is None:
        return EMPTY
    if "error" in outcome:
        return gettext("error: %(error)s") % {"error": outcome["error"]}
    done = ", ".join(f"{name} {n}" for name, n in sorted(outcome.items()))
    return done or gettext("nothing to do")


def stamp(value: datetime | None, now: datetime | None = None, *, short: bool = False) -> str:
    """Return `value` to the second in the current time zone, with how long ago (or how soon) it
    is beside it, from `now` (default: this server's clock): "2026-12-07 21:39:04  5 s ago".

    `short` (a list's narrow column): the time alone if it is on the day of `now`, the date in
    its tooltip.
    """
    if value is None:
        return EMPTY
    now = now or timezone.now()
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    today = timezone.localtime(now) if timezone.is_aware(now) else now
    shown = "%H:%M:%S" if short and local.date() == today.date() else "%Y-%m-%d %H:%M:%S"
    delta = now - value
    if delta >= timedelta(0):
        relative = gettext("%(age)s ago") % {"age": human_duration(delta)}
    else:
        relative = gettext("in %(left)s") % {"left": human_duration(delta)}
    return format_html(
        '<time datetime="{}" title="{}">{}</time> <span class="dl-when">{}</span>',
        local.isoformat(timespec="seconds"),
        local.strftime("%Y-%m-%d %H:%M:%S %Z"),
        local.strftime(shown),
        relative,
    )


def to_the_second(field: str, description: Any) -> Callable[[Any, Any], str]:
    """Return an admin column (or read-only field) that shows the time `field` with `stamp()`,
    sorted by it: the admin's own format has no seconds."""

    @admin.display(description=description, ordering=field)
    def show(model_admin: Any, row: Any) -> str:
        return stamp(getattr(row, field))

    return show


def stamped(model: Any, field: str) -> Callable[[Any], str]:
    """A list's column of the time in `model`'s `field`, to the second (`stamp()`, short),
    headed and sorted as the field."""

    @admin.display(description=model._meta.get_field(field).verbose_name, ordering=field)
    def column(obj: Any) -> str:
        return stamp(getattr(obj, field), short=True)

    column.__name__ = field
    return column
