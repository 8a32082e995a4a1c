"""Which thread writes a worker part's shared fields, asserted where they are written.

The checks cost nothing unless switched on (`check_owners(True)`): the test suite switches them
on, so every in-process worker of the tests asserts its owners as it runs; a production worker
checks nothing. The rules themselves are in docs/architecture.md's thread table.
"""

from __future__ import annotations

import threading
from typing import cast

_checking = False


class OwnerError(AssertionError):
    """A shared field written by a thread that does not own it, or without its lock: a bug of
    ours."""


def check_owners(on: bool) -> None:
    """Switch the owner checks on or off, for the parts built from now on."""
    global _checking
    _checking = on


def checking() -> bool:
    """Whether the owner checks are on."""
    return _checking


class Owner:
    """The one thread that writes some fields: the thread that `bind()`s it (the loop: the
    thread that calls `LeaseWorker.run()`); any thread before that, as while the worker is
    being built."""

    __slots__ = ("role", "thread")

    def __init__(self, role: str) -> None:
        self.role = role
        self.thread: threading.Thread | None = None

    def bind(self) -> None:
        """Make the calling thread the owner."""
        self.thread = threading.current_thread()

    def writes(self, field: str) -> None:
        """Raise `OwnerError` if the checks are on and the calling thread is not the owner."""
        if _checking and self.thread is not None:
            current = threading.current_thread()
            if current is not self.thread:
                raise OwnerError(
                    f"{field} is written by the {self.role} thread ({self.thread.name}) only, "
                    f"not by {current.name}"
                )


class TrackedLock:
    """A lock that knows the thread holding it (`held()`): what the checks ask of a part's lock.
    A `threading.Condition` may be built on it."""

    __slots__ = ("_holder", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._holder = threading.get_ident()
        return got

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def held(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._holder == threading.get_ident()

    def _is_owned(self) -> bool:  # what `threading.Condition.wait()` asks of its lock
        return self.held()


def part_lock() -> threading.Lock:
    """A part's lock: a plain `threading.Lock`, or a `TrackedLock` (which does what a lock does)
    while the checks are on."""
    return cast(threading.Lock, TrackedLock()) if _checking else threading.Lock()


def holds(lock: object) -> bool:
    """Whether the calling thread holds `lock` (known of a `TrackedLock` only: False else)."""
    return isinstance(lock, TrackedLock) and lock.held()


def under(lock: object, field: str) -> None:
    """Raise `OwnerError` if the checks are on and the calling thread does not hold `lock`."""
    if isinstance(lock, TrackedLock) and not lock.held():
        raise OwnerError(f"{field} is written under its part's lock only")
