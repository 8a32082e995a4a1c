"""How the admin shows durations and long texts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils.html import format_html
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
