"""Enqueue rate: `enqueue()` against `objects.create()` of the same row, `enqueue_many()` against
`bulk_create()` of the same rows, with and without idempotency keys, and pgqueuer's batch enqueue.

For each reachable database (PostgreSQL, SQLite, MariaDB/MySQL) one child process runs every
variant `--rounds` times, interleaved (each round rotates the order), on an emptied table:
`--rows` jobs in one transaction (the one-by-one variants) or one call (the batch variants),
commit included; a batch variant's input (payloads, keys, unsaved instances) is built before
the clock starts. It prints each variant's median jobs/s, its spread and the statements it
sent per job (counted in a separate short run), then the ratios of the medians of the
per-round ratios: enqueue() / create(), enqueue_many() / bulk_create(), enqueue_many() /
pgqueuer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import _common as common

VARIANTS = (
    "create",
    "enqueue",
    "create+key",
    "enqueue+key",
    "bulk_create",
    "enqueue_many",
    "bulk_create+keys",
    "enqueue_many+keys",
    "pgqueuer",
)
RATIOS = (
    ("enqueue / create", "enqueue", "create"),
    ("enqueue+key / create+key", "enqueue+key", "create+key"),
    ("enqueue_many / bulk_create", "enqueue_many", "bulk_create"),
    ("enqueue_many+keys / bulk_create+keys", "enqueue_many+keys", "bulk_create+keys"),
    ("enqueue_many / pgqueuer", "enqueue_many", "pgqueuer"),
)


def _variants(vendor: str) -> dict[str, Callable[[int], Callable[[], None]]]:
    """Each variant: a function that builds the input of `n` no-op jobs (`n` payloads
    {"n": i}), untimed, and returns the timed call that enqueues them, commit included."""
    from importlib.util import find_spec

    from django.db import transaction

    from django_leases.models import PaymentJob

    jobs = PaymentJob.objects

    def one_by_one(add: Callable[[int], Any]) -> Callable[[int], Callable[[], None]]:
        def run(n: int) -> None:
            with transaction.atomic():
                for i in range(n):
                    add(i)

        return lambda n: lambda: run(n)

    def bulk(n: int, keys: bool) -> Callable[[], None]:
        rows = [
            PaymentJob(kind="noop", payload={"n": i}, idempotency_key=f"k{i}" if keys else None)
            for i in range(n)
        ]

        def run() -> None:
            with transaction.atomic():
                jobs.bulk_create(rows)

        return run

    def many(n: int, keys: bool) -> Callable[[], None]:
        payloads = [{"n": i} for i in range(n)]
        idempotency_keys = [f"k{i}" for i in range(n)] if keys else None

        def run() -> None:
            with transaction.atomic():
                jobs.enqueue_many("noop", payloads, idempotency_keys=idempotency_keys)

        return run

    variants = {
        "create": one_by_one(lambda i: jobs.create(kind="noop", payload={"n": i})),
        "enqueue": one_by_one(lambda i: jobs.enqueue("noop", {"n": i})),
        "create+key": one_by_one(
            lambda i: jobs.create(kind="noop", payload={"n": i}, idempotency_key=f"k{i}")
        ),
        "enqueue+key": one_by_one(
            lambda i: jobs.enqueue("noop", {"n": i}, idempotency_key=f"k{i}")
        ),
        "bulk_create": lambda n: bulk(n, False),
        "enqueue_many": lambda n: many(n, False),
        "bulk_create+keys": lambda n: bulk(n, True),
        "enqueue_many+keys": lambda n: many(n, True),
    }
    if vendor == "postgresql" and find_spec("pgqueuer"):
        variants["pgqueuer"] = _pgqueuer_enqueue
    return variants


def _pgqueuer_enqueue(n: int) -> Callable[[], None]:
    """pgqueuer's batch enqueue of `n` jobs: one `Queries.enqueue` call (one INSERT)."""
    import asyncio

    payloads: list[bytes | None] = [b'{"n": %d}' % i for i in range(n)]
    entrypoints, priorities = ["noop"] * n, [0] * n
    return lambda: asyncio.run(_pgqueuer_batch(entrypoints, payloads, priorities))


async def _pgqueuer_batch(
    entrypoints: list[str], payloads: list[bytes | None], priorities: list[int]
) -> None:
    import os

    import psycopg
    from pgqueuer import PsycopgDriver, Queries

    dsn = os.environ["DATABASE_URL"]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as connection:
        queries = Queries(PsycopgDriver(connection))
        start = time.perf_counter()
        await queries.enqueue(entrypoints, payloads, priorities)
        _PGQ_SECONDS.append(time.perf_counter() - start)


_PGQ_SECONDS: list[float] = []
"""pgqueuer's own timing of its INSERT (autocommit: its commit included), without the event
loop and connection set-up."""


def _empty() -> None:
    from django.db import connection

    tables = [common.LEDGER_TABLE, common.JOB_TABLE]
    if "pgqueuer" in connection.introspection.table_names():
        tables.append("pgqueuer")
    common.empty_tables(*tables)


def _statements(variant: Callable[[int], Callable[[], None]], rows: int) -> float:
    """Statements `variant` sends per job, the commit included."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _empty()
    run = variant(rows)
    with CaptureQueriesContext(connection) as queries:
        run()
    return len(queries.captured_queries) / rows


def measure(rows: int, rounds: int) -> dict[str, Any]:
    """Time every variant `rounds` times, interleaved; return jobs/s and statements per job."""
    from django.db import connection

    common.migrate()
    variants = _variants(connection.vendor)
    names = [name for name in VARIANTS if name in variants]
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        _empty()
        variants[name](min(rows, 50))()
    statements = {name: _statements(variants[name], 20) for name in names if name != "pgqueuer"}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            _empty()
            _PGQ_SECONDS.clear()
            run = variants[name](rows)
            start = time.perf_counter()
            run()
            seconds = _PGQ_SECONDS[0] if _PGQ_SECONDS else time.perf_counter() - start
            rates[name].append(rows / seconds)
    return {"vendor": connection.vendor, "rates": rates, "statements": statements}


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}

    def on(db: common.BenchDB) -> list[dict[str, Any]]:
        if db.vendor == "postgresql":
            _install_pgqueuer(db, procs, skipped)
        common.note(f"{db.vendor}: {args.rounds} rounds of {args.rows} jobs ...")
        return [
            procs.call(
                db,
                "bench.enqueue:measure",
                timeout=args.timeout,
                rows=args.rows,
                rounds=args.rounds,
            )
        ]

    results = common.each_database(args, "enqueue", on, skipped)
    rows, ratios = [], []
    for result in results:
        rates, statements = result["rates"], result["statements"]
        for name, values in rates.items():
            rows.append(
                [
                    result["vendor"],
                    name,
                    f"{statistics.median(values):.0f}",
                    common.spread(values),
                    f"{min(values):.0f}-{max(values):.0f}",
                    f"{statements[name]:.2f}" if name in statements else "-",
                ]
            )
        for label, top, bottom in RATIOS:
            if top in rates and bottom in rates:
                per_round = [a / b for a, b in zip(rates[top], rates[bottom], strict=True)]
                ratios.append([result["vendor"], label, common.median_range(per_round)])
    title = f"enqueue rate, {args.rows} jobs per transaction or call, {args.rounds} rounds"
    headers = ["database", "variant", "jobs/s", "spread", "min-max", "statements/job"]
    common.print_table(f"{title} (commit {common.commit()})", headers, rows)
    common.print_table(
        "ratios (median of the per-round ratios, min-max)", ["database", "ratio", "x"], ratios
    )
    common.print_skipped(skipped)


def _install_pgqueuer(db: common.BenchDB, procs: common.Processes, skipped: dict[str, str]) -> None:
    from importlib.util import find_spec

    if not find_spec("pgqueuer"):
        skipped["pgqueuer"] = "not installed (see Setup)"
        return
    install = [sys.executable, "-m", "pgqueuer", f"--pg-dsn={db.url}", "install"]
    procs.run(install, common.child_env(db), "pgqueuer-install")


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--rows",
        type=common.positive_int,
        default=2000,
        help="jobs per transaction or call (default: %(default)r)",
    )
    parser.add_argument(
        "--rounds", type=common.positive_int, default=5, help="rounds (default: %(default)r)"
    )
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=1800)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
