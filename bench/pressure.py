"""The queue under production pressure: a pinned vacuum horizon, analytics readers, overload.

One command. It builds a scratch PostgreSQL server of its own from the installed binaries (as
the failover test does: tests/pgcluster.py, a free loopback port, a temporary directory) with
autovacuum at PostgreSQL's defaults and fsync as the server ships it, `pg_stat_statements`
preloaded, migrates, and runs, as a user deploys them:

- a producer child calling `enqueue_many()` in batches of --batch at a steady --rate, credited on
  real elapsed time (a producer that falls behind catches up in batches as fast as it can);
- --workers `run_lease_worker --concurrency N` processes (no --kind, as deployed) and one
  `watch_stuck_jobs`; --soak adds `prune_jobs --older-than RETENTION` every --prune-every s;
- `bench_sleep` jobs of --job-seconds (1 ms), so a slot is busy as a short real job keeps it.

Then the phases of --phases, each NAME[:SECONDS] (default --phase-seconds):
- clean: nothing else runs;
- idle: one session `BEGIN; SELECT txid_current();` that sits idle in transaction, pinning the
  vacuum horizon (a forgotten psql, a pg_dump, a standby's hot_standby_feedback);
- readers: --readers REPEATABLE READ sessions scanning the job table and the ledger over and
  over, each transaction --reader-transaction s long, their starts staggered (analytics);
- overload: the rate set to 1.5x the drain capacity (--drain-rate, else measured first: the
  producer stops, a backlog is enqueued, the completions over 30 s are the capacity);
- recovery: nothing else runs, after a phase of pressure (the rate back to --rate);
- soak: steady, pruning on (--soak runs one hour of it).

Every --sample-seconds a row goes to the CSV: enqueue and completion rates, enqueue->start
p50/p99 (the ledger's claimed_at minus the job's created_at, database clock, first attempts
claimed since the last row), queue depth, live and dead tuples, inserts/updates (HOT)/deletes,
autovacuum runs and size of each of our tables, size and index entries read per scan of each
index of the job table and the ledger, the age of the oldest snapshot, autovacuum workers at work
and the top wait events of the database's active sessions, and the machine's load average.
Per phase: `EXPLAIN (ANALYZE, BUFFERS)` of the workers' claim (table_size.py's, with every
registered kind and the worker's --concurrency as the limit, as a worker sends it) early and
late, pg_stat_statements' heaviest statements, tuples written per completed job per table,
pgstattuple of the job table and ledger at its end. An SVG plots
the run. Results go to --out (a directory): pressure.csv, pressure.svg, pressure.md, and the
server's log (server.log: autovacuum's account of each run).

    PYTHONPATH=. python bench/pressure.py --phases clean:180,idle:600,recovery:120 --rate 500
    PYTHONPATH=. python bench/pressure.py --soak
    PYTHONPATH=. python bench/pressure.py --plot OUT/pressure.csv   # redraw the SVG
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import select
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import _common as common

KIND = "bench_sleep"
PHASES = ("clean", "idle", "readers", "overload", "recovery", "soak")
DEFAULT_PHASES = "clean,idle,recovery,readers,recovery,overload,recovery"
PREFIX = "django_leases_"
DATABASE = "pressure"
SERVER_SETTINGS = {
    # The server's defaults otherwise (autovacuum, fsync, shared_buffers...); what the issue
    # asks for on top: statistics of statements, and room for the run's sessions.
    "shared_preload_libraries": "'pg_stat_statements'",
    "max_connections": "100",
    "log_autovacuum_min_duration": "0",
}
SHOWN_SETTINGS = (
    "server_version", "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_threshold", "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_vacuum_cost_limit", "autovacuum_vacuum_cost_delay", "autovacuum_max_workers",
    "fsync", "synchronous_commit", "shared_buffers", "max_wal_size", "checkpoint_timeout",
)  # fmt: skip


# ---- Django side -------------------------------------------------------------------------------


def produce(rate: float, batch: int, job_seconds: float) -> None:
    """Enqueue `rate` jobs a second with `enqueue_many()`, at most `batch` per call, credited on
    the real time elapsed since the last rate change, until stdin closes. Commands on stdin:
    `RATE r` (from now on), `BURST n` (n jobs at once, outside the schedule)."""
    from django_leases.models import PaymentJob

    payload = {"seconds": job_seconds}
    since, credited, sent = time.monotonic(), 0, 0
    pending = b""  # read from the descriptor: a buffered readline() would hide lines from select()
    while True:
        while select.select([sys.stdin], [], [], 0)[0]:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                return
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            word, value = line.decode().split()
            if word == "RATE":
                credited, since, rate = sent, time.monotonic(), float(value)
            elif word == "BURST":
                for start in range(0, int(value), 1000):
                    count = min(1000, int(value) - start)
                    PaymentJob.objects.enqueue_many(KIND, [payload] * count)
                credited += int(value)
                sent += int(value)
        due = credited + int(rate * (time.monotonic() - since)) - sent
        if due <= 0:
            time.sleep(min(0.01, batch / rate) if rate else 0.05)
            continue
        count = min(due, batch)
        PaymentJob.objects.enqueue_many(KIND, [payload] * count)
        sent += count


def explain_worker_claim(owner: str, ttl: float, limit: int, takeover: bool) -> dict[str, Any]:
    """table_size.py's EXPLAIN of the claim, with the parameters a `run_lease_worker` without
    --kind sends: every registered kind, up to `limit` (its free slots) jobs; `takeover`: the
    claim that also looks for expired leases (a worker's, every `TAKEOVER_EVERY`)."""
    from bench.table_size import explain_claim
    from bench.throughput import registered_kinds

    return explain_claim(owner, ttl, registered_kinds(), limit, takeover)


# ---- the scratch server ------------------------------------------------------------------------


def scratch_server() -> Any:
    """A single PostgreSQL server built by tests/pgcluster.py's `Cluster` without its standby."""
    from tests.pgcluster import Cluster

    class Scratch(Cluster):
        def _build(self) -> None:
            self._run("initdb", "-D", str(self.primary.data), "-U", "root", "--auth=trust")
            self.primary.configure(
                port=str(self.primary.port),
                listen_addresses="'127.0.0.1'",
                unix_socket_directories=f"'{self.directory}'",
                **SERVER_SETTINGS,
            )
            self.primary.start()

    return Scratch(synchronous=False)


# ---- sampling ----------------------------------------------------------------------------------


@dataclass
class Totals:
    """The counters of one sample, to difference against the next."""

    at: float
    enqueued: int
    done: int
    tables: dict[str, dict[str, Any]]
    indexes: dict[str, dict[str, Any]]


@dataclass
class Run:
    """What a run records: CSV rows, per-minute latencies, per-phase notes."""

    args: argparse.Namespace
    conn: Any
    job_table: str
    ledger: str
    writer: Any
    header: list[str] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)
    last: Totals | None = None
    ledger_seen: int = 0
    minutes: dict[tuple[str, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    done_by_minute: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    seconds_by_minute: dict[tuple[str, int], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        return list(self.conn.execute(sql, params).fetchall())

    def totals(self) -> Totals:
        (enqueued, pending, processing) = self.query(
            f"SELECT (SELECT coalesce(max(id), 0) FROM {self.job_table}), "
            f"(SELECT count(*) FROM {self.job_table} WHERE status = 'pending'), "
            f"(SELECT count(*) FROM {self.job_table} WHERE status = 'processing')"
        )[0]
        tables = {
            row[0].removeprefix(PREFIX): dict(
                zip(
                    ("live", "dead", "ins", "upd", "hot", "del", "autovac", "bytes"),
                    row[1:],
                    strict=True,
                )
            )
            for row in self.query(
                "SELECT relname, n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, "
                "n_tup_del, autovacuum_count, pg_relation_size(relid) FROM pg_stat_user_tables "
                "WHERE relname LIKE %s ORDER BY relname",
                [PREFIX + "%"],
            )
        }
        indexes = {
            row[0]: {"bytes": row[1], "scans": row[2], "read": row[3]}
            for row in self.query(
                "SELECT indexrelname, pg_relation_size(indexrelid), idx_scan, idx_tup_read "
                "FROM pg_stat_user_indexes WHERE relname IN (%s, %s) ORDER BY indexrelname",
                [self.job_table, self.ledger],
            )
        }
        return Totals(time.monotonic(), enqueued, enqueued - pending - processing, tables, indexes)

    def latencies(self) -> list[float]:
        """Enqueue->start in ms of every first attempt opened since the last call."""
        rows = self.query(
            f"SELECT a.id, EXTRACT(EPOCH FROM a.claimed_at - j.created_at) * 1000 "
            f"FROM {self.ledger} a JOIN {self.job_table} j ON j.id = a.job_ref "
            f"WHERE a.id > %s AND a.attempt = 1",
            [self.ledger_seen],
        )
        if rows:
            self.ledger_seen = max(r[0] for r in rows)
        return [float(r[1]) for r in rows]

    def sample(self, phase: str, phase_start: float, depth_note: str = "") -> dict[str, Any]:
        now = self.totals()
        ms = self.latencies()
        minute = int((now.at - phase_start) // 60)
        self.minutes[(phase, minute)] += ms
        horizon, waits, vacuuming = self.query(
            "SELECT (SELECT max(age(backend_xmin)) FROM pg_stat_activity), "
            "(SELECT string_agg(w || '=' || n, ';') FROM (SELECT coalesce(wait_event_type || ':' "
            "|| wait_event, 'CPU') AS w, count(*) AS n FROM pg_stat_activity WHERE datname = "
            "current_database() AND state = 'active' AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend' GROUP BY 1 ORDER BY 2 DESC LIMIT 3) t), "
            "(SELECT string_agg(substring(query FROM 'public\\.(\\w+)'), ';') "
            "FROM pg_stat_activity WHERE backend_type = 'autovacuum worker')"
        )[0]
        row: dict[str, Any] = {
            "t": round(now.at - self.start, 1),
            "phase": phase,
            "load1": round(os.getloadavg()[0], 2),
            "enqueued": now.enqueued,
            "done": now.done,
            "depth": now.enqueued - now.done,
            "started": len(ms),
            "p50_ms": round(common.percentile(ms, 50), 1) if ms else "",
            "p99_ms": round(common.percentile(ms, 99), 1) if ms else "",
            "oldest_xmin_age": horizon or 0,
            "autovacuum_running": (vacuuming or "").replace(PREFIX, ""),
            "waits": waits or "",
        }
        last = self.last
        span = now.at - last.at if last else 0.0
        row["enqueue_per_s"] = round((now.enqueued - last.enqueued) / span, 1) if last else ""
        row["done_per_s"] = round((now.done - last.done) / span, 1) if last else ""
        if last:
            self.done_by_minute[(phase, minute)] += now.done - last.done
            self.seconds_by_minute[(phase, minute)] += span
        for name, t in now.tables.items():
            row.update({f"{name}.{key}": value for key, value in t.items() if key != "bytes"})
            row[f"{name}.mb"] = round(t["bytes"] / 2**20, 2)
        for name, i in now.indexes.items():
            row[f"{name}.mb"] = round(i["bytes"] / 2**20, 2)
            before = last.indexes.get(name) if last else None
            scans = i["scans"] - before["scans"] if before else 0
            row[f"{name}.read_per_scan"] = (
                round((i["read"] - before["read"]) / scans, 1) if before and scans else ""
            )
        self.last = now
        if not self.header:
            self.header = list(row)
            self.writer.writerow(self.header)
        self.writer.writerow([row.get(key, "") for key in self.header])
        self.rows.append(row)
        common.note(
            f"{row['t']:7.0f}s {phase:9} load {row['load1']:5} in {row['enqueue_per_s']:>7}/s "
            f"done {row['done_per_s']:>7}/s depth {row['depth']:7} p50 {row['p50_ms']:>8} "
            f"p99 {row['p99_ms']:>8} ms job dead {now.tables['paymentjob']['dead']:>7} "
            f"xmin age {row['oldest_xmin_age']} {row['waits']}"
        )
        return row


# ---- pressure ----------------------------------------------------------------------------------


@contextmanager
def idle_in_transaction(server: Any) -> Iterator[None]:
    """One session that takes a transaction id and sits, pinning the vacuum horizon."""
    conn = server.connect(DATABASE)
    try:
        conn.execute("BEGIN")
        conn.execute("SELECT txid_current()")
        yield
    finally:
        conn.close()


@contextmanager
def readers(server: Any, count: int, transaction: float, tables: list[str]) -> Iterator[None]:
    """`count` REPEATABLE READ sessions scanning `tables` over and over, each transaction
    `transaction` seconds long, their starts staggered over one transaction."""
    stop = threading.Event()

    def read(n: int) -> None:
        if stop.wait(transaction * n / count):
            return
        with server.connect(DATABASE) as conn:
            while not stop.is_set():
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                until = time.monotonic() + transaction
                while time.monotonic() < until and not stop.is_set():
                    for table in tables:
                        conn.execute(f"SELECT count(*), max(id) FROM {table}").fetchall()
                conn.execute("COMMIT")

    threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


@contextmanager
def nothing() -> Iterator[None]:
    yield


# ---- orchestration -----------------------------------------------------------------------------


def phase_list(text: str) -> list[tuple[str, float | None]]:
    phases: list[tuple[str, float | None]] = []
    for part in text.split(","):
        name, _, seconds = part.strip().partition(":")
        if name not in PHASES:
            raise argparse.ArgumentTypeError(f"phases are {', '.join(PHASES)}; got {name!r}")
        phases.append((name, common.positive_float(seconds) if seconds else None))
    return phases


def send(producer: Any, command: str) -> None:
    producer.stdin.write(command + "\n")
    producer.stdin.flush()


def statements(run: Run) -> dict[int, tuple[str, int, float, int]]:
    """pg_stat_statements of the job table and ledger: queryid -> (text, calls, ms, buffers)."""
    return {
        row[0]: (row[1], row[2], row[3], row[4])
        for row in run.query(
            "SELECT queryid, left(regexp_replace(query, '\\s+', ' ', 'g'), 90), calls, "
            "total_exec_time, shared_blks_hit + shared_blks_read FROM pg_stat_statements "
            "WHERE query LIKE %s OR query LIKE %s",
            [f"%{run.job_table}%", f"%{run.ledger}%"],
        )
    }


def explain(run: Run, procs: common.Processes, db: common.BenchDB, label: str) -> None:
    """EXPLAIN (ANALYZE, BUFFERS) of the workers' claims, noted with their buffers: the claim
    of due jobs only, and the one that also looks for expired leases."""
    for takeover in (False, True):
        explain_one(run, procs, db, f"{label}, {'with' if takeover else 'no'} takeover", takeover)


def explain_one(
    run: Run, procs: common.Processes, db: common.BenchDB, label: str, takeover: bool
) -> None:
    try:
        result = procs.call(
            db,
            "bench.pressure:explain_worker_claim",
            timeout=run.args.timeout,
            owner=f"bench-explain-{os.getpid()}",
            ttl=run.args.ttl,
            limit=run.args.concurrency,
            takeover=takeover,
        )
    except common.ChildError as exc:  # a plan is evidence, not the run: note it and go on
        run.notes.append(f"claim EXPLAIN {label} failed: {str(exc).splitlines()[0]}")
        return
    run.notes.append(
        f"claim EXPLAIN {label}: {result['buffers']} buffers (due CTE {result['due_buffers']}, "
        f"expired CTE {result['expired_buffers']}), {result['exec_ms']:.2f} ms\n\n```\n"
        f"{result['plan']}\n```\n"
    )
    common.note(f"claim EXPLAIN {label}: {result['buffers']} buffers, {result['exec_ms']:.2f} ms")


def per_job(run: Run, before: Totals, after: Totals) -> str:
    """Tuples written per job in a phase, per table: inserts into the job table per enqueued
    job, everything else per completed job (a growing backlog tells the two apart)."""
    done, enqueued = after.done - before.done, after.enqueued - before.enqueued
    if done <= 0:
        return "no job completed"
    parts = []
    for name, t in after.tables.items():
        b = before.tables.get(name)
        if b is None:
            continue
        counts = {
            k: (t[k] - b[k]) / (enqueued if (name, k) == ("paymentjob", "ins") else done)
            for k in ("ins", "upd", "hot", "del")
        }
        if any(counts.values()):
            parts.append(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in counts.items() if v))
    return (
        f"tuples written per job ({enqueued} enqueued, {done} completed; hot: of upd, "
        "heap-only): " + "; ".join(parts)
    )


def tuple_stats(run: Run) -> str:
    rows = []
    for table in (run.job_table, run.ledger):
        (dead, dead_pct, free_pct, size) = run.query(
            "SELECT dead_tuple_count, dead_tuple_percent, free_percent, table_len "
            "FROM pgstattuple(%s)",
            [table],
        )[0]
        rows.append(
            f"{table.removeprefix(PREFIX)} {dead} dead ({dead_pct}%), {free_pct}% free, "
            f"{size / 2**20:.1f} MB"
        )
    for (index,) in run.query(
        "SELECT indexrelname FROM pg_stat_user_indexes WHERE relname = %s "
        "AND indexrelname LIKE %s ORDER BY 1",
        [run.job_table, "%due%"],
    ):
        (leaves, density) = run.query(
            "SELECT leaf_pages, avg_leaf_density FROM pgstatindex(%s)", [index]
        )[0]
        rows.append(f"{index}: {leaves} leaf pages, {density}% dense")
    return "pgstattuple: " + "; ".join(rows)


def drain_capacity(run: Run, producer: Any, phase_start: float) -> float:
    """The producer stopped, a backlog enqueued: the completion rate over 30 s."""
    send(producer, "RATE 0")
    send(producer, f"BURST {int(run.args.rate * 60)}")
    first = run.sample("drain", phase_start)
    deadline = time.monotonic() + run.args.timeout
    # Measured from the moment the backlog is in (the producer enqueues it in batches of 1,000).
    while first["depth"] < run.args.rate * 30 and time.monotonic() < deadline:
        time.sleep(1)
        first = run.sample("drain", phase_start)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        time.sleep(run.args.sample_seconds)
        run.sample("drain", phase_start)
    rate = (run.rows[-1]["done"] - first["done"]) / 30
    run.notes.append(f"drain capacity measured: {rate:.0f} jobs/s")
    return rate


def body(args: argparse.Namespace, procs: common.Processes) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common.note("building the scratch server ...")
    cluster = scratch_server()
    try:
        measure(args, procs, cluster, out)
    finally:
        procs.stop_all()
        # The autovacuum runs' own account (log_autovacuum_min_duration = 0): what each
        # removed, and what it could not ("dead but not yet removable").
        (out / "server.log").write_text(cluster.primary.logs())
        cluster.close()


def measure(args: argparse.Namespace, procs: common.Processes, cluster: Any, out: Path) -> None:
    cluster.create_database(DATABASE)
    server = cluster.primary
    db = common.BenchDB("postgresql", f"postgres://root@127.0.0.1:{server.port}/{DATABASE}", "")
    with server.connect(DATABASE) as conn:
        for extension in ("pg_stat_statements", "pgstattuple"):
            conn.execute(f"CREATE EXTENSION IF NOT EXISTS {extension}")
        settings = dict(
            conn.execute(
                "SELECT name, setting || coalesce(' ' || unit, '') FROM pg_settings "
                "WHERE name = ANY(%s)",
                [list(SHOWN_SETTINGS)],
            ).fetchall()
        )
    common.note("migrating ...")
    procs.call(db, "bench._common:migrate")
    env = common.child_env(db)
    producer = procs.spawn(
        common.child_command(
            "bench.pressure:produce", rate=args.rate, batch=args.batch, job_seconds=args.job_seconds
        ),
        env,
        "producer",
    )
    for n in range(args.workers):
        argv = common.django_command(
            "run_lease_worker", f"--concurrency={args.concurrency}", f"--ttl={args.ttl}",
            f"--worker-id=pressure-{n}",
        )  # fmt: skip
        procs.spawn(argv, env, f"worker-{n}", pipes=False)
    procs.spawn(common.django_command("watch_stuck_jobs"), env, "watcher", pipes=False)
    csv_path = out / "pressure.csv"
    conn = server.connect(DATABASE)
    summary: list[str] = []
    with csv_path.open("w", newline="") as handle:
        run = Run(args, conn, f"{PREFIX}paymentjob", f"{PREFIX}jobattempt", csv.writer(handle))
        last_prune = time.monotonic()
        for name, seconds in args.phases:
            length = seconds or args.phase_seconds
            if name == "overload":
                capacity = args.drain_rate or drain_capacity(run, producer, time.monotonic())
                send(producer, f"RATE {1.5 * capacity:.1f}")
            else:
                send(producer, f"RATE {args.rate}")
            phase_start = time.monotonic()  # the phase's length does not include the measuring
            pressure = {
                "idle": lambda: idle_in_transaction(server),
                "readers": lambda: readers(
                    server, args.readers, args.reader_transaction, [run.job_table, run.ledger]
                ),
            }.get(name, nothing)
            common.note(f"phase {name}: {length:.0f} s")
            before, queries = run.totals(), statements(run)
            early_at = phase_start + min(60.0, length / 4)
            explained = False
            with pressure():
                end = phase_start + length
                while (now := time.monotonic()) < end:
                    time.sleep(min(args.sample_seconds, max(0.0, end - now)))
                    run.sample(name, phase_start)
                    if not explained and time.monotonic() >= early_at:
                        explain(run, procs, db, f"{name} at {early_at - phase_start:.0f} s")
                        explained = True
                    if args.prune_every and time.monotonic() - last_prune >= args.prune_every:
                        procs.run(
                            common.django_command("prune_jobs", f"--older-than={args.retention}"),
                            env,
                            "prune",
                        )
                        last_prune = time.monotonic()
                explain(run, procs, db, f"{name} at {time.monotonic() - phase_start:.0f} s")
                summary += phase_summary(run, name, before, queries)
    handle.close()
    conn.close()
    write_report(args, out, settings, summary, run)
    plot(csv_path, out / "pressure.svg")
    common.note(f"written: {csv_path}, {out / 'pressure.svg'}, {out / 'pressure.md'}")


def phase_summary(
    run: Run, name: str, before: Totals, queries: dict[int, tuple[str, int, float, int]]
) -> list[str]:
    after = run.totals()
    lines = [f"### {name}", ""]
    lines.append("| minute | done/s | p50 ms | p99 ms |")
    lines.append("| ---: | ---: | ---: | ---: |")
    for (phase, minute), ms in sorted(run.minutes.items()):
        if phase != name or not ms:
            continue
        done = run.done_by_minute.get((phase, minute), 0)
        seconds = run.seconds_by_minute.get((phase, minute)) or 1.0
        lines.append(
            f"| {minute + 1} | {done / seconds:.0f} | {common.percentile(ms, 50):.1f} | "
            f"{common.percentile(ms, 99):.1f} |"
        )
    # A phase name may come back (recovery): its minutes are for this occurrence only.
    for key in [k for k in run.minutes if k[0] == name]:
        del run.minutes[key]
    for key in [k for k in run.done_by_minute if k[0] == name]:
        del run.done_by_minute[key]
        run.seconds_by_minute.pop(key, None)
    lines += ["", per_job(run, before, after), "", tuple_stats(run), ""]
    job = after.tables["paymentjob"]
    ledger = after.tables["jobattempt"]
    lines.append(
        f"at the end: depth {after.enqueued - after.done}; job table {job['live']} live, "
        f"{job['dead']} dead, {job['bytes'] / 2**20:.1f} MB, {job['autovac']} autovacuums; "
        f"ledger {ledger['live']} live, {ledger['dead']} dead, {ledger['bytes'] / 2**20:.1f} MB, "
        f"{ledger['autovac']} autovacuums; indexes (MB): "
        + ", ".join(f"{k} {v['bytes'] / 2**20:.1f}" for k, v in after.indexes.items())
    )
    lines += ["", "heaviest statements of the phase (pg_stat_statements):", ""]
    lines += ["| statement | calls | ms/call | buffers/call |", "| --- | ---: | ---: | ---: |"]
    now = statements(run)
    deltas = []
    for queryid, (text, calls, ms, buffers) in now.items():
        _, calls0, ms0, buffers0 = queries.get(queryid, (text, 0, 0.0, 0))
        if calls > calls0:
            deltas.append((ms - ms0, text, calls - calls0, buffers - buffers0))
    for total, text, calls, buffers in sorted(deltas, reverse=True)[:6]:
        shown = text.replace("|", "/")
        lines.append(f"| `{shown}` | {calls} | {total / calls:.3f} | {buffers / calls:.1f} |")
    lines += ["", *run.notes, ""]
    run.notes.clear()
    return lines


def write_report(
    args: argparse.Namespace, out: Path, settings: dict[str, str], summary: list[str], run: Run
) -> None:
    argv = " ".join(sys.argv[1:])
    lines = [
        "# pressure.py run",
        "",
        f"commit {common.commit()}; `bench/pressure.py {argv}`; {os.cpu_count()} cores; "
        f"load average at the end {os.getloadavg()}",
        "",
        "server: " + ", ".join(f"{k} = {v}" for k, v in sorted(settings.items())),
        "",
        f"rate {args.rate}/s, enqueue_many batch {args.batch}, {args.workers} worker(s) x "
        f"--concurrency {args.concurrency}, jobs of {args.job_seconds * 1000:g} ms, "
        f"samples every {args.sample_seconds} s",
        "",
        *summary,
    ]
    (out / "pressure.md").write_text("\n".join(lines) + "\n")


# ---- plot --------------------------------------------------------------------------------------


def plot(csv_path: Path, svg_path: Path) -> None:
    """Draw the run's main series as stacked SVG panels sharing the time axis."""
    with csv_path.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return
    panels = [
        ("jobs/s", [("enqueue_per_s", "#1f77b4"), ("done_per_s", "#d62728")], False),
        ("enqueue->start ms (log)", [("p50_ms", "#2ca02c"), ("p99_ms", "#ff7f0e")], True),
        ("queue depth", [("depth", "#9467bd")], False),
        ("dead tuples", [("paymentjob.dead", "#8c564b"), ("jobattempt.dead", "#e377c2")], False),
        ("MB", [("paymentjob.mb", "#7f7f7f"), ("jobattempt.mb", "#bcbd22")], False),
    ]
    width, height, left, top = 900, 150, 70, 20
    times = [float(r["t"]) for r in rows]
    t0, t1 = times[0], max(times[-1], times[0] + 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 180}" '
        f'height="{(height + 40) * len(panels) + 30}" font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]

    def x(t: float) -> float:
        return left + (t - t0) / (t1 - t0) * width

    # Phase boundaries, labelled on the first panel.
    for i, row in enumerate(rows):
        if i == 0 or row["phase"] != rows[i - 1]["phase"]:
            parts.append(
                f'<line x1="{x(times[i]):.1f}" x2="{x(times[i]):.1f}" y1="{top}" '
                f'y2="{(height + 40) * len(panels)}" stroke="#ccc" stroke-dasharray="3,3"/>'
                f'<text x="{x(times[i]) + 3:.1f}" y="{top - 5}">{row["phase"]}</text>'
            )
    for n, (title, series, log) in enumerate(panels):
        y0 = top + n * (height + 40)
        values = [float(r[k]) for r in rows for k, _ in series if r.get(k)]
        positive = [v for v in values if v > 0] or [1.0]
        low, high = (min(positive), max(positive)) if log else (0.0, max(values or [1.0]))
        high = high if high > low else low + 1

        def y(
            v: float, y0: int = y0, low: float = low, high: float = high, log: bool = log
        ) -> float:
            if log:
                share = (math.log10(max(v, low)) - math.log10(low)) / (
                    math.log10(high) - math.log10(low) or 1
                )
            else:
                share = (v - low) / (high - low)
            return y0 + height - share * height

        parts.append(
            f'<rect x="{left}" y="{y0}" width="{width}" height="{height}" fill="none" '
            f'stroke="#999"/><text x="{left}" y="{y0 + height + 14}">{title}</text>'
            f'<text x="{left - 4}" y="{y0 + 10}" text-anchor="end">{high:.4g}</text>'
            f'<text x="{left - 4}" y="{y0 + height}" text-anchor="end">{low:.4g}</text>'
        )
        for k, (key, colour) in enumerate(series):
            points = " ".join(
                f"{x(t):.1f},{y(float(r[key])):.1f}"
                for t, r in zip(times, rows, strict=True)
                if r.get(key)
            )
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.2" points="{points}"/>'
                f'<text x="{left + width + 8}" y="{y0 + 14 + 14 * k}" fill="{colour}">{key}</text>'
            )
    parts.append(
        f'<text x="{left}" y="{(height + 40) * len(panels) + 20}">seconds: {t0:.0f} to '
        f"{t1:.0f}</text></svg>"
    )
    svg_path.write_text("\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--phases",
        type=phase_list,
        default=phase_list(DEFAULT_PHASES),
        help=f"comma-separated NAME[:SECONDS] of {', '.join(PHASES)} (default: {DEFAULT_PHASES})",
    )
    pf, pi = common.positive_float, common.positive_int
    options: list[tuple[str, Any, Any, str]] = [
        ("--phase-seconds", pf, 180.0, "length of a phase without its own"),
        ("--rate", pf, 500.0, "jobs/s offered"),
        ("--batch", pi, 10, "jobs per enqueue_many() call"),
        ("--workers", pi, 1, "run_lease_worker processes"),
        ("--concurrency", pi, 8, "slots per worker"),
        ("--job-seconds", float, 0.001, "each job's sleep"),
        ("--sample-seconds", pf, 5.0, "seconds between two CSV rows"),
        ("--readers", pi, 4, "REPEATABLE READ sessions of the readers phase"),
        ("--reader-transaction", pf, 120.0, "seconds of one reader transaction"),
        ("--drain-rate", pf, None, "the workers' drain capacity in jobs/s; None: measured"),
        ("--prune-every", float, 0.0, "seconds between prune_jobs runs; 0: none (--soak: 60)"),
        ("--retention", pf, 300.0, "prune_jobs --older-than seconds"),
        ("--out", str, "pressure-out", "directory of the CSV, SVG and report"),
        ("--ttl", pf, 60.0, "the workers' lease seconds"),
        ("--timeout", pf, 600.0, "seconds a child (migration, EXPLAIN, prune) may take"),
    ]
    for flag, kind, default, text in options:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument(
        "--soak", action="store_true", help="one hour steady with prune_jobs (unless --phases)"
    )
    parser.add_argument("--plot", metavar="CSV", help="only redraw the SVG of a CSV")
    parser.add_argument("--keep-logs", action="store_true", help="keep the child processes' logs")
    args = parser.parse_args(argv)
    from tests.pgcluster import bindir

    if bindir() is None and not args.plot:
        parser.error("PostgreSQL's server binaries are not installed")
    if args.plot:
        plot(Path(args.plot), Path(args.plot).with_suffix(".svg"))
        return 0
    if args.soak:
        if "--phases" not in (argv or sys.argv):
            args.phases = [("soak", 3600.0)]
        args.prune_every = args.prune_every or 60.0
    common.note(json.dumps({k: str(v) for k, v in vars(args).items()}))
    return common.run_main(body, args)


if __name__ == "__main__":
    sys.exit(main())
