"""The django-leases handlers of the benchmarks (discovered by `run_lease_worker`)."""

import asyncio
import time
from typing import Any

from django_leases import job_handler


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
