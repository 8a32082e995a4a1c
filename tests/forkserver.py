"""Start the suite's Python children from a process that has imported Django already.

The suite starts hundreds of real worker, watcher and helper processes. Each spent about 0.45 s
of CPU importing Django and its database drivers before it did anything: most of the suite's
CPU time on two cores. A fork server, one per test process, imports those modules once
(`PRELOAD`: third-party modules only, none of this repository's, and nothing that reads the
settings) and forks a child for each start. The child becomes a session of its own, takes the
test's pipe as its output and /dev/null as its input, the test's environment, arguments and
working directory, and runs the script, `-m` module or `-c` code as `python` would: the same
code from there on (Django's set-up, the command, its signals and exit status).

Each child is forked twice, so that it becomes a child of the test process itself (a child
subreaper, `PR_SET_CHILD_SUBREAPER`) once the middle process has exited: `subprocess.Popen`'s
wait, poll, signals and return code then work as for a child it started itself (`ForkedPopen`).

A child whose start a fork cannot reproduce starts the plain way: a prefix (faketime), or an
environment that differs from the server's in what Python reads at start-up (`PYTHON*`, `LD_*`,
the locale, `TZ`). So does every child when `LEASES_TEST_FORKSERVER=0`, or where the server
cannot be had.

    python -m tests.forkserver FD    (started by `server()`: FD is its end of the socket)
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import runpy
import socket
import subprocess
import sys
import threading
import types
from typing import Any

PRELOAD = (
    "django.core.management",
    "django.core.management.base",
    "django.core.checks",
    "django.core.serializers.json",
    "django.db.models",
    "django.db.migrations",
    "django.db.backends.sqlite3.base",
    "django.db.backends.postgresql.base",
    "django.db.backends.mysql.base",
    "django.http",
    "django.urls",
    "django.forms",
    "django.template.defaulttags",
    "django.template.defaultfilters",
    "django.template.loader_tags",
    "django.views.generic",
    "django.contrib.admin.sites",
    "django.contrib.admin.options",
    "django.contrib.admin.filters",
    "django.contrib.staticfiles.checks",
    "django.utils.log",
    "asgiref.sync",
    "environ",
    "asyncio",
    "logging.config",
    "importlib.metadata",
)
"""Modules the server imports before it forks (those that fail to import are left out)."""

STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "FAKETIME")
STARTUP_NAMES = ("LANG", "LANGUAGE", "TZ")
"""Environment variables Python or the C library reads when a process starts: a child whose
environment differs from the server's in any of them is started the plain way."""

PR_SET_CHILD_SUBREAPER = 36
MESSAGE_SIZE = 1 << 18


def startup_environment(env: dict[str, str]) -> dict[str, str]:
    """Return the variables of `env` that a process reads when it starts."""
    return {
        name: value
        for name, value in env.items()
        if name.startswith(STARTUP_PREFIXES) or name in STARTUP_NAMES
    }


# ---- the server -----------------------------------------------------------------------------


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork a child for each request on `sock` and answer with its pid; return the request in
    the child, None in the server once the test process has closed its end."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112 - not installed, or needs settings: the child imports it
            continue
    from django.conf import settings

    if settings.configured:  # a module read the settings: a child must read its own
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    sock.sendall(b"ready")
    while True:
        message, fds, _flags, _address = socket.recv_fds(sock, MESSAGE_SIZE, 1)
        if not message:
            return None
        request = json.loads(message)
        (output,) = fds
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(read)
            child = os.fork()
            if child == 0:
                os.close(write)
                sock.close()
                become(request, output)
                return request
            os.write(write, str(child).encode())
            os._exit(0)
        os.close(write)
        os.close(output)
        os.waitpid(middle, 0)
        # The middle process has exited: its child is now the test process's child.
        pid = os.read(read, 32) or b"0"
        os.close(read)
        sock.sendall(pid)


def become(request: dict[str, Any], output: int) -> None:
    """Make this forked process what `subprocess.Popen` would have started for `request`."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def run(argv: list[str]) -> None:
    """Run `argv` (the arguments after `python`) in this process, as `python` would."""
    first, rest = argv[0], argv[1:]
    if first == "-m":
        module, *args = rest
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif first == "-c":
        code, *args = rest
        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 - the test's own code
    else:
        sys.argv = [first, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(first))
        runpy.run_path(first, run_name="__main__")


# ---- the test process's side ----------------------------------------------------------------


class ForkServerError(Exception):
    """The fork server could not start a child."""


class ForkServer:
    """A running fork server and this process's end of its socket."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.startup = startup_environment(env)
        self.lock = threading.Lock()
        # Nothing of a test's own (the settings module, its database names) reaches the server.
        own = {name: env[name] for name in ("PATH", "HOME") if name in env}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.proc = subprocess.Popen(  # noqa: S603 - this interpreter and module
            [sys.executable, "-m", "tests.forkserver", str(theirs.fileno())],
            cwd=cwd,
            env={**own, **self.startup},
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.ready = False

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a child with environment `env` can be forked rather than started."""
        return startup_environment(env) == self.startup and self.proc.poll() is None

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, output: int) -> int:
        """Fork a child running `argv` (after `python`) with its output to `output`; its pid."""
        with self.lock:
            try:
                if not self.ready:
                    self.sock.settimeout(60)
                    self.ready = self.sock.recv(16) == b"ready"
                    if not self.ready:
                        raise ForkServerError("the fork server did not start")
                request = {"argv": argv, "env": env, "cwd": cwd}
                socket.send_fds(self.sock, [json.dumps(request).encode()], [output])
                pid = int(self.sock.recv(32) or b"0")
            except (OSError, ValueError) as exc:
                raise ForkServerError(str(exc)) from exc
        if pid <= 0:
            raise ForkServerError("the fork server did not fork")
        return pid

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def enabled() -> bool:
    """Whether children may be forked here: on Linux, unless `LEASES_TEST_FORKSERVER=0`."""
    return os.environ.get("LEASES_TEST_FORKSERVER", "1") != "0" and sys.platform == "linux"


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server(env: dict[str, str], cwd: str) -> ForkServer | None:
    """This process's fork server, started at the first call; None where there is none."""
    global _server
    if not enabled():
        return None
    with _server_lock:
        if _server is None:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                return None
            _server = ForkServer(env, cwd)
        return _server


def close() -> None:
    """Stop this process's fork server, if it started one."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


class ForkedPopen(subprocess.Popen[str]):
    """A `subprocess.Popen` whose child `server` forks, or that starts it the plain way if the
    server cannot. Only `[sys.executable, *argv]` with `start_new_session=True`, output piped."""

    def __init__(self, fork_server: ForkServer, args: list[str], **kwargs: Any) -> None:
        self._fork_server = fork_server
        super().__init__(args, **kwargs)

    def _execute_child(  # type: ignore[override]
        self,
        args: list[str],
        executable: Any,
        preexec_fn: Any,
        close_fds: bool,
        pass_fds: Any,
        cwd: str,
        env: dict[str, str],
        startupinfo: Any,
        creationflags: int,
        shell: bool,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *rest: Any,
    ) -> None:
        try:
            self.pid = self._fork_server.fork(list(args[1:]), env, str(cwd), c2pwrite)
        except ForkServerError:
            super()._execute_child(  # type: ignore[misc]
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                *rest,
            )  # fmt: skip
            return
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


if __name__ == "__main__":
    request = serve(socket.socket(fileno=int(sys.argv[1])))
    if request is not None:
        run(request["argv"])
