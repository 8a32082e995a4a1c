"""Claims: taking jobs for a worker, the one transition that creates a lease.

A layer of `LeaseQuerySet`. Every claim is one conditional UPDATE (PostgreSQL: one statement
with the ledger's rows; SQLite: UPDATE ... RETURNING passes; MariaDB/MySQL: rows locked with
SKIP LOCKED, then the UPDATE) that gives each row a new fencing token, `attempts + 1` and a lease
from the database clock, and opens its ledger row in the same transaction.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from typing import Any

from django.db import connections, transaction
from django.db.models import F
from django.db.models.functions import Now

from django_leases import sql
from django_leases.conf import to_seconds
from django_leases.dialects import ClaimPath, dialect_of, in_passes
from django_leases.handlers import throttles
from django_leases.limits import CLAIM_LIMIT, JOB_ID, check_int, check_kind
from django_leases.querysets.base import (
    LeaseKey,
    after,
    check_owner,
    lease_keys,
    next_token,
    retry_deadlocks,
)
from django_leases.querysets.ledger import J
from django_leases.querysets.prepared import prepared_claim_raw
from django_leases.querysets.reads import takeover_guard
from django_leases.querysets.throttles import Throttling
from django_leases.sql.postgresql import LedgerNames
from django_leases.status import PROCESSING
from django_leases.throttles import Throttle


class AllBut(tuple[str, ...]):
    """Every kind but these: the kinds of a claim of every kind that the throttled ones leave."""

    __slots__ = ()


Wanted = list[str] | AllBut | None
"""The kinds a claim takes: these, every kind but some, or every kind (None)."""


def kinds_filter(kinds: Wanted) -> tuple[str, sql.Params]:
    """Return the claim's fragment of `kinds` (`sql.kinds_filter()`)."""
    if isinstance(kinds, AllBut):
        return sql.kinds_filter(None, excluded=kinds)
    return sql.kinds_filter(kinds)


class Claims(Throttling[J]):
    # ---- acquisition -------------------------------------------------------------------------

    def claim(
        self,
        owner: str,
        *,
        ttl: float | timedelta,
        limit: int = 1,
        kinds: Collection[str] | None = None,
    ) -> list[J]:
        """Claim up to `limit` claimable jobs for `owner`, oldest expired lease first, then by
        priority (highest first), `run_at` and id.

        Each claimed row gets `attempts + 1`, a new fencing token and a lease of `ttl` seconds
        from the database clock, in the statement that decides ownership, and an open row in the
        attempt ledger in the same transaction. Kinds with a `limit=` or `rate=` are claimed
        first, each in a transaction of its own within its throttle (`Throttling`).
        """
        seconds, kinds = self._claim_args(owner, ttl, limit, kinds)
        if kinds == []:
            return []
        throttled = self._throttled(kinds)
        if not throttled:
            return self._claim(owner, seconds, limit, kinds, self._claim_path())
        jobs: list[J] = []
        path = self._claim_path()
        for kind, throttle in throttled.items():
            if len(jobs) < limit:
                take = partial(self._claim, owner, seconds, kinds=[kind], path=path, atomic=False)
                jobs += self._claim_throttled(kind, throttle, limit - len(jobs), take)
        rest: Wanted = (
            AllBut(throttled) if kinds is None else [k for k in kinds if k not in throttled]
        )
        if len(jobs) < limit and rest != []:
            jobs += self._claim(owner, seconds, limit - len(jobs), rest, path)
        return jobs

    @staticmethod
    def _throttled(kinds: list[str] | None) -> dict[str, Throttle]:
        """Return the throttles of `kinds` (None: every kind), in the order claims lock them."""
        known = throttles()
        if not known:
            return {}
        wanted = sorted(known) if kinds is None else sorted(set(kinds) & known.keys())
        return {kind: known[kind] for kind in wanted}

    def complete_and_claim(
        self,
        owner: str,
        leases: Iterable[LeaseKey] | Mapping[int, int],
        *,
        ttl: float | timedelta,
        limit: int = 1,
        kinds: Collection[str] | None = None,
    ) -> tuple[set[LeaseKey], list[J]]:
        """`complete_many(owner, leases)`, then `claim(owner, ...)`: return the (job id, token)
        pairs completed and the jobs claimed.

        On PostgreSQL with the stock ledger this is one statement, so a holder's finished job
        and its next one cost one commit, not two; every row is still conditional as in the two
        methods. Its held jobs of a lock are completed after it (passing a lock on needs a later
        statement), and the jobs next in line of those locks are claimed then if it came back
        short. Elsewhere it is those two transactions, the completions committed first.
        """
        seconds, kinds = self._claim_args(owner, ttl, limit, kinds)
        if self._claim_path() != "postgresql+ledger" or kinds == [] or self._throttled(kinds):
            return self.complete_many(owner, leases), self.claim(
                owner, ttl=seconds, limit=limit, kinds=kinds
            )
        keys = lease_keys(leases)
        won, jobs = self._complete_and_claim_postgresql(owner, keys, seconds, limit, kinds)
        left = [key for key in keys if key not in won]
        passed = self._complete_locked(owner, left) if left else set()
        if passed and len(jobs) < limit:
            jobs += self.claim(owner, ttl=seconds, limit=limit - len(jobs), kinds=kinds)
        lost = [key for key in left if key not in passed]
        if lost:
            self._record_fenced(lost)
        return won | passed, jobs

    @retry_deadlocks
    def _complete_and_claim_postgresql(
        self,
        owner: str,
        keys: list[LeaseKey],
        seconds: float,
        limit: int,
        kinds: list[str] | None,
    ) -> tuple[set[LeaseKey], list[J]]:
        completing = ([pk for pk, _ in keys], [token for _, token in keys])
        request = self._request(owner, seconds, limit, kinds, completing)
        rows = self._raw_claim(request, self._ledger_names())
        first: Any = rows[0]
        won = set(zip(first.completed_ids, first.completed_tokens, strict=True))
        return won, self._in_claim_order([job for job in rows if job.pk is not None])

    @staticmethod
    def _in_claim_order(jobs: list[J]) -> list[J]:
        """RETURNING gives no order: hand jobs out in claim order."""
        jobs.sort(key=lambda job: (not job.taken_over, -job.priority, job.run_at, job.pk))  # type: ignore[attr-defined]
        return jobs

    @staticmethod
    def _claim_args(
        owner: str, ttl: float | timedelta, limit: int, kinds: Collection[str] | None
    ) -> tuple[float, list[str] | None]:
        """Check a claim's arguments; return the TTL in seconds and the kinds as a list."""
        seconds = to_seconds(ttl, "ttl")
        check_owner(owner)
        check_int(limit, "limit", CLAIM_LIMIT)
        if kinds is None:
            return seconds, None
        return seconds, [check_kind(kind, "kinds") for kind in kinds]

    def _claim_path(self) -> ClaimPath:
        """Pick the claim's path (`Dialect.claim_path()`). Every path claims the same jobs in
        the same order with the same ledger rows (tests/test_claim_paths.py holds them to the
        ORM path, which is the readable specification)."""
        return dialect_of(connections[self.db]).claim_path(self._ledger_names())

    @retry_deadlocks
    def _claim(
        self,
        owner: str,
        seconds: float,
        limit: int,
        kinds: Wanted,
        path: ClaimPath,
        *,
        atomic: bool = True,
    ) -> list[J]:
        """Claim by `path`, with the ledger's rows, in a transaction of its own or (not
        `atomic`) in the caller's."""
        request = self._request(owner, seconds, limit, kinds)
        if path == "postgresql+ledger":
            # One statement claims and writes the ledger: atomic without a transaction block.
            jobs = self._raw_claim(request, self._ledger_names())
        else:
            with transaction.atomic(using=self.db) if atomic else nullcontext():
                if path == "orm":
                    jobs = self._claim_orm(request, kinds)
                else:
                    jobs = self._raw_claim(request, None)
                self._open_attempts(jobs, owner)
        return self._in_claim_order(jobs)

    @staticmethod
    def _request(
        owner: str,
        seconds: float,
        limit: int,
        kinds: Wanted,
        completing: tuple[list[int], list[int]] | None = None,
    ) -> sql.Claim:
        guard = takeover_guard()[1]
        return sql.Claim(owner, seconds, limit, kinds_filter(kinds), guard, completing)

    def _raw_claim(self, request: sql.Claim, ledger: LedgerNames | None) -> list[J]:
        """Claim with the database's own statements (`Dialect.claim()`), with the ledger's rows
        if `ledger`, each statement run as a prepared statement where it can be."""
        dialect = dialect_of(connections[self.db])
        run = partial(prepared_claim_raw, self)
        return dialect.claim(run, self._table(), request, ledger)

    def _claim_orm(self, request: sql.Claim, kinds: Wanted) -> list[J]:
        """The ORM's claim: the specification, and MariaDB/MySQL's path."""
        owner, seconds = request.owner, request.seconds
        return in_passes(
            request.limit,
            lambda limit, takeover: self._claim_pass_locking(
                owner, seconds, limit, kinds, takeover
            ),
        )

    def _claim_pass_locking(
        self, owner: str, seconds: float, limit: int, kinds: Wanted, takeover: bool
    ) -> list[J]:
        # MariaDB/MySQL have no UPDATE ... RETURNING and refuse a LIMIT in an IN subquery on
        # the table being updated. So: lock candidates with FOR UPDATE SKIP LOCKED (MariaDB
        # 10.6+, MySQL 8+), then the conditional UPDATE restating the predicate decides, then
        # read back the rows we now own. The row locks, held to commit, make the read exact.
        # Tested on MariaDB 10.11.
        if isinstance(kinds, AllBut):
            base = self._claimable_pass(None, takeover).exclude(kind__in=kinds)
        else:
            base = self._claimable_pass(kinds, takeover)
        order = ("lease_until",) if takeover else ("-priority", "run_at", "id")
        ids = list(
            base.select_for_update(skip_locked=True)
            .order_by(*order)
            .values_list("pk", flat=True)[:limit]
        )
        if not ids:
            return []
        won = base.filter(pk__in=ids).update(**self._claim_values(owner, seconds))
        if won == 0:
            return []
        return list(self.filter(pk__in=ids, status=PROCESSING, lease_owner=owner).order_by(*order))

    @staticmethod
    def _claim_values(owner: str, seconds: float) -> dict[str, Any]:
        return {
            "status": PROCESSING,
            "lease_owner": owner,
            "lease_until": after(seconds),
            "heartbeat_at": Now(),
            "lease_token": next_token(),
            "attempts": F("attempts") + 1,
        }

    @retry_deadlocks
    def claim_job(self, pk: int, owner: str, *, ttl: float | timedelta) -> J | None:
        """Claim the job `pk` for `owner` if it is claimable (and its kind's throttle lets it
        start); return it, or None if not."""
        check_int(pk, "pk", JOB_ID)
        seconds = to_seconds(ttl, "ttl")
        check_owner(owner)
        known = throttles()
        kind = self.filter(pk=pk).values_list("kind", flat=True).first() if known else None
        if kind is None or kind not in known:
            with transaction.atomic(using=self.db):
                jobs = self._claim_one(pk, owner, seconds)
            return jobs[0] if jobs else None
        jobs = self._claim_throttled(
            kind, known[kind], 1, lambda room: self._claim_one(pk, owner, seconds, kind)
        )
        return jobs[0] if jobs else None

    def _claim_one(self, pk: int, owner: str, seconds: float, kind: str | None = None) -> list[J]:
        """`claim_job()` in the caller's transaction: `[job]`, or `[]`; with `kind`, only a
        job still of that kind (the one a throttled claim counted)."""
        # The seed's statement: UPDATE ... WHERE id = :id AND (pending and due, or processing
        # with an expired lease). Its row count is the decision.
        claimable = self.claimable().filter(pk=pk)
        if kind is not None:
            claimable = claimable.filter(kind=kind)
        if not claimable.update(**self._claim_values(owner, seconds)):
            return []
        # We hold the row lock until commit (and SQLite's write lock), so this read is ours.
        job = self.get(pk=pk)
        # attempts > 1: a ledger row of an earlier holder may still be open; close it.
        job.taken_over = job.attempts > 1  # type: ignore[attr-defined]
        self._open_attempts([job], owner)
        return [job]
