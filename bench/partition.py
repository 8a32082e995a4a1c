"""How fast a worker behind a silent network partition gives up its lease, and recovers.

Per sample, on a throw-away database (PostgreSQL and MariaDB/MySQL): one `bench_sleep` job is
enqueued (its handler sleeps an hour) and a worker ("cut", `--concurrency 2`, network timeouts
left at NETWORK_TIMEOUT = "auto") reaches the database through a TCP proxy on 127.0.0.1
(tests/proxy.py). Once it has claimed the job, and a random 0 to HEARTBEAT seconds later (so the
partition falls anywhere between two heartbeats), the proxy turns into a black hole: it keeps
every socket open and drops every byte, no reset. The parent reads the worker's log every 2 ms.

Reported:
- "cut->lost logged": seconds from the black hole to the worker's "lease lost" line;
- "margin before expiry": the database's `lease_until - now()` at that moment, i.e. how long
  before anyone else could take the job over the worker had already given it up (positive is
  right; the TTL is the upper bound, less the time since the last heartbeat);
- "restore->completed": a `noop` job is enqueued during the partition (directly, not through
  the proxy); after HOLD x TTL seconds of partition the path is restored and this is the time
  (database clock) from the restore to that job's completion by the same worker process.

Leases of --ttl seconds (default 6) renewed every --heartbeat seconds (default a third of it).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from bench import _common as common
from django_leases.network import auto_timeout
from tests.proxy import Proxy

HOUR = 3600.0
LOST = "lease lost job_id="
# Seconds until the lease runs out in the database, per vendor (the job's one row).
MARGIN_SQL = {
    "postgresql": "SELECT EXTRACT(EPOCH FROM lease_until - now()) FROM {table}",
    "mysql": "SELECT TIMESTAMPDIFF(MICROSECOND, NOW(6), lease_until) / 1e6 FROM {table}",
}
NOW_SQL = {"postgresql": "SELECT now()", "mysql": "SELECT NOW(6)"}


# ---- Django side -------------------------------------------------------------------------------


def fresh_job(seconds: float) -> dict[str, Any]:
    """Empty the job, ledger and worker tables; enqueue one `bench_sleep` job."""
    from django_leases.models import PaymentJob

    common.empty_tables(common.JOB_TABLE, common.LEDGER_TABLE, common.WORKER_TABLE)
    return {"id": PaymentJob.objects.enqueue("bench_sleep", {"seconds": seconds}).pk}


def enqueue_noop() -> dict[str, Any]:
    from django_leases.models import PaymentJob

    return {"id": PaymentJob.objects.enqueue("noop").pk}


# ---- orchestration ---------------------------------------------------------------------------


@dataclass
class Sample:
    detected: float
    margin: float
    recovered: float


def through(url: str, port: int) -> str:
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def sample(args: argparse.Namespace, procs: common.Processes, db: common.BenchDB, n: int) -> Sample:
    job = procs.call(db, "bench.partition:fresh_job", seconds=HOUR)["id"]
    port = urlsplit(db.url).port or (5432 if db.vendor == "postgresql" else 3306)
    conn = db.connect()
    with Proxy(port) as proxy:
        argv = common.django_command(
            "run_lease_worker",
            "--kind", "bench_sleep", "noop",
            "--concurrency=2",
            f"--poll-interval={args.poll_interval:g}",
            f"--worker-id=bench-cut-{n}",
            f"--ttl={args.ttl:g}",
            f"--heartbeat={args.heartbeat:g}",
        )  # fmt: skip
        env = {**common.child_env(db), "DATABASE_URL": through(db.url, proxy.port)}
        cut = procs.spawn(argv, env, "cut", pipes=False)
        log = Path(cut.log_path)  # type: ignore[attr-defined]
        try:
            common.wait_for_claim(
                db, conn, job, timeout=args.timeout, what="claim through the proxy", watch=[cut]
            )
            time.sleep(random.uniform(0, args.heartbeat))  # noqa: S311
            proxy.blackhole()
            cut_at = time.monotonic()
            while LOST not in log.read_text():
                if time.monotonic() - cut_at > args.ttl + args.timeout or cut.poll() is not None:
                    raise common.ChildError("no 'lease lost' line", cut)
                time.sleep(0.002)
            detected = time.monotonic() - cut_at
            (margin,) = db.row(conn, MARGIN_SQL[db.vendor].format(table=common.JOB_TABLE))
            noop = procs.call(db, "bench.partition:enqueue_noop")["id"]
            time.sleep(max(0.0, cut_at + args.hold * args.ttl - time.monotonic()))
            proxy.restore()
            (restored_at,) = db.row(conn, NOW_SQL[db.vendor])
            (completed_at,) = common.poll_until(
                db,
                conn,
                f"SELECT (SELECT ended_at FROM {common.LEDGER_TABLE} "
                f"WHERE job_ref = {noop} AND outcome = 'completed')",
                timeout=args.timeout,
                what="completion of the job enqueued during the partition",
                watch=[cut],
            )
        finally:
            conn.close()
            procs.stop(cut)
    return Sample(detected, float(margin), (completed_at - restored_at).total_seconds())


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}

    def measure(db: common.BenchDB) -> list[tuple[str, list[Sample]]]:
        common.note(f"migrating {db.name} ...")
        procs.call(db, "bench._common:migrate")
        samples = []
        for n in range(args.samples):
            s = sample(args, procs, db, n)
            samples.append(s)
            common.note(
                f"{db.vendor} sample {n + 1}/{args.samples}: lease lost logged "
                f"{s.detected:.2f}s after the cut, {s.margin:.2f}s before expiry; recovered "
                f"{s.recovered:.2f}s after the restore"
            )
        return [(db.vendor, samples)]

    results = common.each_database(args, "partition", measure, skipped)
    rows = [
        [
            vendor,
            f"{args.ttl:g}",
            f"{args.heartbeat:g}",
            f"{auto_timeout(args.ttl):g}",
            len(samples),
            common.median_range([s.detected for s in samples]),
            common.median_range([s.margin for s in samples]),
            common.median_range([s.recovered for s in samples]),
        ]
        for vendor, samples in results
    ]
    common.print_table(
        f"silent partition (black hole) of one worker; partition held {args.hold:g} x TTL; "
        f"--poll-interval {args.poll_interval:g}s",
        [
            "database",
            "TTL s",
            "heartbeat s",
            "network timeout s",
            "samples",
            "cut->lost logged s",
            "margin before expiry s",
            "restore->completed s",
        ],
        rows,
    )
    print("\nmedian (min-max) over the samples.")
    common.print_skipped(skipped)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--heartbeat",
        type=common.positive_float,
        default=None,
        help="the worker's --heartbeat, seconds (default: a third of --ttl)",
    )
    parser.add_argument(
        "--samples", type=common.positive_int, default=3, help="per database (default: %(default)r)"
    )
    parser.add_argument(
        "--hold",
        type=common.positive_float,
        default=1.5,
        help="length of the partition, in TTLs (default: %(default)r)",
    )
    parser.add_argument(
        "--poll-interval",
        type=common.positive_float,
        default=1.0,
        help="the worker's --poll-interval, seconds (default: %(default)r)",
    )
    common.add_common_arguments(parser, databases="postgresql,mysql", timeout=60.0)
    parser.set_defaults(ttl=6.0)
    args = parser.parse_args(argv)
    args.heartbeat = args.heartbeat or args.ttl / 3
    if args.heartbeat >= args.ttl:
        parser.error("--heartbeat must be shorter than --ttl")
    if "sqlite" in args.databases:
        parser.error("--databases: SQLite has no network to partition")
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
