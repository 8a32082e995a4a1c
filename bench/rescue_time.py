"""How long the job of a SIGKILLed worker takes to run again elsewhere.

Per sample, on a throw-away PostgreSQL database: one `bench_sleep` job is enqueued (its handler
sleeps an hour on attempt 1 and returns at once on later ones) and a first worker claims it.
Then a second worker and, in the cases that have one, `watch_stuck_jobs --interval I` start;
once the second worker is registered and a random 0 to HEARTBEAT seconds have passed (so the
kill falls anywhere between two heartbeats), the first worker's process group gets SIGKILL and
the parent reads `SELECT now()` at once. Nothing tells anyone about the kill: the lease has to
expire (TTL after the last heartbeat), then either the second worker's claim takes the expired
lease over or the watcher returns the job to pending and the second worker claims it.

Reported from the kill (database clock): to the `claimed_at` of the job's next attempt in the
ledger ("reclaimed") and to that attempt's `ended_at` ("completed"), and who ended attempt 1
(the watcher, or the taking-over worker).

Each --case is TTL/HEARTBEAT/WATCH_INTERVAL/SAMPLES, WATCH_INTERVAL "-" for no watcher.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import _common as common

HOUR = 3600.0


@dataclass(frozen=True)
class Case:
    ttl: float
    heartbeat: float
    watch_interval: float | None
    samples: int

    def label(self) -> str:
        watch = f"{self.watch_interval:g}" if self.watch_interval else "-"
        return f"{self.ttl:g}/{self.heartbeat:g}/{watch}/{self.samples}"


def case(text: str) -> Case:
    try:
        ttl, heartbeat, watch, samples = text.split("/")
        result = Case(
            float(ttl), float(heartbeat), None if watch == "-" else float(watch), int(samples)
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TTL/HEARTBEAT/WATCH_INTERVAL/SAMPLES (e.g. 2/0.5/-/5), got {text!r}"
        ) from None
    if not 0 < result.heartbeat < result.ttl or result.samples < 1:
        raise argparse.ArgumentTypeError(f"need 0 < HEARTBEAT < TTL and SAMPLES >= 1: {text!r}")
    return result


DEFAULT_CASES = [case(text) for text in ("60/20/-/1", "60/20/30/1", "2/0.5/-/5", "2/0.5/1/5")]


# ---- Django side -------------------------------------------------------------------------------


def fresh_job(seconds: float) -> dict[str, Any]:
    """Empty the job, ledger and worker tables; enqueue one `bench_sleep` job."""
    from django_leases.models import PaymentJob

    common.empty_tables(common.JOB_TABLE, common.LEDGER_TABLE, common.WORKER_TABLE)
    return {"id": PaymentJob.objects.enqueue("bench_sleep", {"seconds": seconds}).pk}


# ---- orchestration ---------------------------------------------------------------------------


@dataclass
class Sample:
    reclaimed: float
    completed: float
    by_watcher: bool


def sample(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB, case: Case, n: int
) -> Sample:
    env = common.child_env(db)
    job = procs.call(db, "bench.rescue_time:fresh_job", seconds=HOUR)["id"]
    lease = (f"--ttl={case.ttl:g}", f"--heartbeat={case.heartbeat:g}")

    def worker(name: str) -> Any:
        argv = common.django_command(
            "run_lease_worker",
            "--kind=bench_sleep",
            "--concurrency=1",
            f"--poll-interval={args.poll_interval:g}",
            f"--worker-id=bench-{name}-{n}",
            *lease,
        )
        return procs.spawn(argv, env, name, pipes=False)

    def ledger(*columns: str, attempt: int) -> str:
        """SQL of one row: `columns` of the job's ledger row of `attempt`, NULLs until it exists."""
        table = common.LEDGER_TABLE
        where = f"job_ref = {job} AND attempt = {attempt}"
        return "SELECT " + ", ".join(f"(SELECT {c} FROM {table} WHERE {where})" for c in columns)

    conn = db.connect()
    started = []
    try:
        victim = worker("victim")
        started.append(victim)
        common.poll_until(
            db,
            conn,
            ledger("claimed_at", attempt=1),
            timeout=args.timeout,
            what="claim by the first worker",
            watch=[victim],
        )
        if case.watch_interval:
            argv = common.django_command("watch_stuck_jobs", f"--interval={case.watch_interval:g}")
            started.append(procs.spawn(argv, env, "watcher", pipes=False))
        rescuer = worker("rescuer")
        started.append(rescuer)
        common.poll_until(
            db,
            conn,
            f"SELECT (SELECT max(id) FROM {common.WORKER_TABLE} "
            f"WHERE worker_id = 'bench-rescuer-{n}')",
            timeout=args.timeout,
            what="registration of the second worker",
            watch=started[1:],
        )
        time.sleep(random.uniform(0, case.heartbeat))  # noqa: S311
        os.killpg(victim.pid, signal.SIGKILL)
        (killed_at,) = db.row(conn, "SELECT now()")
        procs.stop(victim)
        completed_at, reclaimed_at = common.poll_until(
            db,
            conn,
            ledger("ended_at", "claimed_at", attempt=2),
            timeout=case.ttl + (case.watch_interval or 0) * 2 + args.timeout,
            what="completion of attempt 2",
            watch=started[1:],
        )
        (ended_by,) = db.row(conn, ledger("ended_by", attempt=1))
    finally:
        conn.close()
        for proc in started:
            procs.stop(proc)
    return Sample(
        reclaimed=(reclaimed_at - killed_at).total_seconds(),
        completed=(completed_at - killed_at).total_seconds(),
        by_watcher=ended_by.startswith("watcher:"),
    )


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    reason = common.check_server("postgresql", args.pg_url)
    if reason:
        raise SystemExit(f"PostgreSQL is needed for this benchmark: {reason}")
    results: list[tuple[Case, list[Sample]]] = []
    with common.temp_database("postgresql", args.pg_url, "rescue") as db:
        common.note(f"migrating {db.name} ...")
        procs.call(db, "bench._common:migrate")
        for c in args.cases:
            samples = []
            for n in range(c.samples):
                samples.append(sample(args, procs, db, c, len(results) * 100 + n))
                s = samples[-1]
                common.note(
                    f"case {c.label()} sample {n + 1}/{c.samples}: reclaimed after "
                    f"{s.reclaimed:.2f}s, completed after {s.completed:.2f}s"
                )
            results.append((c, samples))
    rows = []
    for c, samples in results:
        reclaimed = [s.reclaimed for s in samples]
        completed = [s.completed for s in samples]
        rows.append(
            [
                f"{c.ttl:g}",
                f"{c.heartbeat:g}",
                f"{c.watch_interval:g}" if c.watch_interval else "none",
                len(samples),
                common.median_range(reclaimed),
                common.median_range(completed),
                f"{sum(s.by_watcher for s in samples)}/{len(samples)}",
            ]
        )
    common.print_table(
        f"seconds from SIGKILL of the holder to the job running again (database clock); "
        f"workers' --poll-interval {args.poll_interval:g}s",
        [
            "TTL s",
            "heartbeat s",
            "watcher interval s",
            "samples",
            "kill->reclaimed s",
            "kill->completed s",
            "rescued by watcher",
        ],
        rows,
    )
    print(
        "\nmedian (min-max) over the samples. 'rescued by watcher': samples where the watcher "
        "returned the job to pending, the others were taken over by the second worker's claim."
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_case_argument(parser, case, "TTL/HEARTBEAT/WATCH_INTERVAL/SAMPLES", DEFAULT_CASES)
    parser.add_argument(
        "--poll-interval",
        type=common.positive_float,
        default=1.0,
        help="both workers' --poll-interval, seconds (default: %(default)r)",
    )
    parser.add_argument(
        "--timeout",
        type=common.positive_float,
        default=60.0,
        help="seconds each wait may take beyond the TTL and two watcher intervals "
        "(default: %(default)r)",
    )
    parser.add_argument(
        "--pg-url",
        default=common.DEFAULT_URLS["postgresql"],
        help="PostgreSQL "
        "server for the throw-away database; env BENCH_PG_URL (default: %(default)s)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the child processes' logs")
    args = parser.parse_args(argv)
    args.cases = args.cases or DEFAULT_CASES
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
