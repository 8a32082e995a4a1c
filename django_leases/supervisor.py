"""`run_lease_worker --processes N`: N worker processes under one supervisor and one LISTEN.

The supervisor starts each worker process (`run_lease_worker` with its own options, settings
and import path), starts one that exits again (after a growing delay if it keeps
dying), passes SIGTERM/SIGINT on, and holds the host's only LISTEN connection: it hands each
enqueue notification to one idle process (`Dispatch`) through the socket pair it shares with
that process, instead of every process waking to claim and all but one finding nothing.

A worker process says on its end (`Link`) when it starts and stops waiting for work. It
treats the end of its socket (the supervisor died, even by SIGKILL) as a stop request: it
claims nothing more, its running jobs finish within the grace period, and it exits 0.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from django.conf import settings

from django_leases.backoff import reconnect_delay
from django_leases.listener import Listener

logger = logging.getLogger("django_leases.worker")

WAITING = b"i"
"""A worker process to the supervisor: it waits for work with a slot free."""
NOT_WAITING = b"b"
"""A worker process to the supervisor: it left its wait without a wake-up of ours."""
WAKE = b"w"
"""The supervisor to a worker process: a job was enqueued; claim."""

EXIT_REFUSED = 1
"""A worker process's status for bad options, settings or database: a new start would fail
alike, so the supervisor stops the others and exits with it."""
RESTART_FIRST = 0.5
RESTART_MAX = 30.0
STABLE_AFTER = 30.0
"""A process that ran this many seconds before it died is restarted without delay growth."""


class Dispatch:
    """Hand each wake-up to one idle worker process, first come first served (spreading the
    work over the processes, and so over the host's cores). A wake-up that finds none idle is
    owed to the next one that says it waits (at most one per process), so that a job enqueued
    between a process's empty claim and its wait is not left to its next poll."""

    def __init__(self, processes: int) -> None:
        self._lock = threading.Lock()
        self._idle: dict[int, socket.socket] = {}
        self._owed = 0
        self._most_owed = processes

    @property
    def owed(self) -> int:
        with self._lock:
            return self._owed

    def notified(self) -> None:
        """An enqueue was announced: wake one idle process, or owe the wake-up."""
        with self._lock:
            while self._idle:
                number = next(iter(self._idle))
                if _send(self._idle.pop(number), WAKE):
                    return
            self._owed = min(self._owed + 1, self._most_owed)

    def waiting(self, number: int, end: socket.socket) -> None:
        """Process `number` waits for work: wake it at once if a wake-up is owed."""
        with self._lock:
            if self._owed and _send(end, WAKE):
                self._owed -= 1
                return
            self._idle[number] = end

    def busy(self, number: int) -> None:
        """Process `number` no longer waits (it claims, or it is gone)."""
        with self._lock:
            self._idle.pop(number, None)


def _send(end: socket.socket, message: bytes) -> bool:
    try:
        end.send(message)
    except OSError:
        return False  # its process is gone; the supervisor sees it exit
    return True


class Link:
    """A worker process's end of its socket pair with the supervisor (`Wakeups` of the loop):
    the wake-ups the supervisor hands it, and its stop once the supervisor is gone.

    A reader thread takes the supervisor's messages as they come, so that the end of the
    socket stops the worker even while every slot is busy and the loop waits for none."""

    def __init__(self, fd: int) -> None:
        self._end = socket.socket(fileno=fd)
        self._woken = threading.Event()
        self._closed = threading.Event()
        self._woke_up = False
        """Whether the current wait ended by a wake-up (the loop's thread only)."""

    def start(self, orphaned: Callable[[], None]) -> None:
        """Start reading; call `orphaned` (the worker's stop) once the supervisor is gone."""

        def read() -> None:
            try:
                while data := self._end.recv(64):
                    if WAKE in data:
                        self._woken.set()
            except OSError:
                pass
            if not self._closed.is_set():
                logger.warning("the supervisor is gone; stopping (running jobs finish first)")
                orphaned()

        threading.Thread(target=read, name="django-leases-supervisor-link", daemon=True).start()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Tell the supervisor that the loop waits for work while the block runs."""
        self._woke_up = False
        if not self._woken.is_set():  # else the first wait() returns at once
            _send(self._end, WAITING)
        try:
            yield
        finally:
            if not self._woke_up:
                _send(self._end, NOT_WAITING)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a wake-up; return whether one came."""
        if not self._woken.wait(timeout):
            return False
        self._woken.clear()
        self._woke_up = True
        return True

    def close(self) -> None:
        self._closed.set()
        try:
            self._end.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._end.close()


@dataclass
class Child:
    """One worker process's place under the supervisor, kept across its restarts."""

    number: int
    proc: subprocess.Popen[bytes] | None = None
    end: socket.socket | None = None
    started_at: float = 0.0
    start_at: float = 0.0
    failures: int = 0
    done: bool = False


class Supervisor:
    """Run `processes` worker processes of `run_lease_worker` until stopped.

    `arguments(number, start)` gives the options of process `number` (1 to `processes`) at the
    supervisor's `start`-th process start. With `burst`, a process that exits 0 is done, and
    the supervisor returns once every process is; otherwise it starts it again. `listener` is
    the LISTEN connection of the job table (None: the processes poll).
    """

    def __init__(
        self,
        processes: int,
        arguments: Callable[[int, int], list[str]],
        *,
        listener: Listener | None,
        burst: bool,
    ) -> None:
        self.children = [Child(number) for number in range(1, processes + 1)]
        self.failure: str | None = None
        """Why the supervisor stopped the processes itself: one exited with `EXIT_REFUSED`."""
        self._arguments = arguments
        self._listener = listener
        self._burst = burst
        self._dispatch = Dispatch(processes)
        self._selector = selectors.DefaultSelector()
        self._starts = 0
        self._stopping = False
        self._starting = threading.Lock()
        """Held while a process starts: `stop()` then waits, so that it signals that one too."""
        self._closing = threading.Event()

    def run(self) -> None:
        """Supervise until every process is done, or stopped after a stop request."""
        listening = None
        if self._listener is not None:
            listening = threading.Thread(
                target=self._listen, args=(self._listener,), name="django-leases-listener"
            )
            listening.start()
        try:
            while not all(child.done for child in self.children):
                self._start_due()
                self._read(timeout=0.2)
                self._reap()
        finally:
            self._closing.set()
            if listening is not None:
                listening.join()
            for child in self.children:
                self._close_end(child)  # a process left running sees its end close and stops
            self._selector.close()

    def stop(self) -> None:
        """Stop every process gracefully (SIGTERM) and start none again; from any thread."""
        with self._starting:
            if self._stopping:
                return
            self._stopping = True
            logger.info("stop requested; stopping %s worker process(es)", len(self.running()))
            for child in self.running():
                _signal(child, signal.SIGTERM)

    def pass_on(self, signum: int) -> None:
        """Send `signum` to every running process (a second SIGTERM/SIGINT: they exit at
        once). Takes no lock: a signal handler calls it."""
        for child in self.running():
            _signal(child, signum)

    def running(self) -> list[Child]:
        return [child for child in self.children if child.proc and child.proc.poll() is None]

    # ---- the LISTEN connection's thread ------------------------------------------------------

    def _listen(self, listener: Listener) -> None:
        try:
            while not self._closing.is_set():
                if listener.wait(0.25):
                    self._dispatch.notified()
        finally:
            listener.close()

    # ---- the supervisor's thread -------------------------------------------------------------

    def _start_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.proc is None and not child.done and now >= child.start_at:
                with self._starting:
                    if self._stopping:
                        child.done = True
                    else:
                        self._start(child)
            elif child.proc is None and self._stopping:
                child.done = True

    def _start(self, child: Child) -> None:
        self._starts += 1
        mine, theirs = socket.socketpair()
        argv = worker_command(
            [*self._arguments(child.number, self._starts), f"--supervisor-fd={theirs.fileno()}"]
        )
        try:
            # A process group of its own: a terminal's Ctrl-C reaches the supervisor alone,
            # which passes it on once (a second one to a worker stops it at once).
            child.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and command
                argv, pass_fds=[theirs.fileno()], process_group=0
            )
        except OSError as exc:
            mine.close()
            self._failed(child, f"could not be started ({exc})")
            return
        finally:
            theirs.close()
        mine.setblocking(False)
        child.end = mine
        child.started_at = time.monotonic()
        self._selector.register(mine, selectors.EVENT_READ, child)
        logger.info("worker process %s started pid=%s", child.number, child.proc.pid)

    def _read(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            child: Child = key.data
            try:
                data = child.end.recv(4096) if child.end else b""
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._close_end(child)  # its process exits; `_reap()` sees it
                continue
            last = data[-1:]  # only its latest state counts
            if last == WAITING and child.end is not None:
                self._dispatch.waiting(child.number, child.end)
            elif last == NOT_WAITING:
                self._dispatch.busy(child.number)

    def _reap(self) -> None:
        for child in self.children:
            if child.proc is None or (code := child.proc.poll()) is None:
                continue
            pid = child.proc.pid
            child.proc = None
            self._close_end(child)
            if self._stopping or (code == 0 and self._burst):
                child.done = True
                logger.info("worker process %s exited pid=%s status=%s", child.number, pid, code)
            elif code == EXIT_REFUSED:
                child.done = True
                self.failure = (
                    f"worker process {child.number} (pid {pid}) exited with status {code}; "
                    "stopping the others"
                )
                logger.error("%s", self.failure)
                self.stop()
            elif code == 0:
                logger.info("worker process %s exited pid=%s; starting it again", child.number, pid)
            else:
                self._failed(child, f"pid {pid} exited with {_status(code)}")

    def _failed(self, child: Child, what: str) -> None:
        """Start `child` again after a delay that grows while it keeps dying young."""
        if time.monotonic() - child.started_at >= STABLE_AFTER:
            child.failures = 0
        child.failures += 1
        delay = reconnect_delay(child.failures, RESTART_FIRST, RESTART_MAX)
        child.start_at = time.monotonic() + delay
        logger.warning(
            "worker process %s %s; starting it again in %.1fs", child.number, what, delay
        )

    def _close_end(self, child: Child) -> None:
        self._dispatch.busy(child.number)
        if child.end is None:
            return
        try:
            self._selector.unregister(child.end)
        except (KeyError, ValueError):
            pass
        child.end.close()
        child.end = None


# A worker process runs the command as manage.py would, on this process's import path
# (manage.py's directory, --pythonpath): argv[1] the path, then the program and its arguments.
BOOTSTRAP = (
    "import os, sys; sys.path[:0] = sys.argv[1].split(os.pathsep); "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(sys.argv[2:])"
)


def worker_command(arguments: list[str]) -> list[str]:
    """The command line of a worker process: `run_lease_worker` with `arguments`, under the
    settings and on the import path of this one."""
    path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
    program = os.path.basename(sys.argv[0]) or "manage.py"
    return [
        sys.executable,
        "-c",
        BOOTSTRAP,
        path,
        program,
        "run_lease_worker",
        f"--settings={settings.SETTINGS_MODULE}",
        *arguments,
    ]


def _signal(child: Child, signum: int) -> None:
    if child.proc is not None:
        try:
            child.proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _status(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"
