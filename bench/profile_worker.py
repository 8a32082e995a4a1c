"""Where one worker's time goes under load: per SQL statement and per Python layer.

PostgreSQL only. A throw-away database gets `--jobs` pending no-op jobs, then one
`run_lease_worker --kind noop --burst --concurrency N` drains them, three times:

1. statements: the worker runs in a child that wraps every database connection it opens (each
   slot's, the heartbeat's, the main loop's; Django's `connection_created` signal) with
   `connection.execute_wrapper` and times each statement on the client side (driver, network
   and server). Statements are grouped by their text without literals; per group: calls per
   job, ms per call, ms per job (summed over the worker's threads) and % of all statement time,
   beside the worker's wall time and its CPU time per job.
2. layers: the same worker under `py-spy record --nonblocking` (sampling its threads on the CPU;
   a thread waiting on the socket or a lock is not sampled). Each sample is put in one layer
   by the frames of the worker it is in (claim, completion, handler dispatch, thread hand-off,
   heartbeat, Django connection handling, start-up), by its thread (the acknowledgement writer,
   the slots, the main thread) and by the library its innermost frame is in (psycopg, model
   instantiation, the ORM's SQL compiler, ...). `--gil` samples only the thread holding the
   GIL: where the worker's Python runs. Skipped, with why, when py-spy is not installed or may
   not trace (`--no-py-spy` skips it).
3. plans: `EXPLAIN (ANALYZE, BUFFERS)` of the claim and the completion statements exactly as the
   worker issued them in step 1 (text and parameters), in a rolled-back transaction on a table
   with pending jobs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench import _common as common

# Statement groups, by a pattern of their text; others are named by their first words.
STATEMENT_LABELS = (
    (r"^EXECUTE django_leases_", "claim, prepared (EXECUTE; with completions ahead of it)"),
    (r"^(PREPARE|DEALLOCATE) django_leases_", "claim's PREPARE (and DEALLOCATE as it ages)"),
    (r"SKIP LOCKED", "claim (UPDATE ... SKIP LOCKED, ledger rows opened)"),
    (r"^\s*WITH done AS", "complete (job UPDATE + ledger row closed)"),
    (r"^\s*SELECT 1\s*$", "connection health check (SELECT 1)"),
    (r"django_leases_worker", "worker registry (register, beat, leave)"),
    (r"heartbeat_at", "lease renewal (heartbeat)"),
    (r"^\s*(LISTEN|SET) ", "session set-up (LISTEN, SET)"),
)
# The groups whose statement is explained: the claim (prepared, or sent whole) and the single
# completion; the PREPARE is kept to prepare the claim again where it is explained.
EXPLAINED = tuple(name for _, name in STATEMENT_LABELS[:4])
PREPARE = STATEMENT_LABELS[1][1]
# Layers of a py-spy sample: its innermost worker frame's function names the layer.
OPERATION_LAYERS = {
    **dict.fromkeys(("_heartbeat_loop", "_lease_clock", "renew", "beat"), "heartbeat thread"),
    **dict.fromkeys(("claim", "_claim", "_claim_postgresql"), "claim (statement, rows to models)"),
    **dict.fromkeys(("complete", "_complete_postgresql"), "completion (statement)"),
    **dict.fromkeys(
        ("execute", "run_attempt", "run_handler", "_run_handler", "run"), "handler dispatch (slot)"
    ),
    **dict.fromkeys(
        (
            "run_once",
            "_slot_main",
            "start_next",
            "finish",
            "hand_out",
            "_wait_for_slot",
            "_finished",
        ),
        "thread hand-off (claimed batch to slots, slots back to the loop)",
    ),
    **dict.fromkeys(
        ("add", "take", "next_ready", "written"),
        "acknowledgement buffer (slots adding, the writer taking)",
    ),
    **dict.fromkeys(
        ("leases", "note_claimed", "acknowledged", "_flush_and_claim", "_flush"),
        "batch write's own work (leases built, counts; acks thread)",
    ),
    **dict.fromkeys(
        ("_tidy_connections", "keep_usable", "harden", "close_old_connections", "close_all"),
        "Django connection handling",
    ),
}
START_UP = "start-up and exit (Django set-up, checks, imports, registry)"
# Libraries of a py-spy sample's innermost frame, by a fragment of its file path.
LIBRARY_LAYERS = (
    ("Connection.wait (psycopg/", "psycopg: waiting for the server's answer"),
    ("_execute_send (psycopg/", "psycopg: sending the statement"),
    ("psycopg/", "psycopg (other: adapting parameters, reading rows)"),
    ("django/db/models/base.py", "model instantiation"),
    ("django/db/models/query.py", "querysets (raw() iteration, model rows)"),
    ("django/db/models/sql/", "ORM SQL compiler"),
    ("django/db/backends/", "Django database backend (cursor wrappers, connections)"),
    ("django/db/", "Django db (other)"),
    ("django_leases/", "django-leases"),
    ("Condition.wait (threading.py", "threading: Condition.wait (a slot or the loop waiting)"),
    ("Condition.notify (threading.py", "threading: Condition.notify (waking a slot)"),
    ("threading.py", "threading (other)"),
    ("<frozen importlib", "imports (start-up)"),
    ("logging/", "logging"),
    ("django/", "Django (other)"),
)


def unprefixed(sql: str) -> str:
    """`sql` without the statement timeout the worker sends in front of a transaction's first
    statement (`dialects.postgresql.StatementTimeout`)."""
    return re.sub(r"^\s*SET LOCAL statement_timeout = \d+; ", "", sql)


def label(sql: str) -> str:
    sql = unprefixed(sql)
    for pattern, name in STATEMENT_LABELS:
        if re.search(pattern, sql):
            return name
    return " ".join(re.sub(r"'[^']*'|\b\d+\b|\"s\d+_x\d+\"", "?", sql).split())[:70]


# ---- Django side -------------------------------------------------------------------------------


def seed(jobs: int, kind: str, empty: bool = True) -> dict[str, Any]:
    """Add `jobs` pending jobs of `kind`, to empty tables unless `empty` is false."""
    if empty:
        common.empty_tables(common.JOB_TABLE, common.LEDGER_TABLE, common.WORKER_TABLE)
    common.seed_pending(jobs, kind)
    common.analyze(common.JOB_TABLE, common.LEDGER_TABLE)
    return {}


def timed_worker(kind: str, concurrency: int, ttl: float) -> dict[str, Any]:
    """Run the worker with every statement timed; return the groups, wall and CPU seconds, and
    one statement (text, parameters) of each group."""
    from django.core.management import call_command
    from django.db.backends.signals import connection_created

    lock = threading.Lock()
    totals: dict[str, list[float]] = {}
    samples: dict[str, tuple[str, Any]] = {}

    def timer(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        start = time.perf_counter()
        try:
            return execute(sql, params, many, context)
        finally:
            elapsed = time.perf_counter() - start
            name = label(sql)
            with lock:
                entry = totals.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += elapsed
                if name in EXPLAINED and not unprefixed(sql).startswith("DEALLOCATE"):
                    samples.setdefault(name, (unprefixed(sql), params))

    def wrap(sender: Any, connection: Any, **kwargs: Any) -> None:
        if timer not in connection.execute_wrappers:
            connection.execute_wrappers.append(timer)

    connection_created.connect(wrap, weak=False)
    cpu, wall = os.times(), time.perf_counter()
    call_command(
        "run_lease_worker",
        f"--kind={kind}",
        "--burst",
        f"--concurrency={concurrency}",
        f"--ttl={ttl}",
        "--verbosity=0",
    )
    wall = time.perf_counter() - wall
    end = os.times()
    return {
        "wall": wall,
        "cpu": (end.user - cpu.user) + (end.system - cpu.system),
        "statements": {name: [int(n), s] for name, (n, s) in totals.items()},
        "samples": {name: [sql, dict(params or {})] for name, (sql, params) in samples.items()},
    }


def round_trips(samples: int) -> dict[str, float]:
    """Median ms, on one connection in autocommit, of `SELECT 1` (the round trip) and of a
    one-row UPDATE with its commit, with synchronous_commit on (the WAL flush) and off."""
    from django.db import connection

    from django_leases.models import PaymentJob

    pk = PaymentJob.objects.values_list("pk", flat=True).first()
    table = connection.ops.quote_name(PaymentJob._meta.db_table)
    cases = {
        "SELECT 1": ("SELECT 1", None),
        "one-row UPDATE + commit": (f"UPDATE {table} SET priority = priority WHERE id = %s", [pk]),
    }
    result = {}
    with connection.cursor() as cursor:
        for flush in ("on", "off"):
            cursor.execute(f"SET synchronous_commit = {flush}")
            for name, (sql, params) in cases.items():
                timings = []
                for _ in range(samples):
                    start = time.perf_counter()
                    cursor.execute(sql, params)
                    timings.append((time.perf_counter() - start) * 1000)
                result[f"{name}, synchronous_commit {flush}"] = common.percentile(timings, 50)
    return result


def explain(samples: dict[str, list[Any]]) -> dict[str, str]:
    """`EXPLAIN (ANALYZE, BUFFERS)` of the sampled statements, in one rolled-back transaction;
    the completion is explained for a job claimed in it. Each is explained twice and the
    second plan kept: a worker's session has its catalog caches warm (planning time)."""
    from django.db import connection, transaction

    from django_leases.models import PaymentJob

    plans = {}
    with transaction.atomic():
        for name, (sql, params) in sorted(samples.items(), key=lambda item: item[0] != PREPARE):
            if name == PREPARE:  # the EXECUTE's statement, in this session too
                with connection.cursor() as cursor:
                    cursor.execute(sql)
                continue
            for _ in range(2):
                if "pk" in params:  # a completion: restate it for a job this transaction holds
                    job = PaymentJob.objects.claim(params["owner"], ttl=60, limit=1)[0]
                    params = {**params, "pk": job.pk, "token": job.lease_token}
                with connection.cursor() as cursor:
                    # A prepared claim's EXECUTE comes with its values written in (no params).
                    cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {sql}", params or None)
                    plans[name] = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return plans


# ---- orchestration ---------------------------------------------------------------------------


def statements_report(args: argparse.Namespace, result: dict[str, Any]) -> None:
    jobs = args.jobs
    stats = result["statements"]
    total = sum(seconds for _, seconds in stats.values())
    rows = [
        [
            name,
            f"{calls / jobs:.3f}",
            f"{seconds / calls * 1000:.3f}",
            f"{seconds / jobs * 1000:.3f}",
            f"{seconds / total * 100:.1f}%",
        ]
        for name, (calls, seconds) in sorted(stats.items(), key=lambda item: -item[1][1])
    ]
    rows.append(["all statements", "", "", f"{total / jobs * 1000:.3f}", "100.0%"])
    common.print_table(
        f"statements of one run_lease_worker --concurrency {args.concurrency}, {jobs} jobs of "
        f"kind {args.kind} (client side, summed over the worker's threads)",
        ["statement", "calls/job", "ms/call", "ms/job", "% of statement time"],
        rows,
    )
    wall, cpu = result["wall"], result["cpu"]
    print(
        f"worker: {jobs / wall:.0f} jobs/s; per job {wall / jobs * 1000:.3f} ms wall, "
        f"{cpu / jobs * 1000:.3f} ms CPU of the worker process (all threads), "
        f"{total / jobs * 1000:.3f} ms in statements (all threads)"
    )


def py_spy_record(
    args: argparse.Namespace, db: common.BenchDB, procs: common.Processes
) -> Path | str:
    """Record one worker draining the jobs under py-spy; return the raw stacks' file, or why
    not."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.access(py_spy, os.X_OK):
        return "py-spy is not installed"
    out = procs.logs / "py-spy.txt"
    worker = common.django_command(
        "run_lease_worker",
        f"--kind={args.kind}",
        "--burst",
        f"--concurrency={args.concurrency}",
        f"--ttl={args.ttl}",
        "--verbosity=0",
    )
    argv = [py_spy, "record", "--nonblocking", "--threads", "--format=raw", f"--rate={args.rate}"]
    if args.gil:
        argv.append("--gil")
    try:
        procs.run([*argv, f"--output={out}", "--", *worker], common.child_env(db), "py-spy")
    except common.ChildError as exc:
        return f"py-spy failed: {str(exc).strip().splitlines()[-1]}"
    return out


def parse_raw(path: Path) -> Iterable[tuple[list[str], int]]:
    """(frames outermost first, samples) of each line of py-spy's raw (collapsed) output."""
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


THREAD_ROLES = (
    ("lease-acks", "acknowledgement writer (batch completions, claims ahead)"),
    ("lease-slot-", "slots (handlers, hand-offs)"),
    ("lease-heartbeat", "heartbeat and lease clock"),
    ("lease-clock", "heartbeat and lease clock"),
)
MAIN_THREAD = "main (start-up, claim loop, exit)"


def thread_role(frame: str) -> str:
    """The role of the thread a sample is in, from py-spy's `thread (id): name` frame."""
    return next((role for name, role in THREAD_ROLES if name in frame), MAIN_THREAD)


def function_of(frame: str) -> str:
    """The function's own name: "_slot_main" of "LeaseWorker._slot_main (django_leases/...)"."""
    return frame.split(" (", 1)[0].strip().rsplit(".", 1)[-1]


def layers_report(path: Path) -> None:
    operations: Counter[str] = Counter()
    libraries: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for frames, count in parse_raw(path):
        total += count
        threads[thread_role(frames[0])] += count
        worker = [function_of(f) for f in reversed(frames) if "django_leases/" in f]
        in_loop = any(
            name in ("run", "_slot_main", "_heartbeat_loop", "_ack_loop") for name in worker
        )
        operation = next(
            (OPERATION_LAYERS[name] for name in worker if name in OPERATION_LAYERS),
            "other worker code" if in_loop else START_UP,
        )
        operations[operation if in_loop else START_UP] += count
        innermost = frames[-1]
        libraries[next((name for part, name in LIBRARY_LAYERS if part in innermost), "other")] += (
            count
        )
    work = total - operations[START_UP]
    common.print_table(
        f"py-spy samples of running threads by the worker's layer (innermost worker frame); "
        f"{total} samples, {work} after start-up",
        ["layer", "samples", "% after start-up"],
        [
            [name, n, "-" if name == START_UP else f"{n / work * 100:.1f}%"]
            for name, n in operations.most_common()
        ],
    )
    common.print_table(
        "the same samples by the worker's thread",
        ["thread", "samples", "%"],
        [[name, n, f"{n / total * 100:.1f}%"] for name, n in threads.most_common()],
    )
    common.print_table(
        "the same samples by the library of the innermost frame",
        ["library", "samples", "%"],
        [[name, n, f"{n / total * 100:.1f}%"] for name, n in libraries.most_common()],
    )


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    reason = common.check_server("postgresql", args.pg_url)
    if reason:
        raise SystemExit(f"PostgreSQL is needed for this benchmark: {reason}")
    with common.temp_database("postgresql", args.pg_url, "profile") as db:
        common.note(f"migrating {db.name} ...")
        procs.call(db, "bench._common:migrate")
        common.note(f"statements: {args.jobs} jobs ...")
        procs.call(db, "bench.profile_worker:seed", jobs=args.jobs, kind=args.kind)
        timed = procs.call(
            db,
            "bench.profile_worker:timed_worker",
            kind=args.kind,
            concurrency=args.concurrency,
            ttl=args.ttl,
        )
        statements_report(args, timed)
        if args.py_spy:
            common.note(f"py-spy: {args.jobs} jobs ...")
            procs.call(db, "bench.profile_worker:seed", jobs=args.jobs, kind=args.kind)
            recorded = py_spy_record(args, db, procs)
            if isinstance(recorded, Path):
                layers_report(recorded)
            else:
                print(f"\nskipped py-spy: {recorded}")
        common.note("round trips, EXPLAIN (ANALYZE, BUFFERS) ...")
        # On the table the runs left (their finished jobs and ledger rows), as a worker sees it.
        procs.call(db, "bench.profile_worker:seed", jobs=1000, kind=args.kind, empty=False)
        costs = procs.call(db, "bench.profile_worker:round_trips", samples=500)
        common.print_table(
            "one statement alone on an idle connection (median of 500, client side)",
            ["statement", "ms"],
            [[name, f"{ms:.3f}"] for name, ms in costs.items()],
        )
        plans = procs.call(db, "bench.profile_worker:explain", samples=timed["samples"])
        for name, plan in plans.items():
            print(f"\nEXPLAIN (ANALYZE, BUFFERS) {name}:\n{plan}")


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--jobs",
        type=common.positive_int,
        default=10_000,
        help="jobs per run (default: %(default)r)",
    )
    parser.add_argument(
        "--kind",
        default="noop",
        help="the handler kind of bench/jobs.py the worker runs (default: %(default)s)",
    )
    parser.add_argument(
        "--concurrency",
        type=common.positive_int,
        default=4,
        help="run_lease_worker --concurrency (default: %(default)r)",
    )
    parser.add_argument(
        "--rate",
        type=common.positive_int,
        default=200,
        help="py-spy samples per second (default: %(default)r)",
    )
    parser.add_argument(
        "--no-py-spy", dest="py_spy", action="store_false", help="skip the py-spy profile"
    )
    parser.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread holding the GIL (py-spy --gil): where the worker's Python "
        "runs, leaving out threads waiting in a blocking call or for the GIL",
    )
    common.add_common_arguments(parser, databases=None, timeout=600)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
