"""pgqueuer in throughput.py and wakeup_latency.py: a worker with a no-op entrypoint, and the
enqueue.

pgqueuer needs no Django. A worker is `python -m bench.pgq BATCH_SIZE [MODE]`: pgqueuer's own
`run()`, what `pgq run bench.pgq:create_pgqueuer --batch-size BATCH_SIZE --mode MODE` does (that
CLI command fails in pgqueuer 1.6 while setting its log level up), on one psycopg connection
(the driver django-leases uses too) to DATABASE_URL. MODE is "drain" (the default) or
"continuous".

With BENCH_PGQ_LATENCY_DIR set, the entrypoint writes one line per job to a file of its process
in that directory: the job's id and its pick minus its creation in ms (`updated - created`, both
set by the database's NOW(): at the enqueue, and at the dequeue that picks it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
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

        latency_dir = os.environ.get("BENCH_PGQ_LATENCY_DIR")
        with contextlib.ExitStack() as files:
            log = None
            if latency_dir:
                path = Path(latency_dir) / f"{os.getpid()}.txt"
                log = files.enter_context(open(path, "a", buffering=1))

            @pgq.entrypoint(ENTRYPOINT)
            async def noop(job: Job) -> None:
                """Do nothing, or note the job's wake-up latency."""
                if log is not None:
                    ms = (job.updated - job.created).total_seconds() * 1000
                    log.write(f"{job.id} {ms:.3f}\n")

            yield pgq


def work(batch_size: int, mode: str = "drain") -> None:
    """Run one worker, fetching `batch_size` jobs at a time and logging their completions in
    batches of that size: until the queue is empty and its jobs are done ("drain"), or until
    stopped ("continuous", woken by pgqueuer's NOTIFY)."""
    from pgqueuer import run
    from pgqueuer.types import QueueExecutionMode

    asyncio.run(run(create_pgqueuer, batch_size=batch_size, mode=QueueExecutionMode(mode)))


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


def stream_enqueuer(by: str) -> Callable[[], int]:
    """Return a call that enqueues one no-op job in autocommit on a connection of its own and
    returns its id: through pgqueuer's `SyncQueries.enqueue()` ("django": the library's own
    call), or ("statement") by sending the statement that call sends, with the same
    parameters, through the bare driver."""
    import psycopg
    from pgqueuer.adapters.drivers.psycopg import SyncPsycopgDriver
    from pgqueuer.adapters.persistence.query_helpers import normalize_enqueue_params
    from pgqueuer.queries import SyncQueries
    from pydantic_core import to_json

    connection = psycopg.connect(_dsn(), autocommit=True)
    queries = SyncQueries(SyncPsycopgDriver(connection))
    if by == "django":
        return lambda: queries.enqueue(ENTRYPOINT, None)[0]
    statement = queries.qbq.build_enqueue_query("raise")
    one = normalize_enqueue_params(ENTRYPOINT, None, 0, None, None, None)
    params = (one.priority, one.entrypoint, one.payload, one.execute_after, one.dedupe_key,
              [to_json(header).decode() for header in one.headers])  # fmt: skip
    return lambda: queries.driver.fetch(statement, *params)[0]["id"]


if __name__ == "__main__":
    work(int(sys.argv[1]), *sys.argv[2:])
