"""Cost per job of the server-side statement timeout of `NETWORK_TIMEOUT` (PostgreSQL).

One process, one hardened connection (as a worker slot's), claims a job and completes it, job
after job, in three set-ups side by side:

- `none`: `NETWORK_TIMEOUT = None`, no statement timeout at all (nor keepalives, nor watchdog);
- `startup`: the statement timeout as the `options` startup parameter of the connection, the
  mechanism before 0.2 (a connection `OPTIONS` that sets one; PgBouncer refuses it);
- `set local`: today's default, `SET LOCAL statement_timeout` in front of the first statement
  of each transaction, in the same round trip.

Each round runs the three in a new process each, in a rotated order, on a table emptied and
seeded again; the median per job over the rounds is reported (wall time of the loop, and the
process's CPU time, i.e. the client side), with each set-up's ratio to `none` and to
`startup`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench import _common as common

VARIANTS = ("none", "startup", "set local")
HEADERS = ["set-up", "µs/job (wall)", "spread", "µs/job (client CPU)", "vs none", "vs startup"]


def drain(variant: str, jobs: int, ttl: float, warmup: int) -> dict[str, Any]:
    """Claim and complete `jobs` jobs one by one on a connection hardened as `variant` says;
    return the loop's wall and CPU seconds per job."""
    from django.conf import settings
    from django.db import connection
    from django.test import override_settings

    from django_leases.models import PaymentJob
    from django_leases.network import harden, network_timeout

    leases = {**settings.DJANGO_LEASES, "TTL": ttl}
    if variant == "none":
        leases["NETWORK_TIMEOUT"] = None
    owner = common.owner_name("timeout")
    manager = PaymentJob.objects
    with override_settings(DJANGO_LEASES=leases):
        if variant == "startup":
            ms = round((network_timeout(ttl) or 0) * 1000)
            options = {
                **connection.settings_dict.get("OPTIONS", {}),
                "options": f"-c statement_timeout={ms}",
            }
            connection.settings_dict["OPTIONS"] = options
        connection.close()
        harden(connection, ttl)

        def one() -> None:
            (job,) = manager.claim(owner, ttl=ttl, limit=1)
            manager.complete(job.pk, owner, job.lease_token)

        for _ in range(warmup):
            one()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(jobs):
            one()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        with connection.cursor() as cursor:
            cursor.execute("SHOW statement_timeout")
            (shown,) = cursor.fetchone()
    return {"wall": wall / jobs, "cpu": cpu / jobs, "shown": shown}


def prepare(jobs: int) -> dict[str, Any]:
    """Empty the job tables and add `jobs` pending jobs."""
    common.empty_tables(common.LEDGER_TABLE, common.JOB_TABLE)
    common.seed_pending(jobs)
    common.analyze(common.JOB_TABLE, common.LEDGER_TABLE)
    return {}


def measure(
    args: argparse.Namespace, db: common.BenchDB, procs: common.Processes
) -> list[list[str]]:
    procs.call(db, "bench._common:migrate")
    results: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % 3 :] + VARIANTS[: round_ % 3]
        for variant in order:
            common.note(f"round {round_ + 1}/{args.rounds}: {variant} x {args.jobs} jobs ...")
            procs.call(db, "bench.statement_timeout:prepare", jobs=args.jobs + args.warmup)
            results[variant].append(
                procs.call(
                    db,
                    "bench.statement_timeout:drain",
                    timeout=args.timeout,
                    variant=variant,
                    jobs=args.jobs,
                    ttl=args.ttl,
                    warmup=args.warmup,
                )
            )
    wall = {v: [r["wall"] * 1e6 for r in results[v]] for v in VARIANTS}
    cpu = {v: [r["cpu"] * 1e6 for r in results[v]] for v in VARIANTS}
    median = {v: statistics.median(wall[v]) for v in VARIANTS}
    rows = []
    for variant in VARIANTS:
        shown = {r["shown"] for r in results[variant]}
        rows.append(
            [
                f"{variant} (statement_timeout {', '.join(sorted(shown))})",
                f"{median[variant]:.0f}",
                common.spread(wall[variant]),
                f"{statistics.median(cpu[variant]):.0f}",
                f"{median[variant] / median['none']:.3f}",
                f"{median[variant] / median['startup']:.3f}",
            ]
        )
    return rows


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    args.databases = ["postgresql"]
    skipped: dict[str, str] = {}
    rows = common.each_database(args, "timeout", lambda db: measure(args, db, procs), skipped)
    title = (
        f"claim(limit=1) + complete() per job, one connection, {args.jobs} jobs x "
        f"{args.rounds} rounds (commit {common.commit()})"
    )
    if args.markdown:
        common.print_markdown(HEADERS, rows)
    else:
        common.print_table(title, HEADERS, rows)
    common.print_skipped(skipped)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--jobs", type=common.positive_int, default=2000, help="timed jobs (default: %(default)r)"
    )
    parser.add_argument(
        "--warmup", type=int, default=100, help="untimed jobs first (default: %(default)r)"
    )
    parser.add_argument(
        "--rounds", type=common.positive_int, default=5, help="rounds (default: %(default)r)"
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    common.add_common_arguments(parser, databases=None, timeout=600)
    return common.run_main(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
