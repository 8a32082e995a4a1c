"""`LeaseWorker`: the claim loop, the job slots and the heartbeat, for one worker process.

It parses no arguments, prints nothing and installs no signal handlers: `run_lease_worker`
drives it, and tests or other programs can embed it. Every lease write goes through
`LeaseQuerySet`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from django.db import InterfaceError, OperationalError, close_old_connections, connections, router

from django_leases.backoff import retry_delay
from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import LeaseLost, PermanentError
from django_leases.handlers import get_handler, registered_kinds
from django_leases.lease import Lease
from django_leases.listener import Listener

logger = logging.getLogger("django_leases.worker")

# Errors that mean "the database is unreachable right now", worth a retry after a pause.
TRANSIENT = (OperationalError, InterfaceError)
T = TypeVar("T")


def default_worker_id() -> str:
    """Return "<host>:<pid>:<random>": unique per process, readable in the admin and logs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    abandoned: int = 0
    outages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, count: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + count)

    def summary(self) -> str:
        names = ("claimed", "completed", "retried", "failed", "lost", "released", "abandoned")
        return " ".join(f"{name}={getattr(self, name)}" for name in names)


class LeaseWorker:
    """Claim jobs of the registered kinds and run them, `concurrency` at a time."""

    def __init__(
        self,
        *,
        model: type[Any] | None = None,
        worker_id: str | None = None,
        ttl: float | None = None,
        heartbeat: float | None = None,
        concurrency: int | None = None,
        kinds: Collection[str] | None = None,
        burst: bool = False,
        max_jobs: int | None = None,
        poll_interval: float | None = None,
        grace_period: float | None = None,
    ) -> None:
        if model is None:
            from django_leases.models import PaymentJob

            model = PaymentJob
        self.model = model
        self.worker_id = worker_id or default_worker_id()
        self.ttl = to_seconds(ttl if ttl is not None else leases_settings.TTL, "ttl")
        self.heartbeat_interval = to_seconds(
            heartbeat if heartbeat is not None else leases_settings.HEARTBEAT, "heartbeat"
        )
        if self.heartbeat_interval >= self.ttl:
            raise ValueError(
                f"heartbeat ({self.heartbeat_interval:g}s) must be shorter than ttl ({self.ttl:g}s)"
            )
        gone_after = leases_settings.WORKER_GONE_AFTER
        if self.heartbeat_interval * 2 > gone_after:
            # The registry row is refreshed once per heartbeat; with less than two heartbeats of
            # slack the watcher would take this live worker for gone and rescue its jobs.
            raise ValueError(
                f"heartbeat ({self.heartbeat_interval:g}s) must be at most half of "
                f"DJANGO_LEASES['WORKER_GONE_AFTER'] ({gone_after:g}s)"
            )
        self.concurrency = concurrency if concurrency is not None else leases_settings.CONCURRENCY
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        known = registered_kinds()
        self.kinds = sorted(kinds) if kinds else known
        unknown = sorted(set(self.kinds) - set(known))
        if unknown:
            raise ValueError(
                f"no handler for job kind(s) {', '.join(unknown)}; "
                f"registered: {', '.join(known) or 'none'}"
            )
        if not self.kinds:
            raise ValueError(
                "no job handlers are registered: decorate functions with @job_handler in a "
                "jobs.py module of an installed app"
            )
        self.burst = burst
        self.max_jobs = max_jobs
        self.poll_interval = to_seconds(
            poll_interval if poll_interval is not None else leases_settings.POLL_INTERVAL,
            "poll_interval",
        )
        self.grace_period = (
            grace_period if grace_period is not None else leases_settings.GRACE_PERIOD
        )
        self.using = router.db_for_write(model)
        self.stats = WorkerStats()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._slot_free = threading.Event()
        self._queue: queue.Queue[Lease | None] = queue.Queue()
        self._leases: dict[int, Lease] = {}
        self._renewed_at: dict[int, float] = {}
        self._leases_lock = threading.Lock()
        self._busy = 0
        self._threads: list[threading.Thread] = []

    # ---- public -----------------------------------------------------------------------------

    def run(self) -> WorkerStats:
        """Run until stopped, or until --burst finds nothing left, or --max-jobs is reached."""
        logger.info(
            "worker starting worker_id=%s kinds=%s concurrency=%s ttl=%s heartbeat=%s",
            self.worker_id,
            ",".join(self.kinds),
            self.concurrency,
            self.ttl,
            self.heartbeat_interval,
        )
        self._register()
        self._start_threads()
        listener = Listener.for_model(self.model, self.using)
        try:
            while not self._stopping.is_set():
                close_old_connections()
                free = self.concurrency - self._in_flight()
                claimed = self.run_once() if free > 0 and not self._quota_reached() else 0
                if self._finished(claimed):
                    break
                if claimed >= free:
                    self._wait_for_slot()
                else:
                    self._wait_for_work(listener)
        finally:
            if self._stopping.is_set():
                logger.info(
                    "stop requested; waiting up to %ss for %s running job(s)",
                    self.grace_period,
                    self._in_flight(),
                )
            if listener is not None:
                listener.close()
            self._shutdown()
        logger.info("worker stopped worker_id=%s %s", self.worker_id, self.stats.summary())
        return self.stats

    def run_once(self) -> int:
        """Claim jobs for the free slots and hand them out; return how many were claimed."""
        free = self.concurrency - self._in_flight()
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        if free <= 0:
            return 0
        started = time.monotonic()
        try:
            jobs = self._jobs().claim(self.worker_id, ttl=self.ttl, limit=free, kinds=self.kinds)
        except TRANSIENT as exc:
            self._outage("claim", exc)
            return 0
        for job in jobs:
            lease = Lease(job, ttl=self.ttl)
            with self._leases_lock:
                self._leases[lease.pk] = lease
                self._renewed_at[lease.pk] = started
                self._busy += 1
            self.stats.add("claimed")
            logger.info(
                "claimed job_id=%s kind=%s attempt=%s token=%s owner=%s",
                job.pk,
                job.kind,
                job.attempts,
                job.lease_token,
                self.worker_id,
            )
            self._queue.put(lease)
        return len(jobs)

    def stop(self) -> None:
        """Stop claiming; running jobs get the grace period. Safe to call from a signal handler."""
        self._stopping.set()
        self._slot_free.set()

    # ---- the loop ---------------------------------------------------------------------------

    def _jobs(self) -> Any:
        return self.model._default_manager.db_manager(self.using)

    def _in_flight(self) -> int:
        with self._leases_lock:
            return self._busy

    def _quota_reached(self) -> bool:
        return self.max_jobs is not None and self.stats.claimed >= self.max_jobs

    def _finished(self, claimed: int) -> bool:
        if self._quota_reached() and self._in_flight() == 0:
            return True
        return self.burst and claimed == 0 and self._in_flight() == 0

    def _wait_for_slot(self) -> None:
        self._slot_free.wait(timeout=self.poll_interval)
        self._slot_free.clear()

    def _wait_for_work(self, listener: Listener | None) -> None:
        if self.burst and self._in_flight() == 0:
            return
        # Jitter keeps idle workers from polling in lockstep.
        deadline = time.monotonic() + self.poll_interval * random.uniform(0.5, 1.5)  # noqa: S311
        while not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._slot_free.is_set():
                break
            if listener is not None and listener.wait(min(remaining, 0.25)):
                break
            if listener is None:
                self._slot_free.wait(timeout=min(remaining, 0.25))
        self._slot_free.clear()

    def _outage(self, what: str, exc: Exception) -> None:
        """Log a database outage, drop the broken connection and back off (jittered)."""
        self.stats.add("outages")
        logger.warning("database unavailable during %s: %s; retrying", what, exc)
        close_old_connections()
        connections[self.using].close()
        self._stopping.wait(timeout=min(5.0, self.poll_interval) * random.uniform(0.5, 1.5))  # noqa: S311

    # ---- slots ------------------------------------------------------------------------------

    def _start_threads(self) -> None:
        self._threads = [
            threading.Thread(target=self._slot, name=f"lease-slot-{n}", daemon=True)
            for n in range(self.concurrency)
        ]
        self._threads.append(
            threading.Thread(target=self._heartbeat_loop, name="lease-heartbeat", daemon=True)
        )
        for thread in self._threads:
            thread.start()

    def _slot(self) -> None:
        try:
            while True:
                lease = self._queue.get()
                if lease is None:
                    return
                try:
                    close_old_connections()
                    if self._stopping.is_set():
                        self._release_unstarted(lease)
                    else:
                        self._execute(lease)
                finally:
                    with self._leases_lock:
                        self._leases.pop(lease.pk, None)
                        self._renewed_at.pop(lease.pk, None)
                        self._busy -= 1
                    self._slot_free.set()
        finally:
            connections.close_all()

    def _execute(self, lease: Lease) -> None:
        job = lease.job
        handler = get_handler(job.kind)
        started = time.monotonic()
        logger.debug("started job_id=%s attempt=%s", job.pk, lease.attempt)
        try:
            handler.func(job, lease)
        except LeaseLost as exc:
            self._fenced_out(lease, str(exc))
            return
        except PermanentError as exc:
            self._record(lease, "failed", partial(lease.fail, exc, permanent=True), exc)
            return
        except Exception as exc:  # noqa: BLE001 - any handler error is a failed attempt
            if lease.lost:
                self._fenced_out(
                    lease, f"handler raised {type(exc).__name__} after the lease was lost"
                )
                return
            delay = retry_delay(lease.attempt)
            self._record(lease, "retry", partial(lease.fail, exc, retry_in=delay), exc)
            return
        if lease.finished:  # the handler wrote the outcome itself, e.g. with lease.atomic()
            outcome = lease.outcome or "completed"
            self.stats.add(outcome)
            logger.info(
                "%s job_id=%s attempt=%s by the handler in=%.3fs",
                outcome,
                job.pk,
                lease.attempt,
                time.monotonic() - started,
            )
            return
        if lease.lost:
            self._fenced_out(lease, "the lease was lost while the handler ran; result discarded")
            return
        self._record(lease, "completed", lease.complete, None)

    def _record(
        self, lease: Lease, outcome: str, write: Callable[[], object], error: BaseException | None
    ) -> None:
        """Write a job's outcome, retrying while the database is down and the lease may be live."""
        had_outage = False
        while True:
            try:
                result = write()
                break
            except LeaseLost as exc:
                if had_outage and self._jobs().finished_by(lease.pk, lease.owner, lease.token):
                    # Our earlier attempt committed; only its acknowledgement was lost.
                    result = "unknown"
                    break
                self._fenced_out(lease, str(exc))
                return
            except TRANSIENT as exc:
                had_outage = True
                if lease.lost:
                    self._fenced_out(lease, "database unreachable for longer than the TTL")
                    return
                self._outage(f"{outcome} of job {lease.pk}", exc)
                if self._stopped.is_set():
                    return
        error_name = type(error).__name__ if error else ""
        if outcome == "completed":
            self.stats.add("completed")
            logger.info(
                "completed job_id=%s attempt=%s owner=%s", lease.pk, lease.attempt, lease.owner
            )
        elif result == "failed" or outcome == "failed":
            self.stats.add("failed")
            logger.warning(
                "failed job_id=%s attempt=%s error_class=%s (no retry left or permanent)",
                lease.pk,
                lease.attempt,
                error_name,
            )
        else:
            self.stats.add("retried")
            logger.info(
                "retry job_id=%s attempt=%s error_class=%s", lease.pk, lease.attempt, error_name
            )

    def _fenced_out(self, lease: Lease, reason: str) -> None:
        lease.mark_lost(reason)
        self.stats.add("lost")
        logger.warning(
            "fenced out job_id=%s token=%s owner=%s: %s; nothing written",
            lease.pk,
            lease.token,
            lease.owner,
            reason,
        )
        try:
            self._jobs().record_fenced(lease.pk, lease.token)
        except TRANSIENT:
            close_old_connections()

    # ---- heartbeat --------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        try:
            while not self._stopped.wait(timeout=self.heartbeat_interval):
                close_old_connections()
                self._renew()
                self._register()
        finally:
            connections.close_all()

    def _register(self) -> None:
        """Upsert this worker's registry row, so the watcher and the admin know it is alive."""
        from django_leases.models import Worker

        try:
            Worker.objects.using(self.using).beat(
                self.worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                kinds=self.kinds,
                concurrency=self.concurrency,
            )
        except TRANSIENT:
            close_old_connections()

    def _renew(self) -> None:
        with self._leases_lock:
            leases = {pk: lease for pk, lease in self._leases.items() if not lease.lost}
        if not leases:
            return
        started = time.monotonic()
        try:
            renewed = self._jobs().heartbeat(
                self.worker_id, {pk: lease.token for pk, lease in leases.items()}, ttl=self.ttl
            )
        except TRANSIENT as exc:
            logger.warning("heartbeat failed: %s", exc)
            close_old_connections()
            connections[self.using].close()
            self._expire_unreachable(leases, started)
            return
        with self._leases_lock:
            for pk in renewed:
                self._renewed_at[pk] = started
        for pk, lease in leases.items():
            if pk not in renewed and not lease.finished:
                lease.mark_lost("heartbeat refused: the lease expired or was taken over")
                logger.warning("lease lost job_id=%s token=%s: heartbeat refused", pk, lease.token)
        logger.debug("heartbeat renewed=%s of %s", len(renewed), len(leases))

    def _expire_unreachable(self, leases: dict[int, Lease], now: float) -> None:
        # Without the database we cannot renew: once a TTL has passed since the last renewal
        # that we know reached it, someone else may own the job. Assume so.
        with self._leases_lock:
            renewed_at = dict(self._renewed_at)
        for pk, lease in leases.items():
            if now - renewed_at.get(pk, now) >= self.ttl:
                lease.mark_lost("database unreachable for longer than the TTL")
                logger.warning("lease lost job_id=%s: database unreachable for a whole TTL", pk)

    # ---- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Release unstarted jobs, let running ones finish within the grace period."""
        for lease in self._drain_queue():
            try:
                self._release_unstarted(lease)
            finally:
                with self._leases_lock:
                    self._leases.pop(lease.pk, None)
                    self._busy -= 1
        for _ in range(self.concurrency):
            self._queue.put(None)
        deadline = time.monotonic() + self.grace_period
        slots = [t for t in self._threads if t.name.startswith("lease-slot")]
        # Join in short slices: a signal the kernel hands to another thread only runs its
        # Python handler (a second SIGTERM exits at once) when the main thread runs bytecode.
        while any(t.is_alive() for t in slots) and time.monotonic() < deadline:
            for thread in slots:
                thread.join(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        with self._leases_lock:
            still_running = list(self._leases.values())
        for lease in still_running:
            # Releasing a job whose handler still runs would let a second worker start it
            # alongside. Instead stop renewing: the lease expires and the watcher returns it.
            lease.mark_lost("worker stopped before the job finished")
            self.stats.add("abandoned")
            logger.warning(
                "abandoned job_id=%s token=%s: still running after the %ss grace period; "
                "its lease expires in at most %ss",
                lease.pk,
                lease.token,
                self.grace_period,
                self.ttl,
            )
        self._stopped.set()
        try:
            from django_leases.models import Worker

            Worker.objects.using(self.using).stopped(self.worker_id)
        except TRANSIENT:
            pass
        finally:
            connections.close_all()

    def _release_unstarted(self, lease: Lease) -> None:
        try:
            lease.release()
        except (LeaseLost, *TRANSIENT) as exc:
            logger.warning("could not release job_id=%s: %s", lease.pk, exc)
            return
        self.stats.add("released")
        logger.info("released unstarted job_id=%s token=%s", lease.pk, lease.token)

    def _drain_queue(self) -> list[Lease]:
        drained: list[Lease] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if item is not None:
                drained.append(item)
