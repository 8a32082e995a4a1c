"""The `Dialect` base: what a database without statements of its own does, the ORM's way.

Each database's subclass (`postgresql.py`, `sqlite.py`, `mysql.py`) overrides what it does with
statements of its own; this base is the specification they are tested against
(tests/test_claim_paths.py): the claim as `select_for_update(skip_locked=True)` then the
conditional `filter(...).update(...)`, the batched completion as row locks then the UPDATE of
exactly the rows still held, the ledger written by the ORM. The ORM code itself belongs to the
query layer, which hands it to the dialect (`Jobs`); the dialect decides what runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

from django.db import NotSupportedError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Model
from django.db.models.constants import OnConflict

from django_leases.dialects.insert import InsertDialect
from django_leases.dialects.statements import Claim, LedgerNames, Params

R = TypeVar("R", bound=Model)
DB = BaseDatabaseWrapper
"""A Django connection."""
Statement = tuple[str, Params | None]
"""A statement's text and parameters; None: none, the text is sent as it is."""
CursorFor = Callable[[], CursorWrapper]
Run = Callable[[Statement, CursorFor | None], list[R]]
"""Runs a claim's statement on the cursor given (None: a bound one), rows to models."""
Key = tuple[int, int]
Groups = list[dict[int, int]]
"""Leases as `querysets.base.key_groups()` splits them: {job id: token} a statement each."""


@dataclass(slots=True)
class Jobs(Generic[R]):
    """What the query layer hands a dialect for one claim or batched completion on one job
    table: where it is, and the ORM's own code (the specification) for what the dialect has no
    statement of its own for."""

    connection: DB
    table: str
    """The job table's name, quoted."""
    ledger: LedgerNames | None
    """The stock ledger's names: a dialect's statements write its rows. None: no ledger, or one
    with fields of its own, which the ORM writes (`open_attempts`)."""
    rows: Run[R] = field(default=lambda *_: not_handed("rows"))
    """Runs a statement returning job rows, rows to models (`querysets.base.raw_rows`)."""
    claim_pass: Callable[[int, bool], list[R]] = field(default=lambda *_: not_handed("passes"))
    """The ORM's claim pass (limit, takeover): lock candidates with SKIP LOCKED, then the
    conditional UPDATE restating the whole claimable predicate, then the rows read back."""
    open_attempts: Callable[[list[R]], None] = field(default=lambda *_: not_handed("ledger"))
    """Opens the claimed jobs' ledger rows with the ORM (and closes their taken-over ones)."""
    complete_unlocked: Callable[[Groups], set[Key]] = field(
        default=lambda *_: not_handed("completion")
    )
    """The ORM's batched completion of the jobs without a lock (in the caller's transaction)."""


def not_handed(what: str) -> NoReturn:
    """What a dialect meets where the query layer did not hand it the ORM's `what`."""
    raise NotSupportedError(f"the query layer handed this dialect no {what}")


def in_passes(
    limit: int, claim_pass: Callable[[int, bool], list[R]], *, takeover: bool = True
) -> list[R]:
    """Claim up to `limit` jobs in two passes of `claim_pass(limit, takeover)`: expired leases
    first (rare; the pass is one cheap index probe), then due jobs, each job marked
    `taken_over` by its pass; not `takeover`, the due jobs' pass only. Each pass's UPDATE
    restates the full claimable predicate."""
    jobs: list[R] = []
    for expired in (True, False) if takeover else (False,):
        remaining = limit - len(jobs)
        if remaining <= 0:
            break
        batch = claim_pass(remaining, expired)
        for job in batch:
            job.taken_over = expired  # type: ignore[attr-defined]
        jobs.extend(batch)
    return jobs


def in_transaction(jobs: Jobs[Any], wanted: bool = True) -> ContextManager[Any]:
    """A transaction on the jobs' database if `wanted`, else the caller's."""
    return transaction.atomic(using=jobs.connection.alias) if wanted else nullcontext()


class Dialect:
    """The differences of one database backend; this base is what a backend without statements
    of its own does (the ORM's, no NOTIFY, no estimates, no deadlock retries), and the
    specification every subclass's statements are held to."""

    name: ClassVar[str] = "orm"
    fencing_clock: ClassVar[str]
    """The database clock in microseconds since the epoch: the floor of every new token."""
    insert: ClassVar[InsertDialect]
    notifies: ClassVar[bool] = False
    """Whether enqueues are announced with NOTIFY and workers LISTEN."""
    completes_at_once: ClassVar[bool] = False
    """Whether `complete()` has a one-statement completion with the ledger (`complete()`)."""
    session_clock: ClassVar[str | None] = None
    """The statement reading the session's time zone, where NOW() depends on it."""
    autovacuum: ClassVar[str | None] = None
    """The statement reading whether the server vacuums by itself, where it can be off."""

    def claim(self, jobs: Jobs[R], request: Claim, *, atomic: bool = True) -> list[R]:
        """Claim what `request` asks for, with the claimed jobs' ledger rows, in a transaction
        of its own or (not `atomic`) in the caller's; in no particular order. Here: the ORM's
        passes, then the ORM's ledger rows."""
        with in_transaction(jobs, atomic):
            claimed = in_passes(request.limit, jobs.claim_pass, takeover=request.takeover)
            jobs.open_attempts(claimed)
        return claimed

    def fuses_completion_and_claim(self, ledger: LedgerNames | None) -> bool:
        """Whether a claim's `request.completing` completes those jobs in the claim's own
        statement (`complete_and_claim()` in one commit)."""
        return False

    def completion_block(self, jobs: Jobs[Any]) -> ContextManager[Any]:
        """The transaction a batched completion (`complete_many()`) runs in, its jobs of a lock
        included: one, for the completions and their ledger rows to commit together."""
        return transaction.atomic(using=jobs.connection.alias)

    def complete_many(self, jobs: Jobs[Any], owner: str, groups: Groups) -> set[Key]:
        """Complete the held jobs without a lock of `groups` ({job id: token} each, as
        `querysets.base.key_groups()` splits them) and close their ledger rows, in
        `completion_block()`; return the (job id, token) pairs completed. Here: the ORM's."""
        return jobs.complete_unlocked(groups)

    def complete(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, key: Key
    ) -> bool:
        """Complete a job without a lock and close its ledger row in one statement; return
        whether it won. Only where `completes_at_once`."""
        raise NotSupportedError(f"{self.name} completes through the ORM")

    def insert_skipping(self, connection: DB) -> tuple[str, str]:
        """The words of an INSERT that skips the rows a unique index refuses: its verb with
        INTO, and the clause after its values, as Django writes them (`connection.ops`)."""
        ops = connection.ops
        verb = ops.insert_statement(on_conflict=OnConflict.IGNORE)
        return verb, ops.on_conflict_suffix_sql([], OnConflict.IGNORE, [], []) or ""

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        """The enqueue's read of the job holding `lock`, holding that row until commit."""
        raise NotSupportedError(f"{self.name} reads no lock holder")

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        """The statement, first in a kind's gated claim transaction, that bounds its wait for
        a lock by `wait` seconds and its session's idle time in it by `idle` seconds; None
        where the server has neither (SQLite: its busy timeout bounds the wait)."""
        return None

    def gate_bounds_restored(self, connection: DB) -> Statement | None:
        """The statement, after the gated transaction, that undoes `gate_bounds()`; None if
        they ended with the transaction."""
        return None

    def gate_busy(self, exc: BaseException) -> bool:
        """Whether `exc` says a kind's gate was waited for past its bound."""
        return False

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        """The read of the sessions holding a kind's gate (SQLite: the writer holding the
        database's write lock, which it does not name); None where there is none."""
        return None

    def horizon_pin(self) -> Statement | None:
        """The statement reading what holds back the removal of dead rows (`horizon`), or None
        where nothing does (SQLite)."""
        return None

    def notify(self, channel: str, message: str) -> Statement:
        raise NotSupportedError(f"{self.name} has no NOTIFY")

    def listening(
        self, params: dict[str, Any], channel: str, guard: Callable[[int], ContextManager[Any]]
    ) -> Any:
        """A connection of its own, of a connection's parameters `params`
        (`get_connection_params()`), that LISTENs on `channel`, each call on its socket bounded
        by `guard(fd)`; where `notifies`."""
        raise NotSupportedError(f"{self.name} has no LISTEN")

    def deadlocked(self, exc: BaseException) -> bool:
        """Whether the database rolled the transaction back to break a deadlock or lock wait."""
        return False

    def read_only(self, exc: BaseException) -> bool:
        """Whether the server refused a write because it takes none now (a standby)."""
        return False

    def estimated_count(self, connection: DB, table: str, status: str | None) -> int | None:
        """The database's estimate of `table`'s rows (in `status`), or None: it keeps none."""
        return None

    def bound_cursor(self, connection: DB) -> CursorWrapper:
        """A cursor of `connection` for the lease layer's own statements, through Django's
        cursor wrapper (so the execute wrappers and query logging apply)."""
        return connection.cursor()

    def literal_cursor(self, connection: DB) -> CursorWrapper:
        """A cursor of `connection` that writes the parameters into the statement's text."""
        return connection.cursor()

    def network_options(self, timeout: float) -> dict[str, Any]:
        """The connection `OPTIONS` that bound every network wait by `timeout` seconds."""
        return {}

    def statement_timeout(self, timeout: float, user: dict[str, Any]) -> int | None:
        """The server's per-statement timeout (ms) for a network timeout of `timeout` seconds
        and the project's `OPTIONS` `user`; None where it has none or the project set one."""
        return None

    def bound_transactions(self, connection: DB, milliseconds: int) -> None:
        """Bound each transaction of `connection` by `milliseconds` on the server, where
        `statement_timeout()` gave a bound and the driver can carry it."""

    def lazy_write_lock(self, options: dict[str, Any]) -> bool:
        """Whether a transaction on a connection of these `OPTIONS` reads before it takes the
        database's write lock, so another writer in between fails it instead of waiting."""
        return False

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        """What `exc` (its message `text`; raised while `connecting`, or by a statement) says is
        misconfigured: "NAME", "USER", "PASSWORD", "OPTIONS" or `statements.MIGRATE`; None for
        anything else (an outage)."""
        return None


def match(patterns: Iterable[tuple[re.Pattern[str], str]], text: str) -> str | None:
    """The name paired with the first of `patterns` that `text` matches, or None."""
    return next((what for pattern, what in patterns if pattern.search(text)), None)
