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

`--systems` runs the same stream against other set-ups and peers too, each on a database of its
own, alternating over --rounds:
- "django-leases-processes": one `run_lease_worker --processes W` (W = --workers, --concurrency
  slots each): W worker processes under a supervisor that holds the only LISTEN connection and
  wakes one idle process per notification, where "django-leases" runs W processes that each
  listen (and each wake at every notification);
- "bare": --bare-processes processes of a bare psycopg loop on the same job table, no ledger:
  LISTEN on the channel the enqueue notifies, then claim one job and complete it until none is
  left. The floor of this table and this machine; its claim stamps `heartbeat_at` with the
  statement's time, which is what is timed. (Two such processes, one job at a time each, fall
  behind a 1,000 jobs/s stream here; eight are more than two cores can run beside it.)
- "pgqueuer": --workers processes of pgqueuer's own `run()` (continuous mode, its NOTIFY
  trigger, --pgq-batch), the stream enqueued with its `SyncQueries.enqueue()` or its statement.
  What is timed is `updated - created` of the job it hands to the entrypoint: both its
  database's NOW(), at the enqueue and at the dequeue that picks the job.
The peers run on PostgreSQL only. Beside the latencies, each run reports the CPU a job cost,
from the stream's start to its drain: the worker processes' (their process trees, from
`/proc/<pid>/stat`), the database server's for this database (its backends' on PostgreSQL, the
enqueuers' included) and the whole machine's (`/proc/stat`: another tenant's load included).
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
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


def enqueuer(by: str, system: str = "django-leases", kind: str = "noop") -> Callable[[], int]:
    """Return a call that enqueues one `kind` job in autocommit and returns its id: through
    `enqueue()` ("django"), or ("statement") by sending the very statements `enqueue()` sent
    for a first job (its INSERT and NOTIFY; every value of them is the same for each job, the
    database's clock included) through the bare driver connection, without Django's Python.
    pgqueuer's jobs go through its own enqueue, likewise (`bench.pgq.stream_enqueuer`)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_leases.models import PaymentJob

    if system == "pgqueuer":
        from bench.pgq import stream_enqueuer

        return stream_enqueuer(by)
    if by == "django":
        return lambda: PaymentJob.objects.enqueue(kind, {}).pk
    with CaptureQueriesContext(connection) as sent:
        PaymentJob.objects.enqueue(kind, {})  # a job of its own, not one of the stream
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
    system: str = "django-leases",
    latency_dir: str = "",
    kind: str = "noop",
) -> dict[str, Any]:
    """Enqueue this child's `share` of `shares` of a stream of `rate` jobs a second for
    `seconds`, one per autocommit INSERT at its moment of the schedule (job n at n / rate, this
    child taking every n with n % shares == share), from the parent's GO, `by` `enqueuer()`, for
    `system` (jobs of `kind` on the job table); wait until all are done; return each counted
    job's wake-up latency in ms (`started_ms`), how many fell behind the schedule, and the rate
    this child reached."""
    moments = range(share, int(rate * seconds), shares)  # this child's jobs of the schedule
    pks = []
    late = 0
    enqueue = enqueuer(by, system, kind)  # connected before the stream starts
    common.wait_for_go()
    start = time.monotonic()
    for n in moments:
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -0.01:
            late += 1
        pks.append(enqueue())
    reached = len(pks) / (time.monotonic() - start)
    deadline = time.monotonic() + job_timeout
    while not drained(system, pks):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the stream was not drained within {job_timeout:.0f}s")
        time.sleep(0.05)
    ramp = int(rate / shares)  # the first second is the workers' ramp
    return {
        "ms": started_ms(system, pks[ramp:], latency_dir),
        "at": [n / rate for n in moments[ramp:]],
        "late": late,
        "rate": reached,
    }


def drained(system: str, pks: list[int]) -> bool:
    """Whether every job of `pks` is done: completed, or for pgqueuer gone from its queue."""
    from django.db import connection

    from django_leases.models import PaymentJob

    if system != "pgqueuer":
        return not PaymentJob.objects.filter(pk__in=pks).exclude(status="completed").exists()
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pgqueuer WHERE id = ANY(%s)", [pks])
        return bool(cursor.fetchone()[0] == 0)


def started_ms(system: str, pks: list[int], latency_dir: str) -> list[float]:
    """The wake-up latency in ms of each job of `pks`, done, on the database clock: the claim
    (the ledger's claimed_at; the bare loop's heartbeat_at; pgqueuer's pick, from the files
    its entrypoint wrote in `latency_dir`) minus the enqueue."""
    from django_leases.models import JobAttempt, PaymentJob

    if system == "pgqueuer":
        noted = {}
        for path in Path(latency_dir).glob("*.txt"):
            for line in path.read_text().splitlines():
                pk, ms = line.split()
                noted[int(pk)] = float(ms)
        missing = [pk for pk in pks if pk not in noted]
        if missing:
            raise RuntimeError(f"pgqueuer ran {len(missing)} job(s) unnoted, e.g. {missing[0]}")
        return [noted[pk] for pk in pks]
    created = dict(PaymentJob.objects.filter(pk__in=pks).values_list("pk", "created_at"))
    if system == "bare":
        claimed = dict(PaymentJob.objects.filter(pk__in=pks).values_list("pk", "heartbeat_at"))
    else:
        claimed = dict(
            JobAttempt.objects.filter(job_ref__in=pks, attempt=1).values_list(
                "job_ref", "claimed_at"
            )
        )
    return [(claimed[pk] - created[pk]).total_seconds() * 1000 for pk in pks]


def bare_listen_loop(ttl: float) -> None:
    """Claim one job and complete it until none is left (throughput.py's `bare_step`), then
    wait for a notification of the job table's enqueue channel (or 0.25 s), until killed. The
    wait is our worker's own `Listener`, so the floor differs from the worker in what it does
    once woken."""
    from bench.throughput import bare_step
    from django_leases.listener import Listener
    from django_leases.models import PaymentJob

    listener = Listener.for_model(PaymentJob, "default")
    if listener is None:
        raise RuntimeError("the bare loop listens for PostgreSQL's NOTIFY")
    listener.wait(0)  # LISTEN now, so that the parent sees this process up
    step = bare_step(ttl)
    while True:
        if step() is None:
            listener.wait(0.25)


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


LOAD_SYSTEMS = ("django-leases", "django-leases-processes", "bare", "pgqueuer")
OURS = ("django-leases", "django-leases-processes")
PEERS_ON = "postgresql"  # the peers of --systems listen for NOTIFY: PostgreSQL only


def load_workers(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB, system: str, env: dict
) -> list[Any]:
    """Start `system`'s worker processes on `db`: --workers, or --bare-processes for "bare"."""
    workers = []
    for n in range(args.bare_processes if system == "bare" else args.workers):
        if system == "django-leases":
            argv = common.django_command(
                "run_lease_worker",
                f"--kind={args.kind}",
                f"--concurrency={args.concurrency}",
                f"--poll-interval={args.poll_interval}",
                f"--ttl={args.ttl}",
                f"--worker-id=bench-load-{n}",
            )
        elif system == "django-leases-processes":
            if n:
                break  # one supervisor starts them all
            argv = common.django_command(
                "run_lease_worker",
                f"--processes={args.workers}",
                f"--kind={args.kind}",
                f"--concurrency={args.concurrency}",
                f"--poll-interval={args.poll_interval}",
                f"--ttl={args.ttl}",
                "--worker-id=bench-load",
            )
        elif system == "bare":
            argv = common.child_command("bench.wakeup_latency:bare_listen_loop", ttl=args.ttl)
        else:
            argv = [sys.executable, "-m", "bench.pgq", str(args.pgq_batch), "continuous"]
        workers.append(procs.spawn(argv, env, f"{system}-worker-{n}", pipes=False))
    return workers


def wait_for_workers(
    args: argparse.Namespace, db: common.BenchDB, conn: Any, system: str, workers: list[Any]
) -> None:
    """Return once every worker is up: registered (django-leases), LISTENing (bare: its
    listening connection sends nothing else), or connected (pgqueuer: one connection a worker;
    jobs of the stream's first second, the ramp, are not counted)."""
    if system in OURS:
        ready = (
            f"SELECT CASE WHEN count(*) >= {args.workers} THEN 1 END FROM "
            f"{common.WORKER_TABLE} WHERE worker_id LIKE 'bench-load-%'"
        )
    elif system == "bare":
        ready = (
            f"SELECT CASE WHEN count(*) >= {args.bare_processes} THEN 1 END FROM "
            "pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%'"
        )
    else:
        ready = (
            f"SELECT CASE WHEN count(*) >= {args.workers} THEN 1 END FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    common.poll_until(db, conn, ready, timeout=args.timeout, what="the workers", watch=workers)


def stream_through(
    args: argparse.Namespace,
    procs: common.Processes,
    db: common.BenchDB,
    system: str,
    env: dict[str, str],
    latency_dir: str,
) -> dict[str, Any]:
    """Start `system`'s workers, run the stream through them, stop them; return the stream's
    latencies (ms), their moments in the schedule (at), the enqueues late and the rate sent."""
    conn = db.connect()
    workers = []
    try:
        workers = load_workers(args, procs, db, system, env)
        wait_for_workers(args, db, conn, system, workers)
        common.note(f"{db.vendor} {system}: {args.load:g} jobs/s for {args.seconds:g}s ...")
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
                system=system,
                latency_dir=latency_dir,
                kind=args.kind if system in OURS else "noop",
            )
            for share in range(args.enqueuers)
        ]
        meter = CpuMeter(db, conn, workers)
        parts = procs.release_barrier(
            enqueuers, target, timeout=args.seconds + 2 * args.timeout, at_go=meter.start
        )
        cpu = meter.used()
    finally:
        conn.close()
        for worker in workers:
            procs.stop(worker)
    return {
        "ms": [ms for part in parts for ms in part["ms"]],
        "at": [at for part in parts for at in part["at"]],
        "late": sum(part["late"] for part in parts),
        "rate": sum(part["rate"] for part in parts),
        "cpu": cpu,
    }


class CpuMeter:
    """CPU seconds used from `start()` to `used()`: by the process trees of `workers`, by the
    database server's backends of `db` (PostgreSQL; None elsewhere) and by the whole machine
    (None without /proc)."""

    def __init__(self, db: common.BenchDB, conn: Any, workers: list[Any]) -> None:
        self.db, self.conn, self.workers = db, conn, workers
        self.began: tuple[float, float | None, float | None] = (0.0, None, None)
        self.backends: list[int] = []

    def start(self) -> None:
        if self.db.vendor == "postgresql":
            with self.conn.cursor() as cursor:
                cursor.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                )
                self.backends = [row[0] for row in cursor.fetchall()]
        self.began = self._now()

    def used(self) -> dict[str, float | None]:
        now = self._now()
        return {
            name: None if now[n] is None or self.began[n] is None else now[n] - self.began[n]
            for n, name in enumerate(("workers", "server", "machine"))
        }

    def _now(self) -> tuple[float, float | None, float | None]:
        from bench.throughput import machine_cpu

        tree = descendants([proc.pid for proc in self.workers])
        server = sum(map(process_cpu, self.backends)) if self.backends else None
        return sum(map(process_cpu, tree)), server, machine_cpu()


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` used so far; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(roots: list[int]) -> list[int]:
    """`roots` and every live process below them."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def measure_loaded(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB, system: str
) -> list[tuple[str, str, bool, dict[str, Any]]]:
    common.note(f"{db.vendor}: migrating {db.name} ...")
    procs.call(db, "bench._common:migrate", then=args.after_migrate)
    notify = db.vendor == "postgresql"
    with tempfile.TemporaryDirectory(prefix="bench_pgq_latency_") as latency_dir:
        env = common.child_env(
            db, BENCH_USE_NOTIFY="1" if notify else "0", BENCH_PGQ_LATENCY_DIR=latency_dir
        )
        if system == "pgqueuer":
            install = [sys.executable, "-m", "pgqueuer", f"--pg-dsn={db.url}", "install"]
            procs.run(install, env, "pgqueuer-install")
        result = stream_through(args, procs, db, system, env, latency_dir)
    return [(system, db.vendor, notify, result)]


def run_loaded(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    results = []
    for n in range(args.rounds):
        turn = n % len(args.systems)  # each round starts with the next system
        for system in args.systems[turn:] + args.systems[:turn]:
            on = args
            if system not in OURS:
                for vendor in set(args.databases) - {PEERS_ON}:
                    skipped[f"{system} on {vendor}"] = "it listens for PostgreSQL's NOTIFY"
                on = argparse.Namespace(**{**vars(args), "databases": [PEERS_ON]})
                if PEERS_ON not in args.databases:
                    continue
            results += common.each_database(
                on,
                "wakeup",
                lambda db, system=system: measure_loaded(args, procs, db, system),
                skipped,
            )
    if args.csv:
        with open(args.csv, "w", newline="") as out:
            writer = csv.writer(out)
            writer.writerow(["run", "system", "database", "scheduled_s", "ms"])
            for run, (system, vendor, _, result) in enumerate(results, 1):
                for at, ms in sorted(zip(result["at"], result["ms"], strict=True)):
                    writer.writerow([run, system, vendor, f"{at:.4f}", f"{ms:.3f}"])
    rows = []
    for system, vendor, notify, result in results:
        ms = result["ms"]
        jobs = args.load * args.seconds
        rows.append(
            [
                system,
                NAMES[vendor],
                "LISTEN/NOTIFY" if notify else "polling",
                f"{result['rate']:.0f}",
                result["late"],
                len(ms),
                *(f"{common.percentile(ms, q):.1f}" for q in (50, 95, 99)),
                f"{max(ms):.1f}",
                *(
                    "-" if seconds is None else f"{seconds * 1000 / jobs:.3f}"
                    for seconds in result["cpu"].values()
                ),
            ]
        )
    common.print_table(
        f"enqueue -> claim under a steady stream of {args.load:g} jobs/s ({args.enqueuers} "
        f"enqueuers by {args.enqueue_by}); django-leases: {args.workers} workers x --concurrency "
        f"{args.concurrency}, kind {args.kind}; bare: {args.bare_processes} processes; "
        f"pgqueuer: {args.workers} workers, --batch-size {args.pgq_batch}; ms on the database "
        "clock, one row per run",
        [
            "system",
            "database",
            "wake-up",
            "jobs/s sent",
            "late",
            "jobs",
            "p50",
            "p95",
            "p99",
            "max",
            "workers CPU ms/job",
            "server CPU ms/job",
            "machine CPU ms/job",
        ],
        rows,
    )
    common.print_skipped(skipped)
    print("\n'late' = enqueues more than 10 ms behind the stream's schedule.")
    print("CPU from the stream's start to its drain, divided by the jobs of the stream.")


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
    parser.add_argument(
        "--systems",
        type=common.choice_list(LOAD_SYSTEMS),
        default=["django-leases"],
        help=f"with --load: the systems to measure, comma-separated, of {', '.join(LOAD_SYSTEMS)} "
        "(the peers on PostgreSQL only) (default: django-leases)",
    )
    parser.add_argument(
        "--rounds",
        type=common.positive_int,
        default=1,
        help="with --load: runs of each system, alternating (default: %(default)r)",
    )
    parser.add_argument(
        "--csv",
        default=None,
        metavar="FILE",
        help="with --load: write every counted job to FILE: its run, system, database, moment "
        "in the stream's schedule (s) and latency (ms), to see when the tail happens",
    )
    parser.add_argument(
        "--after-migrate",
        default=None,
        metavar="FILE",
        help="with --load: run the SQL of FILE on each throw-away database after its migrations "
        "(a what-if, e.g. bench/job_table_without_checks.sql on PostgreSQL)",
    )
    parser.add_argument(
        "--kind",
        choices=("noop", "noop_batch"),
        default="noop",
        help="with --load: the kind django-leases' workers run, a no-op with single acks "
        "('noop') or with batched acks ('noop_batch', as pgqueuer acks) (default: %(default)r)",
    )
    parser.add_argument(
        "--bare-processes",
        type=common.positive_int,
        default=4,
        help="processes of the bare loop in --systems (default: %(default)r)",
    )
    parser.add_argument(
        "--pgq-batch",
        type=common.positive_int,
        default=10,
        help="pgqueuer's --batch-size in --systems (default: %(default)r, its own)",
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
