"""Every lease write of django-leases. No other module writes lease fields.

Each transition is ONE conditional UPDATE whose WHERE restates the full precondition; the row
count it returns is the decision. Holder writes (heartbeat, checkpoint, complete, fail, release)
always filter on id + processing + owner + fencing token, so a worker that paused past its lease
cannot touch a job that someone else now owns. Every lease time comes from the database clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import timedelta
from functools import reduce
from operator import or_
from typing import Any

from django.db import connections, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from django_leases import sql
from django_leases.conf import to_seconds
from django_leases.exceptions import LeaseError, LeaseLost
from django_leases.limits import (
    CHECKPOINT_LENGTH,
    CLAIM_LIMIT,
    JOB_ID,
    KIND_LENGTH,
    check_int,
    check_text,
)
from django_leases.querysets.acks import Acknowledgements
from django_leases.querysets.base import (
    ClaimPath,
    after,
    bound_cursor,
    bound_raw,
    check_owner,
    retry_deadlocks,
)
from django_leases.querysets.ledger import MAX_ERROR_LENGTH, J, describe_error
from django_leases.querysets.reads import takeover_guard
from django_leases.sql import postgresql, sqlite
from django_leases.sql.postgresql import LedgerNames
from django_leases.status import (
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    TIMED_OUT,
    AttemptOutcome,
)


class LeaseQuerySet(Acknowledgements[J]):
    """Reads and lease transitions of any `AbstractLeasedJob` table.

    Built up in layers, one module each: reads (`reads`), ledger writes (`ledger`), pruning
    (`prune`), operator actions (`operators`), enqueueing (`enqueue`); the claim, the holder's
    writes and the watcher's rescue are here.
    """

    # ---- acquisition -------------------------------------------------------------------------

    @retry_deadlocks
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
        attempt ledger in the same transaction.
        """
        seconds, kinds = self._claim_args(owner, ttl, limit, kinds)
        if kinds == []:
            return []
        return self._claim(owner, seconds, limit, kinds, self._claim_path())

    def complete_and_claim(
        self,
        owner: str,
        leases: Mapping[int, int],
        *,
        ttl: float | timedelta,
        limit: int = 1,
        kinds: Collection[str] | None = None,
    ) -> tuple[set[int], list[J]]:
        """`complete_many(owner, leases)`, then `claim(owner, ...)`: return the pks completed
        and the jobs claimed.

        On PostgreSQL with the stock ledger this is one statement, so a holder's finished job
        and its next one cost one commit, not two; every row is still conditional as in the two
        methods. Elsewhere it is those two transactions, the completions committed first.
        """
        seconds, kinds = self._claim_args(owner, ttl, limit, kinds)
        if self._claim_path() != "postgresql+ledger" or kinds == []:
            return self.complete_many(owner, leases), self.claim(
                owner, ttl=seconds, limit=limit, kinds=kinds
            )
        leases = {
            check_int(pk, "pk", JOB_ID): check_int(token, "token", JOB_ID)
            for pk, token in leases.items()
        }
        won, jobs = self._complete_and_claim_postgresql(owner, leases, seconds, limit, kinds)
        lost = {pk: token for pk, token in leases.items() if pk not in won}
        if lost:
            self._record_fenced(lost)
        return won, jobs

    @retry_deadlocks
    def _complete_and_claim_postgresql(
        self,
        owner: str,
        leases: dict[int, int],
        seconds: float,
        limit: int,
        kinds: list[str] | None,
    ) -> tuple[set[int], list[J]]:
        rows = self._claim_postgresql(
            owner,
            seconds,
            limit,
            kinds,
            ledger=self._ledger_names(),
            completing=(list(leases), list(leases.values()), COMPLETED),
        )
        won = set(rows[0].completed_ids)  # type: ignore[attr-defined]
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
        return seconds, [check_text(kind, "kinds", KIND_LENGTH) for kind in kinds]

    def _claim_path(self) -> ClaimPath:
        """Pick the claim's path: the ONE vendor switch. Every path claims the same jobs in the
        same order with the same ledger rows (tests/test_claim_paths.py holds them to the ORM
        path, which is the readable specification)."""
        vendor = connections[self.db].vendor
        if vendor == "postgresql":
            return "postgresql+ledger" if self._ledger_names() is not None else "postgresql"
        return "sqlite" if vendor == "sqlite" else "orm"

    def _claim(
        self, owner: str, seconds: float, limit: int, kinds: list[str] | None, path: ClaimPath
    ) -> list[J]:
        ledger = self._ledger_names() if path == "postgresql+ledger" else None
        if ledger is not None:
            # One statement claims and writes the ledger: atomic without a transaction block.
            jobs = self._claim_postgresql(owner, seconds, limit, kinds, ledger=ledger)
        else:
            with transaction.atomic(using=self.db):
                if path.startswith("postgresql"):
                    jobs = self._claim_postgresql(owner, seconds, limit, kinds)
                else:
                    jobs = self._claim_passes(owner, seconds, limit, kinds, sqlite=path == "sqlite")
                self._open_attempts(jobs, owner)
        return self._in_claim_order(jobs)

    def _claim_postgresql(
        self,
        owner: str,
        seconds: float,
        limit: int,
        kinds: list[str] | None,
        *,
        ledger: LedgerNames | None = None,
        completing: tuple[list[int], list[int], str] | None = None,
    ) -> list[J]:
        statement = postgresql.claim(
            self._table(),
            owner=owner,
            seconds=seconds,
            limit=limit,
            kinds=sql.kinds_filter(kinds),
            guard=takeover_guard()[1],
            ledger=ledger,
            pending=PENDING,
            processing=PROCESSING,
            running=AttemptOutcome.RUNNING,
            lease_lost=AttemptOutcome.LEASE_LOST,
            completing=completing,
        )
        return bound_raw(self, statement)

    def _claim_passes(
        self, owner: str, seconds: float, limit: int, kinds: list[str] | None, *, sqlite: bool
    ) -> list[J]:
        # Two passes, expired leases first (rare; the pass is one cheap index probe), then due
        # jobs. Each pass's UPDATE restates the full claimable predicate.
        jobs: list[J] = []
        for takeover in (True, False):
            remaining = limit - len(jobs)
            if remaining <= 0:
                break
            if sqlite:
                batch = self._claim_pass_sqlite(owner, seconds, remaining, kinds, takeover)
            else:
                batch = self._claim_pass_locking(owner, seconds, remaining, kinds, takeover)
            for job in batch:
                job.taken_over = takeover  # type: ignore[attr-defined]
            jobs.extend(batch)
        return jobs

    def _claim_pass_sqlite(
        self, owner: str, seconds: float, limit: int, kinds: list[str] | None, takeover: bool
    ) -> list[J]:
        statement = sqlite.claim_pass(
            self._table(),
            owner=owner,
            seconds=seconds,
            limit=limit,
            takeover=takeover,
            kinds=sql.kinds_filter(kinds),
            guard=takeover_guard()[1] if takeover else ("", {}),
            pending=PENDING,
            processing=PROCESSING,
        )
        return list(self.raw(*statement))

    def _claim_pass_locking(
        self, owner: str, seconds: float, limit: int, kinds: list[str] | None, takeover: bool
    ) -> list[J]:
        # MariaDB/MySQL have no UPDATE ... RETURNING and refuse a LIMIT in an IN subquery on
        # the table being updated. So: lock candidates with FOR UPDATE SKIP LOCKED (MariaDB
        # 10.6+, MySQL 8+), then the conditional UPDATE restating the predicate decides, then
        # read back the rows we now own. The row locks, held to commit, make the read exact.
        # Tested on MariaDB 10.11.
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
            "lease_token": F("lease_token") + 1,
            "attempts": F("attempts") + 1,
        }

    @retry_deadlocks
    def claim_job(self, pk: int, owner: str, *, ttl: float | timedelta) -> J | None:
        """Claim the job `pk` for `owner` if it is claimable; return it, or None if not."""
        check_int(pk, "pk", JOB_ID)
        seconds = to_seconds(ttl, "ttl")
        check_owner(owner)
        with transaction.atomic(using=self.db):
            # The seed's statement: UPDATE ... WHERE id = :id AND (pending and due, or
            # processing with an expired lease). Its row count is the decision.
            won = self.claimable().filter(pk=pk).update(**self._claim_values(owner, seconds))
            if not won:
                return None
            # We hold the row lock until commit (and SQLite's write lock), so this read is ours.
            job = self.get(pk=pk)
            # attempts > 1: a ledger row of an earlier holder may still be open; close it.
            job.taken_over = job.attempts > 1  # type: ignore[attr-defined]
            self._open_attempts([job], owner)
        return job

    # ---- holder writes ----------------------------------------------------------------------

    @retry_deadlocks
    def heartbeat(
        self, owner: str, leases: Mapping[int, int], *, ttl: float | timedelta
    ) -> set[int]:
        """Renew every live lease in `leases` ({pk: token}) held by `owner`, in one statement.

        Returns the pks renewed. A lease that already expired is not renewed: its holder must
        assume somebody else owns the job now.
        """
        seconds = to_seconds(ttl, "ttl")
        if not leases:
            return set()
        pairs = reduce(or_, (Q(pk=pk, lease_token=token) for pk, token in leases.items()))
        live = self.filter(pairs, status=PROCESSING, lease_owner=owner, lease_until__gte=Now())
        with transaction.atomic(using=self.db):
            won = live.update(lease_until=after(seconds), heartbeat_at=Now())
            if won == len(leases):
                renewed = set(leases)
            else:
                # Rare: some leases were lost. The rows we renewed are locked by us and still
                # match; the lost ones cannot match again (tokens only grow).
                renewed = set(live.values_list("pk", flat=True))
            if renewed:
                self._ledger_update(
                    {pk: leases[pk] for pk in renewed},
                    last_heartbeat_at=self._job_column("heartbeat_at"),
                    lease_until=self._job_column("lease_until"),
                )
        return renewed

    def checkpoint(self, pk: int, owner: str, token: int, step: str) -> None:
        """Record that the holder reached `step`; the watcher's review policy reads it.

        Refused (`LeaseLost`) once the lease has expired, even if nobody took the job over: the
        watcher may already have decided the job's fate from the checkpoint it read.
        """
        check_text(step, "checkpoint step", CHECKPOINT_LENGTH)
        self._holder_write(pk, owner, token, None, None, live=True, checkpoint=step)

    def complete(self, pk: int, owner: str, token: int, *, result: Any = None) -> None:
        """Mark the job completed, storing `result` (JSON) if given.

        Raises `LeaseLost` if `owner` no longer holds the job.
        """
        ledger = self._ledger_names() if connections[self.db].vendor == "postgresql" else None
        if (
            ledger is not None
            and result is None
            and self._complete_postgresql(pk, owner, token, ledger)
        ):
            return
        values: dict[str, Any] = {
            "status": COMPLETED,
            "completed_at": Now(),
            "last_error": "",
            "lock_holder": None,
        }
        if result is not None:
            values["result"] = result
        self._holder_write(pk, owner, token, AttemptOutcome.COMPLETED, None, **values)

    @retry_deadlocks
    def _complete_postgresql(self, pk: int, owner: str, token: int, ledger: LedgerNames) -> bool:
        """Complete a job without a lock in one statement; False leaves the job (lost, or of a
        lock, which is passed on in a transaction) to the general path."""
        statement = postgresql.complete(
            self._table(),
            ledger,
            pk=pk,
            owner=owner,
            token=token,
            processing=PROCESSING,
            completed=COMPLETED,
        )
        with bound_cursor(self.db) as cursor:
            cursor.execute(*statement)
            (won,) = cursor.fetchone()
        return bool(won)

    @retry_deadlocks
    def fail(
        self,
        pk: int,
        owner: str,
        token: int,
        error: BaseException | str,
        *,
        retry_in: float | timedelta | None = None,
        permanent: bool = False,
    ) -> str:
        """Record a failed attempt and return the job's new status.

        The job goes back to pending, due in `retry_in` (database clock), while it has attempts
        left; it fails for good when `permanent` or when it used its last attempt.
        """
        error_class, message = describe_error(error)
        last_error = f"{error_class}: {message}" if error_class else message
        final = Q(attempts__gte=F("max_attempts"))
        if permanent:
            status: Any = Value(FAILED)
            completed_at: Any = Now()
            run_at: Any = F("run_at")
            lock_holder: Any = None
        else:
            delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
            status = Case(When(final, then=Value(FAILED)), default=Value(PENDING))
            completed_at = Case(When(final, then=Now()), default=None)
            run_at = Case(When(final, then=F("run_at")), default=after(delay) if delay else Now())
            # A retry keeps the job's lock: the jobs behind it wait for its last attempt.
            lock_holder = Case(When(final, then=None), default=F("lock_holder"))
        with transaction.atomic(using=self.db):
            won = self.held(pk, owner, token).update(
                status=status,
                completed_at=completed_at,
                run_at=run_at,
                last_error=last_error,
                lock_holder=lock_holder,
            )
            if not won:
                raise LeaseLost(f"job {pk}: lease lost before its failure could be recorded")
            # The row is ours until commit; read back which branch the UPDATE took.
            new_status, lock = self.filter(pk=pk).values_list("status", "lock").get()
            outcome = AttemptOutcome.FAILED if new_status == FAILED else AttemptOutcome.RETRIED
            self._close_attempt(pk, token, outcome, by=owner, error=(error_class, message))
            if new_status == FAILED and lock:
                self._pass_lock(pk)
        return new_status

    @retry_deadlocks
    def time_out(
        self, pk: int, owner: str, token: int, *, retry_in: float | None, reason: str
    ) -> str:
        """End the holder's attempt at its run-time limit; return the job's new status.

        The job follows its kind's stuck policy, as an expired lease would: held for review
        after a risky checkpoint, failed without attempts left, else pending after `retry_in`.
        """
        guard = takeover_guard()[0]
        review = ~guard if guard else Q(pk__in=[])
        final = Q(attempts__gte=F("max_attempts"))
        delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
        with transaction.atomic(using=self.db):
            won = self.held(pk, owner, token).update(
                status=Case(
                    When(review, then=Value(REVIEW)),
                    When(final, then=Value(FAILED)),
                    default=Value(PENDING),
                ),
                completed_at=Case(When(~review & final, then=Now()), default=None),
                lock_holder=Case(When(~review & final, then=None), default=F("lock_holder")),
                run_at=Case(
                    When(review | final, then=F("run_at")),
                    default=after(delay) if delay else Now(),
                ),
                last_error=reason[:MAX_ERROR_LENGTH],
            )
            if won:
                new_status, lock = self.filter(pk=pk).values_list("status", "lock").get()
                self._close_attempt(pk, token, TIMED_OUT, by=owner, error=("", reason))
                if new_status == FAILED and lock:
                    self._pass_lock(pk)
        if not won:
            self.record_fenced(pk, token)
            raise LeaseLost(f"job {pk}: {owner} no longer holds token {token}")
        return new_status

    def release(self, pk: int, owner: str, token: int) -> None:
        """Give a job back unstarted (graceful shutdown): pending, due now.

        The acquisition still counts in `attempts` (never reset), so `max_attempts` grows by one:
        a release does not spend the job's retry budget.
        """
        self._holder_write(
            pk,
            owner,
            token,
            AttemptOutcome.RELEASED,
            None,
            status=PENDING,
            run_at=Now(),
            max_attempts=F("max_attempts") + 1,
        )

    def lock_held(self, pk: int, owner: str, token: int) -> None:
        """Re-check the lease and lock the job row until the current transaction ends.

        Used by `Lease.atomic()`: the row lock keeps a claim from taking the job over while the
        handler's writes commit. Raises `LeaseLost` if `owner` no longer holds the job.
        """
        if not connections[self.db].in_atomic_block:
            raise LeaseError("lock_held() must run inside transaction.atomic()")
        # An UPDATE, not SELECT ... FOR UPDATE: it is the conditional write that takes the row
        # lock on every backend, SQLite's database write lock included.
        if not self.held(pk, owner, token).update(heartbeat_at=Now()):
            raise LeaseLost(f"job {pk}: lease lost; the transaction is rolled back")

    @retry_deadlocks
    def _holder_write(
        self,
        pk: int,
        owner: str,
        token: int,
        outcome: str | None,
        error: tuple[str, str] | None,
        *,
        live: bool = False,
        **values: Any,
    ) -> None:
        held = self.held(pk, owner, token)
        if live:
            held = held.filter(lease_until__gte=Now())
        try:
            # One transaction: the job's transition and its ledger row commit together.
            with transaction.atomic(using=self.db):
                if not self._held_update(held, pk, values):
                    raise LeaseLost(f"job {pk}: {owner} no longer holds token {token}")
                if outcome is not None:
                    self._close_attempt(pk, token, outcome, by=owner, error=error)
                elif "checkpoint" in values:
                    self._ledger_update({pk: token}, checkpoint=values["checkpoint"])
        except LeaseLost:
            self.record_fenced(pk, token)
            raise

    def _held_update(self, held: LeaseQuerySet[J], pk: int, values: dict[str, Any]) -> bool:
        """Apply the holder's write `values` to `held` (the job `pk` as its holder holds it);
        one that releases the job's lock passes it on.

        A job without a lock is updated in one statement, as before locks existed; a job of a
        lock fails that statement's `lock = ''` and takes the second, then passes its lock on.
        """
        if "lock_holder" not in values:
            return bool(held.update(**values))
        if held.filter(lock="").update(**values):
            return True
        if not held.exclude(lock="").update(**values):
            return False
        self._pass_lock(pk)
        return True
