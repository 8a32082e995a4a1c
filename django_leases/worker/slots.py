"""`SlotPool`: a worker's job slots and the queue of jobs claimed for them, under one lock.

The pool alone holds the lock; every read and write of the fields below is one of its methods
(`Slot`'s fields are the pool's too). The worker's threads are named by their role: the claim
loop ("loop", the thread that calls `LeaseWorker.run()`), the slot threads ("slot N", one per
slot), the heartbeat and its lease clock, and the acknowledgement writer ("acks").

| field               | written by (always under the lock)        | read by                       |
|---------------------|-------------------------------------------|-------------------------------|
| `Slot.thread`       | loop (starts, replaces, abandons it)      | loop, slot N, heartbeat       |
| `Slot.lease`        | slot N (takes a job, ends it); loop (a    | loop, slots, heartbeat, clock,|
|                     | time-out, a dead thread, `close()`)       | acks (how many slots idle)    |
| `Slot.started`,     | slot N (starts, ends a job); loop (as     | loop, slot N, heartbeat,      |
| `Slot.deadline`     | for `Slot.lease`)                         | clock                         |
| `_ready`,           | loop, acks (`hand_out()`); slots (take);  | loop, slots, heartbeat,       |
| `_queued_at`        | heartbeat (waited a TTL); loop (`close`)  | clock, acks                   |
| `_closing`          | loop (`close()`)                          | loop, slots, acks             |
| `_abandoned`        | loop (a handler timed out; pruned)        | loop                          |

"clock" is the heartbeat's lease clock thread.

A lease is only ever held by a slot whose thread is alive, or queued in `_ready`; the heartbeat
renews just those (`held()`). What the pool decides to give back, count lost or abandon it
hands, after letting go of the lock, to the callables it was built with: no database write and
no logging runs under it (`tests/test_slots.py` runs a worker and watches for both). The
fields only the loop writes are asserted so (`owners.Owner`), and a slot's fields are asserted
written under the lock (`owners.under()`), while the test suite runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from django_leases.handlers import get_handler
from django_leases.lease import Lease
from django_leases.worker.owners import Owner, part_lock, under

logger = logging.getLogger("django_leases.worker")

# A coroutine is cancelled at its timeout by its own event loop; the loop supervises it only this
# much later, for a coroutine that blocks its loop and so cannot be cancelled.
ASYNC_TIMEOUT_SLACK = 2.0


class Slot:
    """One job at a time, on its own thread. Its fields are `SlotPool`'s (see its table)."""

    def __init__(self, number: int, lock: threading.Lock) -> None:
        self.number = number
        self._lock = lock
        self.wake = threading.Condition(lock)
        """Notified when this slot gets a lease, a new thread, or the worker closes."""
        self.thread: threading.Thread | None = None
        self.lease: Lease | None = None
        self.started: float | None = None
        """Monotonic time the handler started; None while the lease waits for the thread."""
        self.deadline: float | None = None
        """Monotonic time past which the loop ends the attempt as timed out."""

    @property
    def running(self) -> bool:
        return self.lease is not None and self.started is not None

    def clear(self) -> None:
        under(self._lock, "Slot.lease")
        self.lease, self.started, self.deadline = None, None, None


def deadline(lease: Lease, started: float) -> float | None:
    """When the loop ends this attempt: at the kind's timeout; for a coroutine, which its own
    event loop cancels at the timeout, only if it blocks that loop."""
    handler = get_handler(lease.job.kind)
    if handler.timeout is None:
        return None
    slack = ASYNC_TIMEOUT_SLACK if handler.is_async else 0.0
    return started + handler.timeout + slack


class SlotPool:
    """The slots, the jobs claimed for them (`_ready`) and the lock over both.

    `release` gives back a lease no slot will start; `lost` counts leases that ran out while
    queued; `slot_free` is set for the loop whenever a slot may want a job.
    """

    def __init__(
        self,
        concurrency: int,
        *,
        stopping: threading.Event,
        slot_free: threading.Event,
        release: Callable[[Lease], None],
        lost: Callable[[list[Lease]], None],
        loop: Owner | None = None,
    ) -> None:
        self.concurrency = concurrency
        self._stopping = stopping
        self._slot_free = slot_free
        self._release = release
        self._lost = lost
        self._loop = loop or Owner("loop")
        """The thread that alone writes `Slot.thread`, `_closing` and `_abandoned`."""
        self._lock = part_lock()
        self._slots = [Slot(n, self._lock) for n in range(concurrency)]
        self._ready: deque[Lease] = deque()
        """Jobs claimed ahead, for the slots to start as they finish their own (oldest first)."""
        self._queued_at: dict[tuple[int, int], float] = {}
        """When each lease of `_ready` was queued (monotonic), by `Lease.key`."""
        self._closing = False
        self._abandoned: list[threading.Thread] = []
        """Threads of handlers timed out, still running."""

    # ---- the queue ----------------------------------------------------------------------------

    def hand_out(self, leases: list[Lease]) -> None:
        """Queue claimed jobs for the slots and wake one idle slot: each slot that takes one
        wakes the next (`_wake_idle()`), off the claiming thread, whose next statement is the
        pipeline's critical path. Release them all once the pool is closed."""
        with self._lock:
            late = self._closing
            if not late:
                now = time.monotonic()
                self._queued_at.update((lease.key, now) for lease in leases)
                self._ready.extend(leases)
                self._wake_idle()
        if late:
            for lease in leases:
                self._release(lease)

    def next_ready(self) -> Lease | None:
        """The oldest job claimed ahead, for a slot that finished its own; None if there is none
        or the worker stops (its shutdown releases them)."""
        lost: list[Lease] = []
        with self._lock:
            lease = None if self._stopping.is_set() else self._take_ready(lost)
            self._wake_idle()  # this slot still holds the lease it just finished
        self._lost(lost)
        return lease

    def release_waited_too_long(self) -> None:
        """Release the jobs that waited a whole lease length in `_ready`: the heartbeat renews a
        queued job while a slot may soon start it, not for as long as the slots' handlers hang."""
        now = time.monotonic()
        with self._lock:
            stale = [
                lease
                for lease in self._ready
                if now - self._queued_at.get(lease.key, now) >= lease.ttl
            ]
            for lease in stale:
                self._ready.remove(lease)
                self._queued_at.pop(lease.key, None)
        for lease in stale:
            self._release(lease)

    def _wake_idle(self) -> None:
        """Under the lock: wake one idle slot for the jobs waiting in `_ready`, if any."""
        if self._ready:
            for slot in self._slots:
                if slot.lease is None and slot.thread is not None:
                    slot.wake.notify()
                    return

    def _take_ready(self, lost: list[Lease]) -> Lease | None:
        """Under the lock: the oldest job in `_ready`. One whose lease ran out while it waited
        goes to `lost`, never started: its job is taken over once the lease expires in the
        database. The caller, its slot no longer idle, wakes a slot for the next."""
        under(self._lock, "SlotPool._ready")
        while self._ready:
            lease = self._ready.popleft()
            self._queued_at.pop(lease.key, None)
            if not lease.lost:
                return lease
            lost.append(lease)
        return None

    # ---- counts -------------------------------------------------------------------------------

    def _idle(self) -> int:
        return sum(slot.lease is None for slot in self._slots)

    def claimable(self, *, ahead: bool, owed: int, batch: int) -> int:
        """How many jobs the loop claims: one per idle slot; when claiming `ahead`, also one
        ahead per slot, at most a `batch`, less the jobs claimed ahead and the completions not
        yet written (`owed`: each write claims a job for a slot)."""
        with self._lock:
            if not ahead:
                return max(0, self._idle() - len(self._ready))
            idle = self._idle()
            if not idle:
                return 0
            wanted = idle + self.concurrency - len(self._ready) - owed
            return max(0, min(batch, wanted))

    def wanted(self, batch: int) -> int:
        """How many jobs a batch's write claims ahead: up to one waiting per slot beside one
        running, at most a `batch`; none once the worker stops."""
        with self._lock:
            if self._stopping.is_set() or self._closing:
                return 0
            wanted = self._idle() + self.concurrency - len(self._ready)
            return max(0, min(batch, wanted))

    def in_flight(self) -> int:
        """Jobs held and not finished: in the slots, and claimed ahead."""
        with self._lock:
            return len(self._ready) + sum(slot.lease is not None for slot in self._slots)

    def busy(self) -> Counter[str]:
        """How many slots hold a job now (handed to them or running), per kind."""
        with self._lock:
            return Counter(slot.lease.job.kind for slot in self._slots if slot.lease is not None)

    def deadlines(self) -> list[float]:
        """The run-time limits of the running slots."""
        with self._lock:
            return [s.deadline for s in self._slots if s.running and s.deadline is not None]

    def held(self) -> list[Lease]:
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

    # ---- a slot thread's turns ----------------------------------------------------------------

    def start_next(self, slot: Slot) -> tuple[bool, Lease | None]:
        """On slot thread `slot`: wait for a job and start it. Return (False, None) when the
        thread is to end, else (True, the lease started, or None if another slot took it)."""
        me = threading.current_thread()
        lost: list[Lease] = []
        with self._lock:
            # Once stop is requested an unstarted lease stays where it is, in the slot or in
            # `_ready`: the shutdown releases it (and counts it) before it waits for running ones.
            slot.wake.wait_for(
                lambda: (
                    slot.thread is not me
                    or self._closing
                    or (
                        not self._stopping.is_set()
                        and (
                            (slot.lease is None and bool(self._ready))
                            or (slot.lease is not None and slot.started is None)
                        )
                    )
                )
            )
            if slot.thread is not me or self._closing or slot.started is not None:
                return False, None
            if slot.lease is None:
                slot.lease = self._take_ready(lost)
                self._wake_idle()
            lease = slot.lease
            if lease is not None:
                slot.started = time.monotonic()
                slot.deadline = deadline(lease, slot.started)
        self._lost(lost)
        return True, lease

    def finish(self, slot: Slot, lease: Lease, following: Lease | None) -> tuple[bool, bool]:
        """On slot thread `slot`: its attempt of `lease` ended; `following` is the job its
        completion claimed for it, started next. Return (the slot is still this thread's, it is
        idle)."""
        with self._lock:
            mine = slot.thread is threading.current_thread()
            if mine and slot.lease is lease:
                slot.clear()
                if following is not None and not self._closing:
                    # The completion claimed this slot's next job: it starts at once (a
                    # shutdown releases the unstarted leases it finds in slots).
                    slot.lease, following = following, None
            free = slot.lease is None
        if following is not None:
            self._release(following)  # its slot was taken from this thread
        return mine, free

    # ---- the loop's supervision ---------------------------------------------------------------

    def reap(self, abandon: Callable[[Lease, str], None]) -> list[tuple[Slot, Lease]]:
        """On the loop: free the slots whose thread died and `abandon` their leases (after
        letting go of the lock); return the running slots past their time limit, with their
        leases."""
        now = time.monotonic()
        dead: list[tuple[Slot, Lease | None]] = []
        with self._lock:
            for slot in self._slots:
                if slot.thread is not None and not slot.thread.is_alive():
                    self._loop.writes("Slot.thread")
                    if not (self._closing and slot.lease is None):
                        # The slot's code catches everything a job raises, so this is a bug of
                        # ours: never keep (or renew) a lease whose handler nobody runs.
                        dead.append((slot, slot.lease))
                        slot.clear()
                    slot.thread = None  # a new one starts unless the worker is closing
            late = [
                (slot, slot.lease)
                for slot in self._slots
                if slot.lease is not None
                and slot.started is not None
                and slot.deadline is not None
                and now >= slot.deadline
            ]
        for slot, lease in dead:
            logger.error("slot thread %s died; starting a new one", slot.number)
            if lease is not None:
                abandon(lease, "its slot thread died")
        if dead:
            self._slot_free.set()
        return late

    def abandon_timed_out(self, slot: Slot, lease: Lease, reason: str) -> bool:
        """Take `lease` lost at its time limit and its slot from the handler's thread, which runs
        on, abandoned; False if the handler returned meanwhile (its slot wrote the outcome)."""
        with self._lock:
            if slot.lease is not lease or slot.thread is None:
                return False
            self._loop.writes("Slot.thread")
            lease.mark_lost(reason)
            self._abandoned.append(slot.thread)
            slot.thread = None
            slot.clear()
            self._wake_slots()
        return True

    def start_threads(self, target: Callable[[Slot], None]) -> int:
        """Give each slot without a thread a new one running `target(slot)`, unless closing;
        return how many abandoned threads still run."""
        with self._lock:
            self._loop.writes("Slot.thread")
            for slot in self._slots:
                if slot.thread is None and not self._closing:
                    slot.thread = threading.Thread(
                        target=target, args=(slot,), name=f"lease-slot-{slot.number}", daemon=True
                    )
                    slot.thread.start()
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)

    def close(self) -> None:
        """Take no more jobs: release the unstarted ones, wake the slots to end their threads
        once their jobs are done."""
        with self._lock:
            unstarted = [s.lease for s in self._slots if s.lease is not None and s.started is None]
            unstarted += self._ready
            self._ready.clear()
            self._queued_at.clear()
            for slot in self._slots:
                if slot.started is None:
                    slot.lease = None
            self._loop.writes("SlotPool._closing")
            self._closing = True
            self._wake_slots()
        for lease in unstarted:
            self._release(lease)

    def running(self) -> list[Lease]:
        """The leases of the slots' jobs still running."""
        with self._lock:
            return [slot.lease for slot in self._slots if slot.lease is not None]

    def _wake_slots(self) -> None:
        # Called under the lock.
        for slot in self._slots:
            slot.wake.notify()
