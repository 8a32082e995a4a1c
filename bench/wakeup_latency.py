"""Enqueue-to-start latency of an idle `run_lease_worker`: LISTEN/NOTIFY against polling.

One worker (`run_lease_worker --kind noop --concurrency 1 --poll-interval P`) runs idle on a
throw-away database. A child process then, --samples times, enqueues one job with
`PaymentJob.objects.enqueue()`, waits until it is completed and pauses a random --gap-min to
--gap-max seconds, so every job finds the worker idle. The latency of a job is measured on the
database clock: the `claimed_at` of its attempt-ledger row minus the job's `created_at`, both
set by the database. Two warm-up jobs (the worker's first claims, and on PostgreSQL the opening
of its LISTEN connection) are not counted.

PostgreSQL is measured twice: with DJANGO_LEASES["USE_NOTIFY"] on (the default: the enqueue
sends a NOTIFY that wakes the worker) and off (the worker finds the job at its next poll).
SQLite and MariaDB have no NOTIFY: polling is their only mode.

`--load RATE` measures the same latency under load instead: --workers worker processes
(--concurrency slots each) drain a steady stream of RATE jobs/s for --seconds, enqueued one at a
time in autocommit, each at its own moment of the schedule (n / RATE), by --enqueuers children
taking turns; every job of the stream is a sample. The first second of the stream (the workers'
ramp) is not counted. The claim is where the handler starts: the slot runs it as soon as the
claim returns.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import _common as common

# (database, USE_NOTIFY); NOTIFY exists on PostgreSQL only.
MODES = {"postgresql": (True, False), "sqlite": (False,), "mysql": (False,)}
WARMUP = 2


# ---- Django side -------------------------------------------------------------------------------


def enqueue_one_by_one(
    samples: int, gap_min: float, gap_max: float, job_timeout: float
) -> dict[str, Any]:
    """Enqueue WARMUP + `samples` jobs one at a time, each once the previous one is done and
    a random gap has passed; return each counted job's claimed_at - created_at in ms."""
    from django_leases.models import JobAttempt, PaymentJob

    counted = []
    for n in range(WARMUP + samples):
        job = PaymentJob.objects.enqueue("noop", {})
        deadline = time.monotonic() + job_timeout
        while not PaymentJob.objects.filter(pk=job.pk, status="completed").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job.pk} not completed within {job_timeout:.0f}s")
            time.sleep(0.01)
        if n >= WARMUP:
            counted.append(job.pk)
        time.sleep(random.uniform(gap_min, gap_max))  # noqa: S311
    created = dict(PaymentJob.objects.filter(pk__in=counted).values_list("pk", "created_at"))
    claimed = dict(
        JobAttempt.objects.filter(job_ref__in=counted, attempt=1).values_list(
            "job_ref", "claimed_at"
        )
    )
    return {"ms": [(claimed[pk] - created[pk]).total_seconds() * 1000 for pk in counted]}


def enqueuer(by: str) -> Callable[[], int]:
    """Return a call that enqueues one `noop` job in autocommit and returns its id: through
    `enqueue()` ("django"), or ("statement") by sending the very statements `enqueue()` sent
    for a first job (its INSERT and NOTIFY; every value of them is the same for each job, the
    database's clock included) through the bare driver connection, without Django's Python."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_leases.models import PaymentJob

    if by == "django":
        return lambda: PaymentJob.objects.enqueue("noop", {}).pk
    with CaptureQueriesContext(connection) as sent:
        PaymentJob.objects.enqueue("noop", {})  # a job of its own, not one of the stream
    statements = [query["sql"] for query in sent.captured_queries]
    cursor = connection.connection.cursor()

    def send() -> int:
        pk = 0
        for statement in statements:
            cursor.execute(statement)
            if statement.startswith("INSERT"):
                pk = int(cursor.fetchone()[0])
        return pk

    return send


def enqueue_stream(
    rate: float,
    seconds: float,
    job_timeout: float,
    share: int = 0,
    shares: int = 1,
    by: str = "django",
) -> dict[str, Any]:
    """Enqueue this child's `share` of `shares` of a stream of `rate` jobs a second for
    `seconds`, one per autocommit INSERT at its moment of the schedule (job n at n / rate, this
    child taking every n with n % shares == share), from the parent's GO, `by` `enqueuer()`;
    wait until all are completed; return each counted job's claimed_at - created_at in ms, how
    many fell behind the schedule, and the rate this child reached."""
    from django_leases.models import JobAttempt, PaymentJob

    total = int(rate * seconds)
    pks = []
    late = 0
    enqueue = enqueuer(by)  # connected before the stream starts
    common.wait_for_go()
    start = time.monotonic()
    for n in range(share, total, shares):
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -0.01:
            late += 1
        pks.append(enqueue())
    reached = len(pks) / (time.monotonic() - start)
    deadline = time.monotonic() + job_timeout
    while PaymentJob.objects.filter(pk__in=pks).exclude(status="completed").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stream was not drained within {job_timeout:.0f}s")
        time.sleep(0.05)
    counted = pks[int(rate / shares) :]  # the first second is the workers' ramp
    created = dict(PaymentJob.objects.filter(pk__in=counted).values_list("pk", "created_at"))
    claimed = dict(
        JobAttempt.objects.filter(job_ref__in=counted, attempt=1).values_list(
            "job_ref", "claimed_at"
        )
    )
    return {
        "ms": [(claimed[pk] - created[pk]).total_seconds() * 1000 for pk in counted],
        "late": late,
        "rate": reached,
    }


# ---- orchestration ---------------------------------------------------------------------------


def measure(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB
) -> list[tuple[str, bool, list[float]]]:
    common.note(f"{db.vendor}: migrating {db.name} ...")
    procs.call(db, "bench._common:migrate")
    results = []
    for notify in MODES[db.vendor]:
        label = "NOTIFY" if notify else "polling"
        worker_id = f"bench-wakeup-{label.lower()}"
        env = common.child_env(db, BENCH_USE_NOTIFY="1" if notify else "0")
        argv = common.django_command(
            "run_lease_worker",
            "--kind=noop",
            "--concurrency=1",
            f"--poll-interval={args.poll_interval}",
            f"--ttl={args.ttl}",
            f"--worker-id={worker_id}",
        )
        worker = procs.spawn(argv, env, f"worker-{label.lower()}", pipes=False)
        conn = db.connect()
        try:
            common.poll_until(
                db,
                conn,
                f"SELECT (SELECT max(id) FROM {common.WORKER_TABLE} "
                f"WHERE worker_id = '{worker_id}')",
                timeout=args.timeout,
                what="worker registration",
                watch=[worker],
            )
            common.note(f"{db.vendor} {label}: {args.samples} jobs, one at a time ...")
            ms = procs.call(
                db,
                "bench.wakeup_latency:enqueue_one_by_one",
                timeout=args.timeout * (args.samples + WARMUP),
                samples=args.samples,
                gap_min=args.gap_min,
                gap_max=args.gap_max,
                job_timeout=args.timeout,
            )["ms"]
        finally:
            conn.close()
            procs.stop(worker)
        results.append((db.vendor, notify, ms))
    return results


def measure_loaded(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB
) -> list[tuple[str, bool, dict[str, Any]]]:
    common.note(f"{db.vendor}: migrating {db.name} ...")
    procs.call(db, "bench._common:migrate")
    notify = db.vendor == "postgresql"
    env = common.child_env(db, BENCH_USE_NOTIFY="1" if notify else "0")
    workers = []
    conn = db.connect()
    try:
        for n in range(args.workers):
            argv = common.django_command(
                "run_lease_worker",
                "--kind=noop",
                f"--concurrency={args.concurrency}",
                f"--poll-interval={args.poll_interval}",
                f"--ttl={args.ttl}",
                f"--worker-id=bench-load-{n}",
            )
            workers.append(procs.spawn(argv, env, f"worker-{n}", pipes=False))
        common.poll_until(
            db,
            conn,
            f"SELECT CASE WHEN count(*) >= {args.workers} THEN 1 END FROM "
            f"{common.WORKER_TABLE} WHERE worker_id LIKE 'bench-load-%'",
            timeout=args.timeout,
            what="worker registration",
            watch=workers,
        )
        common.note(f"{db.vendor}: {args.load:g} jobs/s for {args.seconds:g}s ...")
        target = "bench.wakeup_latency:enqueue_stream"
        enqueuers = [
            procs.start_barrier(
                db,
                target,
                rate=args.load,
                seconds=args.seconds,
                job_timeout=args.timeout,
                share=share,
                shares=args.enqueuers,
                by=args.enqueue_by,
            )
            for share in range(args.enqueuers)
        ]
        parts = procs.release_barrier(enqueuers, target, timeout=args.seconds + 2 * args.timeout)
        result = {
            "ms": [ms for part in parts for ms in part["ms"]],
            "late": sum(part["late"] for part in parts),
            "rate": sum(part["rate"] for part in parts),
        }
    finally:
        conn.close()
        for worker in workers:
            procs.stop(worker)
    return [(db.vendor, notify, result)]


def run_loaded(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    results = common.each_database(
        args, "wakeup", lambda db: measure_loaded(args, procs, db), skipped
    )
    rows = []
    for vendor, notify, result in results:
        ms = result["ms"]
        rows.append(
            [
                NAMES[vendor],
                "LISTEN/NOTIFY" if notify else "polling",
                f"{result['rate']:.0f}",
                result["late"],
                len(ms),
                *(f"{common.percentile(ms, q):.1f}" for q in (50, 95, 99)),
                f"{max(ms):.1f}",
            ]
        )
    common.print_table(
        f"enqueue -> claim under a steady stream of {args.load:g} jobs/s ({args.enqueuers} "
        f"enqueuers by {args.enqueue_by}), {args.workers} workers x --concurrency "
        f"{args.concurrency}, ms on the database clock",
        ["database", "wake-up", "jobs/s sent", "late", "jobs", "p50", "p95", "p99", "max"],
        rows,
    )
    common.print_skipped(skipped)
    print("\n'late' = enqueues more than 10 ms behind the stream's schedule.")


NAMES = {"postgresql": "PostgreSQL", "sqlite": "SQLite", "mysql": "MariaDB/MySQL"}


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    results = common.each_database(args, "wakeup", lambda db: measure(args, procs, db), skipped)
    notify_p = {
        q: common.percentile(ms, q) for vendor, notify, ms in results if notify for q in (50, 95)
    }
    rows = []
    for vendor, notify, ms in results:
        p50, p95 = common.percentile(ms, 50), common.percentile(ms, 95)
        rows.append(
            [
                NAMES[vendor],
                "LISTEN/NOTIFY" if notify else "polling",
                len(ms),
                f"{p50:.1f}",
                f"{p95:.1f}",
                f"{max(ms):.1f}",
                f"{statistics.mean(ms):.1f}",
                f"{p50 / notify_p[50]:.0f}x" if notify_p else "-",
                f"{p95 / notify_p[95]:.0f}x" if notify_p else "-",
            ]
        )
    common.print_table(
        f"enqueue -> claim by an idle worker, ms on the database clock (claimed_at - "
        f"created_at); --poll-interval {args.poll_interval:g}s",
        ["database", "wake-up", "jobs", "p50", "p95", "max", "mean", "p50 vs", "p95 vs"],
        rows,
    )
    common.print_skipped(skipped)
    print("\n'vs' = this mode / PostgreSQL LISTEN/NOTIFY.")


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--samples",
        type=common.positive_int,
        default=50,
        help="jobs timed per mode (default: %(default)r)",
    )
    parser.add_argument(
        "--poll-interval",
        type=common.positive_float,
        default=1.0,
        help="the worker's --poll-interval, seconds; it sleeps 0.5-1.5 times this between "
        "polls (default: %(default)r)",
    )
    parser.add_argument(
        "--gap-min",
        type=common.positive_float,
        default=0.2,
        help="shortest pause after a job is done before the next is enqueued (default: "
        "%(default)r)",
    )
    parser.add_argument(
        "--gap-max",
        type=common.positive_float,
        default=0.6,
        help="longest such pause (default: %(default)r)",
    )
    parser.add_argument(
        "--load",
        type=common.positive_float,
        default=None,
        metavar="RATE",
        help="measure under a steady stream of RATE jobs/s instead of one idle worker",
    )
    parser.add_argument(
        "--seconds",
        type=common.positive_float,
        default=10.0,
        help="how long the --load stream runs (default: %(default)r)",
    )
    parser.add_argument(
        "--workers",
        type=common.positive_int,
        default=2,
        help="worker processes draining the --load stream (default: %(default)r)",
    )
    parser.add_argument(
        "--enqueuers",
        type=common.positive_int,
        default=4,
        help="processes enqueuing the --load stream, each every n-th job of its schedule (one "
        "autocommit INSERT a job, as web requests would; one process falls behind past a few "
        "hundred jobs/s) (default: %(default)r)",
    )
    parser.add_argument(
        "--enqueue-by",
        choices=("django", "statement"),
        default="django",
        help="how the --enqueuers send each job: enqueue() ('django'), or the very statements "
        "enqueue() sent for a first job through the bare driver connection ('statement': the "
        "same INSERT and NOTIFY on the server, as from web processes on other machines, without "
        "their Python on this machine's cores) (default: %(default)r)",
    )
    parser.add_argument(
        "--concurrency",
        type=common.positive_int,
        default=4,
        help="slots of each --load worker (default: %(default)r)",
    )
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=60)
    args = parser.parse_args(argv)
    if args.gap_max < args.gap_min:
        parser.error("--gap-max must be at least --gap-min")
    if args.load is not None and args.load * args.seconds < 2 * args.load:
        parser.error("--seconds must be at least 2 with --load (the first second is the ramp)")
    return common.run_main(run if args.load is None else run_loaded, args)


if __name__ == "__main__":
    sys.exit(main())
