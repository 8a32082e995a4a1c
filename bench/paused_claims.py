"""What a paused kind costs a claim, and what the worker's check at each job's start costs.

For each reachable database, a fresh table gets `--backlog` due jobs of kind `noop` (the kind
paused) ahead of (higher priority than) `--others` jobs of kind `io_sync`. Each case times
`--claims` claims of one job (released again outside the timed region, so every claim meets
the same table): of the two kinds, of the paused kind alone and of every kind, with nothing
paused and with `noop` paused, and the worker's read at a job's start
(`LeaseQuerySet.kind_paused()`). With `noop` paused, a claim of the two kinds takes an
`io_sync` job from behind the paused backlog: the `vs unpaused` column is that case's p50 over
the same claim's with nothing paused (which takes a `noop` job from the front).

    python -m bench.paused_claims [--databases postgresql,sqlite,mysql] [--backlog 100000]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from bench import _common as common

HEADERS = ["database", "backlog", "claim", "paused", "p50 ms", "p95 ms", "vs unpaused"]
CLAIMS = {"two kinds": ["noop", "io_sync"], "paused kind": ["noop"], "every kind": None}


def child(backlog: int, others: int, claims: int) -> dict[str, Any]:
    """In a Django process on the benchmark's database: the timings, in milliseconds."""
    import django

    django.setup()
    from django.core.management import call_command

    from django_leases.models import PaymentJob

    call_command("migrate", verbosity=0)
    jobs = PaymentJob.objects
    rows = [PaymentJob(kind="noop", priority=1) for _ in range(backlog)]
    rows += [PaymentJob(kind="io_sync", payload={"seconds": 0}) for _ in range(others)]
    jobs.bulk_create(rows, batch_size=5000)
    results: dict[str, Any] = {}
    for paused in (False, True):
        if paused:
            jobs.pause_kind("noop", by="bench")
        for name, kinds in CLAIMS.items():
            times = []
            for _ in range(claims):
                started = time.perf_counter()
                claimed = jobs.claim("bench", ttl=60, kinds=kinds)
                times.append((time.perf_counter() - started) * 1000)
                for job in claimed:
                    jobs.release(job.pk, "bench", job.lease_token)
            results[f"{name}|{paused}"] = times
        check = []
        for _ in range(claims):
            started = time.perf_counter()
            jobs.kind_paused("noop")
            check.append((time.perf_counter() - started) * 1000)
        results[f"start check|{paused}"] = check
    return results


def measure(db: common.BenchDB, args: Any) -> list[list[str]]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.paused_claims", "--child",
         str(args.backlog), str(args.others), str(args.claims)],
        env=common.child_env(db), capture_output=True, text=True, timeout=args.timeout,
        cwd=common.ROOT, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise common.ChildError(proc.stderr[-2000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith(common.RESULT_PREFIX))
    results = json.loads(line[len(common.RESULT_PREFIX) :])
    table = []
    for case in [*CLAIMS, "start check"]:
        base = common.percentile(results[f"{case}|False"], 50)
        for paused in (False, True):
            ms = results[f"{case}|{paused}"]
            p50 = common.percentile(ms, 50)
            ratio = f"{p50 / base:.2f}x" if paused and base else ""
            p95 = common.percentile(ms, 95)
            row = [db.vendor, str(args.backlog), case, "noop" if paused else "-"]
            table.append([*row, f"{p50:.2f}", f"{p95:.2f}", ratio])
    return table


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        backlog, others, claims = (int(value) for value in sys.argv[2:5])
        results = child(backlog, others, claims)
        sys.stdout.write(common.RESULT_PREFIX + json.dumps(results) + "\n")
        return 0
    parser = common.make_parser(__doc__)
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=600.0)
    parser.add_argument("--backlog", type=common.positive_int, default=100_000)
    parser.add_argument("--others", type=common.positive_int, default=100)
    parser.add_argument("--claims", type=common.positive_int, default=200)
    args = parser.parse_args()
    skipped: dict[str, str] = {}

    def body(args: Any, procs: Any) -> None:
        rows = common.each_database(args, "paused", lambda db: measure(db, args), skipped)
        widths = [max(len(str(r[i])) for r in [HEADERS, *rows]) for i in range(len(HEADERS))]
        for row in [HEADERS, *rows]:
            sys.stdout.write(
                "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + "\n"
            )
        for vendor, why in skipped.items():
            sys.stdout.write(f"{vendor}: skipped, {why}\n")

    return common.run_main(body, args)


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    sys.exit(main())
