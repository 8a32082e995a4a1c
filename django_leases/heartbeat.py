"""The heartbeat half of `LeaseWorker` (one of its base classes): on its own thread, renew the
leases that live slots run, refresh the worker's registry row, and report a lease lost at its
deadline even while the database does not answer."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections, connections

from django_leases.attempts import TRANSIENT, WorkerStats
from django_leases.db import harden, keep_usable
from django_leases.lease import Lease, Presence
from django_leases.querysets import LeaseQuerySet, WorkerQuerySet
from django_leases.redaction import error_text
from django_leases.status import AttemptOutcome

if TYPE_CHECKING:
    from django_leases.worker import Slot

logger = logging.getLogger("django_leases.worker")


class RenewsLeases:
    """The heartbeat thread's part of `LeaseWorker`; its fields change under the worker's lock."""

    worker_id: str
    ttl: float
    heartbeat_interval: float
    using: str
    stats: WorkerStats
    presence: Presence
    failure: str | None
    _instance: str
    _lock: threading.Lock
    _slots: list[Slot]
    _ready: deque[Lease]
    _stopped: threading.Event
    _reported_lost: set[tuple[int, int]]

    def _jobs(self) -> LeaseQuerySet[Any]:
        raise NotImplementedError

    def _workers(self) -> WorkerQuerySet:
        raise NotImplementedError

    def _registry_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _release_waited_too_long(self) -> None:
        raise NotImplementedError

    def _heartbeat_loop(self) -> None:
        harden(connections[self.using], self.ttl)
        clock = threading.Thread(
            target=self._lease_clock, args=(threading.current_thread(),), daemon=True
        )
        clock.start()
        try:
            while not self._stopped.wait(timeout=self.heartbeat_interval):
                try:
                    keep_usable(health_check=True)
                    self._renew()
                    self._beat()
                except BaseException:  # noqa: BLE001 - the next beat tries again
                    logger.exception("heartbeat failed")
                    connections[self.using].close()
        finally:
            connections.close_all()

    def _beat(self) -> None:
        """Refresh this worker's registry row, so the watcher and the admin know it is alive."""
        started = time.monotonic()
        try:
            if self._workers().beat(self.worker_id, self._instance):
                self.presence.confirmed(started)
                return
            # Our row was pruned, or taken by another process after we looked gone for longer
            # than WORKER_GONE_AFTER (a partition): take it back, unless that process is live.
            if self._workers().register(self.worker_id, **self._registry_fields()):
                self.presence.confirmed(started)
            else:
                self.failure = (
                    f"worker id {self.worker_id!r} was taken by another live worker process"
                )
                logger.error("%s; stopping", self.failure)
                self.stop()
        except TRANSIENT:
            close_old_connections()

    def _held(self) -> list[Lease]:
        """The leases to renew: handed to a live slot, not lost, within their time limit, and
        the jobs claimed ahead for the slots."""
        now = time.monotonic()
        with self._lock:
            return [
                slot.lease
                for slot in self._slots
                if slot.lease is not None
                and slot.thread is not None
                and slot.thread.is_alive()
                and (slot.deadline is None or now < slot.deadline)
                and not slot.lease.finished
            ] + [lease for lease in self._ready if not lease.finished]

    def _lease_clock(self, heartbeat: threading.Thread) -> None:
        """Report each held lease lost at its deadline, with no database access: the heartbeat
        thread may be blocked on a silent connection right then, for up to NETWORK_TIMEOUT."""
        while heartbeat.is_alive() and not self._stopped.wait(timeout=self._until_deadline()):
            self._live(self._held())

    def _until_deadline(self) -> float:
        """Seconds until the first held lease runs out, at most one heartbeat interval."""
        deadlines = [lease.valid_until for lease in self._held() if not lease.lost]
        first = min(deadlines, default=time.monotonic() + self.heartbeat_interval)
        return max(0.01, min(self.heartbeat_interval, first - time.monotonic()))

    def _live(self, leases: list[Lease]) -> list[Lease]:
        """Return the leases of `leases` not lost; log each lost one once."""
        live = []
        for lease in leases:
            if not lease.lost:
                live.append(lease)
                continue
            with self._lock:
                first = lease.key not in self._reported_lost
                self._reported_lost.add(lease.key)
            if first:
                self._report_lost(lease)
        return live

    def _renew(self) -> None:
        self._release_waited_too_long()
        leases = self._live(self._held())
        if not leases:
            return
        started = time.monotonic()
        try:
            renewed = self._jobs().heartbeat(
                self.worker_id, [lease.key for lease in leases], ttl=self.ttl
            )
        except TRANSIENT as exc:
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
            return self._jobs().cancelled_leases([lease.key for lease in refused])
        except TRANSIENT as exc:
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
