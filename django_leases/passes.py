"""A claim in two passes, expired leases first, then due jobs (`in_passes()`), and each pass of
MariaDB/MySQL's claim (`locking_passes()`, chosen by `dialects.MySQL`).

MariaDB has no `UPDATE ... RETURNING`, so its pass is the ORM path's
(`querysets.claims.claim_pass_locking()`, the specification) written out in the statements of
`sql.mysql`, each built once per shape: lock the candidates with SKIP LOCKED, the conditional
UPDATE restating the whole predicate, the rows read back, then the stock ledger's rows. The row
locks, held to commit, make every read after the lock exact. Tested on MariaDB 10.11.
"""

from collections.abc import Callable
from typing import TypeVar

from django.db.backends.utils import CursorWrapper
from django.db.models import Model

from django_leases import sql
from django_leases.sql import Claim, merge, mysql
from django_leases.sql.postgresql import LedgerNames

R = TypeVar("R", bound=Model)
Statement = tuple[str, sql.Params | None]
"""A statement's text and parameters; None: none, the text is sent as it is."""
CursorFor = Callable[[], CursorWrapper]
Run = Callable[[Statement, CursorFor | None], list[R]]
"""Runs a claim's statement on the cursor given (None: a bound one), rows to models."""


def in_passes(limit: int, claim_pass: Callable[[int, bool], list[R]]) -> list[R]:
    """Claim up to `limit` jobs in two passes of `claim_pass(limit, takeover)`: expired leases
    first (rare; the pass is one cheap index probe), then due jobs, each job marked
    `taken_over` by its pass. Each pass's UPDATE restates the full claimable predicate."""
    jobs: list[R] = []
    for takeover in (True, False):
        remaining = limit - len(jobs)
        if remaining <= 0:
            break
        batch = claim_pass(remaining, takeover)
        for job in batch:
            job.taken_over = takeover  # type: ignore[attr-defined]
        jobs.extend(batch)
    return jobs


def locking_passes(
    cursor: CursorWrapper, run: Run[R], table: str, claim: Claim, ledger: LedgerNames | None
) -> list[R]:
    """Claim on MariaDB/MySQL in the caller's transaction, each statement on `cursor` but the
    read-back, run by `run` (rows to models); with `ledger`, open the claimed jobs' ledger
    rows and close those of the holders whose expired leases it took over."""
    kinds = mysql.merged_kinds(claim)

    def ids(statement: Statement) -> list[int]:
        cursor.execute(*statement)
        return [row[0] for row in cursor.fetchall()]

    def locked(limit: int, takeover: bool) -> list[int]:
        if not kinds:  # every kind, one, or all but some: one ordered range of an index
            return ids(mysql.lock_candidates(table, claim, limit, takeover))

        def read(count: int) -> list[int]:
            cursor.execute(*mysql.merge_candidates(table, claim, kinds, count, takeover))
            return merge.in_claim_order(cursor.fetchall(), takeover, count)

        def lock(chunk: list[int]) -> list[int]:
            return ids(mysql.lock_chosen(table, claim, chunk, takeover))

        return merge.lock_in_order(read, lock, limit)

    def claim_pass(limit: int, takeover: bool) -> list[R]:
        pks = locked(limit, takeover)
        if not pks:
            return []
        cursor.execute(*mysql.claim_update(table, claim, pks, takeover))
        if not cursor.rowcount:
            return []
        jobs = run(mysql.claimed(table, claim.owner, pks, takeover), None)
        if ledger is not None and jobs:
            won = [job.pk for job in jobs]
            if takeover:  # before the new rows open: their holders lost these leases
                cursor.execute(*mysql.close_taken_over(ledger, claim.owner, won))
            cursor.execute(*mysql.open_attempts(table, ledger, claim.owner, won, takeover))
        return jobs

    return in_passes(claim.limit, claim_pass)
