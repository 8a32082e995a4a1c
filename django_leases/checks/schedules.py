"""System checks of `DJANGO_LEASES["SCHEDULES"]`, entry by entry."""

import os
from typing import Any
from zoneinfo import TZPATH, ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning

from django_leases.conf import DEFAULTS, to_seconds
from django_leases.exceptions import InvalidArgument, InvalidDuration, InvalidPayload
from django_leases.handlers import registered_kinds
from django_leases.limits import check_json, check_kind, check_text, shown
from django_leases.querysets.schedules import TZ_LENGTH
from django_leases.schedules import MIN_EVERY, SCHEDULE_KEYS, SCHEDULE_NAME_LENGTH, cron_problem


def check_schedules(**kwargs: Any) -> list[CheckMessage]:
    """Validate `DJANGO_LEASES["SCHEDULES"]`, entry by entry."""
    user = getattr(settings, "DJANGO_LEASES", {})
    schedules = user.get("SCHEDULES", {}) if isinstance(user, dict) else {}
    if not isinstance(schedules, dict):
        return [
            Error(
                f"DJANGO_LEASES['SCHEDULES'] must be a dict of schedules by name, got "
                f"{shown(schedules)}.",
                hint=SCHEDULE_HINT,
                id="django_leases.E025",
            )
        ]
    messages: list[CheckMessage] = []
    for name, entry in schedules.items():
        messages.extend(_check_schedule(name, entry, {**DEFAULTS, **user}["RETENTION"]))
    names = sorted((name for name in schedules if isinstance(name, str)), key=str.casefold)
    for name, other in zip(names, names[1:], strict=False):
        if name.casefold() == other.casefold():
            # MariaDB/MySQL compare the keys without case: both would enqueue one job per tick.
            messages.append(
                Error(
                    f"DJANGO_LEASES['SCHEDULES'] has {name!r} and {other!r}, names that differ "
                    "only in case: their jobs' idempotency keys collide on MariaDB/MySQL.",
                    hint="Give each schedule a name of its own.",
                    id="django_leases.E025",
                )
            )
    return messages


SCHEDULE_HINT = (
    "For example {'nightly-sweep': {'kind': 'reconcile_sweep', 'every': 3600}} or "
    "{'nightly-sweep': {'kind': 'reconcile_sweep', 'cron': '30 2 * * *', 'tz': 'Europe/Berlin'}}, "
    "optionally with 'payload' (JSON) and 'catch_up' (True or False)."
)


def _check_schedule(name: Any, entry: Any, retention: Any) -> list[CheckMessage]:
    where = f"DJANGO_LEASES['SCHEDULES'][{shown(name)}]"
    problem = ""
    try:
        check_text(name, "its name", SCHEDULE_NAME_LENGTH)
    except InvalidArgument as exc:
        problem = str(exc)
    else:
        if ":" in name:
            problem = "its name must not contain ':', which separates the parts of its jobs' keys"
    if not problem and not isinstance(entry, dict):
        problem = f"it must be a dict, got {shown(entry)}"
    if problem:
        return [Error(f"{where}: {problem}.", hint=SCHEDULE_HINT, id="django_leases.E025")]
    messages: list[CheckMessage] = []
    unknown = sorted(map(str, set(entry) - set(SCHEDULE_KEYS)))
    if unknown:
        messages.append(
            Warning(
                f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; they are ignored.",
                hint=f"Known keys: {', '.join(SCHEDULE_KEYS)}.",
                id="django_leases.W005",
            )
        )
    kind = entry.get("kind")
    try:
        check_kind(kind, f"{where}['kind']")
    except InvalidArgument as exc:
        messages.append(
            Error(f"{exc}.", hint="Name the job kind each tick enqueues.", id="django_leases.E026")
        )
    else:
        if kind not in registered_kinds():
            messages.append(
                Warning(
                    f"{where}['kind'] is {kind!r}, for which no handler is registered: its "
                    "jobs would pile up, pending, one per tick.",
                    hint="Decorate a function with @job_handler(" + repr(kind) + ") in a jobs.py "
                    "module of an installed app, or fix the kind.",
                    id="django_leases.W006",
                )
            )
    messages.extend(_check_period(where, entry))
    try:
        check_json(entry.get("payload"), f"{where}['payload']")
    except InvalidPayload as exc:
        messages.append(
            Error(
                f"{exc}.",
                hint="Each tick's job gets this payload, stored as JSON.",
                id="django_leases.E028",
            )
        )
    catch_up = entry.get("catch_up", True)
    if not isinstance(catch_up, bool):
        messages.append(
            Error(
                f"{where}['catch_up'] must be True or False, got {shown(catch_up)}.",
                hint="True (the default) enqueues a missed tick once, late; False skips it.",
                id="django_leases.E029",
            )
        )
    # django_leases.W007 (a period longer than RETENTION["completed"]) is retired: a schedule's
    # own row decides which ticks are due, whatever was pruned. Never reuse the id.
    return messages


def _check_period(where: str, entry: dict[Any, Any]) -> list[CheckMessage]:
    """Check that `entry` has one of `every` and `cron` (with `tz`), and that it is valid."""
    messages: list[CheckMessage] = []
    if ("every" in entry) == ("cron" in entry):
        messages.append(
            Error(
                f"{where} must have exactly one of 'every' and 'cron', "
                f"{'has both' if 'every' in entry else 'has neither'}.",
                hint="'every': seconds between ticks (Unix time); 'cron': a five-field cron "
                "expression in 'tz' (local time).",
                id="django_leases.E036",
            )
        )
    elif "every" in entry:
        messages.extend(_check_every(where, entry["every"]))
    else:
        messages.extend(_check_cron(where, entry["cron"]))
        messages.extend(_check_tz(where, entry.get("tz", "UTC")))
    if "tz" in entry and "cron" not in entry:
        messages.append(
            Error(
                f"{where} has 'tz' without 'cron': a time zone applies to a cron expression "
                "only ('every' counts Unix seconds).",
                hint="Remove 'tz', or give a 'cron' expression instead of 'every'.",
                id="django_leases.E037",
            )
        )
    return messages


def _check_every(where: str, every: Any) -> list[CheckMessage]:
    try:
        seconds = to_seconds(every, f"{where}['every']")
    except InvalidDuration as exc:
        wrong = str(exc)
    else:
        wrong = ""
        if seconds < MIN_EVERY:
            wrong = f"{where}['every'] must be at least {MIN_EVERY:g} second, got {every!r}"
    if not wrong:
        return []
    return [
        Error(
            f"{wrong}.",
            hint="Seconds (int or float) or a timedelta, one tick each.",
            id="django_leases.E027",
        )
    ]


def _check_cron(where: str, cron: Any) -> list[CheckMessage]:
    wrong = cron_problem(cron)
    if not wrong:
        return []
    return [
        Error(
            f"{where}['cron'] {wrong}.",
            hint="Five fields: minute, hour, day of month, month, day of week, e.g. "
            "'30 2 * * 1-5' (02:30 on weekdays); for seconds, use 'every'.",
            id="django_leases.E034",
        )
    ]


# Files of a host's zone directory that are no zone of the IANA database: the host's own zone
# (a link to /etc/localtime), the rules POSIX TZ strings borrow, and "Factory" (no zone, "-00").
# Fire times in them would differ from host to host.
HOST_ZONES = frozenset({"localtime", "posixrules", "Factory"})
# The zone directory's copies of every zone in POSIX and in leap-second ("right") time.
HOST_DIRECTORIES = frozenset({"posix", "right"})


def is_iana_zone(name: str) -> bool:
    """Tell whether `name` is a time zone of the IANA database (a zone or one of its links,
    such as 'UTC'), not one of the host's own files: those of `HOST_ZONES`, the copies under
    `HOST_DIRECTORIES`, or a link that leaves the zone directory."""
    if name in HOST_ZONES or name.split("/", 1)[0] in HOST_DIRECTORIES:
        return False
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return False
    return not _leaves(name)


def _leaves(name: str) -> bool:
    """Tell whether `name` is a link out of the zone directory it is found in."""
    for root in TZPATH:
        path = os.path.join(root, name)
        if os.path.exists(path):
            return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) != (
                os.path.realpath(root)
            )
    return False


def _check_tz(where: str, tz: Any) -> list[CheckMessage]:
    if isinstance(tz, str) and 0 < len(tz) <= TZ_LENGTH and is_iana_zone(tz):
        return []
    return [
        Error(
            f"{where}['tz'] must be the name of a time zone of the IANA database, got {shown(tz)}.",
            hint="For example 'Europe/Berlin', 'America/New_York' or 'UTC' (the default); not "
            "'localtime', 'posixrules' or 'Factory', which name each host's own zone or none.",
            id="django_leases.E035",
        )
    ]
