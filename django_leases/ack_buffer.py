"""`AckBuffer`: completions of `ack="batch"` kinds waiting to be written together, and
`AckWriter`, the thread that writes them.

The worker's slots add to the buffer (`completers`); the writer takes due batches.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from django.db import DatabaseError, connections

from django_leases.conf import leases_settings, to_seconds
from django_leases.handlers import ACK_BATCH, get_handler, min_lease
from django_leases.lease import Lease
from django_leases.limits import ACK_BATCH_SIZE
from django_leases.network import harden
from django_leases.outages import is_outage
from django_leases.outcomes import Outcomes
from django_leases.querysets import LeaseQuerySet
from django_leases.slots import SlotPool

logger = logging.getLogger("django_leases.worker")


class AckBuffer:
    """Completions of ack="batch" kinds waiting to be written together. Thread-safe.

    A batch is due when it holds `size` leases, when the oldest has waited `interval` seconds,
    or when a buffered lease comes within `margin` seconds of the time it must be taken as lost
    (the heartbeat no longer renews it: its handler is done), and at once after `close()`.
    """

    def __init__(self, *, size: int, interval: float, margin: float) -> None:
        self.size = size
        self.interval = interval
        self.margin = margin
        self._leases: list[Lease] = []
        self._buffered_at: list[float] = []
        self._in_hand = 0
        self._expiry = math.inf
        self._ready = threading.Condition()
        self._closed = False

    @classmethod
    def configured(cls, size: int | None, interval: float | None, *, margin: float) -> AckBuffer:
        """Return a buffer of `size` and `interval`, the ACK_* settings where None."""
        size = size if size is not None else leases_settings.ACK_BATCH_SIZE
        low, high = ACK_BATCH_SIZE
        if not low <= size <= high:
            raise ValueError(f"ack batch size must be from {low} to {high}, got {size}")
        if interval is None:
            interval = leases_settings.ACK_FLUSH_INTERVAL
        return cls(size=size, interval=to_seconds(interval, "ack_flush_interval"), margin=margin)

    def __len__(self) -> int:
        with self._ready:
            return len(self._leases)

    @property
    def pending(self) -> int:
        """Completions buffered or taken and not yet written (`written()`)."""
        with self._ready:
            return len(self._leases) + self._in_hand

    def narrow(self, size: int) -> None:
        """Make batches due at `size` completions if that is fewer."""
        with self._ready:
            self.size = min(self.size, size)

    def add(self, lease: Lease) -> bool:
        """Buffer `lease`'s completion; False once closed (the caller writes it at once)."""
        with self._ready:
            if self._closed:
                return False
            self._leases.append(lease)
            self._buffered_at.append(time.monotonic())
            self._expiry = min(self._expiry, lease.valid_until - self.margin)
            # Wake the writer only when its deadline moved: a first lease, or a batch now due.
            if len(self._leases) == 1 or self._due_in() <= 0:
                self._ready.notify()
            return True

    def take(self) -> list[Lease] | None:
        """Wait for a due batch and return it, oldest first; None once closed and empty."""
        with self._ready:
            while (due := self._due_in()) > 0:
                if self._closed and not self._leases:
                    return None
                self._ready.wait(None if due == math.inf else due)
            batch, self._leases = self._leases[: self.size], self._leases[self.size :]
            del self._buffered_at[: self.size]
            self._in_hand = len(batch)
            self._expiry = min(
                (lease.valid_until - self.margin for lease in self._leases), default=math.inf
            )
            return batch

    def written(self) -> None:
        """Note that the batch last taken is written (or given up: its writer died)."""
        with self._ready:
            self._in_hand = 0

    def close(self) -> None:
        """Make everything buffered due now and refuse more."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _due_in(self) -> float:
        """Seconds until the buffered batch is due (<= 0: now; infinite: nothing buffered)."""
        if not self._leases:
            return math.inf
        if self._closed or len(self._leases) >= self.size:
            return 0.0
        return min(self._buffered_at[0] + self.interval, self._expiry) - time.monotonic()


class AckWriter:
    """The acknowledgement thread: write `buffer`'s batches until it is closed and empty.

    Claiming `ahead`, each batch's statement also claims jobs ahead for the slots of `pool`.
    Its own field `_thread` is written by the loop only (`start()`, `ensure_running()`).
    """

    def __init__(
        self,
        buffer: AckBuffer,
        outcomes: Outcomes,
        jobs: LeaseQuerySet[Any],
        *,
        pool: SlotPool,
        kinds: list[str],
        ahead: bool,
        slot_free: threading.Event,
    ) -> None:
        self.buffer = buffer
        self.outcomes = outcomes
        self.jobs = jobs
        self.pool = pool
        self.kinds = kinds
        self.ahead = ahead
        self.slot_free = slot_free
        self.using = jobs.db
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, if a claimed kind batches its completions; else close the buffer."""
        if not any(get_handler(kind).ack == ACK_BATCH for kind in self.kinds):
            self.buffer.close()
            return
        self._started()

    def ensure_running(self) -> None:
        """On the loop: replace a writer thread that died.

        Its code catches what a write raises, so this is a bug of ours. Completions it had taken
        are not written: their leases run out and those jobs run again, as after a crash;
        without a writer every later ack of the batch kinds would be lost too.
        """
        if self._thread is not None and not self._thread.is_alive():
            logger.error("the acknowledgement thread died; starting a new one")
            self.buffer.written()
            self._started()

    def _started(self) -> None:
        self._thread = threading.Thread(target=self._ack_loop, name="lease-acks", daemon=True)
        self._thread.start()

    def write_all(self) -> None:
        """Write every buffered completion before the worker exits.

        The writer gives up on a lease once the database was unreachable for its whole TTL, so
        waiting one TTL (plus a network timeout's worth) is enough.
        """
        self.buffer.close()
        if self._thread is not None:
            self._thread.join(timeout=self.outcomes.ttl * 2)
            if self._thread.is_alive():
                logger.warning("buffered completions not written: %s left", len(self.buffer))

    def _ack_loop(self) -> None:
        """Write buffered completions batch by batch until the buffer is closed and empty."""
        harden(connections[self.using], min_lease(self.kinds, self.outcomes.ttl))
        try:
            while (batch := self.buffer.take()) is not None:
                short = False
                try:
                    if self.ahead:
                        short = self._flush_and_claim(batch)
                    else:
                        self._flush(batch)
                except Exception:  # noqa: BLE001 - a bug of ours: write them one by one
                    logger.exception("batched acknowledgement failed; writing each on its own")
                    for lease in batch:
                        if not lease.finished:
                            self.outcomes.complete(lease)
                finally:
                    self.buffer.written()
                if short:
                    self.slot_free.set()  # the loop claims for idle slots, or sees no work
        finally:
            connections.close_all()

    def _flush_and_claim(self, batch: list[Lease]) -> bool:
        """Complete `batch` and claim jobs ahead for the slots (`SlotPool.wanted()`) in one
        statement where the database allows it (`complete_and_claim()`); hand them out. Return
        whether it claimed fewer than it wanted (or nothing is wanted): the loop then claims
        for idle slots itself, or finds that nothing is due.

        A statement refused or lost to an outage leaves the batch to `_flush()`, which finds
        the completions of it that committed; a claim of it that committed unseen expires and is
        taken over, as any claim whose answer was lost.
        """
        wanted = self.pool.wanted(self.buffer.size)
        if not wanted:
            self._flush(batch)
            return True
        started = time.monotonic()
        try:
            won, jobs = self.jobs.complete_and_claim(
                self.outcomes.worker_id,
                [lease.key for lease in batch],
                ttl=self.outcomes.ttl,
                limit=wanted,
                kinds=self.kinds,
            )
        except Exception as exc:  # noqa: BLE001 - _flush() retries, or records why it cannot
            if not isinstance(exc, DatabaseError):
                logger.exception("batched acknowledgement with claim failed; writing it alone")
            self._flush(batch, maybe_written=True)
            return True
        self.outcomes.note_claimed(jobs)
        pending = {lease.key: lease for lease in batch}
        self.outcomes.acknowledged(pending, won, started, had_outage=False)
        self.pool.hand_out(self.outcomes.leases(jobs, started))
        return len(jobs) < wanted

    def _flush(self, batch: list[Lease], *, maybe_written: bool = False) -> None:
        """Complete `batch` in one statement, retrying while the database is down.

        Once the database is unreachable for a lease's whole TTL, that lease is taken as lost,
        as a single completion would be: its job runs again after the lease expires.
        `maybe_written`: an earlier write of it failed, and may have committed.
        """
        pending = {lease.key: lease for lease in batch}
        had_outage = maybe_written
        started = time.monotonic()
        while pending:
            try:
                won = self.jobs.complete_many(self.outcomes.worker_id, list(pending))
                break
            except DatabaseError as exc:
                if not is_outage(exc, self.using):
                    raise
                if not self.outcomes.outages.away(exc):
                    # The database answered and refused the statement: write each on its own.
                    for lease in pending.values():
                        self.outcomes.complete(lease)
                    return
                had_outage = True
                for lease in [lease for lease in pending.values() if lease.lost]:
                    del pending[lease.key]
                    self.outcomes.fenced_out(lease, "database unreachable for longer than the TTL")
                self.outcomes.outages.pause(
                    f"acknowledgement of {len(pending)} job(s)", exc, wait=self.outcomes.stopped
                )
        else:
            return
        self.outcomes.acknowledged(pending, won, started, had_outage=had_outage)
