"""Jobs per second with no-op handlers: django-leases against its database-backed peers.

Every system drains the same number of jobs on the same throw-away PostgreSQL database with the
same number of worker processes, each started with its own worker command as real processes.
The `-mysql` systems do the same on a throw-away MariaDB database: django-leases' worker against
a bare mysqlclient lease loop.
Enqueueing is not timed: the clock runs from the start of the workers until a poll of the
database sees every job finished. Rounds are interleaved (each round rotates the order) and the
median and spread over the rounds are reported, with each peer's ratio to django-leases and
django-leases' ratio to it; `--markdown` prints the table as markdown with the commit measured.

Beside the rates, the CPU each job cost, which the machine's noise (another tenant, the
scheduler) hardly moves while it moves wall time a lot: the worker processes' own CPU
(`getrusage` of the reaped children, so not a worker's own children that outlive it, such as
django-q2's cluster), start-up and exit included, divided by the jobs; and the whole machine's
CPU from `/proc/stat` (user, nice, system, irq and softirq; not idle, I/O wait or stolen time)
in the steady part, from the poll that saw the first finished job to the one that saw the last,
divided by the jobs finished in between. The machine's figure includes PostgreSQL (its backends,
WAL writer, autovacuum) and this script's polls; without `/proc/stat` it is left out.

While `run_lease_worker` is not available, django-leases is measured as the queryset-level loop
(claim a batch, complete each job) in the same number of processes; the output says which.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from bench import _common as common

POLL_INTERVAL = 0.05


@dataclass(frozen=True)
class System:
    """One queue under test: how to enqueue, start its workers and see that it is done."""

    name: str
    requires: tuple[str, ...]
    tables: tuple[str, ...]
    # Returns (succeeded, finished) counts.
    poll_sql: str
    workers: Callable[[argparse.Namespace, bool], list[list[str]]]
    # Environment of its workers beyond the shared one (e.g. another CONN_MAX_AGE).
    env: tuple[tuple[str, str], ...] = ()
    # Directory its workers start in (`python -m` imports from there first); None: this one.
    cwd: str | None = None
    # The django-leases handler kind its workers run (its jobs are enqueued with it).
    kind: str = "noop"
    # The database it runs on: "postgresql" or "mysql" (MariaDB).
    database: str = "postgresql"

    def missing(self) -> list[str]:
        return [module for module in self.requires if find_spec(module) is None]


def lease_worker_commands(
    args: argparse.Namespace, kind: str, concurrency: int | None = None
) -> list[list[str]]:
    """`run_lease_worker --burst` of `kind`, once per worker process."""
    return [
        common.django_command(
            "run_lease_worker",
            f"--kind={kind}",
            "--burst",
            f"--concurrency={concurrency or args.concurrency}",
            f"--ttl={args.ttl}",
            f"--worker-id=bench-{i}",
            "--verbosity=0",
        )
        for i in range(args.workers)
    ]


def leases_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    if has_command:
        return lease_worker_commands(args, "noop")
    loop = common.child_command(
        "bench.throughput:leases_loop", batch=args.batch, ttl=args.ttl, ledger=args.ledger
    )
    return [loop] * args.workers


def bare_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    return [common.child_command("bench.throughput:bare_loop", ttl=args.ttl)] * args.bare_processes


def bare_mysql_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    loop = common.child_command("bench.throughput:bare_mysql_loop", ttl=args.ttl)
    return [loop] * args.bare_processes


def leases_batch_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    # As many jobs in flight per process as pgqueuer's batch: the same batch size both ways.
    return lease_worker_commands(args, BATCH_KIND, concurrency=args.batch)


def pgqueuer_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    # Drain mode exits once the queue is empty, as `--burst` does; acks are buffered up to the
    # batch size (or 0.1 s), its default, and every fetched job runs as its own task.
    argv = [sys.executable, "-m", "bench.pgq", str(args.batch)]
    return [argv] * args.workers


def procrastinate_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    argv = common.django_command(
        "procrastinate", "worker", f"--concurrency={args.concurrency}", "--one-shot"
    )
    return [argv] * args.workers


def tasks_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    argv = common.django_command(
        "db_worker", "--batch", "--no-startup-delay", "--no-reload", "--verbosity=0"
    )
    return [argv] * args.workers


def q2_workers(args: argparse.Namespace, has_command: bool) -> list[list[str]]:
    # One cluster with Q_CLUSTER["workers"] = --workers worker processes (BENCH_WORKERS).
    return [common.django_command("qcluster")]


BATCH_KIND = "noop_batch"
LEASES_POLL = (
    f"SELECT count(*) FILTER (WHERE status = 'completed'), "
    f"count(*) FILTER (WHERE status IN ('completed', 'failed', 'review')) "
    f"FROM {common.JOB_TABLE}"
)
LEASES_TABLES = (common.JOB_TABLE, common.LEDGER_TABLE, "django_leases_worker")
# MariaDB has no FILTER: a true comparison is 1.
LEASES_POLL_MYSQL = (
    f"SELECT COALESCE(SUM(status = 'completed'), 0), "
    f"COALESCE(SUM(status IN ('completed', 'failed', 'review')), 0) FROM {common.JOB_TABLE}"
)
# The peer apps a system's workers load (bench/settings.py): their own only.
NO_PEERS = (("BENCH_PEERS", ""),)
SYSTEMS = [
    System(
        "django-leases",
        ("django_leases",),
        LEASES_TABLES,
        LEASES_POLL,
        leases_workers,
        env=NO_PEERS,
    ),
    System(
        "leases-cma0 (django-leases, CONN_MAX_AGE=0)",
        ("django_leases",),
        LEASES_TABLES,
        LEASES_POLL,
        leases_workers,
        env=(("BENCH_CONN_MAX_AGE", "0"), *NO_PEERS),
    ),
    System(
        "bare (psycopg lease loop, no ledger)",
        ("psycopg",),
        LEASES_TABLES,
        LEASES_POLL,
        bare_workers,
        env=NO_PEERS,
    ),
    System(
        f"django-leases-batch (run_lease_worker --concurrency=--batch, kind {BATCH_KIND}: "
        "ack=batch)",
        ("django_leases",),
        LEASES_TABLES,
        LEASES_POLL,
        leases_batch_workers,
        env=NO_PEERS,
        kind=BATCH_KIND,
    ),
    System(
        "django-leases-mysql (run_lease_worker on MariaDB)",
        ("django_leases", "MySQLdb"),
        LEASES_TABLES,
        LEASES_POLL_MYSQL,
        leases_workers,
        env=NO_PEERS,
        database="mysql",
    ),
    System(
        "bare-mysql (mysqlclient lease loop on MariaDB, no ledger)",
        ("MySQLdb",),
        LEASES_TABLES,
        LEASES_POLL_MYSQL,
        bare_mysql_workers,
        env=NO_PEERS,
        database="mysql",
    ),
    System(
        "pgqueuer",
        ("pgqueuer", "psycopg"),
        ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics"),
        # A finished job leaves the queue table and gets its final row in the log table.
        "SELECT count(*) FILTER (WHERE status = 'successful'), "
        "count(*) FILTER (WHERE status IN ('successful', 'exception', 'failed', 'canceled', "
        "'deleted')) FROM pgqueuer_log",
        pgqueuer_workers,
    ),
    System(
        "procrastinate",
        ("procrastinate",),
        ("procrastinate_jobs", "procrastinate_events", "procrastinate_workers"),
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
        "count(*) FILTER (WHERE status IN ('succeeded', 'failed', 'aborted')) "
        "FROM procrastinate_jobs",
        procrastinate_workers,
        env=(("BENCH_PEERS", "procrastinate.contrib.django"),),
    ),
    System(
        "django-tasks (database)",
        ("django_tasks_db",),
        ("django_tasks_database_dbtaskresult",),
        "SELECT count(*) FILTER (WHERE status = 'SUCCESSFUL'), "
        "count(*) FILTER (WHERE status IN ('SUCCESSFUL', 'FAILED')) "
        "FROM django_tasks_database_dbtaskresult",
        tasks_workers,
        env=(("BENCH_PEERS", "django_tasks,django_tasks_db"),),
    ),
    System(
        "django-q2 (ORM broker)",
        ("django_q",),
        ("django_q_ormq", "django_q_task"),
        "SELECT count(*) FILTER (WHERE success), count(*) FROM django_q_task",
        q2_workers,
        env=(("BENCH_PEERS", "django_q"),),
    ),
]


# ---- Django side -------------------------------------------------------------------------------


def enqueue(system: str, jobs: int, tables: list[str], kind: str) -> dict[str, Any]:
    """Empty `system`'s tables, enqueue `jobs` no-op jobs through its API (django-leases' of
    `kind`), refresh statistics."""
    from django.db import transaction

    common.empty_tables(*tables)
    start = time.perf_counter()
    if system.startswith(("django-leases", "leases-", "bare")):
        common.seed_pending(jobs, kind)
    elif system == "pgqueuer":
        from bench.pgq import enqueue as pgq_enqueue

        pgq_enqueue(jobs)
    elif system == "procrastinate":
        from bench.tasks import noop_procrastinate

        for first in range(0, jobs, 1000):
            noop_procrastinate.batch_defer(*({} for _ in range(first, min(first + 1000, jobs))))
    elif system.startswith("django-tasks"):
        from bench.tasks import noop_task

        with transaction.atomic():
            for _ in range(jobs):
                noop_task.enqueue()
    else:
        from django_q.tasks import async_task

        with transaction.atomic():
            for _ in range(jobs):
                async_task("bench.tasks.noop_q")
    seconds = time.perf_counter() - start
    common.analyze(*tables)
    return {"seconds": seconds}


def leases_loop(batch: int, ttl: float, ledger: bool) -> dict[str, Any]:
    """Claim `batch` jobs, complete each, until nothing is claimable (the worker stand-in).

    Without `ledger`, the attempt ledger is switched off, to see what it costs.
    """
    from bench.jobs import noop
    from django_leases.models import PaymentJob

    if not ledger:
        PaymentJob.attempt_model = None

    owner = common.owner_name("loop")
    done = 0
    while jobs := PaymentJob.objects.claim(owner, ttl=ttl, limit=batch, kinds=["noop"]):
        for job in jobs:
            noop(job, None)
            PaymentJob.objects.complete(job.pk, owner, job.lease_token)
            done += 1
    return {"done": done}


def bare_step(ttl: float) -> Callable[[], int | None]:
    """Return a call that claims one job and completes it, on the Django connection made
    persistent and autocommit: None if nothing was claimable, else the rows its completion
    wrote (1, or 0 had it lost the job). psycopg alone, no ledger.

    The claim is one conditional UPDATE (SKIP LOCKED, database clock, token and attempts
    incremented), the completion another (restating id, status, owner and token).
    """
    from django.db import connection

    connection.ensure_connection()
    raw = connection.connection
    raw.autocommit = True
    cursor = raw.cursor()
    owner = common.owner_name("bare")
    table = common.JOB_TABLE
    claim = f"""
        UPDATE {table} AS job
        SET status = 'processing', lease_owner = %(owner)s,
            lease_until = STATEMENT_TIMESTAMP() + make_interval(secs => %(ttl)s),
            heartbeat_at = STATEMENT_TIMESTAMP(),
            lease_token = job.lease_token + 1, attempts = job.attempts + 1
        FROM (
            SELECT id FROM {table}
            WHERE status = 'pending' AND run_at <= STATEMENT_TIMESTAMP() AND kind = 'noop'
              AND attempts < max_attempts
            ORDER BY priority DESC, run_at, id
            LIMIT 1
            FOR UPDATE SKIP LOCKED
        ) AS picked
        WHERE job.id = picked.id
        RETURNING job.id, job.lease_token
    """  # noqa: S608 - a constant table name
    complete = f"""
        UPDATE {table}
        SET status = 'completed', completed_at = STATEMENT_TIMESTAMP(), last_error = ''
        WHERE id = %(pk)s AND status = 'processing' AND lease_owner = %(owner)s
          AND lease_token = %(token)s
    """  # noqa: S608 - a constant table name

    def step() -> int | None:
        cursor.execute(claim, {"owner": owner, "ttl": ttl})
        row = cursor.fetchone()
        if row is None:
            return None
        cursor.execute(complete, {"pk": row[0], "owner": owner, "token": row[1]})
        return int(cursor.rowcount)

    return step


def bare_loop(ttl: float) -> dict[str, Any]:
    """Claim one job, complete it, until nothing is claimable (`bare_step`): the floor a lease
    queue on this table can reach, in autocommit, on one persistent connection."""
    step = bare_step(ttl)
    done = 0
    while (completed := step()) is not None:
        done += completed
    return {"done": done}


def bare_mysql_loop(ttl: float) -> dict[str, Any]:
    """Claim one job, complete it, until nothing is claimable: mysqlclient alone on MariaDB, no
    ledger.

    The floor of a lease queue on this table there: per job a transaction that locks one job
    (`SELECT ... LIMIT 1 FOR UPDATE SKIP LOCKED`, the claim order of django-leases' index led by
    kind) and leases it (UPDATE: database clock, token and attempts incremented), then one that
    completes it (restating id, status, owner and token), on one persistent connection.
    """
    from django.db import connection

    connection.ensure_connection()
    raw = connection.connection
    raw.autocommit(False)
    owner = common.owner_name("bare")
    table = common.JOB_TABLE
    pick = f"""
        SELECT id, lease_token FROM {table}
        WHERE status = 'pending' AND run_at <= CURRENT_TIMESTAMP(6) AND kind = 'noop'
          AND attempts < max_attempts
        ORDER BY priority DESC, run_at, id
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    """  # noqa: S608 - a constant table name
    lease = f"""
        UPDATE {table}
        SET status = 'processing', lease_owner = %(owner)s,
            lease_until = CURRENT_TIMESTAMP(6) + INTERVAL %(micros)s MICROSECOND,
            heartbeat_at = CURRENT_TIMESTAMP(6),
            lease_token = lease_token + 1, attempts = attempts + 1
        WHERE id = %(pk)s
    """  # noqa: S608 - a constant table name
    complete = f"""
        UPDATE {table}
        SET status = 'completed', completed_at = CURRENT_TIMESTAMP(6), last_error = ''
        WHERE id = %(pk)s AND status = 'processing' AND lease_owner = %(owner)s
          AND lease_token = %(token)s
    """  # noqa: S608 - a constant table name
    micros = round(ttl * 1e6)
    done = 0
    with raw.cursor() as cursor:
        while True:
            cursor.execute(pick)
            row = cursor.fetchone()
            if row is None:
                raw.commit()
                break
            pk, token = row
            cursor.execute(lease, {"pk": pk, "owner": owner, "micros": micros})
            raw.commit()
            cursor.execute(complete, {"pk": pk, "owner": owner, "token": token + 1})
            done += cursor.rowcount
            raw.commit()
    return {"done": done}


def has_worker_command() -> dict[str, Any]:
    from django.core.management import get_commands

    return {"found": "run_lease_worker" in get_commands()}


def registered_kinds() -> list[str]:
    """The handler kinds `run_lease_worker` finds (bench/jobs.py's, once discovered)."""
    from django_leases.handlers import autodiscover, registered_kinds

    autodiscover()
    return registered_kinds()


# ---- orchestration ---------------------------------------------------------------------------


@dataclass
class Drain:
    seconds: float
    steady_rate: float  # jobs/s from the first poll that saw a finished job to the last
    succeeded: int
    finished: int
    timed_out: bool
    worker_cpu: float  # seconds of CPU of the worker processes
    # Seconds of CPU of the whole machine in the steady part; None without /proc/stat.
    machine_cpu: float | None


def children_cpu() -> float:
    """Seconds of CPU (user and system) of this process's reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_cpu() -> float | None:
    """Seconds of CPU the whole machine has used so far, all cores, from `/proc/stat`: user,
    nice, system, irq and softirq time (not idle, I/O wait or stolen); None without it."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(n) for n in first[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def drain(
    system: System,
    args: argparse.Namespace,
    db: common.BenchDB,
    procs: common.Processes,
    has_command: bool,
) -> Drain:
    """Start `system`'s workers and time them until every job is finished or the timeout."""
    extra = {"BENCH_WORKERS": str(args.workers), "BENCH_CONN_MAX_AGE": args.conn_max_age}
    if system.kind == BATCH_KIND:
        # --batch is the ack batch of its workers (bench/settings.py maps it to the setting).
        extra["BENCH_ACK_BATCH"] = str(args.batch)
    env = common.child_env(db, **{**extra, **dict(system.env)})
    conn = db.connect()
    workers: list[subprocess.Popen[str]] = []
    cpu_at_start = children_cpu()
    machine_at: list[float | None] = [None, None]  # at the first finished job, at the last
    try:
        started = time.monotonic()
        workers = [
            procs.spawn(argv, env, f"{system.name.split()[0]}-worker", pipes=False, cwd=system.cwd)
            for argv in system.workers(args, has_command)
        ]
        first = None
        succeeded = finished = 0
        while (now := time.monotonic()) - started < args.timeout:
            succeeded, finished = (int(n) for n in db.row(conn, system.poll_sql))
            if finished and first is None:
                first = (now, finished)
                machine_at[0] = machine_cpu()
            if finished >= args.jobs:
                machine_at[1] = machine_cpu()
                break
            if all(w.poll() is not None for w in workers) and finished < args.jobs:
                raise common.ChildError(f"{system.name} workers exited early", workers[0])
            time.sleep(POLL_INTERVAL)
        elapsed = time.monotonic() - started
    finally:
        conn.close()
        for worker in workers:
            procs.stop(worker)
    first_at, first_count = first or (started, 0)
    steady_time = started + elapsed - first_at
    return Drain(
        seconds=elapsed,
        steady_rate=(finished - first_count) / steady_time if steady_time > 0 else 0.0,
        succeeded=succeeded,
        finished=finished,
        timed_out=finished < args.jobs,
        worker_cpu=children_cpu() - cpu_at_start,
        machine_cpu=(
            None
            if machine_at[0] is None or machine_at[1] is None or finished == first_count
            else (machine_at[1] - machine_at[0]) * (args.jobs / (finished - first_count))
        ),
    )


def checkouts(specs: list[tuple[str, str, str | None]], *, batch: bool = False) -> list[System]:
    """django-leases systems whose workers import another checkout (`--checkout`), or run its
    batched acks (`--checkout-batch`: kind `noop_batch`, as django-leases-batch)."""
    leases = next(s for s in SYSTEMS if s.kind == (BATCH_KIND if batch else "noop"))
    systems = []
    for name, directory, max_age in specs:
        env = [("PYTHONPATH", directory), *NO_PEERS]
        if max_age is not None:
            env.append(("BENCH_CONN_MAX_AGE", max_age))
        label = f"leases-{name} ({directory}, CONN_MAX_AGE={max_age or 'as --conn-max-age'})"
        if batch:
            label = f"leases-batch-{name} ({directory}, kind {BATCH_KIND}: ack=batch)"
        systems.append(
            System(
                label,
                leases.requires,
                leases.tables,
                LEASES_POLL,
                leases.workers,
                tuple(env),
                cwd=directory,
                kind=leases.kind,
            )
        )
    return systems


def byte_compile(directories: list[str]) -> None:
    """Byte-compile the Python code the Django workers import from `directories` (this tree and
    each checkout), as pip does for what it installs: a peer's installed package starts from
    its bytecode, and so do the workers of a checkout, even where PYTHONDONTWRITEBYTECODE is
    set (a worker would otherwise compile django_leases from source at every start)."""
    for directory in directories:
        for package in ("django_leases", "bench", "example_project"):
            compileall.compile_dir(Path(directory) / package, quiet=1)


def checkout(text: str) -> tuple[str, str, str | None]:
    name, sep, rest = text.partition("=")
    directory, at, max_age = rest.partition("@")
    if not sep or not name or not directory or (at and conn_max_age(max_age) != max_age):
        raise argparse.ArgumentTypeError(f"NAME=DIR or NAME=DIR@CONN_MAX_AGE, got {text!r}")
    return name, directory, max_age if at else None


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    wanted = [s for s in SYSTEMS if s.name.split()[0] in args.systems]
    skipped = {s.name: f"not installed ({', '.join(s.missing())})" for s in wanted if s.missing()}
    systems = [s for s in wanted if s.name not in skipped] + checkouts(args.checkout)
    systems += checkouts(args.checkout_batch, batch=True)
    byte_compile([".", *(directory for _, directory, _ in args.checkout + args.checkout_batch)])
    urls = common.server_urls(args)
    with contextlib.ExitStack() as stack:
        dbs: dict[str, common.BenchDB] = {}
        for vendor in sorted({s.database for s in systems}):
            reason = common.check_server(vendor, urls[vendor])
            if reason:
                skipped.update({s.name: reason for s in systems if s.database == vendor})
                continue
            db = dbs[vendor] = stack.enter_context(
                common.temp_database(vendor, urls[vendor], "throughput")
            )
            common.note(f"migrating {db.name} ...")
            procs.call(db, "bench._common:migrate", then=args.after_migrate)
        systems = [s for s in systems if s.database in dbs]
        if not systems:
            raise SystemExit(f"nothing to measure: {skipped}")
        first = dbs[systems[0].database]
        has_command = procs.call(first, "bench.throughput:has_worker_command")["found"]
        mode = (
            f"run_lease_worker --concurrency {args.concurrency}"
            if has_command
            else f"queryset loop, claim(limit={args.batch}) + complete() per job "
            f"{'' if args.ledger else 'WITHOUT the attempt ledger '}(run_lease_worker not found)"
        )
        if has_command and not args.ledger:
            raise SystemExit("--no-ledger only applies to the queryset loop")
        systems = prepare(systems, dbs, procs, has_command, skipped)
        results: dict[str, list[Drain]] = {s.name: [] for s in systems}
        for round_no in range(args.rounds):
            order = systems[round_no % len(systems) :] + systems[: round_no % len(systems)]
            for system in order:
                db = dbs[system.database]
                common.note(f"round {round_no + 1}/{args.rounds}: {system.name}: enqueue ...")
                procs.call(
                    db,
                    "bench.throughput:enqueue",
                    system=system.name,
                    jobs=args.jobs,
                    tables=list(system.tables),
                    kind=system.kind,
                )
                result = drain(system, args, db, procs, has_command)
                results[system.name].append(result)
                common.note(
                    f"  drained {result.finished}/{args.jobs} in {result.seconds:.2f}s "
                    f"({args.jobs / result.seconds:.0f} jobs/s)"
                    + (" TIMEOUT" if result.timed_out else "")
                )
    report(args, systems, results, skipped, mode)


def prepare(
    systems: list[System],
    dbs: dict[str, common.BenchDB],
    procs: common.Processes,
    has_command: bool,
    skipped: dict[str, str],
) -> list[System]:
    """Install what `systems` need beyond the migrations (pgqueuer's schema) on their database
    of `dbs`; move a system that cannot run here to `skipped`, with why. Return the ones to
    measure."""
    kinds = procs.call(dbs[systems[0].database], "bench.throughput:registered_kinds")
    ready = []
    for system in systems:
        if system.kind not in kinds:
            skipped[system.name] = (
                f"handler kind {system.kind!r} is not registered in bench/jobs.py"
            )
        elif system.kind != "noop" and not has_command:
            skipped[system.name] = "needs run_lease_worker"
        else:
            ready.append(system)
        if system.name == "pgqueuer":
            # Its own CLI creates its tables, types and triggers (durability "durable").
            db = dbs[system.database]
            install = [sys.executable, "-m", "pgqueuer", f"--pg-dsn={db.url}", "install"]
            procs.run(install, common.child_env(db), "pgqueuer-install")
    return ready


def rates(args: argparse.Namespace, drains: list[Drain]) -> tuple[list[float], list[float]]:
    """Jobs/s of each finished round: from the workers' start, and after the first job."""
    done = [d for d in drains if not d.timed_out]
    return [args.jobs / d.seconds for d in done], [d.steady_rate for d in done]


def cpu_per_job(args: argparse.Namespace, drains: list[Drain]) -> tuple[float, float | None]:
    """Median milliseconds of CPU a job cost over the finished rounds: the worker processes',
    and the whole machine's (None without /proc/stat)."""
    done = [d for d in drains if not d.timed_out]
    workers = statistics.median(d.worker_cpu * 1000 / args.jobs for d in done)
    machine = [d.machine_cpu * 1000 / args.jobs for d in done if d.machine_cpu is not None]
    return workers, statistics.median(machine) if machine else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def report(
    args: argparse.Namespace,
    systems: list[System],
    results: dict[str, list[Drain]],
    skipped: dict[str, str],
    mode: str,
) -> None:
    medians = {
        s.name.split()[0]: statistics.median(rates(args, results[s.name])[0])
        for s in systems
        if rates(args, results[s.name])[0]
    }
    base = medians.get("django-leases")
    cpu = {
        s.name.split()[0]: cpu_per_job(args, results[s.name])
        for s in systems
        if rates(args, results[s.name])[0]
    }
    rows = []
    for system in systems:
        wall, steady = rates(args, results[system.name])
        drains = results[system.name]
        failures = sum(d.finished - d.succeeded for d in drains)
        timeouts = sum(d.timed_out for d in drains)
        if not wall:
            rows.append([system.name, "timed out", "", "", "", "", "", "", "", ""])
            continue
        median = statistics.median(wall)
        workers_cpu, whole_cpu = cpu[system.name.split()[0]]
        rows.append(
            [
                system.name,
                f"{median:.0f}",
                common.spread(wall),
                f"{min(wall):.0f}-{max(wall):.0f}",
                ratio(median, base),
                ratio(base, median),
                f"{statistics.median(steady):.0f}",
                f"{workers_cpu:.3f}",
                "-" if whole_cpu is None else f"{whole_cpu:.3f}",
                f"{failures} failed, {timeouts} timeouts" if failures or timeouts else "ok",
            ]
        )
    headers = [
        "system",
        "jobs/s",
        "spread",
        "min-max",
        "vs leases",
        "leases vs it",
        "steady jobs/s",
        "worker CPU ms/job",
        "steady machine CPU ms/job",
        "status",
    ]
    title = (
        f"throughput: {args.jobs} no-op jobs, {args.workers} worker processes, "
        f"{args.rounds} interleaved rounds, batch {args.batch}, PostgreSQL (the -mysql systems: "
        f"MariaDB), workers' "
        f"CONN_MAX_AGE={args.conn_max_age}; django-leases measured as: {mode}"
    )
    if args.markdown:
        print(f"\n{title}; commit {common.commit()}\n")
        common.print_markdown(headers, rows)
    else:
        print(f"\n{title}")
        common.print_table(
            "jobs/s from worker start to last job done (median of rounds), and after the first job",
            headers,
            rows,
        )
    print()
    for label, a, b in (
        ("django-leases / bare psycopg loop", "django-leases", "bare"),
        (
            "django-leases-mysql / bare mysqlclient loop (MariaDB)",
            "django-leases-mysql",
            "bare-mysql",
        ),
        ("django-leases / django-tasks (database)", "django-leases", "django-tasks"),
        ("CONN_MAX_AGE=0 / persistent (django-leases)", "leases-cma0", "django-leases"),
        ("django-leases-batch / pgqueuer", "django-leases-batch", "pgqueuer"),
    ):
        if a in medians and b in medians:
            whole = f"; steady machine CPU a job: {ratio(cpu[a][1], cpu[b][1])}"
            print(f"{label}: {ratio(medians[a], medians[b])}{whole}")
    common.print_skipped(skipped)
    print(
        "\n'vs leases' = system / django-leases (above 1.00x: it is faster); 'leases vs it' = "
        "django-leases / system. 'steady' leaves out worker start-up (clock from the first "
        "finished job)."
        " CPU ms/job (median of rounds; lower is better, less noisy than jobs/s): the worker"
        " processes' CPU with start-up, and the whole machine's (PostgreSQL included) in the"
        " steady part."
    )


def conn_max_age(text: str) -> str:
    if text.lower() != "none" and not (text.isdigit()):
        raise argparse.ArgumentTypeError(f"'none' or whole seconds, got {text!r}")
    return text.lower()


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--jobs",
        type=common.positive_int,
        default=20_000,
        help="jobs per run (default: %(default)r)",
    )
    parser.add_argument(
        "--workers",
        type=common.positive_int,
        default=2,
        help="worker processes per system (default: %(default)r)",
    )
    parser.add_argument(
        "--rounds",
        type=common.positive_int,
        default=2,
        help="interleaved rounds per system (default: %(default)r)",
    )
    parser.add_argument(
        "--systems",
        type=lambda text: [s.strip() for s in text.split(",")],
        default=[s.name.split()[0] for s in SYSTEMS],
        help=f"comma-separated subset of {','.join(s.name.split()[0] for s in SYSTEMS)} "
        "(default: all)",
    )
    parser.add_argument(
        "--concurrency",
        type=common.positive_int,
        default=4,
        help="run_lease_worker --concurrency of each django-leases worker, and procrastinate's "
        "(default: %(default)r)",
    )
    parser.add_argument(
        "--checkout",
        type=checkout,
        action="append",
        default=[],
        metavar="NAME=DIR[@CONN_MAX_AGE]",
        help="also measure run_lease_worker of the django-leases checkout in DIR (e.g. a "
        "`git worktree` of an earlier commit), optionally with its own CONN_MAX_AGE; repeatable",
    )
    parser.add_argument(
        "--checkout-batch",
        type=checkout,
        action="append",
        default=[],
        metavar="NAME=DIR[@CONN_MAX_AGE]",
        help="also measure the batched acks of the checkout in DIR, as django-leases-batch "
        "(kind noop_batch, --concurrency and ACK_BATCH_SIZE = --batch); repeatable",
    )
    parser.add_argument(
        "--after-migrate",
        default=None,
        metavar="FILE",
        help="run the SQL of FILE on the throw-away database after its migrations, e.g. "
        "bench/lean_job_table.sql (PostgreSQL): what a schema change would give every system",
    )
    parser.add_argument(
        "--bare-processes",
        type=common.positive_int,
        default=4,
        help="processes of each bare lease loop, psycopg and mysqlclient (default: %(default)r)",
    )
    parser.add_argument(
        "--batch",
        type=common.positive_int,
        default=10,
        help="pgqueuer's --batch-size, the ack batch (ACK_BATCH_SIZE) and --concurrency of "
        "django-leases-batch, and the claim(limit=...) of the queryset loop (default: "
        "%(default)r, pgqueuer's)",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as markdown, with the commit measured (for bench/README.md)",
    )
    parser.add_argument(
        "--no-ledger",
        dest="ledger",
        action="store_false",
        help="switch the attempt ledger off in the queryset loop, to see what it costs",
    )
    parser.add_argument(
        "--conn-max-age",
        type=conn_max_age,
        default="none",
        help="CONN_MAX_AGE of every worker: 'none' (persistent connections) or seconds; 0 is "
        "Django's default, a new connection each worker round (default: %(default)s)",
    )
    common.add_common_arguments(parser, databases=None, timeout=900)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
