"""The worker registry: each worker process keeps its own row fresh; the watcher reads it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_leases.conf import leases_settings, to_seconds
from django_leases.querysets.base import ago


class Role(models.TextChoices):
    """What a process of the registry does."""

    WORKER = "worker", _("worker")
    """Runs jobs (`run_lease_worker`): beats every `heartbeat` seconds."""
    WATCHER = "watcher", _("watcher")
    """Rescues expired leases (`watch_stuck_jobs`): reports in after each pass."""


# A process that has not reported in for this many of its intervals is late: shown so in the
# admin, counted so in the metrics, and not taken to serve its kinds. It stays alive (its jobs
# are not rescued) until WORKER_GONE_AFTER.
LATE_AFTER = 2


class WorkerQuerySet(models.QuerySet[Any]):
    """The worker registry: each worker process keeps its own row fresh."""

    def register(
        self,
        worker_id: str,
        *,
        instance: str,
        hostname: str,
        pid: int,
        kinds: list[str],
        concurrency: int,
        heartbeat: float | None = None,
        role: str = Role.WORKER,
    ) -> bool:
        """Take the registry row of `worker_id` for the process `instance`; return whether it did.

        A row that is stopped, or was not refreshed within WORKER_GONE_AFTER, is taken over; a
        live one is not: two processes never share one worker id (one's exit would mark the
        other stopped, and the watcher would rescue a live worker's jobs). `heartbeat`: the
        seconds between two reports of the process (see `late()`); `role`: "worker" or
        "watcher".
        """
        fields = {
            "instance": instance,
            "hostname": hostname,
            "pid": pid,
            "kinds": kinds,
            "concurrency": concurrency,
            "role": role,
            "heartbeat": heartbeat,
            "started_at": Now(),
            "last_seen_at": Now(),
            "stopped_at": None,
            "last_pass_at": None,
            "last_pass": None,
        }
        takeable = self.filter(worker_id=worker_id).exclude(pk__in=self.alive().values("pk"))
        if takeable.update(**fields):
            return True
        try:
            with transaction.atomic(using=self.db):
                self.create(worker_id=worker_id, **fields)
        except IntegrityError:
            # A row exists: live (refused), or it went stale between our two statements.
            return bool(takeable.update(**fields))
        return True

    def beat(self, worker_id: str, instance: str) -> bool:
        """Refresh `last_seen_at` of the row `instance` holds (database clock); False if lost."""
        return bool(
            self.filter(worker_id=worker_id, instance=instance).update(
                last_seen_at=Now(), stopped_at=None
            )
        )

    def passed(self, worker_id: str, instance: str, outcome: dict[str, Any]) -> bool:
        """Record a watcher's pass (database clock) and what it did; False if the row is lost."""
        return bool(
            self.filter(worker_id=worker_id, instance=instance).update(
                last_seen_at=Now(), last_pass_at=Now(), last_pass=outcome, stopped_at=None
            )
        )

    def stopped(self, worker_id: str, instance: str) -> None:
        self.filter(worker_id=worker_id, instance=instance).update(stopped_at=Now())

    def alive(self, within: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers seen within `within` seconds (default WORKER_GONE_AFTER) and not stopped."""
        seconds = to_seconds(
            within if within is not None else leases_settings.WORKER_GONE_AFTER, "within"
        )
        return self.filter(
            stopped_at__isnull=True, last_seen_at__gte=Now() - timedelta(seconds=seconds)
        )

    def workers(self) -> WorkerQuerySet:
        """The rows of worker processes (`run_lease_worker`), not of watchers."""
        return self.filter(role=Role.WORKER)

    def watchers(self) -> WorkerQuerySet:
        """The rows of watcher processes (`watch_stuck_jobs`)."""
        return self.filter(role=Role.WATCHER)

    def gone(self, within: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers that stopped, or were not seen within `within` seconds."""
        seconds = to_seconds(
            within if within is not None else leases_settings.WORKER_GONE_AFTER, "within"
        )
        return self.filter(
            Q(stopped_at__isnull=False) | Q(last_seen_at__lt=Now() - timedelta(seconds=seconds))
        )

    def long_gone(self, retention: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers stopped, or last seen, more than `retention` ago (default WORKER_RETENTION)."""
        seconds = to_seconds(
            retention if retention is not None else leases_settings.WORKER_RETENTION, "retention"
        )
        return self.filter(Q(stopped_at__lt=ago(seconds)) | Q(last_seen_at__lt=ago(seconds)))

    def prune(self, retention: float | timedelta | None = None) -> int:
        """Delete the registry rows of `long_gone(retention)` workers; return how many went."""
        # One DELETE: no relation points at the registry, and it holds a row per worker process
        # name, not per job.
        return self.long_gone(retention)._raw_delete(self.db)
