"""Fixtures shared by the suite: real worker subprocesses against the test database."""

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


def read_until(proc: "subprocess.Popen[str]", *texts: str, timeout: float = 30.0) -> str:
    """Read the process's output until every one of `texts` has appeared; return all it read.

    It reads the pipe itself, never through `proc.stdout`'s buffer: a line buffered there would
    be invisible to `select()` (and to a later `communicate()`) until the process wrote more.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    read = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break  # the process closed its output
        read += chunk
        text = read.decode(errors="replace")
        if all(wanted in text for wanted in texts):
            return text
    text = read.decode(errors="replace")
    missing = sorted(wanted for wanted in texts if wanted not in text)
    pytest.fail(f"{missing} not seen in the output within {timeout}s: {text}")


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
