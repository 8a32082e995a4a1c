"""Aggregate throughput of one queue split across two databases against the same queue on one.

On throw-away PostgreSQL databases (`--pg-url`, or BENCH_PG_URL for the server): per round,
case "one" seeds 2 × --jobs `noop` jobs in one database and drains them with --workers
`run_lease_worker --burst` processes; case "two" seeds --jobs in each of two databases and
drains each with half the workers (each worker's DATABASE_URL is its database, as a worker
started with `--database ALIAS` reaches its alias). Rounds alternate the cases. Reported per
case: jobs/s from spawning the workers to the last exit (start-up included, what a `--burst`
user sees), median of the rounds, and the ratio two / one.

Both databases live on one server here, and the workers share the machine's cores: the split
pays where the database server is the bottleneck (its CPU, WAL, or the claim index's hot
pages). Where the workers' CPU is, as on a 2-core laptop, expect about 1×; the figure says how
much the split costs when it cannot help.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench import _common as common


def fresh(count: int) -> dict[str, Any]:
    """Empty the job and ledger tables; seed `count` pending `noop` jobs."""
    common.empty_tables(common.JOB_TABLE, common.LEDGER_TABLE)
    common.seed_pending(count)
    return {}


def drain(args: argparse.Namespace, procs: common.Processes, dbs: list[common.BenchDB]) -> float:
    """Seed each of `dbs`, drain them with the workers split evenly; return jobs/s (wall)."""
    per_db = args.jobs * 2 // len(dbs)
    for db in dbs:
        procs.call(db, "bench.split:fresh", count=per_db)
    argv = common.django_command(
        "run_lease_worker",
        "--kind=noop",
        "--burst",
        f"--concurrency={args.concurrency}",
        "-v",
        "0",
    )
    started = time.monotonic()
    workers = [
        procs.spawn(argv, common.child_env(dbs[n % len(dbs)]), f"worker-{n}", pipes=False)
        for n in range(args.workers)
    ]
    for proc in workers:
        proc.wait(timeout=args.timeout)
    wall = time.monotonic() - started
    for proc in workers:
        if proc.returncode:
            raise common.ChildError("a worker failed", proc)
        procs.stop(proc)
    return per_db * len(dbs) / wall


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    reason = common.check_server("postgresql", args.pg_url)
    if reason:
        raise SystemExit(f"PostgreSQL is needed for this benchmark: {reason}")
    rates: dict[str, list[float]] = {"one": [], "two": []}
    with (
        common.temp_database("postgresql", args.pg_url, "split_a") as first,
        common.temp_database("postgresql", args.pg_url, "split_b") as second,
    ):
        for db in (first, second):
            procs.call(db, "bench._common:migrate")
        for n in range(args.rounds):
            order = ("one", "two") if n % 2 == 0 else ("two", "one")
            for case in order:
                rate = drain(args, procs, [first] if case == "one" else [first, second])
                rates[case].append(rate)
                common.note(f"round {n + 1}/{args.rounds} {case}: {rate:.0f} jobs/s")
    one, two = (statistics.median(rates[c]) for c in ("one", "two"))
    rows: list[list[Any]] = [
        ["one database", f"{one:.0f}", common.spread(rates["one"]), "1.00x"],
        ["two databases", f"{two:.0f}", common.spread(rates["two"]), f"{two / one:.2f}x"],
    ]
    common.print_table(
        f"{args.jobs * 2} noop jobs, {args.workers} workers x --concurrency {args.concurrency}, "
        f"{args.rounds} rounds, medians; jobs/s from spawning the workers to the last exit",
        ["queue", "jobs/s", "spread", "vs one"],
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_common_arguments(parser, databases=None, timeout=600.0)
    parser.add_argument("--jobs", type=common.positive_int, default=5000, help="per database")
    parser.add_argument("--workers", type=common.positive_int, default=4)
    parser.add_argument("--concurrency", type=common.positive_int, default=4)
    parser.add_argument("--rounds", type=common.positive_int, default=3)
    args = parser.parse_args(argv)
    if args.workers % 2:
        parser.error("--workers must be even: the two-database case splits them")
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
