"""MariaDB/MySQL's dialect: its claim's passes (the ORM's specification written out in the
statements of `mysql_statements.py`), the batched completion, the enqueue's share lock on a lock
holder, the gate's bounds, row estimates, network options and error codes. Tested on MariaDB
10.11.
"""

from __future__ import annotations

import math
from typing import Any

from django.db.backends.utils import CursorWrapper

from django_leases.dialects import horizon, merge
from django_leases.dialects import mysql_statements as statements
from django_leases.dialects.base import (
    DB,
    Dialect,
    Groups,
    Jobs,
    Key,
    R,
    Run,
    Statement,
    in_passes,
    in_transaction,
)
from django_leases.dialects.statements import Claim, LedgerNames


class MySQL(Dialect):
    name = "mysql"
    fencing_clock = statements.FENCING_CLOCK
    insert = statements.INSERT
    session_clock = statements.SESSION_CLOCK

    def claim(self, jobs: Jobs[R], request: Claim, *, atomic: bool = True) -> list[R]:
        # With the stock ledger its rows are written by the passes' own statements; a ledger
        # of its own by the ORM after them. One transaction either way.
        run = jobs.rows
        with in_transaction(jobs, atomic), jobs.connection.cursor() as cursor:
            claimed: list[R] = locking_passes(cursor, run, jobs.table, request, jobs.ledger)
            if jobs.ledger is None:
                jobs.open_attempts(claimed)
        return claimed

    def complete_many(self, jobs: Jobs[Any], owner: str, groups: Groups) -> set[Key]:
        if jobs.ledger is None:
            return super().complete_many(jobs, owner, groups)
        # In `completion_block()`, as the ORM's: lock the rows still held (no UPDATE ...
        # RETURNING to say which won), complete exactly those, close their ledger rows.
        done: set[Key] = set()
        with jobs.connection.cursor() as cursor:
            for group in groups:
                cursor.execute(*statements.lock_held(jobs.table, owner=owner, group=group))
                held = dict(cursor.fetchall())
                if held:
                    cursor.execute(*statements.complete_held(jobs.table, owner=owner, group=held))
                    cursor.execute(
                        *statements.close_completed(
                            jobs.table, jobs.ledger, owner=owner, group=held
                        )
                    )
                    done.update(held.items())
        return done

    def horizon_pin(self) -> Statement | None:
        return horizon.mysql_pin()

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        return statements.share_lock_holder(table, lock=lock)

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        return statements.gate_bounds(wait=wait, idle=idle, mariadb=_mariadb(connection))

    def gate_bounds_restored(self, connection: DB) -> Statement | None:
        return statements.gate_bounds_restored(mariadb=_mariadb(connection))

    def gate_busy(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] == statements.LOCK_WAIT_TIMEOUT

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        return statements.GATE_HOLDERS, None

    def deadlocked(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] in statements.DEADLOCK_ERRORS

    def read_only(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] in statements.READ_ONLY_ERRORS

    def estimated_count(self, connection: DB, table: str, status: str | None) -> int | None:
        with connection.cursor() as cursor:

            def planned(**where: Any) -> int:
                cursor.execute(*statements.row_estimate(table, **where))
                columns = [column[0] for column in cursor.description]
                return statements.planned_rows(columns, cursor.fetchone())

            if status is None:
                return planned()
            equal, other_than = planned(status=status), planned(status=status, other_than=True)
            return statements.status_estimate(equal, other_than, planned())

    def network_options(self, timeout: float) -> dict[str, Any]:
        seconds = max(1, math.ceil(timeout))
        return {"connect_timeout": seconds, "read_timeout": seconds, "write_timeout": seconds}

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        code = exc.args[0] if exc.args else None
        if not isinstance(code, int):
            return None
        if connecting and code in statements.MISCONFIGURED_WHILE_CONNECTING:
            return "OPTIONS"
        return statements.MISCONFIGURED_ERRORS.get(code)


def _mariadb(connection: DB) -> bool:
    return bool(getattr(connection, "mysql_is_mariadb", False))


def locking_passes(
    cursor: CursorWrapper, run: Run[R], table: str, claim: Claim, ledger: LedgerNames | None
) -> list[R]:
    """Claim on MariaDB/MySQL in the caller's transaction, each statement on `cursor` but the
    read-back, run by `run` (rows to models); with `ledger`, open the claimed jobs' ledger
    rows and close those of the holders whose expired leases it took over.

    The ORM's claim pass (`querysets.claims.claim_pass_locking()`) written out: lock the
    candidates with SKIP LOCKED, the conditional UPDATE restating the whole predicate, the rows
    read back; the row locks, held to commit, make every read after the lock exact."""
    kinds = statements.merged_kinds(claim)

    def ids(statement: Statement) -> list[int]:
        cursor.execute(*statement)
        return [row[0] for row in cursor.fetchall()]

    def locked(limit: int, takeover: bool) -> list[int]:
        if not kinds:  # every kind, one, or all but some: one ordered range of an index
            return ids(statements.lock_candidates(table, claim, limit, takeover))

        def read(count: int) -> list[int]:
            cursor.execute(*statements.merge_candidates(table, claim, kinds, count, takeover))
            return merge.in_claim_order(cursor.fetchall(), takeover, count)

        def lock(chunk: list[int]) -> list[int]:
            return ids(statements.lock_chosen(table, claim, chunk, takeover))

        return merge.lock_in_order(read, lock, limit)

    def claim_pass(limit: int, takeover: bool) -> list[R]:
        pks = locked(limit, takeover)
        if not pks:
            return []
        cursor.execute(*statements.claim_update(table, claim, pks, takeover))
        if not cursor.rowcount:
            return []
        jobs = run(statements.claimed(table, claim.owner, pks, takeover), None)
        if ledger is not None and jobs:
            won = [job.pk for job in jobs]
            if takeover:  # before the new rows open: their holders lost these leases
                cursor.execute(*statements.close_taken_over(ledger, claim.owner, won))
            cursor.execute(*statements.open_attempts(table, ledger, claim.owner, won, takeover))
        return jobs

    return in_passes(claim.limit, claim_pass, takeover=claim.takeover)
