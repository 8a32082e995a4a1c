"""pgqueuer in throughput.py: a worker with a no-op entrypoint, and the enqueue.

pgqueuer needs no Django. A worker is `python -m bench.pgq BATCH_SIZE`: pgqueuer's own `run()`,
what `pgq run bench.pgq:create_pgqueuer --batch-size BATCH_SIZE --mode drain` does (that CLI
command fails in pgqueuer 1.6 while setting its log level up), on one psycopg connection (the
driver django-leases uses too) to DATABASE_URL.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

ENTRYPOINT = "noop"
ENQUEUE_CHUNK = 5000


def _dsn() -> str:
    return os.environ["DATABASE_URL"]


@asynccontextmanager
async def create_pgqueuer() -> AsyncIterator[Any]:
    """Yield a PgQueuer with the no-op entrypoint on its own connection (autocommit, as its
    driver requires)."""
    import psycopg
    from pgqueuer import Job, PgQueuer

    async with await psycopg.AsyncConnection.connect(_dsn(), autocommit=True) as connection:
        pgq = PgQueuer.from_psycopg_connection(connection)

        @pgq.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            """Do nothing."""

        yield pgq


def work(batch_size: int) -> None:
    """Run one worker until the queue is empty and its jobs are done (drain mode), fetching
    `batch_size` jobs at a time and logging their completions in batches of that size."""
    from pgqueuer import run
    from pgqueuer.types import QueueExecutionMode

    asyncio.run(run(create_pgqueuer, batch_size=batch_size, mode=QueueExecutionMode.drain))


def enqueue(jobs: int) -> None:
    """Enqueue `jobs` no-op jobs with pgqueuer's batch API (one INSERT per chunk)."""
    asyncio.run(_enqueue(jobs))


async def _enqueue(jobs: int) -> None:
    import psycopg
    from pgqueuer import PsycopgDriver, Queries

    async with await psycopg.AsyncConnection.connect(_dsn(), autocommit=True) as connection:
        queries = Queries(PsycopgDriver(connection))
        for first in range(0, jobs, ENQUEUE_CHUNK):
            count = min(ENQUEUE_CHUNK, jobs - first)
            await queries.enqueue([ENTRYPOINT] * count, [None] * count, [0] * count)


if __name__ == "__main__":
    work(int(sys.argv[1]))
