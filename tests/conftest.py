"""Fixtures shared by the suite: real worker subprocesses against the test database."""

import ast
import codecs
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit
from weakref import WeakKeyDictionary

import pytest
from django.db import connection, connections

from django_leases.network import UNWRAPPED_CALLS

from . import forkserver
from .pgbouncer import EXECUTABLE as PGBOUNCER
from .pgbouncer import PgBouncer
from .ports import free_port

ROOT = Path(__file__).resolve().parent.parent
# The database under test, as chosen by DATABASE_URL (unset or empty: SQLite).
ON_SQLITE = (os.environ.get("DATABASE_URL") or "sqlite").startswith("sqlite")


@pytest.fixture(autouse=True, scope="session")
def owners_checked() -> None:
    """Assert the worker's thread owners in every in-process worker of the suite."""
    # Imported here: the worker package loads the models, which needs Django set up first.
    from django_leases.worker.owners import check_owners

    check_owners(True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--serial-tests",
        choices=("only", "exclude"),
        help="keep only the tests marked serial, or leave them out (scripts/test's two passes)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect by --serial-tests, and start the tests marked slow first: on several processes
    (-n) a slow test that starts last would be the only one still running."""
    choice = config.getoption("serial_tests")
    if choice:
        kept: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            (kept if serial == (choice == "only") else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    items.sort(key=lambda item: not item.get_closest_marker("slow"))


HORIZON_READS = 0 if connection.vendor == "sqlite" else 1
"""Queries `horizon.oldest_pin()` makes: none on SQLite, which has no vacuum horizon."""


def modules_importing(package: str) -> list[str]:
    """The modules of django_leases that import `package` (or a module of it), anywhere in them."""
    importers = set()
    for module in sorted((ROOT / "django_leases").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.split(".")[0] == package for name in names):
                importers.add(module.relative_to(ROOT).as_posix())
    return sorted(importers)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that must use this test run's database."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "LEASES_TEST_DB_NAME": str(connection.settings_dict["NAME"]),
        "LEASES_TEST_OTHER_DB_NAME": str(connections["other"].settings_dict["NAME"]),
        "LEASES_TEST_LOCAL_DB_NAME": str(connections["local"].settings_dict["NAME"]),
        "LEASES_TEST_PSP_DB_NAME": str(connections["psp"].settings_dict["NAME"]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def database_url(
    *, user: str | None = None, password: str | None = None, port: int | None = None
) -> str:
    """Return DATABASE_URL of this run with its user, password or port replaced."""
    url = urlsplit(os.environ["DATABASE_URL"])
    user = url.username if user is None else user
    password = url.password if password is None else password
    login = quote(user or "") + (f":{quote(password)}" if password else "")
    netloc = f"{login}@{url.hostname}:{port or url.port}"
    return urlunsplit(url._replace(netloc=netloc))


def wait_for(
    predicate: Callable[[], object], *, timeout: float = 30.0, interval: float = 0.05
) -> object:
    """Poll `predicate` until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout}s: {predicate}")
        time.sleep(interval)


# Output read from a child's pipe by read_until() beyond the lines it returned.
UNREAD: "WeakKeyDictionary[subprocess.Popen[str], tuple[str, codecs.IncrementalDecoder]]" = (
    WeakKeyDictionary()
)


def read_until(proc: "subprocess.Popen[str]", *texts: str, timeout: float = 30.0) -> str:
    """Read the process's output line by line until every one of `texts` has appeared.

    Reads the pipe's file descriptor itself: `proc.stdout.readline()` would read ahead into
    Python's buffer, where select() cannot see the lines still waiting, and the next wait would
    last until the child writes again. What was read past the last line returned waits for the
    next read_until() or finish().
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    pending, decoder = UNREAD.get(proc) or ("", codecs.getincrementaldecoder("utf-8")("replace"))
    seen: list[str] = []
    missing = set(texts)
    deadline = time.monotonic() + timeout
    while True:
        while "\n" in pending:
            line, pending = pending.split("\n", 1)
            seen.append(line + "\n")
            missing = {text for text in missing if text not in line}
            if not missing:
                UNREAD[proc] = (pending, decoder)
                return "".join(seen)
        if time.monotonic() >= deadline:
            break
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # the child closed its output
            pending += decoder.decode(chunk)
    UNREAD[proc] = (pending, decoder)
    pytest.fail(f"{sorted(missing)} not seen in the output within {timeout}s: {''.join(seen)}")


def finish(proc: "subprocess.Popen[str]", timeout: float = 60) -> str:
    """Wait for the process to exit and return the output read_until() has not returned yet."""
    out, _ = proc.communicate(timeout=timeout)
    pending, decoder = UNREAD.pop(proc, ("", None))
    if decoder is not None:
        pending += decoder.decode(b"", final=True)
    return pending + (out or "")


def processes_marked(name: str, value: str) -> list[int]:
    """Return the pids of live processes whose environment has `name` set to `value`."""
    found = []
    wanted = f"{name}={value}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if wanted in environ and state != "Z":
            found.append(int(entry.name))
    return found


class Processes:
    """Child processes started by one test; all are killed at teardown, and so is every process
    they started, even in a session of its own (the demo's workers): each carries `MARKER` in
    its environment. A test that fails before it stops its processes' children must not leave
    them writing into the next test's database."""

    MARKER = "LEASES_TEST_PROCESSES"

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.marker = uuid.uuid4().hex

    def start(
        self, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None
    ) -> subprocess.Popen[str]:
        cmd = [*(prefix or []), sys.executable, *args]
        env = {**(env or subprocess_env()), self.MARKER: self.marker}
        options: dict[str, Any] = {
            "cwd": ROOT,
            "env": env,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.STDOUT,
            "text": True,
            "start_new_session": True,
        }
        fork_server = None if prefix else forkserver.server(env, str(ROOT))
        if fork_server is not None and fork_server.serves(env):
            proc: subprocess.Popen[str] = forkserver.ForkedPopen(fork_server, cmd, **options)
        else:
            proc = subprocess.Popen(cmd, **options)
        self.procs.append(proc)
        return proc

    def manage(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return self.start(str(ROOT / "manage.py"), *args, **kwargs)  # type: ignore[arg-type]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
            if proc.stdout:
                proc.stdout.close()
        if not self.procs:
            return
        for _ in range(50):
            left = processes_marked(self.MARKER, self.marker)
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise AssertionError(f"processes {left} outlived SIGKILL")


@pytest.fixture(autouse=True)
def unhardened() -> Iterator[None]:
    """Give back this thread's connections as the test found them. A test that runs a watcher
    pass or a worker loop in-process hardens them (`network.harden()`), and every later test of the
    process would see its statement timeout in front of the SQL it captures."""
    saved = [
        (
            conn,
            conn.settings_dict,
            list(conn.execute_wrappers),
            {name: conn.__dict__[name] for name in UNWRAPPED_CALLS if name in conn.__dict__},
        )
        for conn in connections.all()
    ]
    yield
    for conn, settings_dict, wrappers, methods in saved:
        conn.settings_dict = settings_dict
        conn.execute_wrappers[:] = wrappers
        for name in UNWRAPPED_CALLS:
            conn.__dict__.pop(name, None)
        conn.__dict__.update(methods)


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.kill_all()


@pytest.fixture(scope="session", params=["transaction", "session"])
def pgbouncer(request: pytest.FixtureRequest) -> Iterator[PgBouncer]:
    """A PgBouncer of stock configuration in front of the test database's server, in transaction
    pooling, then in session pooling; one of each per test process (xdist worker)."""
    if connection.vendor != "postgresql":
        pytest.skip("PgBouncer pools PostgreSQL connections: these tests run on PostgreSQL")
    if PGBOUNCER is None:
        pytest.skip("pgbouncer is not installed (Debian and Ubuntu: apt-get install pgbouncer)")
    mode: str = request.param
    # Transaction pooling shares 4 server sessions among every client's transactions. Session
    # pooling gives a client a server session until it disconnects: its pool is PgBouncer's
    # default, which holds every connection a test opens at once.
    size = 4 if mode == "transaction" else 20
    url = os.environ["DATABASE_URL"]
    with PgBouncer(url, pool_mode=mode, pool_size=size, port=free_port()) as bouncer:
        yield bouncer


def pytest_sessionfinish(session: pytest.Session) -> None:
    forkserver.close()
