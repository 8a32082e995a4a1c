"""What the benchmark scripts share: throw-away databases, child processes, statistics, tables.

A benchmark script is a thin orchestrator that never sets Django up itself. Everything that
needs Django runs in a child process (`python -m bench._child module:function JSON`) whose
DATABASE_URL points at a database the script created and drops again, so one run can measure
several database servers and no state leaks between measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, TextIO, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH-RESULT "
READY, GO = "BENCH-READY", "GO"
VENDORS = ("postgresql", "sqlite", "mysql")
JOB_TABLE, LEDGER_TABLE = "django_leases_paymentjob", "django_leases_jobattempt"
WORKER_TABLE = "django_leases_worker"
DEFAULT_URLS = {
    "postgresql": os.environ.get("BENCH_PG_URL", "postgres://root@127.0.0.1:5432/postgres"),
    "mysql": os.environ.get("BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/"),
}


def in_this_process(measure: Callable[[], None]) -> None:
    """Set Django up in this process with the test settings on DATABASE_URL (default: a SQLite
    file in a temporary directory), migrate it, and call `measure`: for the scripts that only
    enqueue, act and read beside workers of their own (release_rule.py, steps.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DATABASE_URL", f"sqlite:///{tmp}/bench.sqlite3")
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        measure()


# ---- command line ----------------------------------------------------------------------------


def make_parser(doc: str | None) -> argparse.ArgumentParser:
    """Return an argument parser whose --help shows the script's whole docstring."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def int_list(text: str) -> list[int]:
    """Parse "1,4" or "0,100k,1M" into integers."""
    units = {"k": 1_000, "m": 1_000_000}
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = units.get(part[-1:], 1)
        values.append(int(float(part[:-1] if scale > 1 else part) * scale))
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"need non-negative integers, got {text!r}")
    return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """Return an argparse type that parses "a,b" into names, each one of `choices`."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or set(names) - set(choices):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return names

    return parse


vendor_list = choice_list(VENDORS)


def add_common_arguments(
    parser: argparse.ArgumentParser, *, databases: str | None, timeout: float
) -> None:
    """Add --ttl, --timeout, --pg-url, --mysql-url, --keep-logs and, given default
    `databases`, --databases."""
    parser.add_argument(
        "--ttl", type=positive_float, default=60.0, help="lease seconds (default: %(default)r)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=timeout,
        help="seconds one measurement may take before it is abandoned (default: %(default)r)",
    )
    if databases is not None:
        parser.add_argument(
            "--databases",
            type=vendor_list,
            default=vendor_list(databases),
            help=f"comma-separated backends to measure, of {', '.join(VENDORS)} (default: "
            f"{databases}); an unreachable server is reported as skipped",
        )
    parser.add_argument(
        "--pg-url",
        default=DEFAULT_URLS["postgresql"],
        help="PostgreSQL server to create throw-away databases on; env BENCH_PG_URL "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--mysql-url",
        default=DEFAULT_URLS["mysql"],
        help="MariaDB/MySQL server, likewise; env BENCH_MYSQL_URL (default: %(default)s)",
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the child processes' logs and print where they are",
    )


def add_sizes_argument(parser: argparse.ArgumentParser) -> None:
    """Add --sizes: the finished-row counts a table is grown through."""
    parser.add_argument(
        "--sizes",
        type=int_list,
        default=[0, 100_000, 1_000_000],
        help="comma-separated finished-row counts, k and M allowed (default: 0,100k,1M)",
    )


def server_urls(args: argparse.Namespace) -> dict[str, str]:
    return {"postgresql": args.pg_url, "mysql": args.mysql_url, "sqlite": ""}


def each_database(
    args: argparse.Namespace,
    purpose: str,
    measure: Callable[[BenchDB], list[T]],
    skipped: dict[str, str],
) -> list[T]:
    """Call `measure` with a throw-away database on each of `args.databases` that can be
    reached, dropping each before the next is made; note the others in `skipped`, with why.
    Return the concatenated results."""
    urls = server_urls(args)
    results: list[T] = []
    for vendor in args.databases:
        reason = check_server(vendor, urls[vendor])
        if reason:
            skipped[vendor] = reason
            continue
        with temp_database(vendor, urls[vendor], purpose) as db:
            results += measure(db)
    return results


# ---- throw-away databases --------------------------------------------------------------------


@dataclass
class BenchDB:
    """A database created for one benchmark; `url` is the DATABASE_URL of its children."""

    vendor: str
    url: str
    name: str

    def connect(self) -> Any:
        """Open a plain DB-API connection in autocommit mode (for polling from the parent)."""
        if self.vendor == "sqlite":
            import sqlite3

            return sqlite3.connect(self.name, isolation_level=None, timeout=30)
        if self.vendor == "mysql":
            import MySQLdb

            conn = MySQLdb.connect(**_mysql_kwargs(self.url), database=self.name)
            conn.autocommit(True)
            return conn
        import psycopg

        return psycopg.connect(_pg_conninfo(self.url), autocommit=True)

    def row(self, conn: Any, sql: str) -> tuple[Any, ...]:
        cursor = conn.cursor()
        try:
            cursor.execute(sql)
            return tuple(cursor.fetchone())
        finally:
            cursor.close()


def _pg_conninfo(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def _mysql_kwargs(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    kwargs: dict[str, Any] = {"host": parts.hostname or "127.0.0.1", "port": parts.port or 3306}
    if parts.username:
        kwargs["user"] = unquote(parts.username)
    if parts.password:
        kwargs["password"] = unquote(parts.password)
    return kwargs


def _with_path(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, ""))


def check_server(vendor: str, url: str) -> str | None:
    """Return why `vendor` cannot be used (driver missing, server down), or None if it can."""
    if vendor == "sqlite":
        return None
    module = "psycopg" if vendor == "postgresql" else "MySQLdb"
    if find_spec(module) is None:
        return f"{module} is not installed"
    try:
        conn = BenchDB(vendor, url, "postgres" if vendor == "postgresql" else "").connect()
        conn.close()
    except Exception as exc:
        return f"server not reachable ({str(exc).strip().splitlines()[0]})"
    return None


@contextlib.contextmanager
def temp_database(vendor: str, server_url: str, purpose: str) -> Iterator[BenchDB]:
    """Create a uniquely named database for `purpose`, yield it, and always drop it."""
    name = f"bench_{purpose}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    if vendor == "sqlite":
        folder = tempfile.mkdtemp(prefix=f"{name}_")
        path = os.path.join(folder, "db.sqlite3")
        try:
            yield BenchDB(vendor, f"sqlite:///{path}", path)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if vendor == "postgresql":
        create = f'CREATE DATABASE "{name}"'
        drop = f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
        admin = BenchDB(vendor, server_url, "postgres")
    else:
        create = f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
        drop = f"DROP DATABASE IF EXISTS `{name}`"
        admin = BenchDB(vendor, server_url, "")
    _admin_execute(admin, create)
    try:
        yield BenchDB(vendor, _with_path(server_url, name), name)
    finally:
        _admin_execute(admin, drop)


def _admin_execute(admin: BenchDB, sql: str) -> None:
    conn = admin.connect()
    try:
        conn.cursor().execute(sql)
    finally:
        conn.close()


# ---- child processes -------------------------------------------------------------------------


def child_env(db: BenchDB, **extra: str) -> dict[str, str]:
    """Environment of a Django child process that works on `db`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "DATABASE_URL": db.url,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def django_command(*args: str) -> list[str]:
    """Return the argv of `django-admin ARGS` run with this interpreter."""
    return [sys.executable, "-m", "django", *args]


def child_command(target: str, **kwargs: Any) -> list[str]:
    """Return the argv that calls `module:function(**kwargs)` in a Django child."""
    return [sys.executable, "-m", "bench._child", target, json.dumps(kwargs)]


def _die_with_parent() -> None:
    # Best effort for a parent killed with SIGKILL: the kernel sends the child SIGTERM.
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Processes:
    """Every child process of a benchmark run; `close()` stops them all, even on Ctrl-C.

    Each child leads its own process group (so the terminal's Ctrl-C reaches only the parent,
    which then stops them in order) and is killed with its whole group, workers' own children
    included.
    """

    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench_logs_")))
    keep_logs: bool = False
    running: list[subprocess.Popen[str]] = field(default_factory=list)
    _count: int = 0

    def spawn(
        self,
        argv: Sequence[str],
        env: dict[str, str],
        name: str,
        *,
        pipes: bool = True,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[str]:
        """Start `argv` (in `cwd`, default the repository root) with its output in a log file,
        or only stderr there with `pipes` (then stdin and stdout are pipes to the child)."""
        self._count += 1
        with open(self.logs / f"{self._count:03d}-{name}.log", "w") as log:
            proc = subprocess.Popen(
                argv,
                cwd=cwd or ROOT,
                env=env,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else log,
                stderr=log if pipes else subprocess.STDOUT,
                text=True,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.running.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[str], grace: float = 5.0) -> None:
        """SIGTERM the process group of `proc`, then SIGKILL it after `grace` seconds."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        # A worker's own children (django-q2's cluster) may outlive their leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for stream in (proc.stdin, proc.stdout):
            if stream:
                with contextlib.suppress(OSError):
                    stream.close()
        if proc in self.running:
            self.running.remove(proc)

    def stop_all(self, grace: float = 5.0) -> None:
        for proc in list(self.running):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in list(self.running):
            self.stop(proc, grace)

    def close(self) -> None:
        self.stop_all()
        if self.keep_logs:
            print(f"child logs kept in {self.logs}", file=sys.stderr)
        else:
            shutil.rmtree(self.logs, ignore_errors=True)

    def run(
        self, argv: Sequence[str], env: dict[str, str], name: str, timeout: float = 300
    ) -> None:
        """Run the command `argv` to its end; raise ChildError if it fails or runs over."""
        proc = self.spawn(argv, env, name, pipes=False)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise ChildError(f"{name} ran over {timeout:.0f}s", proc) from None
        self.stop(proc)
        if proc.returncode:
            raise ChildError(f"{name} failed", proc)

    def call(self, db: BenchDB, target: str, timeout: float = 1800, **kwargs: Any) -> Any:
        """Run `module:function(**kwargs)` in a Django child on `db` and return its result."""
        proc = self.spawn(child_command(target, **kwargs), child_env(db), target.split(":")[-1])
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            raise ChildError(f"{target} ran over {timeout:.0f}s", proc) from None
        self.stop(proc)
        return read_result(out, proc, target)

    def start_barrier(self, db: BenchDB, target: str, **kwargs: Any) -> subprocess.Popen[str]:
        """Start a child that prepares, prints READY and waits for GO (see `wait_for_go`)."""
        return self.spawn(child_command(target, **kwargs), child_env(db), target.split(":")[-1])

    def release_barrier(
        self,
        procs: Sequence[subprocess.Popen[str]],
        target: str,
        timeout: float = 1800,
        at_go: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Wait until every child in `procs` is READY, call `at_go`, let them all go, return
        their results."""
        for proc in procs:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != READY:
                proc.wait(timeout=30)
                raise ChildError(f"{target} did not get ready", proc)
        if at_go is not None:
            at_go()
        for proc in procs:
            if proc.stdin:
                proc.stdin.write(GO + "\n")
                proc.stdin.flush()
        results = []
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ChildError(f"{target} ran over {timeout:.0f}s", proc) from None
            results.append(read_result(out, proc, target))
            self.stop(proc)
        return results


def measure_sizes_on(
    args: argparse.Namespace, db: BenchDB, procs: Processes, target: str, **kwargs: Any
) -> list[tuple[str, dict[str, Any]]]:
    """Run `target` (a child's `measure_sizes(sizes, ...)`) on `db` for `args.sizes`; return
    (vendor, step) pairs."""
    note(f"{db.vendor}: sizes {args.sizes} ...")
    steps = procs.call(db, target, timeout=args.timeout, sizes=args.sizes, **kwargs)
    return [(db.vendor, step) for step in steps]


def poll_until(
    db: BenchDB,
    conn: Any,
    sql: str,
    *,
    timeout: float,
    what: str,
    watch: Sequence[subprocess.Popen[str]],
    every: float = 0.02,
) -> tuple[Any, ...]:
    """Run `sql` (one row) on `conn` every `every` seconds until its first value is not NULL;
    return the row. Raise ChildError, with the log of the first of `watch`, after `timeout`
    seconds or as soon as one of `watch` exits."""
    deadline = time.monotonic() + timeout
    while True:
        row = db.row(conn, sql)
        if row[0] is not None:
            return row
        for proc in watch:
            if proc.poll() is not None:
                raise ChildError(f"exited while waiting for {what}", proc)
        if time.monotonic() > deadline:
            raise ChildError(f"no {what} within {timeout:.0f}s", watch[0])
        time.sleep(every)


def wait_for_claim(
    db: BenchDB, conn: Any, job: int, *, timeout: float, what: str, watch: Sequence[Any]
) -> None:
    """Wait until job `job` has an attempt-ledger row (a worker claimed it); see `poll_until`."""
    poll_until(
        db,
        conn,
        f"SELECT (SELECT claimed_at FROM {LEDGER_TABLE} WHERE job_ref = {int(job)})",
        timeout=timeout,
        what=what,
        watch=watch,
    )


def add_case_argument(
    parser: argparse.ArgumentParser, parse: Callable[[str], Any], fields: str, defaults: Any
) -> None:
    """Add the repeatable `--case FIELDS` option, parsed by `parse` into `args.cases` (None
    when not given); its help lists `defaults`, objects with a `label()`."""
    parser.add_argument(
        "--case",
        dest="cases",
        type=parse,
        action="append",
        default=None,
        help=f"{fields}, repeatable (default: " + " ".join(c.label() for c in defaults) + ")",
    )


class ChildError(RuntimeError):
    """A child process failed; the message ends with the tail of its log."""

    def __init__(self, what: str, proc: subprocess.Popen[str]) -> None:
        path = getattr(proc, "log_path", None)
        tail = Path(path).read_text(errors="replace")[-3000:] if path else ""
        super().__init__(f"{what} (exit code {proc.returncode})\n{tail}")


def read_result(out: str, proc: subprocess.Popen[str], target: str) -> Any:
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise ChildError(f"{target} returned no result", proc)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt, so `finally` blocks clean up
    (SIGINT too: a shell starts background jobs with it ignored)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {
        sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_main(body: Any, args: argparse.Namespace) -> int:
    """Run `body(args, processes)` with cleanup on any exit; return the exit code."""
    procs = Processes(keep_logs=args.keep_logs)
    try:
        with interruptible():
            body(args, procs)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping child processes and dropping databases", file=sys.stderr)
        return 130
    except ChildError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        procs.close()
    return 0


def wait_for_go() -> None:
    """In a child: say READY, then block until the parent says GO (or gives no stdin)."""
    print(READY, flush=True)
    sys.stdin.readline()


# ---- statistics and output -------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Return the `q`-th percentile (0-100) of `values`, interpolated linearly."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(ms: Sequence[float]) -> list[str]:
    """Return the p50, p95, p99 and max of `ms`, formatted."""
    return [f"{percentile(ms, q):.2f}" for q in (50, 95, 99)] + [f"{max(ms):.2f}"]


def median_range(values: Sequence[float]) -> str:
    """Return "median (min-max)", or the one value, with two decimals."""
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def spread(values: Sequence[float]) -> str:
    """Return (max - min) / median as a percentage: how much the rounds disagree."""
    median = statistics.median(values)
    return f"±{(max(values) - min(values)) / 2 / median * 100:.0f}%" if median else "-"


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO = sys.stdout
) -> None:
    """Print `rows` as an aligned plain-text table (numbers right-aligned)."""
    cells = [[str(c) for c in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
        ).rstrip()

    print(f"\n{title}", file=out)
    print(line(cells[0]), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells[1:]:
        print(line(row), file=out)
    out.flush()


def print_markdown(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print `rows` as a markdown table (numbers right-aligned)."""
    numeric = [any(_numeric(str(row[i])) for row in rows) for i in range(len(headers))]
    align = ["---:" if right else "---" for right in numeric]
    for row in (headers, align, *rows):
        print("| " + " | ".join(str(c) for c in row) + " |")


def commit() -> str:
    """The checkout's commit (short hash, "-dirty" with uncommitted changes)."""
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def print_skipped(skipped: dict[str, str]) -> None:
    """Print what was not measured, and why, under a table."""
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")


def _numeric(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text[0] in "±-+.") and text != "-"


def note(text: str) -> None:
    """Print a progress line on stderr (tables go to stdout)."""
    print(text, file=sys.stderr, flush=True)


# ---- Django side (run inside children only) --------------------------------------------------


def migrate(then: str | None = None) -> dict[str, Any]:
    """Create every table of the benchmark project; then run the SQL of the file `then`, if
    given (a what-if: a schema the migrations do not make, measured before it is proposed)."""
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0, interactive=False)
    if then:
        with connection.cursor() as cursor:
            cursor.execute(Path(then).read_text())
    return {}


def vendor() -> str:
    from django.db import connection

    return connection.vendor


def execute(sql: str, params: Sequence[Any] = ()) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def empty_tables(*tables: str) -> None:
    """Remove every row of `tables` (TRUNCATE where the database has it)."""
    from django.db import connection

    quoted = ", ".join(connection.ops.quote_name(t) for t in tables)
    if connection.vendor == "postgresql":
        execute(f"TRUNCATE {quoted} RESTART IDENTITY CASCADE")
    elif connection.vendor == "mysql":
        execute("SET FOREIGN_KEY_CHECKS = 0")
        for table in tables:
            execute(f"TRUNCATE {connection.ops.quote_name(table)}")
        execute("SET FOREIGN_KEY_CHECKS = 1")
    else:
        for table in tables:
            execute(f"DELETE FROM {connection.ops.quote_name(table)}")


def analyze(*tables: str) -> None:
    """Refresh the planner statistics of `tables`, so every plan sees the real row counts."""
    from django.db import connection

    for table in tables:
        quoted = connection.ops.quote_name(table)
        execute(f"ANALYZE TABLE {quoted}" if connection.vendor == "mysql" else f"ANALYZE {quoted}")


def seed_pending(count: int, kind: str = "noop") -> None:
    """Add `count` pending, due jobs of `kind` (run_at from the database clock)."""
    from django_leases.models import PaymentJob

    PaymentJob.objects.bulk_create(
        (PaymentJob(kind=kind, payload={}) for _ in range(count)), batch_size=2000
    )


def claim_timings(
    claims: int, *, limit: int, ttl: float, owner: str, kinds: list[str] | None = None
) -> dict[str, Any]:
    """Claim `claims` times; return each claim() call's latency in ms ("ms"), how many claims
    found nothing ("empty") and how many jobs they got ("jobs").

    Each claimed job is then completed, outside the timed region, as a worker would. The caller
    seeds more jobs than it claims, so a claim that finds nothing is a claim that missed jobs.
    """
    from django_leases.models import PaymentJob

    manager = PaymentJob.objects
    timings, empty, claimed = [], 0, 0
    for _ in range(claims):
        start = time.perf_counter()
        jobs = manager.claim(owner, ttl=ttl, limit=limit, kinds=kinds)
        timings.append((time.perf_counter() - start) * 1000)
        empty += not jobs
        claimed += len(jobs)
        for job in jobs:
            manager.complete(job.pk, owner, job.lease_token)
    return {"ms": timings, "empty": empty, "jobs": claimed}


def owner_name(role: str) -> str:
    return f"bench-{role}-{os.getpid()}"
