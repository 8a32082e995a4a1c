"""System checks for `settings.DJANGO_LEASES` and the database sessions. Ids are stable: never
renumber or reuse one."""

import difflib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import django
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_leases.conf import DEFAULTS
from django_leases.constraints import is_unique
from django_leases.handlers import lease_lengths, registered_kinds
from django_leases.jobs import BACKEND_PATH, lease_task_queues, tasks_framework_missing
from django_leases.limits import (
    ACK_BATCH_SIZE,
    BATCH_SIZE,
    CONCURRENCY,
    DURATION_RANGE,
    EXACT_COUNT_LIMIT,
    MAX_ATTEMPTS,
    MAX_DURATION,
    MIN_SECONDS,
    PAYLOAD_BYTES,
    XIDS,
    duration_range,
    in_duration_range,
    shown,
)
from django_leases.network import AUTO, TIMEOUT_RANGE
from django_leases.status import FINAL_STATUSES, StuckPolicy
from django_leases.tables import job_model, leased_job_models, ledger_model

DURATIONS = (
    "TTL",
    "HEARTBEAT",
    "NEAR_EXPIRY",
    "POLL_INTERVAL",
    "GRACE_PERIOD",
    "BACKOFF_BASE",
    "BACKOFF_MAX",
    "WATCH_INTERVAL",
    "RECONCILE_TIMEOUT",
    "WORKER_GONE_AFTER",
    "LONG_RUNNING",
    "METRICS_MAX_AGE",
    "HORIZON_WARN_AFTER",
)
COUNTS = {
    "CONCURRENCY": CONCURRENCY,
    "MAX_ATTEMPTS": MAX_ATTEMPTS,
    "PRUNE_BATCH_SIZE": BATCH_SIZE,
    "ADMIN_EXACT_COUNT_LIMIT": EXACT_COUNT_LIMIT,
    "MAX_PAYLOAD_BYTES": PAYLOAD_BYTES,
    "HORIZON_WARN_XIDS": XIDS,
}
BOOLEANS = ("PRUNE_LEDGER", "USE_NOTIFY", "LOCK_BY_PAYMENT", "TRACING")
POLICIES = tuple(StuckPolicy.values)


def _is_positive_number(value: Any) -> bool:
    """Whether `value` is a duration in range: positive seconds up to `limits.MAX_DURATION`."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= MAX_DURATION
    )


def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """Validate `settings.DJANGO_LEASES`."""
    user = getattr(settings, "DJANGO_LEASES", {})
    if not isinstance(user, dict):
        return [
            Error(
                f"DJANGO_LEASES must be a dict, got {type(user).__name__}.",
                hint="Set DJANGO_LEASES = {...} with the keys documented in the README.",
                id="django_leases.E001",
            )
        ]
    messages: list[CheckMessage] = []
    for key in sorted(set(user) - set(DEFAULTS)):
        messages.append(
            Warning(
                f"DJANGO_LEASES has an unknown key {key!r}; it is ignored.",
                hint=f"Known keys: {', '.join(DEFAULTS)}.",
                id="django_leases.W001",
            )
        )
    values = {**DEFAULTS, **user}
    for key in DURATIONS:
        minimum = MIN_SECONDS.get(key, 0.0)
        if not (_is_positive_number(values[key]) and in_duration_range(values[key], minimum)):
            messages.append(
                Error(
                    f"DJANGO_LEASES[{key!r}] must be {duration_range(minimum)}, "
                    f"got {values[key]!r}.",
                    hint=f"The default is {DEFAULTS[key]!r}.",
                    id="django_leases.E002",
                )
            )
    for key, (low, high) in COUNTS.items():
        value = values[key]
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            messages.append(
                Error(
                    f"DJANGO_LEASES[{key!r}] must be a whole number from {low} to {high}, "
                    f"got {value!r}.",
                    hint=f"The default is {DEFAULTS[key]!r}.",
                    id="django_leases.E004",
                )
            )
    for key in BOOLEANS:
        if not isinstance(values[key], bool):
            messages.append(
                Error(
                    f"DJANGO_LEASES[{key!r}] must be True or False, got {values[key]!r}.",
                    hint=f"The default is {DEFAULTS[key]!r}.",
                    id="django_leases.E009",
                )
            )
    ttl, heartbeat = values["TTL"], values["HEARTBEAT"]
    if _is_positive_number(ttl) and _is_positive_number(heartbeat) and heartbeat >= ttl:
        messages.append(
            Error(
                f"DJANGO_LEASES['HEARTBEAT'] ({heartbeat!r}) must be shorter than "
                f"DJANGO_LEASES['TTL'] ({ttl!r}).",
                hint="A lease renewed no more often than it expires is lost between renewals; "
                "use a heartbeat of about a third of the TTL.",
                id="django_leases.E003",
            )
        )
    gone = values["WORKER_GONE_AFTER"]
    if _is_positive_number(heartbeat) and _is_positive_number(gone) and gone < 2 * heartbeat:
        messages.append(
            Error(
                f"DJANGO_LEASES['WORKER_GONE_AFTER'] ({gone!r}) must be at least twice "
                f"DJANGO_LEASES['HEARTBEAT'] ({heartbeat!r}).",
                hint="Workers refresh their registry row once per heartbeat; the watcher would "
                "take live workers for gone and rescue their jobs.",
                id="django_leases.E010",
            )
        )
    if _is_positive_number(ttl) and _is_positive_number(gone) and gone < ttl:
        messages.append(
            Warning(
                f"DJANGO_LEASES['TTL'] ({ttl!r}) is longer than WORKER_GONE_AFTER ({gone!r}): a "
                "worker cut off from the database gives its leases up WORKER_GONE_AFTER after "
                "its last registry beat, not a TTL after its last renewal.",
                hint="The watcher may rescue a worker's jobs once its registry row is that old, "
                "so its leases end then too. Set WORKER_GONE_AFTER to at least the TTL (e.g. "
                "360 with a TTL of 300) to keep the TTL's slack.",
                id="django_leases.W012",
            )
        )
    near = values["NEAR_EXPIRY"]
    if _is_positive_number(ttl) and _is_positive_number(near) and near >= ttl:
        messages.append(
            Warning(
                f"DJANGO_LEASES['NEAR_EXPIRY'] ({near!r}) is not shorter than the TTL ({ttl!r}): "
                "every lease will show as near expiry.",
                hint="Use a value below TTL - HEARTBEAT, e.g. the default 20 with a TTL of 60.",
                id="django_leases.W002",
            )
        )
    base, cap = values["BACKOFF_BASE"], values["BACKOFF_MAX"]
    if _is_positive_number(base) and _is_positive_number(cap) and cap < base:
        messages.append(
            Error(
                f"DJANGO_LEASES['BACKOFF_MAX'] ({cap!r}) is smaller than BACKOFF_BASE ({base!r}).",
                hint="BACKOFF_MAX caps the retry delay and must be at least BACKOFF_BASE.",
                id="django_leases.E008",
            )
        )
    messages.extend(_check_policies(values))
    messages.extend(_check_retention(values["RETENTION"]))
    messages.extend(_check_redactor(values["REDACT_ERRORS"]))
    return messages


def check_ack_batching(**kwargs: Any) -> list[CheckMessage]:
    """Validate the batching of ack="batch" completions: ACK_BATCH_SIZE, ACK_FLUSH_INTERVAL."""
    user = getattr(settings, "DJANGO_LEASES", {})
    values = {**DEFAULTS, **(user if isinstance(user, dict) else {})}
    messages: list[CheckMessage] = []
    size, (low, high) = values["ACK_BATCH_SIZE"], ACK_BATCH_SIZE
    if not (isinstance(size, int) and not isinstance(size, bool) and low <= size <= high):
        messages.append(
            Error(
                f"DJANGO_LEASES['ACK_BATCH_SIZE'] must be a whole number from {low} to {high}, "
                f"got {size!r}.",
                hint='Completions of ack="batch" kinds written in one statement at most; the '
                f"default is {DEFAULTS['ACK_BATCH_SIZE']!r}.",
                id="django_leases.E032",
            )
        )
    interval = values["ACK_FLUSH_INTERVAL"]
    if not _is_positive_number(interval):
        messages.append(
            Error(
                "DJANGO_LEASES['ACK_FLUSH_INTERVAL'] must be a positive number of seconds up to "
                f"{MAX_DURATION} (100 years), got {interval!r}.",
                hint="How long a worker holds a buffered completion at most; keep it well below "
                f"the TTL. The default is {DEFAULTS['ACK_FLUSH_INTERVAL']!r}.",
                id="django_leases.E033",
            )
        )
    return messages


def _check_policies(values: dict[str, Any]) -> list[CheckMessage]:
    messages: list[CheckMessage] = []
    if values["STUCK_POLICY"] not in POLICIES:
        messages.append(
            Error(
                f"DJANGO_LEASES['STUCK_POLICY'] must be one of {POLICIES}, "
                f"got {values['STUCK_POLICY']!r}.",
                hint="'retry' returns expired jobs to pending; 'review' holds them for an "
                "operator when they passed a checkpoint.",
                id="django_leases.E005",
            )
        )
    by_kind = values["STUCK_POLICY_BY_KIND"]
    if not isinstance(by_kind, dict) or any(
        not isinstance(kind, str) or policy not in POLICIES for kind, policy in by_kind.items()
    ):
        messages.append(
            Error(
                "DJANGO_LEASES['STUCK_POLICY_BY_KIND'] must map job kinds to one of "
                f"{POLICIES}, got {by_kind!r}.",
                hint="For example {'capture': 'review', 'webhook': 'retry'}.",
                id="django_leases.E006",
            )
        )
    elif by_kind:
        messages.extend(_check_policy_kinds(by_kind, values["STUCK_POLICY"]))
    return messages


def _check_policy_kinds(by_kind: dict[str, str], default: str) -> list[CheckMessage]:
    """Warn of STUCK_POLICY_BY_KIND keys that are no registered kind: a misspelt one leaves the
    real kind under the default policy (a capture blindly retried past its checkpoint)."""
    kinds = registered_kinds()
    folded = {kind.casefold(): kind for kind in kinds}
    messages: list[CheckMessage] = []
    for kind in sorted(set(by_kind) - set(kinds)):
        close = [folded[k] for k in difflib.get_close_matches(kind.casefold(), folded, n=1)]
        messages.append(
            Warning(
                f"DJANGO_LEASES['STUCK_POLICY_BY_KIND'] names {shown(kind)}, for which no "
                "handler is registered: if it is a misspelt kind, that kind is under "
                f"STUCK_POLICY ({default!r}), not {by_kind[kind]!r}.",
                hint=(f"Did you mean {close[0]!r}? " if close else "")
                + "Use the kind of a @job_handler in a jobs.py module of an installed app.",
                id="django_leases.W009",
            )
        )
    return messages


def _check_retention(retention: Any) -> list[CheckMessage]:
    if isinstance(retention, dict) and all(
        status in FINAL_STATUSES and _is_positive_number(seconds)
        for status, seconds in retention.items()
    ):
        return []
    return [
        Error(
            "DJANGO_LEASES['RETENTION'] must map final statuses "
            f"{FINAL_STATUSES} to {DURATION_RANGE.removesuffix(' or a timedelta')}, "
            f"got {retention!r}.",
            hint="For example {'completed': 7 * 86400, 'failed': 30 * 86400}; a status left "
            "out is never pruned.",
            id="django_leases.E007",
        )
    ]


def _check_redactor(path: Any) -> list[CheckMessage]:
    problem = ""
    if not isinstance(path, str):
        problem = f"must be the dotted path of a callable, got {path!r}"
    else:
        try:
            hook = import_string(path)
        except ImportError as exc:
            problem = f"{path!r} cannot be imported: {exc}"
        else:
            if not callable(hook):
                problem = f"{path!r} is not callable"
    if not problem:
        return []
    return [
        Error(
            f"DJANGO_LEASES['REDACT_ERRORS'] {problem}.",
            hint="Name a function (exception, text) -> text that returns what to keep of an "
            "error's text, e.g. the default 'django_leases.redaction.redact_database_values'.",
            id="django_leases.E012",
        )
    ]


def check_tasks_framework(**kwargs: Any) -> list[CheckMessage]:
    """Report a `LeaseBackend` in `settings.TASKS` where no Tasks framework is installed."""
    if not (lease_task_queues() and tasks_framework_missing()):
        return []
    return [
        Error(
            f"settings.TASKS uses {BACKEND_PATH}, but Django {django.get_version()} has no "
            "Tasks framework and the django-tasks backport is not installed.",
            hint='Install the backport with pip install "django-leases[tasks]" and add '
            '"django_tasks" to INSTALLED_APPS, or upgrade to Django 6, which has it built in.',
            id="django_leases.E018",
        )
    ]


def check_worker_retention(**kwargs: Any) -> list[CheckMessage]:
    """Check WORKER_RETENTION: a duration not shorter than WORKER_GONE_AFTER, or prune_jobs
    would delete the registry row of a worker that is merely late with its heartbeat."""
    user = getattr(settings, "DJANGO_LEASES", {})
    values = {**DEFAULTS, **(user if isinstance(user, dict) else {})}
    retention, gone_after = values["WORKER_RETENTION"], values["WORKER_GONE_AFTER"]
    if _is_positive_number(retention) and (
        not _is_positive_number(gone_after) or retention >= gone_after
    ):
        return []
    return [
        Error(
            "DJANGO_LEASES['WORKER_RETENTION'] must be a number of seconds from "
            f"WORKER_GONE_AFTER ({gone_after!r}) to {MAX_DURATION} (100 years), "
            f"got {retention!r}.",
            hint=f"The default is {DEFAULTS['WORKER_RETENTION']!r} (7 days).",
            id="django_leases.E024",
        )
    ]


def check_job_model(**kwargs: Any) -> list[CheckMessage]:
    """Report a `JOB_MODEL` that names no installed concrete `AbstractLeasedJob` model."""
    user = getattr(settings, "DJANGO_LEASES", {})
    if not isinstance(user, dict):
        return []  # E001 says so
    label = user.get("JOB_MODEL", DEFAULTS["JOB_MODEL"])
    try:
        job_model(label)
    except ImproperlyConfigured as exc:
        return [
            Error(
                f"DJANGO_LEASES['JOB_MODEL'] {exc}.",
                hint="Name your job model as 'app_label.ModelName': a concrete subclass of "
                "django_leases.models.AbstractLeasedJob in an installed app. The default is "
                f"{DEFAULTS['JOB_MODEL']!r}.",
                id="django_leases.E030",
            )
        ]
    return []


def check_ledgers(**kwargs: Any) -> list[CheckMessage]:
    """Report a job model whose `attempt_model` names no ledger of that job model."""
    messages: list[CheckMessage] = []
    for model in leased_job_models():
        try:
            ledger_model(model)
        except ImproperlyConfigured as exc:
            messages.append(
                Error(
                    f"{model._meta.label}.attempt_model {exc}.",
                    hint="Set attempt_model to the 'app_label.ModelName' of a subclass of "
                    "django_leases.models.AbstractJobAttempt with `job = models.ForeignKey("
                    f"{model.__name__}, null=True, on_delete=models.SET_NULL, ...)`, or to "
                    "None for a job table without a ledger.",
                    obj=model,
                    id="django_leases.E031",
                )
            )
    return messages


def check_lock_holders(**kwargs: Any) -> list[CheckMessage]:
    """Report a job model whose `lock_holder` is not unique: "one job per lock at a time"
    rests on that index."""
    return [
        Error(
            f"{model._meta.label}.lock_holder is not unique: two jobs of one lock could run at "
            "the same time.",
            hint="Keep lease_constraints(prefix) in the model's Meta.constraints (it has "
            "UniqueWhenSet(fields=['lock_holder'], ...)), then makemigrations and migrate.",
            obj=model,
            id="django_leases.E039",
        )
        for model in leased_job_models()
        if not is_unique(model, "lock_holder")
    ]


def check_network_timeout(**kwargs: Any) -> list[CheckMessage]:
    """Validate `DJANGO_LEASES["NETWORK_TIMEOUT"]`: None, "auto" or seconds in range."""
    user = getattr(settings, "DJANGO_LEASES", {})
    value: Any = user.get("NETWORK_TIMEOUT", AUTO) if isinstance(user, dict) else AUTO
    low, high = TIMEOUT_RANGE
    if value is None or value == AUTO or (_is_positive_number(value) and low <= value <= high):
        return []
    return [
        Error(
            f"DJANGO_LEASES['NETWORK_TIMEOUT'] must be None, 'auto' or a number of seconds from "
            f"{low:g} to {high:g}, got {value!r}.",
            hint="It bounds how long a worker or watcher waits on a silent database "
            "connection; 'auto' (the default) is a third of the TTL, None turns it off.",
            id="django_leases.E019",
        )
    ]


_worker_heartbeat = ContextVar("worker_heartbeat", default=False)


@contextmanager
def heartbeat_judged_by_worker() -> Iterator[None]:
    """Leave E038 out of the checks run in the block: `run_lease_worker` runs them, and its
    worker compares its own heartbeat (`--heartbeat`) with the ttl of the kinds it serves
    (`--kind`) itself, where E038 can only compare HEARTBEAT with every kind's."""
    token = _worker_heartbeat.set(True)
    try:
        yield
    finally:
        _worker_heartbeat.reset(token)


def check_kind_leases(**kwargs: Any) -> list[CheckMessage]:
    """Check each kind's own `ttl=` (`@job_handler`) against the HEARTBEAT that renews it and
    the WORKER_GONE_AFTER after which a cut-off worker gives it up."""
    user = getattr(settings, "DJANGO_LEASES", {})
    values = {**DEFAULTS, **(user if isinstance(user, dict) else {})}
    heartbeat, gone = values["HEARTBEAT"], values["WORKER_GONE_AFTER"]
    judge_heartbeat = _is_positive_number(heartbeat) and not _worker_heartbeat.get()
    messages: list[CheckMessage] = []
    for kind, ttl in sorted(lease_lengths().items()):
        if judge_heartbeat and heartbeat >= ttl:
            messages.append(
                Error(
                    f"Job kind {kind!r} has a ttl of {ttl:g}s, not longer than "
                    f"DJANGO_LEASES['HEARTBEAT'] ({heartbeat!r}).",
                    hint="A worker serving it with that heartbeat would lose each of its "
                    "leases between two renewals, and refuses to start; give the kind a ttl of "
                    "about three heartbeats, or lower HEARTBEAT. A worker started with a "
                    "shorter --heartbeat, or without the kind (--kind), is not refused: if "
                    "every worker serving the kind runs so, add this id to "
                    "SILENCED_SYSTEM_CHECKS.",
                    id="django_leases.E038",
                )
            )
        if _is_positive_number(gone) and gone < ttl:
            messages.append(
                Warning(
                    f"Job kind {kind!r} has a ttl of {ttl:g}s, longer than "
                    f"DJANGO_LEASES['WORKER_GONE_AFTER'] ({gone!r}): a worker cut off from the "
                    "database gives its leases up WORKER_GONE_AFTER after its last registry "
                    "beat, not a ttl after their last renewal.",
                    hint=f"Set WORKER_GONE_AFTER to at least {ttl:g} to keep the kind's slack.",
                    id="django_leases.W013",
                )
            )
    return messages
