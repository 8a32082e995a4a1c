"""Fixtures shared by the suite: real worker subprocesses against the test database."""

import codecs
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from weakref import WeakKeyDictionary

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
# The database under test, as chosen by DATABASE_URL (unset or empty: SQLite).
ON_SQLITE = (os.environ.get("DATABASE_URL") or "sqlite").startswith("sqlite")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that must use this test run's database."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "LEASES_TEST_DB_NAME": str(connection.settings_dict["NAME"]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


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


class Processes:
    """Child processes started by one test; all are killed at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None
    ) -> subprocess.Popen[str]:
        cmd = [*(prefix or []), sys.executable, *args]
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env or subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
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


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    yield procs
    procs.kill_all()
