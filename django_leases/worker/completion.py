"""After the handler returns: how a slot's finished job is completed, and where its next job
comes from.

A worker picks one `Completer` when it starts, from its configuration (`choose()`); a slot's
attempt only ever calls `complete(lease)` after a handler succeeded, or `next_job()` after any
other end, and starts the lease either returns next.

- `Direct` (`max_jobs` set: the loop counts, so it claims): the completion is written on its
  own, or buffered for the acknowledgement writer if the kind batches its acks.
- `Grouped` (the default): the completion and the claim of the slot's next job go in one group
  write with those of every other slot finishing at the same moment (`GroupCommit`); once the
  worker stops it completes as `Direct` does, and nothing is claimed.
- `ClaimsAhead` (every kind batches its acks): the completion is buffered, and the slot starts a
  job claimed ahead by an earlier batch's write (`AckWriter`); once the buffer is closed it
  completes as `Grouped` does.

`AckBuffer` holds the completions of `ack="batch"` kinds waiting to be written together;
`AckWriter` is the thread that writes them. A group write and a batch's write claiming ahead
both complete and claim in one statement through `complete_and_claim()`; what is written on
its own is written by `Outcomes`, which retries while the database is away.

A job with a lock takes the same route as any other, but is never buffered (`buffered()`): the
job waiting behind it would wait for the batch too. Every completion of `LeaseQuerySet` passes
a released lock on by itself.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import DatabaseError, connections

from django_leases.conf import leases_settings, to_seconds
from django_leases.handlers import ACK_BATCH, get_handler, min_lease
from django_leases.lease import Lease
from django_leases.limits import ACK_BATCH_SIZE
from django_leases.network import harden
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.base import LeaseKey
from django_leases.worker.group_commit import GroupCommit
from django_leases.worker.outcomes import Outcomes
from django_leases.worker.owners import Owner
from django_leases.worker.slots import SlotPool

logger = logging.getLogger("django_leases.worker")


class Completer(Protocol):
    def complete(self, lease: Lease) -> Lease | None:
        """Complete `lease`, whose handler succeeded; return the slot's next lease, if any."""

    def next_job(self) -> Lease | None:
        """Return the slot's next lease after an attempt with nothing to complete, if any."""


def buffered(acks: AckBuffer, lease: Lease) -> bool:
    """Buffer `lease`'s completion for the acknowledgement writer; False for a job of a lock
    (the job waiting behind it would wait for the batch too) and once the buffer is closed (the
    worker is writing its last batch)."""
    if lease.job.lock or not acks.add(lease):
        return False
    logger.debug("ack buffered job_id=%s token=%s", lease.pk, lease.token)
    return True


class Direct:
    """Each completion its own statement, or buffered for kinds that batch their acks."""

    def __init__(self, outcomes: Outcomes, acks: AckBuffer) -> None:
        self.outcomes = outcomes
        self.acks = acks

    def complete(self, lease: Lease) -> Lease | None:
        if get_handler(lease.job.kind).ack != ACK_BATCH or not buffered(self.acks, lease):
            self.outcomes.complete(lease)
        return None

    def next_job(self) -> Lease | None:
        return None


@dataclass(frozen=True)
class GroupCompletion:
    """What `Grouped.write()` did for one lease."""

    written: bool
    """False: nothing was written; the slot writes the completion on its own."""
    won: bool = False
    """The completion won (else the lease was lost before it)."""
    following: Lease | None = None
    """The slot's next job, claimed in the same statement."""
    failed: bool = False
    """The statement was sent and failed: part of it may have committed."""


class Grouped:
    """Complete and claim each slot's next job in one group write; `Direct` once stopping."""

    def __init__(self, outcomes: Outcomes, *, stopping: threading.Event, direct: Direct) -> None:
        self.outcomes = outcomes
        self.stopping = stopping
        self.direct = direct
        self.commit: GroupCommit[Lease | None, GroupCompletion] = GroupCommit(self.write)

    def complete(self, lease: Lease) -> Lease | None:
        """A completion the group statement could not write is written on its own, where
        `record()` retries it or records why it cannot."""
        if self.stopping.is_set():
            return self.direct.complete(lease)
        group = self.commit.submit(lease)
        if not group.written:
            # After a failed group statement a completion found done may be our own.
            self.outcomes.complete(lease, maybe_written=group.failed)
        elif group.won:
            self.outcomes.completed(lease)
        else:
            self.outcomes.fenced_out(lease, "lease lost before its completion", recorded=True)
        return group.following

    def next_job(self) -> Lease | None:
        # Once the worker stops, nothing is claimed.
        return None if self.stopping.is_set() else self.commit.submit(None).following

    def write(self, items: list[Lease | None]) -> list[GroupCompletion]:
        """Complete the leases of `items` and claim a next job for each item in one statement
        (`complete_and_claim()`). One that fails leaves each completion to its slot."""
        if self.stopping.is_set():
            return [GroupCompletion(written=False) for _ in items]
        keys = [lease.key for lease in items if lease is not None]
        failed = "group write failed; each slot writes its completion alone"
        fused = complete_and_claim(self.outcomes, keys, limit=len(items), failed=failed)
        if fused is None:
            return [GroupCompletion(written=False, failed=True) for _ in items]
        following: list[Lease | None] = list(fused.claimed)
        following += [None] * (len(items) - len(following))
        return [
            GroupCompletion(
                written=True, won=lease is not None and lease.key in fused.won, following=next_lease
            )
            for lease, next_lease in zip(items, following, strict=True)
        ]


@dataclass(frozen=True)
class Fused:
    """What one statement of `complete_and_claim()` did."""

    won: set[LeaseKey]
    """The leases it completed (else lost before it)."""
    claimed: list[Lease]
    """The leases of the jobs it claimed."""
    started: float
    """When it was sent (monotonic)."""


def complete_and_claim(
    outcomes: Outcomes, keys: list[LeaseKey], *, limit: int, failed: str
) -> Fused | None:
    """Complete the leases of `keys` and claim up to `limit` next jobs, in one statement where
    the database allows it (`LeaseQuerySet.complete_and_claim()`): one commit for the jobs
    finished and the next ones, however many slots or acks it carries; count the claims.

    None if the statement failed (logged as `failed`, unless the database refused it): the
    caller writes the completions again, where `Outcomes` finds those that committed (elsewhere
    than PostgreSQL they may have committed before the claim failed). A claim of it that
    committed unseen expires and is taken over, as any claim whose answer was lost.
    """
    started = time.monotonic()
    looked = outcomes.takes_over()
    try:
        won, jobs = outcomes.claimer.complete_and_claim(keys, limit, takeover=looked)
    except Exception as exc:  # noqa: BLE001 - the caller writes them again, or records why not
        if not isinstance(exc, DatabaseError):  # a database's refusal is logged by the retry
            logger.exception("%s", failed)
        return None
    outcomes.note_claimed(jobs, looked=looked)
    return Fused(won, outcomes.leases(jobs, started), started)


class ClaimsAhead:
    """Buffer every completion; each batch's write claims the slots' jobs ahead."""

    def __init__(self, pool: SlotPool, acks: AckBuffer, grouped: Grouped) -> None:
        self.pool = pool
        self.acks = acks
        self.grouped = grouped

    def complete(self, lease: Lease) -> Lease | None:
        if buffered(self.acks, lease):
            return self.pool.next_ready()
        return self.grouped.complete(lease)

    def next_job(self) -> Lease | None:
        return self.pool.next_ready()


def choose(
    outcomes: Outcomes,
    *,
    pool: SlotPool,
    acks: AckBuffer,
    stopping: threading.Event,
    counts_claims: bool,
    claims_ahead: bool,
) -> Completer:
    """The completer of a worker: `Direct` if it `counts_claims` (`max_jobs`), `ClaimsAhead` if
    it `claims_ahead`, else `Grouped`."""
    direct = Direct(outcomes, acks)
    if counts_claims:
        return direct
    grouped = Grouped(outcomes, stopping=stopping, direct=direct)
    return ClaimsAhead(pool, acks, grouped) if claims_ahead else grouped


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
        loop: Owner | None = None,
    ) -> None:
        self.buffer = buffer
        self.outcomes = outcomes
        self.jobs = jobs
        self.pool = pool
        self.kinds = kinds
        self.ahead = ahead
        self.slot_free = slot_free
        self.using = jobs.db
        self._loop = loop or Owner("loop")
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
        self._loop.writes("AckWriter._thread")
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
        statement (`complete_and_claim()`); hand them out. Return whether it claimed fewer
        than it wanted (or nothing is wanted): the loop then claims for idle slots itself, or
        finds that nothing is due. A statement that failed leaves the batch to `_flush()`."""
        wanted = self.pool.wanted(self.buffer.size)
        if not wanted:
            self._flush(batch)
            return True
        keys = [lease.key for lease in batch]
        failed = "batched acknowledgement with claim failed; writing it alone"
        fused = complete_and_claim(self.outcomes, keys, limit=wanted, failed=failed)
        if fused is None:
            self._flush(batch, maybe_written=True)
            return True
        pending = {lease.key: lease for lease in batch}
        self.outcomes.acknowledged(pending, fused.won, fused.started, had_outage=False)
        self.pool.hand_out(fused.claimed)
        return len(fused.claimed) < wanted

    def _flush(self, batch: list[Lease], *, maybe_written: bool = False) -> None:
        """Complete `batch` in one statement, retrying while the database is away
        (`Outcomes.answered()`): a lease it is away for a whole TTL is taken as lost, as a
        single completion would be, its job run again after the lease expires. A statement the
        database refuses leaves each completion to be written on its own.
        `maybe_written`: an earlier write of it failed, and may have committed.
        """
        pending = {lease.key: lease for lease in batch}
        started = time.monotonic()
        try:
            answer = self.outcomes.answered(
                pending,
                f"acknowledgement of {len(batch)} job(s)",
                lambda: self.jobs.complete_many(self.outcomes.worker_id, list(pending)),
                wait=self.outcomes.stopped,
            )
        except DatabaseError:
            for lease in pending.values():
                self.outcomes.complete(lease)
            return
        if answer is not None:
            won, had_outage = answer
            self.outcomes.acknowledged(
                pending, won, started, had_outage=had_outage or maybe_written
            )
