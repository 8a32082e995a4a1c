"""The suite's fork server (tests/forkserver.py): a forked child is what a started one would be."""

import json
import os
import signal
from pathlib import Path

import pytest

from . import forkserver
from .conftest import ROOT, Processes, finish, subprocess_env

# Prints what a child can see of how it was started.
PROBE = (
    "import json, os, sys; "
    "print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'pid': os.getpid(), "
    "'pgid': os.getpgid(0), 'sid': os.getsid(0), "
    "'mark': os.environ.get('PROBE_MARK'), 'path0': sys.path[0], "
    "'stdin': sys.stdin.read(), 'main': __name__, 'started': sys.orig_argv[1:3]})); "
    "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))"
)

pytestmark = pytest.mark.skipif(
    not forkserver.enabled(), reason="no fork server here (not Linux, or turned off)"
)


def probe(processes: Processes, *args: str, **env: str) -> tuple[dict[str, object], str, int]:
    proc = processes.start("-c", PROBE, *args, env=subprocess_env(**env))
    out = finish(proc)
    first, *rest = out.splitlines()
    return json.loads(first), "\n".join(rest), proc.pid


def test_forkserver__a_forked_child_is_a_child_of_its_own_session(processes: Processes) -> None:
    seen, rest, pid = probe(processes, "7", "x", PROBE_MARK="m1")
    proc = processes.procs[-1]
    assert isinstance(proc, forkserver.ForkedPopen)
    assert proc.returncode == 7
    assert seen == {
        "argv": ["-c", "7", "x"],
        "cwd": str(ROOT),
        "pid": pid,
        "pgid": pid,  # start_new_session
        "sid": pid,
        "mark": "m1",
        "path0": "",
        "stdin": "",
        "main": "__main__",
        "started": ["-m", "tests.forkserver"],  # forked, not started the plain way
    }
    assert rest == "to stderr"


def test_forkserver__a_signal_ends_a_forked_child_as_any_child(processes: Processes) -> None:
    proc = processes.start("-c", "import time; print('up', flush=True); time.sleep(60)")
    assert isinstance(proc, forkserver.ForkedPopen)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    assert proc.poll() is None
    # Reparented to the test process once the server answered: Popen waits for it.
    stat = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert int(stat[1]) == os.getpid()
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_forkserver__a_module_and_a_script_run_as_python_runs_them(processes: Processes) -> None:
    module = processes.start("-m", "json.tool", "--help")
    assert isinstance(module, forkserver.ForkedPopen)
    assert "usage:" in finish(module) and module.returncode == 0
    script = processes.manage("help", "run_lease_worker")
    assert isinstance(script, forkserver.ForkedPopen)
    assert "--burst" in finish(script) and script.returncode == 0


def test_forkserver__a_start_up_environment_of_its_own_starts_the_plain_way(
    processes: Processes,
) -> None:
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    proc = processes.start("-c", "import sys; print(sys.path[1]); print(sys.orig_argv[1])", env=env)
    assert not isinstance(proc, forkserver.ForkedPopen)
    # Started from its own command line, not the server's.
    assert finish(proc).split() == [str(ROOT / "tests"), "-c"]
    assert proc.returncode == 0
