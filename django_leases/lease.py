"""`Lease`: what a handler receives beside its job. It calls queryset methods only."""

from __future__ import annotations

import inspect
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import transaction

from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import Cancelled, InvalidArgument, LeaseError, LeaseLost
from django_leases.limits import STEP_NAME_LENGTH, check_json, check_json_size, check_text
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.groups import GroupMember, ended_members
from django_leases.status import FAILED, TIMED_OUT, AttemptOutcome
from django_leases.tables import leased_jobs

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob

P = ParamSpec("P")
R = TypeVar("R")


Clock = Callable[[], float]
"""A monotonic clock in seconds (`time.monotonic`): what a worker's deadlines are measured by."""


class Presence:
    """How long the stuck watcher takes a worker for alive: `WORKER_GONE_AFTER` seconds after the
    start of the last registry beat of it that the database confirmed.

    Past that the watcher may rescue the worker's jobs as orphaned, whatever their leases say,
    so every `Lease` of the worker ends then too (`Lease.valid_until`): a worker cut off from its
    registry row never believes in a lease that the watcher may already have given away.
    """

    def __init__(self, gone_after: float, *, clock: Clock = time.monotonic) -> None:
        self.gone_after = gone_after
        self.clock = clock
        self._until = -math.inf

    @property
    def until(self) -> float:
        """Monotonic time at which the watcher may take the worker for gone."""
        return self._until

    def confirmed(self, started_at: float) -> None:
        """Note a registry beat (or registration) the database confirmed, sent at `started_at`:
        the row's `last_seen_at` is no earlier, so the watcher's deadline is no earlier either."""
        self._until = max(self._until, started_at + self.gone_after)


class Lease:
    """The claim of one job by one owner under one fencing token.

    Its holder knows the lease is lost when a write of its own is refused, when the worker's
    heartbeat is refused, or — without asking the database — once a whole TTL has passed since
    the start of the last renewal the database confirmed, or its worker's registry row may look
    gone to the watcher (`Presence`): after that, someone else may own the job whatever happened
    to the network. `lost` reads the worker's monotonic clock, never the wall clock.

    Who writes its state in a worker (docs/architecture.md, the thread table):
    `finished` and `outcome`, the thread whose outcome write the database accepted (a slot, the
    loop at a time-out, or the acknowledgement writer): several threads may try, but the
    database lets one write of a lease's outcome win, and only the winner sets them, each a
    single assignment of a value that never changes back; `ending`, the thread writing an
    outcome (set before its write, never cleared: it only makes the heartbeat and the lease
    clock leave the lease to that write); `_renewed_until`, the heartbeat and the handler's
    own `heartbeat()`, under `_marking` (`renewed()` only raises it); the lost state and
    `_on_cancel` (the event-loop thread of an `async def` handler sets and removes it), under
    `_marking` too.
    """

    def __init__(
        self,
        job: AbstractLeasedJob,
        *,
        ttl: float | timedelta,
        renewed_at: float | None = None,
        presence: Presence | None = None,
    ) -> None:
        self.job = job
        self.pk: int = job.pk
        self.owner: str = job.lease_owner
        self.token: int = job.lease_token
        self.attempt: int = job.attempts
        self.ttl = to_seconds(ttl, "ttl")
        self.finished = False
        # What the holder's last write made of the job: "completed", "retried", "failed",
        # "released" or "timed_out"; None while it holds the job.
        self.outcome: str | None = None
        self.ending = False
        """The attempt's outcome is being written: a renewal the database refuses now may have
        raced that write, which decides (it finishes the lease, or finds it lost)."""
        self._presence = presence
        self._clock: Clock = time.monotonic if presence is None else presence.clock
        # A flag, not an Event: nothing waits for it, and building an Event (a Condition and
        # its lock) was two thirds of building a Lease, once per job claimed (bench/README.md).
        self._lost = False
        self._marking = threading.Lock()
        self._lost_reason = ""
        self._cancelled = False
        self._on_cancel: Callable[[], None] | None = None
        # The function each step of this attempt was run with (`step()`), by name.
        self._steps: dict[str, Callable[..., Any]] = {}
        # The claim's statement started at or after `renewed_at`, so the database's lease ends
        # no earlier than this deadline.
        self.claimed_at = self._clock() if renewed_at is None else renewed_at
        """When the claim's statement was sent, by the lease's (monotonic) clock."""
        self._renewed_until = self.claimed_at + self.ttl

    def claimed_ago(self) -> float:
        """Seconds since the claim's statement was sent."""
        return self._clock() - self.claimed_at

    def __repr__(self) -> str:
        state = "lost" if self.lost else "finished" if self.finished else "held"
        return f"<Lease job={self.pk} owner={self.owner} token={self.token} {state}>"

    @property
    def key(self) -> tuple[int, int]:
        """(job id, fencing token): one acquisition, even when one worker claims a job again."""
        return self.pk, self.token

    @property
    def lost(self) -> bool:
        """True once this holder knows, or must assume, that it no longer owns the job.

        Never by the clock once `finished`: the database accepted the outcome under this
        token, so nobody else owned the job before it."""
        if not self._lost and not self.finished and self._clock() >= self.valid_until:
            if self._clock() >= self._renewed_until:
                self.mark_lost("not renewed for a whole TTL (database unreachable?)")
            else:
                self.mark_lost(
                    "the worker's registry row was not refreshed for WORKER_GONE_AFTER "
                    "(database unreachable?): the watcher may rescue its jobs"
                )
        return self._lost

    @property
    def marked_lost(self) -> bool:
        """True once the lease was marked lost; unlike `lost`, never marks it by the clock."""
        return self._lost

    @property
    def valid_until(self) -> float:
        """Monotonic time at which the lease must be taken as lost unless renewed before: a TTL
        after its last confirmed renewal, or when its worker may look gone, whichever is first."""
        if self._presence is None:
            return self._renewed_until
        return min(self._renewed_until, self._presence.until)

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    @property
    def cancelled(self) -> bool:
        """True once this holder knows an operator cancelled the job (`check()` raises
        `Cancelled`)."""
        return self._cancelled

    def mark_lost(self, reason: str, *, cancelled: bool = False) -> None:
        """Take the lease as lost for `reason`; `cancelled`: by an operator's `cancel()`."""
        # Under its own lock: the heartbeat, the lease clock, the loop and the slot may all
        # find the lease lost at once, and the first reason is the one kept.
        with self._marking:
            if self._lost:
                return
            self._lost_reason = reason
            self._cancelled = cancelled
            self._lost = True
            hook = self._on_cancel if cancelled else None
        if hook is not None:
            hook()

    def on_cancel(self, hook: Callable[[], None] | None) -> None:
        """Call `hook` (on whichever thread learns it) once the job is found cancelled, at once
        if it already was; None removes it. The worker cancels an `async def` handler so.

        Set under `_marking`, as `mark_lost()` reads it: a cancel that races the hook's setting
        calls it exactly once, from one side or the other."""
        with self._marking:
            self._on_cancel = hook
            now = hook is not None and self._cancelled
        if now and hook is not None:
            hook()

    def renewed(self, started_at: float) -> None:
        """Note a renewal the database confirmed, sent at `started_at` (monotonic).

        The heartbeat and the handler's own `heartbeat()` both renew: under `_marking`, the
        later of their deadlines stays, where an unlocked read-max-write could lower it."""
        until = started_at + self.ttl
        with self._marking:
            if until > self._renewed_until:
                self._renewed_until = until

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is known to be lost, `Cancelled` if by a cancel."""
        if self.lost:
            error = Cancelled if self._cancelled else LeaseLost
            raise error(f"job {self.pk}: {self._lost_reason or 'lease lost'}")

    def _jobs(self) -> LeaseQuerySet[Any]:
        # The database the job was claimed on, whatever the routers say.
        return leased_jobs(type(self.job), self.job._state.db)

    def kind_paused(self) -> bool:
        """Whether the job's kind is paused now (`LeaseQuerySet.pause_kind()`), by the database."""
        return self._jobs().kind_paused(self.job.kind)

    def group(self) -> list[GroupMember]:
        """Return how each member of the group ended, in the group's order, if this job is a
        group's callback (`enqueue_group()`): id, kind, final status and last error, as the
        transactions that ended them wrote it on this job's row (no statement). Raises
        `LeaseError` for a job that is no group's callback."""
        return ended_members(self.job)

    def heartbeat(self) -> None:
        """Renew the lease now for another TTL; raise `LeaseLost` if it was lost."""
        self.check()
        started = self._clock()
        jobs = self._jobs()
        if self.key not in jobs.heartbeat(self.owner, [self.key], ttl=self.ttl):
            by = jobs.cancelled_leases([self.key]).get(self.key)
            if by is None:
                self.mark_lost("heartbeat refused: the lease expired or was taken over")
            else:
                self.mark_lost(f"cancelled by {by}", cancelled=True)
            self.check()
        self.renewed(started)

    def checkpoint(self, step: str) -> None:
        """Record that the handler reached `step` (e.g. "psp_called") before a risky action.

        Refused (`LeaseLost`) once the lease has expired, even if nobody took it over yet: the
        watcher may already have decided what to do with the job from the checkpoint it read.
        """
        self.check()
        self._guard(lambda: self._jobs().checkpoint(self.pk, self.owner, self.token, step))

    def complete(self, result: Any = None) -> None:
        """Complete the job now (storing `result`, if given); the worker then writes nothing."""
        self._end(lambda: self._jobs().complete(self.pk, self.owner, self.token, result=result))
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def mark_completed(self) -> None:
        """Note that the worker's batched acknowledgement completed the job."""
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def fail(
        self, error: BaseException | str, *, retry_in: float | None = None, permanent: bool = False
    ) -> str:
        status = self._end(
            lambda: self._jobs().fail(
                self.pk, self.owner, self.token, error, retry_in=retry_in, permanent=permanent
            )
        )
        self.finished, self.outcome = (
            True,
            (AttemptOutcome.FAILED if status == FAILED else AttemptOutcome.RETRIED),
        )
        return str(status)

    def release(self) -> None:
        self._end(lambda: self._jobs().release(self.pk, self.owner, self.token))
        self.finished, self.outcome = True, AttemptOutcome.RELEASED

    def time_out(self, reason: str, *, retry_in: float, running: bool = False) -> str:
        """End the attempt as timed out (the worker's run-time limit); return the status the
        job ends as (stopping meanwhile if the handler is still `running`)."""
        status = self._end(
            lambda: self._jobs().time_out(
                self.pk, self.owner, self.token, retry_in=retry_in, reason=reason, running=running
            )
        )
        self.mark_lost(reason)
        self.finished, self.outcome = True, TIMED_OUT
        return str(status)

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Run the block in a transaction that holds the lease and completes the job on exit.

        The lease is re-checked (and the job row locked) when the block starts, so a holder that
        lost its lease gets `LeaseLost` and its writes roll back; on a clean exit the job is
        completed in the same transaction as the handler's own writes: both commit or neither.
        Keep the block short: it holds the job row (and, on SQLite, the database) locked.

        Raises `LeaseError` inside another atomic block (of the job's database): the completion
        would then commit or roll back with that outer block, not here, and the worker could
        not tell which.
        """
        self.check()
        jobs = self._jobs()
        with ExitStack() as stack:
            self._durable(stack, jobs, "lease.atomic()", "the completion")
            self._guard(lambda: jobs.lock_held(self.pk, self.owner, self.token))
            yield
            self._end(lambda: jobs.complete(self.pk, self.owner, self.token))
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def run_atomic(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call `func` inside `atomic()`: its writes and the completion commit together."""
        with self.atomic():
            return func(*args, **kwargs)

    def _durable(self, stack: ExitStack, jobs: LeaseQuerySet[Any], what: str, write: str) -> None:
        """Enter a transaction on the job's database in `stack`; raise `LeaseError` inside
        another atomic block of it: `write` would commit or roll back with that outer block, not
        here, and the worker could not tell which."""
        try:
            stack.enter_context(transaction.atomic(using=jobs.db, durable=True))
        except RuntimeError:
            raise LeaseError(
                f"job {self.pk}: {what} cannot run inside another atomic block of "
                f"database {jobs.db!r}: {write} would commit or roll back with it"
            ) from None

    # ---- resumable steps ------------------------------------------------------------------------

    def step_key(self, name: str) -> str:
        """Return the idempotency key of the step `name` for a payment provider: the same on
        every attempt of the job (see `step_key()`)."""
        return step_key(self.job, name)

    def step(self, name: str, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run `fn(*args, **kwargs)` as the step `name` of the job, unless a run of it was
        already recorded: then return the recorded result without running `fn`.

        `fn` runs in a transaction on the job's database; its JSON result is recorded in that
        transaction under this lease's fencing token, so its own writes and the record commit
        together, or (`LeaseLost` once another holder owns the job) neither does. Before `fn`
        runs, the step is marked started in the job's checkpoint, refused once the lease expired:
        a crash before the record leaves the step's outcome ambiguous, and the kind's stuck
        policy (retry, or review and its reconcile hook) applies to it. The record takes the
        mark off again. Returns the result as recorded (JSON: a tuple comes back a list).

        Raises `InvalidArgument` (nothing written, `fn` not run) for a name that is not a string
        of 1 to STEP_NAME_LENGTH characters or that this attempt already ran with another
        function, and (after `fn` ran; its writes roll back) for a result that is not JSON or
        is larger than MAX_PAYLOAD_BYTES.
        """
        check_text(name, "step name", STEP_NAME_LENGTH)
        if not callable(fn) or inspect.iscoroutinefunction(fn):
            raise InvalidArgument(
                f"step {name!r}: fn must be a plain function (it runs in a transaction), got {fn!r}"
            )
        earlier = self._steps.setdefault(name, fn)
        if earlier != fn:
            raise InvalidArgument(
                f"job {self.pk}: step {name!r} already ran in this attempt with {earlier!r}, "
                f"not {fn!r}: give each step its own name"
            )
        self.check()
        jobs = self._jobs()
        done, recorded = self._guard(
            lambda: jobs.recorded_step(self.pk, self.owner, self.token, name)
        )
        if done:
            return recorded
        self._guard(lambda: jobs.start_step(self.pk, self.owner, self.token, name))
        try:
            with ExitStack() as stack:
                self._durable(stack, jobs, f"lease.step({name!r})", "its record")
                result = fn(*args, **kwargs)
                what = f"result of step {name!r}"
                check_json(result, what)
                check_json_size(result, what, leases_settings.MAX_PAYLOAD_BYTES)
                self._guard(
                    lambda: jobs.record_step(
                        self.pk, self.owner, self.token, self.attempt, name, result
                    )
                )
        except LeaseLost:
            # After the rollback: the refusal is noted on the attempt, not rolled back with it.
            jobs.record_fenced(self.pk, self.token)
            raise
        return json.loads(json.dumps(result))

    # ---- from async handlers ------------------------------------------------------------------
    # Each runs the synchronous method on the worker's slot thread (thread-sensitive
    # sync_to_async), whose database connection the handler's own `sync_to_async` calls and
    # Django's async ORM methods use too. The event loop never blocks on the database.

    async def acheck(self) -> None:
        """Raise `LeaseLost` if the lease is known to be lost (no database access)."""
        self.check()

    async def aheartbeat(self) -> None:
        await sync_to_async(self.heartbeat)()

    async def acheckpoint(self, step: str) -> None:
        await sync_to_async(self.checkpoint)(step)

    async def acomplete(self, result: Any = None) -> None:
        await sync_to_async(self.complete)(result)

    async def afail(
        self, error: BaseException | str, *, retry_in: float | None = None, permanent: bool = False
    ) -> str:
        return await sync_to_async(self.fail)(error, retry_in=retry_in, permanent=permanent)

    async def arelease(self) -> None:
        await sync_to_async(self.release)()

    async def aatomic(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the synchronous `func` inside `atomic()` on the slot thread; return its result.

        The async counterpart of `with lease.atomic():` — Django's transactions are
        synchronous, so the writes that must commit with the completion go in one function:
        `await lease.aatomic(Payment.objects.filter(pk=pk).update, status="captured")`.
        """
        return await sync_to_async(self.run_atomic)(func, *args, **kwargs)

    async def astep(self, name: str, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the synchronous `fn` as the step `name` on the slot thread (see `step()`)."""
        return await sync_to_async(self.step)(name, fn, *args, **kwargs)

    def _end(self, write: Callable[[], R]) -> R:
        """Make `write`, the attempt's outcome (`ending` meanwhile), as `_guard()` does."""
        self.ending = True
        return self._guard(write)

    def _guard(self, write: Callable[[], R]) -> R:
        try:
            return write()
        except LeaseLost as exc:
            self.mark_lost(str(exc), cancelled=isinstance(exc, Cancelled))
            raise


def step_key(job: AbstractLeasedJob, name: str) -> str:
    """Return the idempotency key of the step `name` of `job` for a payment provider, e.g.
    "django_leases.paymentjob:42:capture": the same on every attempt, so that the provider
    answers a repeated call with its first answer. A reconcile hook asks the provider by it."""
    return f"{job._meta.label_lower}:{job.pk}:{name}"
