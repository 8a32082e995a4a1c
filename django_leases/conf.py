"""Settings of django-leases: one dict, `settings.DJANGO_LEASES`, read lazily.

Values are validated by the system checks in `checks.py`, never here.
"""

import math
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from django_leases.exceptions import InvalidDuration
from django_leases.limits import DAY, duration_range, in_duration_range, shown
from django_leases.status import CANCELLED, COMPLETED, FAILED, StuckPolicy

# Every default, in the order the README documents them.
DEFAULTS: dict[str, Any] = {
    # Lease length in seconds; a job whose holder stops heartbeating is claimable after this.
    "TTL": 60.0,
    # Seconds between two lease renewals of a worker; must be shorter than TTL.
    "HEARTBEAT": 20.0,
    # A lease ending within this many seconds is shown as "near expiry" in the admin.
    "NEAR_EXPIRY": 20.0,
    # Seconds a worker sleeps between two polls when it found nothing to claim (jittered).
    "POLL_INTERVAL": 1.0,
    # Jobs one worker process runs at once, each on its own thread and connection.
    "CONCURRENCY": 1,
    # Seconds a stopping worker lets running jobs finish; later ones are left to lease expiry.
    "GRACE_PERIOD": 30.0,
    # Completions of ack="batch" kinds a worker writes in one statement at most.
    "ACK_BATCH_SIZE": 100,
    # Seconds a worker holds the oldest buffered completion of an ack="batch" kind at most
    # before it writes the batch.
    "ACK_FLUSH_INTERVAL": 0.1,
    # Acquisitions a job gets before it fails for good, unless enqueue() says otherwise.
    "MAX_ATTEMPTS": 5,
    # First retry delay in seconds; it doubles per attempt, with full jitter.
    "BACKOFF_BASE": 2.0,
    # Upper bound of a retry delay in seconds.
    "BACKOFF_MAX": 600.0,
    # Seconds between two passes of watch_stuck_jobs (jittered).
    "WATCH_INTERVAL": 30.0,
    # What the watcher does with an expired lease: "retry" (back to pending) or "review".
    "STUCK_POLICY": StuckPolicy.RETRY.value,
    # Per-kind overrides of STUCK_POLICY, e.g. {"capture": "review"}.
    "STUCK_POLICY_BY_KIND": {},
    # Seconds the watcher waits for one reconcile hook before it leaves the job under review
    # for a later pass.
    "RECONCILE_TIMEOUT": 10.0,
    # Seconds a finished job is kept per final status before prune_jobs deletes it.
    "RETENTION": {COMPLETED: 7 * DAY, FAILED: 30 * DAY, CANCELLED: 30 * DAY},
    # Rows prune_jobs deletes per statement.
    "PRUNE_BATCH_SIZE": 1000,
    # Whether prune_jobs deletes a job's attempt ledger with it (False keeps the audit trail).
    "PRUNE_LEDGER": True,
    # On PostgreSQL, wake idle workers with LISTEN/NOTIFY when a job is enqueued.
    "USE_NOTIFY": True,
    # A worker whose registry row was not refreshed for this many seconds is presumed gone.
    "WORKER_GONE_AFTER": 120.0,
    # Dotted path of a callable (exception, text) -> text: what is kept of an error's text in
    # the ledger, `last_error` and the logs. The default strips values from database errors.
    "REDACT_ERRORS": "django_leases.redaction.redact_database_values",
    # Seconds a worker's registry row is kept after it stopped or was last seen; prune_jobs
    # deletes older ones. Not shorter than WORKER_GONE_AFTER.
    "WORKER_RETENTION": 7 * DAY,
    # The job table that run_lease_worker, watch_stuck_jobs, prune_jobs and the Tasks backend
    # work on, as "app_label.ModelName": a concrete subclass of AbstractLeasedJob.
    "JOB_MODEL": "django_leases.PaymentJob",
    # Whether PaymentJob.objects.enqueue() locks a job with a payment_id by its payment
    # ("payment:<id>") when no `lock` is given: one job of a payment at a time, in enqueue order.
    "LOCK_BY_PAYMENT": True,
    # Seconds a worker or watcher waits on a silent database connection before giving it up
    # (connect, TCP keepalives, statement and read timeouts); "auto" is a third of the TTL
    # (2 to 30 s), None leaves the connections as configured.
    "NETWORK_TIMEOUT": "auto",
    # Seconds after which a running attempt shows as "running long" in the admin and metrics,
    # for kinds whose handler has no `timeout` (theirs is that timeout).
    "LONG_RUNNING": 600.0,
    # Periodic jobs: {"name": {"kind": "k", "every": seconds}}, optionally with "payload" and
    # "catch_up" (default True: a missed tick is enqueued once, late). One job per tick.
    "SCHEDULES": {},
    # Seconds a process keeps the queue gauges it read for its metrics endpoint or view:
    # scrapes within it share one database read.
    "METRICS_MAX_AGE": 5.0,
    # Seconds a transaction (or prepared transaction) may hold back the removal of dead rows
    # (PostgreSQL's vacuum horizon, InnoDB's purge) before the watcher warns, the overview
    # flags it and `check --database` reports it.
    "HORIZON_WARN_AFTER": 300.0,
    # The same bound in transactions, for what pins PostgreSQL's horizon without a start time:
    # a replication slot, a standby's hot_standby_feedback.
    "HORIZON_WARN_XIDS": 1_000_000,
    # Jobs the admin counts exactly (per status on the overview, per changelist): beyond it, a
    # finished status or the whole table shows the database's estimate, anything else "more than".
    "ADMIN_EXACT_COUNT_LIMIT": 10_000,
    # The largest payload (and handler result) a job stores, in bytes of its JSON text: 1 MiB,
    # far above a job's references and amounts, and below what every database takes in one
    # statement (MariaDB's default max_allowed_packet is 16 MiB).
    "MAX_PAYLOAD_BYTES": 1024 * 1024,
    # With the otel extra installed: store the enqueuer's trace context with each job and
    # trace each attempt (claim, handler, completion) as its continuation. False: neither.
    "TRACING": True,
}


class LeasesSettings:
    """Read `settings.DJANGO_LEASES` lazily, falling back to `DEFAULTS`."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(settings, "DJANGO_LEASES", None)
        return value if isinstance(value, dict) else {}

    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(f"Unknown django-leases setting {name!r}")
        if name not in self._cache:
            self._cache[name] = self.user_settings.get(name, DEFAULTS[name])
        return self._cache[name]

    def reload(self) -> None:
        self._cache.clear()

    def stuck_policy(self, kind: str) -> str:
        """Return the watcher policy ("retry" or "review") for jobs of `kind`."""
        return str(self.STUCK_POLICY_BY_KIND.get(kind, self.STUCK_POLICY))


leases_settings = LeasesSettings()


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "DJANGO_LEASES":
        leases_settings.reload()


def connect_signals() -> None:
    setting_changed.connect(_on_setting_changed, dispatch_uid="django_leases.conf")


def to_seconds(value: float | timedelta, name: str = "duration", minimum: float = 0.0) -> float:
    """Return `value` (seconds or a `timedelta`) as positive float seconds.

    Raises:
        InvalidDuration: naming `name`, for anything that is not a positive duration (of at
            least `minimum` seconds, when given) of at most `limits.MAX_DURATION` (about 100
            years).
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = float("inf")
    else:
        seconds = math.nan
    if not in_duration_range(seconds, minimum):
        raise InvalidDuration(
            f"{name} must be {duration_range(minimum)} or a timedelta, got {shown(value)}"
        )
    return seconds
