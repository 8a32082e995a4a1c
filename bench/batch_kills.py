"""Duplicate executions while workers of a batched-acknowledgement kind are SIGKILLed over and over.

On a throw-away database: --jobs `bench_record_batch` jobs (ack="batch": completions are
buffered and written a batch at a time). Each execution of the handler inserts a row into
`bench_execution` at once, outside the job's transaction, as a PSP call would leave a trace.
--workers `run_lease_worker` processes (--concurrency, --ttl, --heartbeat) and one
`watch_stuck_jobs` run; every --kill-every seconds one worker, chosen at random, gets SIGKILL
and a new one takes its place, until every job is completed (then the workers are stopped).

Reported: jobs, kills, executions, jobs executed more than once ("duplicates", per 1,000 jobs),
and of those how many had a first execution whose worker was killed: a job whose handler ran
but whose buffered completion died with its process runs again by design (at-least-once; the
handler's writes are fenced, its outside effects are not). A duplicate whose first holder was
NOT killed would be a broken lease; the script counts them apart ("not explained").
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time
from typing import Any

from bench import _common as common

# ---- Django side -------------------------------------------------------------------------------


def prepare(jobs: int, seconds: float) -> dict[str, Any]:
    """Empty the tables, create `bench_execution`, enqueue `jobs` jobs."""
    from django.db import connection

    from django_leases.models import PaymentJob

    common.empty_tables(common.JOB_TABLE, common.LEDGER_TABLE, common.WORKER_TABLE)
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_execution")
        cursor.execute(
            "CREATE TABLE bench_execution (job_id BIGINT NOT NULL, token BIGINT NOT NULL, "
            "owner VARCHAR(255) NOT NULL)"
        )
    PaymentJob.objects.bulk_create(
        (PaymentJob(kind="bench_record_batch", payload={"seconds": seconds}) for _ in range(jobs)),
        batch_size=2000,
    )
    return {}


def tally(killed: list[str]) -> dict[str, Any]:
    """Executions per job, and the duplicates whose first execution's worker is in `killed`."""
    from django.db import connection

    from django_leases.models import PaymentJob

    with connection.cursor() as cursor:
        cursor.execute("SELECT job_id, token, owner FROM bench_execution ORDER BY job_id, token")
        rows = cursor.fetchall()
    runs: dict[int, list[tuple[int, str]]] = {}
    for job_id, token, owner in rows:
        runs.setdefault(job_id, []).append((token, owner))
    duplicates = {job: r for job, r in runs.items() if len(r) > 1}
    gone = set(killed)
    explained = sum(1 for r in duplicates.values() if r[0][1] in gone)
    same_token = sum(1 for r in duplicates.values() if len({t for t, _ in r}) < len(r))
    return {
        "executions": len(rows),
        "jobs_run": len(runs),
        "duplicates": len(duplicates),
        "explained": explained,
        "same_token": same_token,
        "completed": PaymentJob.objects.filter(status="completed").count(),
    }


# ---- orchestration ---------------------------------------------------------------------------


def measure(args: argparse.Namespace, procs: common.Processes, db: common.BenchDB) -> list[Any]:
    """One run on `db`: the workers killed one by one until every job is completed."""
    common.note(f"{db.vendor}: migrating {db.name} ...")
    procs.call(db, "bench._common:migrate")
    procs.call(db, "bench.batch_kills:prepare", jobs=args.jobs, seconds=args.seconds)
    env = common.child_env(db)
    names = iter(range(1, 1_000_000))

    def spawn() -> tuple[str, Any]:
        name = f"bench-kills-{next(names)}"
        argv = common.django_command(
            "run_lease_worker",
            "--kind=bench_record_batch",
            f"--concurrency={args.concurrency}",
            f"--ttl={args.ttl:g}",
            f"--heartbeat={args.heartbeat:g}",
            f"--worker-id={name}",
        )
        return name, procs.spawn(argv, env, name, pipes=False)

    watcher = procs.spawn(
        common.django_command("watch_stuck_jobs", f"--interval={args.ttl / 2:g}"),
        env,
        "watcher",
        pipes=False,
    )
    workers = [spawn() for _ in range(args.workers)]
    killed: list[str] = []
    conn = db.connect()
    started = time.monotonic()
    try:
        while True:
            (done,) = db.row(
                conn, f"SELECT COUNT(*) FROM {common.JOB_TABLE} WHERE status = 'completed'"
            )
            if done >= args.jobs:
                break
            if time.monotonic() - started > args.timeout:
                raise SystemExit(f"{db.vendor}: {done} of {args.jobs} completed in {args.timeout}s")
            time.sleep(args.kill_every * random.uniform(0.5, 1.5))  # noqa: S311
            name, victim = workers.pop(random.randrange(len(workers)))  # noqa: S311
            victim.send_signal(signal.SIGKILL)
            procs.stop(victim)
            killed.append(name)
            workers.append(spawn())
    finally:
        conn.close()
        for _, proc in workers:
            procs.stop(proc)
        procs.stop(watcher)
    wall = time.monotonic() - started
    result = procs.call(db, "bench.batch_kills:tally", killed=killed)
    common.note(f"{db.vendor}: {result}")
    duplicates = result["duplicates"]
    return [
        [
            db.vendor,
            args.jobs,
            len(killed),
            f"{wall:.0f}",
            result["executions"],
            duplicates,
            f"{1000 * duplicates / args.jobs:.1f}",
            f"{duplicates / max(len(killed), 1):.1f}",
            result["explained"],
            duplicates - result["explained"],
            result["same_token"],
        ]
    ]


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    rows = common.each_database(args, "kills", lambda db: measure(args, procs, db), skipped)
    common.print_table(
        f"--workers {args.workers} --concurrency {args.concurrency} --ttl {args.ttl:g} "
        f"--heartbeat {args.heartbeat:g}, a SIGKILL every ~{args.kill_every:g}s",
        [
            "database",
            "jobs",
            "kills",
            "wall s",
            "executions",
            "duplicates",
            "per 1,000",
            "per kill",
            "first holder killed",
            "not explained",
            "repeated token",
        ],
        rows,
    )
    common.print_skipped(skipped)
    print(
        "\n'first holder killed': duplicates whose first execution ran on a killed worker (its "
        "buffered completion died with it). 'not explained' and 'repeated token' must be 0."
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_common_arguments(parser, databases="postgresql", timeout=900.0)
    parser.add_argument("--jobs", type=common.positive_int, default=3000)
    parser.add_argument("--seconds", type=float, default=0.005, help="each handler's wait")
    parser.add_argument("--workers", type=common.positive_int, default=3)
    parser.add_argument("--concurrency", type=common.positive_int, default=10)
    parser.add_argument("--heartbeat", type=common.positive_float, default=0.5)
    parser.add_argument("--kill-every", type=common.positive_float, default=1.0)
    parser.set_defaults(ttl=2.0)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
