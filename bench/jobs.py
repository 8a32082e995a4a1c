"""The django-leases handlers of the benchmarks (discovered by `run_lease_worker`)."""

import asyncio
import time
from typing import Any

from django_leases import Cancelled, job_handler


@job_handler("noop")
def noop(job: Any, lease: Any) -> None:
    """Do nothing: the benchmarks measure the queue, not the work."""


@job_handler("bench_sleep")
def bench_sleep(job: Any, lease: Any) -> None:
    """Sleep `payload["seconds"]` on the first attempt, return at once on any later one: the
    first holder is killed while it sleeps (rescue_time.py), the rescuer finishes quickly."""
    if lease.attempt == 1:
        time.sleep(job.payload["seconds"])


@job_handler("io_sync")
def io_sync(job: Any, lease: Any) -> None:
    """Wait on I/O for `payload["seconds"]` (a PSP or webhook call), blocking the slot thread."""
    time.sleep(job.payload["seconds"])


@job_handler("io_async")
async def io_async(job: Any, lease: Any) -> None:
    """The same wait, awaited (an async HTTP client)."""
    await asyncio.sleep(job.payload["seconds"])


@job_handler("noop_async")
async def noop_async(job: Any, lease: Any) -> None:
    """Do nothing, as a coroutine: what running a handler on an event loop costs."""


@job_handler("noop_batch", ack="batch")
def noop_batch(job: Any, lease: Any) -> None:
    """Do nothing, with batched acknowledgements: what one statement per batch of completions
    saves against one per job (compare with `noop`)."""


@job_handler("bench_record_batch", ack="batch")
def bench_record_batch(job: Any, lease: Any) -> None:
    """Record this execution at once (a side effect outside the job's transaction, like a PSP
    call), then wait `payload["seconds"]`; batched acknowledgements (batch_kills.py counts the
    executions of each job while it SIGKILLs the workers)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO bench_execution (job_id, token, owner) VALUES (%s, %s, %s)",
            [job.pk, lease.token, lease.owner],
        )
    time.sleep(job.payload.get("seconds", 0))


def _learned(path: str) -> None:
    """Note when this holder learned of the cancel (wall clock: one host, cancel_latency.py)."""
    with open(path, "w") as out:
        out.write(repr(time.time()))


@job_handler("bench_cancel_sync")
def bench_cancel_sync(job: Any, lease: Any) -> None:
    """Loop on `lease.check()` every 10 ms until it raises `Cancelled`."""
    try:
        while True:
            lease.check()
            time.sleep(0.01)
    except Cancelled:
        _learned(job.payload["path"])
        raise


@job_handler("bench_cancel_async")
async def bench_cancel_async(job: Any, lease: Any) -> None:
    """Await for an hour; the worker cancels the coroutine when the job is cancelled."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        _learned(job.payload["path"])
        raise
