"""One attempt of a job on a slot thread: run the handler, sync or async, then end the attempt.

Whatever the handler raises ends the attempt here (`Attempts.execute()`). A coroutine runs on
an event loop of its own (`run_handler()`). What comes of the attempt is written and counted by
`Outcomes`; a successful handler's completion, and the slot's next job, come from the worker's
`Completer`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from functools import partial
from typing import Any

from asgiref.sync import async_to_sync
from django.db import DatabaseError, connections

from django_leases import tracing
from django_leases.backoff import retry_delay
from django_leases.exceptions import (
    Cancelled,
    HandlerError,
    HandlerTimeout,
    LeaseLost,
    PermanentError,
)
from django_leases.handlers import Kind, get_handler
from django_leases.lease import Lease
from django_leases.network import keep_usable
from django_leases.querysets.pauses import FRESH_CLAIM
from django_leases.redaction import error_text
from django_leases.status import TIMED_OUT, AttemptOutcome
from django_leases.worker.completion import Completer
from django_leases.worker.outcomes import Outcomes

logger = logging.getLogger("django_leases.worker")


class Attempts:
    """Run attempts on the calling slot thread; stateless, so every slot shares one."""

    def __init__(self, outcomes: Outcomes, completer: Completer) -> None:
        self.outcomes = outcomes
        self.completer = completer
        # `run_handler()` itself, no method around it: `TracedAttempts` gives its own.
        self.run_handler: Callable[..., None] = run_handler

    def execute(self, lease: Lease) -> Lease | None:
        """Run `lease`'s attempt, end it and return the slot's next lease, claimed with the
        outcome or right after it (the completer's), if there was one to claim."""
        job = lease.job
        handler = get_handler(job.kind)
        error: BaseException | None = None
        started = time.monotonic()
        runs = True
        try:
            keep_usable()  # a worker's connections outlive CONN_MAX_AGE: not a request cycle
            # The lease's own clock, last thing before the start, whichever way the slot got
            # the job (claimed by the loop, with a completion, or ahead): a lease whose time ran
            # out (the worker paused, a claim answered late) may be another worker's by now.
            runs = not lease.lost
            if runs and self.paused(lease):
                return self.completer.next_job()
            if runs:
                started = time.monotonic()
                logger.debug("started job_id=%s attempt=%s", job.pk, lease.attempt)
                deadline = None if handler.timeout is None else started + handler.timeout
                self.run_handler(handler, job, lease, deadline=deadline)
        except BaseException as exc:  # noqa: BLE001 - whatever it raises ends this attempt
            error = exc
        outcomes = self.outcomes
        if not runs:
            # Nothing written: its ledger row stays open for the worker that takes it over.
            outcomes.fenced_out(lease, f"not started: {lease.lost_reason}", recorded=True)
            return self.completer.next_job()
        lease.ending = True
        outcomes.ran(lease, time.monotonic() - started)
        left_open = restore_connections()
        if error is None and left_open:
            error = HandlerError(left_open)
        if lease.outcome == TIMED_OUT:
            # The loop stopped this attempt at its timeout; the handler came back late, on its
            # abandoned thread: its execution ends now.
            outcomes.ended([lease], "timed out", recorded=True)
            return None
        if isinstance(error, LeaseLost):
            # Whichever write of the handler's was refused: its ledger row is noted here.
            outcomes.fenced_out(lease, str(error))
        elif isinstance(error, HandlerTimeout):
            delay = retry_delay(lease.attempt)
            # The coroutine was cancelled at its timeout: its execution ended with it.
            write = partial(lease.time_out, str(error), retry_in=delay)
            outcomes.record(lease, TIMED_OUT, write)
        elif error is not None and lease.lost:
            outcomes.fenced_out(
                lease, f"handler raised {type(error).__name__} after the lease was lost"
            )
        elif isinstance(error, PermanentError):
            write = partial(lease.fail, error, permanent=True)
            outcomes.record(lease, AttemptOutcome.FAILED, write, error)
        elif error is not None:
            write = partial(lease.fail, error, retry_in=retry_delay(lease.attempt))
            outcomes.record(lease, AttemptOutcome.RETRIED, write, error)
        elif lease.finished:  # the handler wrote the outcome itself, e.g. with lease.atomic()
            outcomes.by_handler(lease, started)
        elif lease.lost:
            outcomes.fenced_out(lease, "the lease was lost while the handler ran; result discarded")
        else:
            return self.completer.complete(lease)
        return self.completer.next_job()

    def paused(self, lease: Lease) -> bool:
        """Read, as the job starts, whether its kind is paused (a job claimed before the pause
        committed, ahead or racing it, must not start); if so give the job back unstarted. A
        job whose claim was sent less than FRESH_CLAIM seconds ago is not read: `pause_kind()`
        waits that long after its commit, so that claim's statement saw the pause. A database
        that does not answer starts nothing: the lease runs out, its ledger row left open for
        the worker that takes the job over."""
        if lease.claimed_ago() < FRESH_CLAIM:
            return False  # its claim, sent after any pause this start must see, left it out
        try:
            paused = lease.kind_paused()
        except DatabaseError as exc:
            self.outcomes.fenced_out(lease, f"not started: {error_text(exc)}", recorded=True)
            return True
        if paused:
            logger.info("kind paused kind=%s job_id=%s: not started", lease.job.kind, lease.pk)
            self.outcomes.release_unstarted(lease)
        return paused


class TracedAttempts(Attempts):
    """`Attempts` traced with OpenTelemetry (`tracing.py`): chosen once, as the worker starts,
    when `tracing.enabled()`; the untraced attempt pays nothing for it."""

    def __init__(self, outcomes: Outcomes, completer: Completer) -> None:
        super().__init__(outcomes, completer)
        self.run_handler = self._traced_handler

    def execute(self, lease: Lease) -> Lease | None:
        with tracing.attempt(lease):
            return super().execute(lease)

    def _traced_handler(self, *args: Any, **kwargs: Any) -> None:
        with tracing.handler_running():
            run_handler(*args, **kwargs)


def restore_connections() -> str:
    """Undo a transaction the handler left open on this thread's connections.

    Returns what was wrong, or "". Left as it was, the worker's own write of the outcome would
    run inside the handler's transaction, and commit or vanish with it.
    """
    problems = []
    for conn in connections.all(initialized_only=True):
        try:
            if conn.in_atomic_block:
                # An atomic block entered and never exited: the wrapper cannot leave it cleanly,
                # so close the connection and forget it; the next use reconnects.
                conn.close()
                del connections[conn.alias]
            elif conn.connection is not None and not conn.get_autocommit():
                conn.rollback()
                conn.set_autocommit(True)
            else:
                continue
        except DatabaseError:
            conn.close()
        problems.append(conn.alias)
    if not problems:
        return ""
    return (
        f"the handler returned with a transaction open on database(s) "
        f"{', '.join(problems)}; its uncommitted writes were rolled back"
    )


def run_handler(
    kind: Kind, job: Any, lease: Lease | None, *, deadline: float | None = None
) -> None:
    """Call `kind`'s handler; if it returns an awaitable, await it on an event loop of its own.

    The calling thread (a worker slot) stays the loop's "sync thread": the coroutine's
    thread-sensitive `sync_to_async` calls (Django's async ORM, `lease.acheckpoint()`, ...) run
    back on it, with its database connection and inside its transactions; the event loop runs
    on a thread of its own (asgiref's). A coroutine still running at `deadline` (monotonic
    seconds) is cancelled: `HandlerTimeout`; one whose job an operator cancels is cancelled as
    soon as the lease learns it: `Cancelled`.
    """
    result = kind.func(job, lease)
    if inspect.isawaitable(result):
        async_to_sync(_await_until)(result, deadline, kind.timeout, lease)


async def _await_until(
    awaitable: Awaitable[object],
    deadline: float | None,
    timeout: float | None,
    lease: Lease | None,
) -> None:
    """On the event loop's thread: await `awaitable` until `deadline`, or until `lease` is found
    cancelled (`Lease.on_cancel()`: the hook is set and removed on this thread, called on the
    thread that learns the cancel, and only schedules the task's cancel on this loop)."""
    limit = asyncio.timeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
    task = asyncio.ensure_future(awaitable)
    if lease is not None:
        loop = asyncio.get_running_loop()

        def cancel() -> None:
            with suppress(RuntimeError):  # the loop is closed: the handler is done anyway
                loop.call_soon_threadsafe(task.cancel)

        lease.on_cancel(cancel)
    try:
        async with limit:
            await task
    except TimeoutError:
        if not limit.expired():
            raise  # the handler's own TimeoutError (an HTTP client's, say): a failed attempt
        raise HandlerTimeout(f"the handler ran past its timeout of {timeout:g}s") from None
    except asyncio.CancelledError:
        if lease is None or not lease.cancelled:
            raise
        raise Cancelled(
            f"job {lease.pk}: {lease.lost_reason}; its coroutine was cancelled"
        ) from None
    finally:
        if lease is not None:
            lease.on_cancel(None)
