"""`WorkerStats`, a worker's counters, and `Recorder`, where it reports them (e.g. Prometheus)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Protocol


class Recorder(Protocol):
    """Where a worker reports each event with its job's kind, e.g. to Prometheus
    (`django_leases.metrics.WorkerMetrics`)."""

    def count(self, event: str, kind: str, n: int) -> None:
        """Count `n` events named like a `WorkerStats` field, or `AttemptOutcome.LEASE_LOST`
        for a lease the heartbeat found lost."""

    def ran(self, kind: str, seconds: float) -> None:
        """Note how long a handler ran."""

    def waited(self, kind: str, seconds: float) -> None:
        """Note how long a job waited from its due time to its claim (database clock)."""

    def serve_slots(self, busy: Callable[[], Mapping[str, int]], total: int) -> None:
        """Take what reads the worker's busy slots per kind (at a scrape), and how many it has."""


@dataclass
class WorkerStats:
    """What one worker did. Every thread counts; `add()` takes the counters' own lock."""

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    abandoned: int = 0
    timed_out: int = 0
    cancelled: int = 0
    outages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    recorder: Recorder | None = field(default=None, repr=False)

    def add(self, name: str, count: int = 1, *, kind: str | None = None) -> None:
        """Count `count` events `name`, and report them with their job's `kind` if given."""
        with self.lock:
            setattr(self, name, getattr(self, name) + count)
        if kind is not None and self.recorder is not None:
            self.recorder.count(name, kind, count)

    def claimed_after_wait(self, job: Any) -> None:
        """Report how long `job` waited from its due time to its claim, both by the database
        clock (the claim sets `heartbeat_at` to its own time); a takeover did not wait."""
        if self.recorder is None or getattr(job, "taken_over", False):
            return
        if isinstance(job.heartbeat_at, datetime) and isinstance(job.run_at, datetime):
            waited = (job.heartbeat_at - job.run_at).total_seconds()
            self.recorder.waited(job.kind, max(waited, 0.0))

    def summary(self) -> str:
        names = [f.name for f in fields(self) if f.name not in ("outages", "lock", "recorder")]
        return " ".join(f"{name}={getattr(self, name)}" for name in names)
