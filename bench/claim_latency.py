"""Latency of one `PaymentJob.objects.claim()` call, alone and with concurrent claimers.

For each reachable database (PostgreSQL, SQLite, MariaDB/MySQL) and each claimer count, a fresh
table gets enough pending jobs, then every claimer process (released together) times its claim()
calls one by one: the whole call, i.e. the claiming statement, the attempt-ledger insert and the
commit. Each claimed job is completed outside the timed region, as a worker would.

`--throttles none,limit,rate,both` measures the same claims of a kind without limits and of a
kind with `limit=` and/or `rate=` (`@job_handler`), set far above what the claimers reach, so
that what is timed is the throttled claim's own cost (its gate row, its counts, its start
record), not waiting for a slot; the `vs none` column is each row's p50 over the unthrottled
row's of the same database and claimers. `ttl` is the same claim of a kind with a lease length
of its own (`@job_handler(ttl=600)`), which the claim statement sets by a CASE on the kind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench import _common as common

HEADERS = ["database", "claimers", "throttle", "claims", "p50", "p95", "p99", "max", "jobs/s",
           "empty", "vs none"]  # fmt: skip
# Far above what the claimers reach: a slot is always free, a start always allowed.
THROTTLES: dict[str, dict[str, Any]] = {
    "none": {},
    "limit": {"limit": 1_000_000},
    "rate": {"rate": (1_000_000, 1)},
    "both": {"limit": 1_000_000, "rate": (1_000_000, 1)},
    "ttl": {"ttl": 600},
}


def kind_of(throttle: str) -> str:
    return "noop" if throttle == "none" else f"noop_{throttle}"


def claimer(claims: int, warmup: int, limit: int, ttl: float, throttle: str) -> dict[str, Any]:
    """Warm up, wait for the parent's GO, then time `claims` claim() calls."""
    from bench.jobs import noop
    from django_leases import job_handler

    kind = kind_of(throttle)
    if THROTTLES[throttle]:
        job_handler(kind, **THROTTLES[throttle])(noop)
    owner = common.owner_name("claimer")
    timed = {"limit": limit, "ttl": ttl, "owner": owner, "kinds": [kind]}
    common.claim_timings(warmup, **timed)
    common.wait_for_go()
    started = time.time()
    result = common.claim_timings(claims, **timed)
    return {**result, "started": started, "ended": time.time()}


def prepare(jobs: int, kind: str = "noop") -> dict[str, Any]:
    """Empty the job tables and add `jobs` pending jobs of `kind`."""
    common.empty_tables(common.LEDGER_TABLE, common.JOB_TABLE)
    common.seed_pending(jobs, kind)
    common.analyze(common.JOB_TABLE, common.LEDGER_TABLE)
    return {"vendor": common.vendor()}


def measure(
    args: argparse.Namespace, db: common.BenchDB, procs: common.Processes
) -> list[list[str]]:
    rows = []
    procs.call(db, "bench._common:migrate")
    for claimers in args.claimers:
        unthrottled = None
        for throttle in args.throttles:
            p50 = measure_one(args, db, procs, claimers, throttle, rows)
            unthrottled = p50 if throttle == "none" else unthrottled
            rows[-1].append(f"{p50 / unthrottled:.2f}" if unthrottled else "")
    return rows


def measure_one(
    args: argparse.Namespace,
    db: common.BenchDB,
    procs: common.Processes,
    claimers: int,
    throttle: str,
    rows: list[list[str]],
) -> float:
    """Time the claims of `claimers` processes with `throttle`; add its row; return its p50."""
    # Every claim takes `limit` jobs; leave headroom so no claimer ever finds none.
    per_claimer = (args.claims + args.warmup) * args.limit
    jobs = per_claimer * claimers + 100
    procs.call(db, "bench.claim_latency:prepare", jobs=jobs, kind=kind_of(throttle))
    common.note(f"{db.vendor}: {claimers} claimer(s) x {args.claims} claims, {throttle} ...")
    children = [
        procs.start_barrier(
            db,
            "bench.claim_latency:claimer",
            claims=args.claims,
            warmup=args.warmup,
            limit=args.limit,
            ttl=args.ttl,
            throttle=throttle,
        )
        for _ in range(claimers)
    ]
    results = procs.release_barrier(children, "claimer", timeout=args.timeout)
    ms = [t for r in results for t in r["ms"]]
    window = max(r["ended"] for r in results) - min(r["started"] for r in results)
    rows.append(
        [
            db.vendor,
            str(claimers),
            throttle,
            str(len(ms)),
            *common.latency_summary(ms),
            f"{sum(r['jobs'] for r in results) / window:.0f}",
            str(sum(r["empty"] for r in results)),
        ]
    )
    return statistics.median(ms)


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    rows = common.each_database(args, "latency", lambda db: measure(args, db, procs), skipped)
    common.print_table(
        f"claim() latency in ms, limit={args.limit}, {args.claims} timed claims per claimer",
        HEADERS,
        rows,
    )
    common.print_skipped(skipped)
    print(
        "\njobs/s: jobs claimed by all claimers together over the timed window (the completes "
        "between claims are in the window, not in the latencies).\nempty: claims that "
        "returned no job although pending jobs were left (the table always holds more than "
        "are claimed): should be 0."
    )


def throttle_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = sorted(set(names) - set(THROTTLES))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown throttles {unknown}; pick from {list(THROTTLES)}"
        )
    # "none" first: the other rows' ratio is to it.
    return sorted(set(names), key=list(THROTTLES).index)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--claims",
        type=common.positive_int,
        default=500,
        help="timed claims per claimer (default: %(default)r)",
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="untimed claims per claimer first (default: 20)"
    )
    parser.add_argument(
        "--claimers",
        type=common.int_list,
        default=[1, 4],
        help="comma-separated concurrent claimer counts (default: 1,4)",
    )
    parser.add_argument(
        "--limit", type=common.positive_int, default=1, help="claim(limit=...) (default: 1)"
    )
    parser.add_argument(
        "--throttles",
        type=throttle_list,
        default=["none"],
        help="comma-separated kinds' options to compare: none, limit, rate, both, ttl "
        "(default: none)",
    )
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=600)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
