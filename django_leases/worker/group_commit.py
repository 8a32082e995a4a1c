"""`GroupCommit`: writes that threads need at the same moment, made in one call.

Flat combining, as PostgreSQL's own group commit: each thread submits its item and waits for
its result. A thread that finds no write under way writes every item waiting, its own included,
in one call; items submitted meanwhile wait for the next write, which one of their threads makes
once this one is done. Nothing waits for a batch to fill: a lone item is written after one
scheduler turn, and a batch forms only from items whose threads would otherwise have queued for
the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Pending(Generic[T, R]):
    __slots__ = ("done", "error", "item", "result")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    """Run `write(items)` for the items of every thread waiting in `submit()`, one call at a time.

    `write` returns one result per item, in order. If it raises, every thread of that batch gets
    the exception from `submit()`.
    """

    def __init__(self, write: Callable[[list[T]], list[R]]) -> None:
        self._write = write
        self._ready = threading.Condition()
        self._waiting: list[_Pending[T, R]] = []
        self._writing = False

    def submit(self, item: T) -> R:
        """Have `item` written, with whatever else waits, and return its result."""
        pending: _Pending[T, R] = _Pending(item)
        with self._ready:
            self._waiting.append(pending)
            while not pending.done:
                if self._writing:
                    self._ready.wait()
                else:
                    self._write_waiting()
        if pending.error is not None:
            raise pending.error
        return pending.result  # type: ignore[return-value]

    def _write_waiting(self) -> None:
        """Write every waiting item; called, and returns, with the condition's lock held."""
        self._writing = True
        batch: list[_Pending[T, R]] = []
        results: list[R] | None = None
        error: BaseException | None = None
        self._ready.release()
        try:
            # One scheduler turn first (it lets go of the GIL): threads about to submit, such as
            # a slot whose handler is returning right now, join this write instead of waiting
            # for the next one, as with PostgreSQL's commit_delay.
            time.sleep(0)
            with self._ready:
                batch, self._waiting = self._waiting, []
            results = self._write([pending.item for pending in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} items")
        except BaseException as exc:  # noqa: BLE001 - handed to every thread of the batch
            error = exc
        finally:
            self._ready.acquire()
            self._writing = False
            for n, pending in enumerate(batch):
                pending.error = error
                pending.result = None if error is not None or results is None else results[n]
                pending.done = True
            self._ready.notify_all()
