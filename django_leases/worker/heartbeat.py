"""`Heartbeat`: on its own thread, renew the leases a worker holds and refresh its registry row;
on a second thread, its lease clock, report a lease lost at its deadline even while the
database does not answer. `RegistryRow` is the worker's row in the registry."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from django.db import DatabaseError, close_old_connections, connections

from django_leases.exceptions import WorkerIdTaken
from django_leases.handlers import min_lease
from django_leases.lease import Lease, Presence
from django_leases.network import harden, keep_usable
from django_leases.outages import Outages, is_outage, outage_or_raise
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.workers import Role
from django_leases.redaction import error_text
from django_leases.status import AttemptOutcome
from django_leases.tables import registered_workers
from django_leases.worker.counters import WorkerStats
from django_leases.worker.owners import Owner, part_lock, under

logger = logging.getLogger("django_leases.worker")


def default_worker_id() -> str:
    """Return "<host>:<pid>:<random>": unique per process, readable in the admin and logs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class RegistryRow:
    """The worker's row in the registry: how the watcher and the admin know it is alive."""

    def __init__(
        self,
        *,
        using: str,
        worker_id: str,
        instance: str,
        kinds: Collection[str],
        concurrency: int,
        presence: Presence,
        heartbeat: float | None = None,
        role: str = Role.WORKER,
    ) -> None:
        self.using = using
        self.worker_id = worker_id
        self.instance = instance
        self.kinds = list(kinds)
        self.concurrency = concurrency
        self.presence = presence
        self.heartbeat = heartbeat
        self.role = role

    def register(self, started: float | None = None) -> bool:
        """Take the row; False if a live process holds it. Raises what the database raises.

        `started`: when the statement that found the row gone was sent (monotonic)."""
        started = time.monotonic() if started is None else started
        registered = registered_workers(self.using).register(
            self.worker_id,
            instance=self.instance,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            kinds=self.kinds,
            concurrency=self.concurrency,
            heartbeat=self.heartbeat,
            role=self.role,
        )
        if registered:
            self.presence.confirmed(started)
        return registered

    def take(self, outages: Outages, stopping: threading.Event) -> None:
        """Take the row at the worker's start, waiting out database outages (until stopped).

        Raises `WorkerIdTaken` if a live process holds it.
        """
        while True:
            try:
                registered = self.register()
            except DatabaseError as exc:
                outage_or_raise(exc, self.using)
                if stopping.is_set():
                    return
                outages.pause("registration", exc)
                continue
            outages.over()
            if not registered:
                raise WorkerIdTaken(
                    f"worker id {self.worker_id!r} is in use by a live worker process; "
                    "give each process its own --worker-id"
                )
            return

    def beat(self, started: float) -> bool:
        """Refresh the row with a statement sent at `started` (monotonic); False if it is gone
        (pruned, or taken by another process)."""
        if registered_workers(self.using).beat(self.worker_id, self.instance):
            self.presence.confirmed(started)
            return True
        return False

    def stopped(self) -> None:
        """Mark the row stopped (the worker exits)."""
        registered_workers(self.using).stopped(self.worker_id, self.instance)


class Heartbeat:
    """Renew `held()` every `interval` seconds (after `tidy()`, which gives back what should no
    longer be renewed) and beat `row`; call `taken(why)` if another live process took the row.

    Its own fields: `_thread` (written by the loop, `ensure_running()`) and `_reported_lost`
    (written by the heartbeat thread and the lease clock, under `_lock`).
    """

    def __init__(
        self,
        jobs: LeaseQuerySet[Any],
        row: RegistryRow,
        *,
        held: Callable[[], list[Lease]],
        tidy: Callable[[], None],
        taken: Callable[[str], None],
        stats: WorkerStats,
        ttl: float,
        interval: float,
        stopped: threading.Event,
        loop: Owner | None = None,
    ) -> None:
        self.jobs = jobs
        self.row = row
        self.held = held
        self.tidy = tidy
        self.taken = taken
        self.stats = stats
        self.ttl = ttl
        self.interval = interval
        self.stopped = stopped
        self.using = jobs.db
        self._loop = loop or Owner("loop")
        self._thread: threading.Thread | None = None
        self._lock = part_lock()
        self._reported_lost: set[tuple[int, int]] = set()

    def ensure_running(self) -> None:
        """On the loop: start the heartbeat thread, or a new one if it died (a bug of ours)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if self._thread is not None:
            logger.error("the heartbeat thread died; starting a new one")
        self._loop.writes("Heartbeat._thread")
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="lease-heartbeat", daemon=True
        )
        self._thread.start()

    def _heartbeat_loop(self) -> None:
        harden(connections[self.using], min_lease(self.row.kinds, self.ttl))
        clock = threading.Thread(
            target=self._lease_clock,
            args=(threading.current_thread(),),
            name="lease-clock",
            daemon=True,
        )
        clock.start()
        try:
            while not self.stopped.wait(timeout=self.interval):
                try:
                    keep_usable(health_check=True)
                    self.renew()
                    self.beat()
                except BaseException:  # noqa: BLE001 - the next beat tries again
                    logger.exception("heartbeat failed")
                    connections[self.using].close()
        finally:
            connections.close_all()

    def beat(self) -> None:
        """Refresh this worker's registry row, so the watcher and the admin know it is alive."""
        started = time.monotonic()
        try:
            # A row pruned, or taken by another process after we looked gone for longer than
            # WORKER_GONE_AFTER (a partition): take it back, unless that process is live.
            if self.row.beat(started) or self.row.register(started):
                return
            why = f"worker id {self.row.worker_id!r} was taken by another live worker process"
            logger.error("%s; stopping", why)
            self.taken(why)
        except DatabaseError as exc:
            if not is_outage(exc, self.using):
                raise
            # Also a connection that answers: one to a server that takes no writes stays so.
            connections[self.using].close()

    def _lease_clock(self, heartbeat: threading.Thread) -> None:
        """Report each held lease lost at its deadline, with no database access: the heartbeat
        thread may be blocked on a silent connection right then, for up to NETWORK_TIMEOUT."""
        while heartbeat.is_alive() and not self.stopped.wait(timeout=self._until_deadline()):
            self._live(self.held())

    def _until_deadline(self) -> float:
        """Seconds until the first held lease runs out, at most one heartbeat interval. Leases
        lost or being written are left out, and none is marked: `_live()` decides."""
        deadlines = [
            lease.valid_until for lease in self.held() if not (lease.ending or lease.marked_lost)
        ]
        first = min(deadlines, default=time.monotonic() + self.interval)
        return max(0.01, min(self.interval, first - time.monotonic()))

    def _live(self, leases: list[Lease]) -> list[Lease]:
        """Return the leases of `leases` not lost; log each lost one once.

        A lease whose outcome is being written is not read by the clock (reading `lost` marks
        it): that write decides, as in `renew()`; it finishes the lease or reports it lost."""
        live = []
        for lease in leases:
            if (lease.ending and not lease.marked_lost) or not lease.lost:
                live.append(lease)
                continue
            with self._lock:
                under(self._lock, "Heartbeat._reported_lost")
                first = lease.key not in self._reported_lost
                self._reported_lost.add(lease.key)
            if first:
                self._report_lost(lease)
        return live

    def renew(self) -> None:
        """Renew the held leases in one statement; take those the database refused as lost."""
        self.tidy()
        leases = self._live(self.held())
        if not leases:
            return
        started = time.monotonic()
        try:
            renewed = self.jobs.heartbeat(
                self.row.worker_id, [lease.key for lease in leases], ttl=self.ttl
            )
        except DatabaseError as exc:
            if not is_outage(exc, self.using):
                raise
            logger.warning("heartbeat failed: %s", error_text(exc))
            close_old_connections()
            connections[self.using].close()
            return
        refused = []
        for lease in leases:
            if lease.key in renewed:
                lease.renewed(started)
            elif not (lease.finished or lease.ending):
                # A lease whose outcome is being written may have lost only to that write,
                # which decides: it finishes the lease, or finds it lost and says so.
                refused.append(lease)
        if refused:
            cancelled = self._cancelled(refused)
            for lease in refused:
                by = cancelled.get(lease.key)
                if by is None:
                    lease.mark_lost("heartbeat refused: the lease expired or was taken over")
                else:
                    lease.mark_lost(f"cancelled by {by}", cancelled=True)
            self._live(refused)
        logger.debug("heartbeat renewed=%s of %s", len(renewed), len(leases))

    def _cancelled(self, refused: list[Lease]) -> dict[tuple[int, int], str]:
        """Which refused leases an operator cancelled, and by whom; {} if the database cannot
        say now (those leases are lost all the same)."""
        try:
            return self.jobs.cancelled_leases([lease.key for lease in refused])
        except DatabaseError as exc:
            if not is_outage(exc, self.using):
                raise
            logger.warning("could not read the refused leases: %s", error_text(exc))
            return {}

    def _report_lost(self, lease: Lease) -> None:
        """Log a lease this worker found lost, and count it; `_live()` calls it once per lease."""
        if lease.cancelled:
            logger.info(
                "lease cancelled job_id=%s token=%s: %s", lease.pk, lease.token, lease.lost_reason
            )
            return
        if self.stats.recorder is not None:
            self.stats.recorder.count(AttemptOutcome.LEASE_LOST, lease.job.kind, 1)
        logger.warning(
            "lease lost job_id=%s token=%s: %s", lease.pk, lease.token, lease.lost_reason
        )
