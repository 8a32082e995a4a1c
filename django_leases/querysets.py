"""Every lease write of django-leases. No other module writes lease fields.

Each transition is ONE conditional UPDATE whose WHERE restates the full precondition; the row
count it returns is the decision. Holder writes (heartbeat, checkpoint, complete, fail, release)
always filter on id + processing + owner + fencing token, so a worker that paused past its lease
cannot touch a job that someone else now owns. Every lease time comes from the database clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache, reduce, wraps
from operator import or_
from typing import TYPE_CHECKING, Any, TypeVar

from django.apps import apps
from django.db import IntegrityError, OperationalError, connections, models, transaction
from django.db.models import Case, F, OuterRef, Q, Subquery, Value, When
from django.db.models.functions import Greatest, Now

from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import LeaseError, LeaseLost
from django_leases.limits import (
    CHECKPOINT_LENGTH,
    CLAIM_LIMIT,
    IDEMPOTENCY_KEY_LENGTH,
    JOB_ID,
    KIND_LENGTH,
    MAX_ATTEMPTS,
    OWNER_LENGTH,
    PAYMENT_ID_LENGTH,
    PRIORITY,
    check_datetime,
    check_int,
    check_json,
    check_text,
)
from django_leases.redaction import error_text

if TYPE_CHECKING:
    from django_leases.models import AbstractJobAttempt, AbstractLeasedJob, PaymentJob

J = TypeVar("J", bound="AbstractLeasedJob")

PENDING, PROCESSING, COMPLETED, FAILED, REVIEW, CANCELLED = (
    "pending",
    "processing",
    "completed",
    "failed",
    "review",
    "cancelled",
)
FINAL_STATUSES = (COMPLETED, FAILED, CANCELLED)
# Ledger outcomes only a holder's own write gives its attempt.
HOLDER_OUTCOMES = ("completed", "failed", "retried", "released", "timed_out")
# Jobs one operator action changes per transaction (one locking read and one UPDATE).
OPERATOR_BATCH_SIZE = 500
MAX_ERROR_LENGTH = 2000
MAX_ERROR_CLASS_LENGTH = 255
DEADLOCK_RETRIES = 5


def after(seconds: float) -> Any:
    """Return the SQL expression "database now + `seconds`"."""
    return Now() + timedelta(seconds=seconds)


def describe_error(error: BaseException | str) -> tuple[str, str]:
    """Return (error class, message) for the ledger: never the payload, never a traceback.

    An exception's message goes through the `REDACT_ERRORS` hook (see `redaction`); a string
    (an operator's reason) is kept as given.
    """
    if isinstance(error, BaseException):
        cls = type(error)
        name = (
            cls.__qualname__
            if cls.__module__ == "builtins"
            else f"{cls.__module__}.{cls.__qualname__}"
        )
        # Cut to the ledger's column: an error that cannot be stored must still end the attempt.
        if len(name) > MAX_ERROR_CLASS_LENGTH:
            name = name[: MAX_ERROR_CLASS_LENGTH - 1] + "…"
        return storable(name), storable(error_text(error))[:MAX_ERROR_LENGTH]
    return "", storable(str(error))[:MAX_ERROR_LENGTH]


def storable(text: str) -> str:
    """Return `text` with what no database column stores escaped: NUL characters (PostgreSQL
    refuses them) and lone surrogates (not UTF-8), as backslash escapes."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Rescue:
    """What the watcher did with one expired lease."""

    pk: int
    kind: str
    previous_owner: str
    token: int
    attempts: int
    action: str
    expired_for: float


def deadlocked(exc: OperationalError, vendor: str) -> bool:
    """Whether the database rolled the transaction back to break a deadlock or lock wait."""
    if vendor == "mysql":
        # 1213: deadlock found; 1205: lock wait timeout. InnoDB rolls the transaction back.
        return bool(exc.args) and exc.args[0] in (1205, 1213)
    if vendor == "postgresql":
        return getattr(exc.__cause__, "sqlstate", None) in ("40001", "40P01")
    return False


F_ = TypeVar("F_", bound=Callable[..., Any])


def retry_deadlocks(method: F_) -> F_:
    """Run a lease transition again when the database aborted it to break a deadlock.

    InnoDB picks deadlock victims among concurrent claims and completions even when every
    statement is correct. The victim's transaction was rolled back whole, and every transition
    here is a conditional UPDATE, so running it again is safe. Inside a caller's transaction
    nothing can be retried: the error propagates.
    """

    @wraps(method)
    def wrapper(self: LeaseQuerySet[Any], *args: Any, **kwargs: Any) -> Any:
        connection = connections[self.db]
        nested = connection.in_atomic_block
        attempt = 1
        while True:
            try:
                return method(self, *args, **kwargs)
            except OperationalError as exc:
                if nested or attempt >= DEADLOCK_RETRIES or not deadlocked(exc, connection.vendor):
                    raise
            time.sleep(random.uniform(0.005, 0.05) * attempt)  # noqa: S311 - jitter
            attempt += 1

    return wrapper  # type: ignore[return-value]


# The ledger columns the PostgreSQL fast paths write: a ledger model with other fields (a
# project's own AbstractJobAttempt subclass that adds some) takes the ORM path instead.
LEDGER_FIELDS = {
    "id", "job", "job_ref", "attempt", "token", "owner", "claimed_at", "last_heartbeat_at",
    "lease_until", "checkpoint", "ended_at", "outcome", "ended_by", "fenced_at", "error_class",
    "error_message", "resolution", "resolved_by", "resolved_at",
}  # fmt: skip


@dataclass(frozen=True)
class LedgerSQL:
    """Quoted names of the attempt ledger, for statements that write it in raw SQL."""

    table: str
    columns: dict[str, str]

    def __getattr__(self, name: str) -> str:
        try:
            return self.columns[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def insert_columns(self) -> str:
        names = ("job", "job_ref", "attempt", "token", "owner", "claimed_at",
                 "last_heartbeat_at", "lease_until", "checkpoint", "outcome", "ended_by",
                 "error_class", "error_message", "resolution", "resolved_by")  # fmt: skip
        return ", ".join(self.columns[name] for name in names)

    @property
    def insert_values(self) -> str:
        """The values of `insert_columns`, read from the `claimed` CTE (the new leases)."""
        return (
            "claimed.id, claimed.id, claimed.attempts, claimed.lease_token, %s, "
            "STATEMENT_TIMESTAMP(), claimed.heartbeat_at, claimed.lease_until, "
            "claimed.checkpoint, %s, '', '', '', '', ''"
        )

    @staticmethod
    def insert_params(owner: str) -> list[Any]:
        return [owner, "running"]


@dataclass(frozen=True)
class PrunedBatch:
    """One batch deleted by `prune()`, in its own transaction."""

    status: str
    jobs: int
    attempts: int
    """Ledger rows of those jobs: deleted, or kept with `job` set to NULL (`keep_ledger`)."""
    keep_ledger: bool


@cache
def ledger_sql(model: type[AbstractLeasedJob], alias: str) -> LedgerSQL | None:
    """Build the `LedgerSQL` of `model`'s ledger once per process (claim and complete are hot).

    None where the raw-SQL paths do not apply: no ledger, or a ledger with fields of its own.
    """
    label = model.attempt_model
    if not label:
        return None
    ledger = apps.get_model(label)
    fields = {field.name: field for field in ledger._meta.concrete_fields}
    if set(fields) != LEDGER_FIELDS:
        return None
    quote = connections[alias].ops.quote_name
    return LedgerSQL(
        table=quote(ledger._meta.db_table),
        columns={name: quote(str(field.column)) for name, field in fields.items()},
    )


class LeaseQuerySet(models.QuerySet[J]):
    """Reads and lease transitions of any `AbstractLeasedJob` table."""

    # ---- reads -------------------------------------------------------------------------------

    def pending(self) -> LeaseQuerySet[J]:
        return self.filter(status=PENDING)

    def processing(self) -> LeaseQuerySet[J]:
        return self.filter(status=PROCESSING)

    def due(self) -> LeaseQuerySet[J]:
        """Pending jobs whose `run_at` has passed by the database clock."""
        return self.filter(status=PENDING, run_at__lte=Now())

    def expired(self) -> LeaseQuerySet[J]:
        """Processing jobs whose lease already ended: stuck, until a claim or the watcher acts."""
        return self.filter(status=PROCESSING, lease_until__lt=Now())

    def near_expiry(self, within: float | timedelta) -> LeaseQuerySet[J]:
        """Processing jobs whose lease is still live but ends within `within`."""
        seconds = to_seconds(within, "within")
        return self.filter(
            status=PROCESSING, lease_until__gte=Now(), lease_until__lt=after(seconds)
        )

    def healthy(self, within: float | timedelta) -> LeaseQuerySet[J]:
        """Processing jobs whose lease ends later than `within` from now."""
        seconds = to_seconds(within, "within")
        return self.filter(status=PROCESSING, lease_until__gte=after(seconds))

    def finished_within(self, within: float | timedelta) -> LeaseQuerySet[J]:
        """Jobs that reached a final status (completed, failed, cancelled) within the last
        `within`, by the database clock; a range of the (status, completed_at) index."""
        seconds = to_seconds(within, "within")
        return self.filter(
            status__in=[COMPLETED, FAILED, CANCELLED],
            completed_at__gte=Now() - timedelta(seconds=seconds),
        )

    def claimable(self, kinds: Collection[str] | None = None) -> LeaseQuerySet[J]:
        """Due pending jobs and expired leases that still have an attempt left."""
        guard, _, _ = takeover_guard()
        qs = self.filter(
            Q(status=PENDING, run_at__lte=Now())
            | (Q(status=PROCESSING, lease_until__lt=Now()) & guard),
            attempts__lt=F("max_attempts"),
        )
        return qs.filter(kind__in=list(kinds)) if kinds is not None else qs

    def _claimable_pass(self, kinds: Collection[str] | None, takeover: bool) -> LeaseQuerySet[J]:
        qs = self.expired().filter(takeover_guard()[0]) if takeover else self.due()
        qs = qs.filter(attempts__lt=F("max_attempts"))
        return qs.filter(kind__in=list(kinds)) if kinds is not None else qs

    def under_review(self) -> LeaseQuerySet[J]:
        """Jobs the watcher held for review: an operator or a reconcile hook decides."""
        return self.filter(status=REVIEW)

    def held_by(self, owner: str) -> LeaseQuerySet[J]:
        """Processing jobs whose lease `owner` holds (live or expired)."""
        return self.filter(status=PROCESSING, lease_owner=owner)

    def finished_by(self, pk: int, owner: str, token: int) -> bool:
        """Whether `owner`'s own write under `token` ended that attempt (completed, failed,
        retried, released or timed out).

        A holder whose connection died after sending its completion asks this before it calls
        itself fenced out: its write may have committed with only the acknowledgement lost. The
        attempt's ledger row answers, not the job row: a watcher's rescue also moves the job out
        of processing under the same token, but closes the row as someone else. A job table
        without a ledger cannot tell the two apart, so the answer there is always False.
        """
        ledger = self._ledger()
        if ledger is None:
            return False
        return (
            ledger.objects.using(self.db)
            .filter(job_ref=pk, token=token, ended_by=owner, outcome__in=HOLDER_OUTCOMES)
            .exists()
        )

    def orphaned(self, owners: Collection[str] | models.QuerySet[Any]) -> LeaseQuerySet[J]:
        """Processing jobs with a live lease whose owner is one of `owners` (workers known gone).

        `owners` is a collection of worker ids, or a one-column queryset of them (e.g. the
        registry's `gone().values("worker_id")`), which stays a subquery in the database.
        """
        if not isinstance(owners, models.QuerySet):
            owners = list(owners)
        return self.filter(status=PROCESSING, lease_until__gte=Now(), lease_owner__in=owners)

    def held(self, pk: int, owner: str, token: int) -> LeaseQuerySet[J]:
        """The one row `owner` holds under `token`, or nothing: the filter of every holder write."""
        return self.filter(pk=pk, status=PROCESSING, lease_owner=owner, lease_token=token)

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
        seconds = to_seconds(ttl, "ttl")
        _check_owner(owner)
        check_int(limit, "limit", CLAIM_LIMIT)
        if kinds is not None:
            kinds = [check_text(kind, "kinds", KIND_LENGTH) for kind in kinds]
            if not kinds:
                return []
        vendor = connections[self.db].vendor
        ledger = self._ledger_sql() if vendor == "postgresql" else None
        if ledger is not None:
            # One statement claims and writes the ledger: atomic without a transaction block.
            jobs = self._claim_postgresql(owner, seconds, limit, kinds, ledger=ledger)
        else:
            with transaction.atomic(using=self.db):
                if vendor == "postgresql":
                    jobs = self._claim_postgresql(owner, seconds, limit, kinds)
                else:
                    jobs = self._claim_portable(owner, seconds, limit, kinds, vendor)
                self._open_attempts(jobs, owner)
        # RETURNING gives no order: hand jobs out in claim order.
        jobs.sort(key=lambda job: (not job.taken_over, -job.priority, job.run_at, job.pk))  # type: ignore[attr-defined]
        return jobs

    def _claim_sql_parts(self, kinds: list[str] | None) -> tuple[str, str, list[Any]]:
        connection = connections[self.db]
        table = connection.ops.quote_name(self.model._meta.db_table)
        if not kinds:
            return table, "", []
        placeholders = ", ".join(["%s"] * len(kinds))
        return table, f"AND kind IN ({placeholders})", list(kinds)

    def _claim_postgresql(
        self,
        owner: str,
        seconds: float,
        limit: int,
        kinds: list[str] | None,
        *,
        ledger: LedgerSQL | None = None,
    ) -> list[J]:
        # One statement decides ownership. Each candidate set is a MATERIALIZED CTE with
        # FOR UPDATE SKIP LOCKED: it is evaluated once, so it cannot re-run per row and lock
        # more than LIMIT rows (the trap of `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR
        # UPDATE SKIP LOCKED)`, which PostgreSQL may re-execute and then over-claim). Rows
        # locked by a concurrent claim are skipped, not waited for; a row changed by a commit
        # before we lock it is rechecked against the CTE's WHERE (READ COMMITTED EvalPlanQual).
        # Expired leases are taken first; `due` is only read as far as the outer LIMIT needs.
        # Each CTE walks its own partial index, so the cost does not grow with finished rows.
        # Tested on PostgreSQL 15.
        table, kind_sql, kind_params = self._claim_sql_parts(kinds)
        _, guard_sql, guard_params = takeover_guard()
        update = f"""
            UPDATE {table} AS job
            SET status = %s,
                lease_owner = %s,
                lease_until = STATEMENT_TIMESTAMP() + make_interval(secs => %s),
                heartbeat_at = STATEMENT_TIMESTAMP(),
                lease_token = job.lease_token + 1,
                attempts = job.attempts + 1
            FROM picked
            WHERE job.id = picked.id
            RETURNING job.*, picked.taken_over
        """  # noqa: S608 - table name quoted by the backend, values are parameters
        params: list[Any] = [
            PROCESSING,
            *kind_params,
            *guard_params,
            limit,
            PENDING,
            *kind_params,
            limit,
            limit,
            PROCESSING,
            owner,
            seconds,
        ]
        if ledger is None:
            main = update
        else:
            # The ledger writes ride in the same statement as data-modifying CTEs: the open row
            # of each new attempt, and the closing of the rows of holders whose expired lease
            # this claim took over. All parts run on one snapshot, so the UPDATE cannot see
            # (and close) the rows the INSERT adds.
            main = f"""
            , claimed AS ({update}
            ), lost AS (
                UPDATE {ledger.table} AS a
                SET {ledger.outcome} = %s,
                    {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                    {ledger.ended_by} = %s
                FROM claimed
                WHERE claimed.taken_over AND a.{ledger.job_ref} = claimed.id
                  AND a.{ledger.ended_at} IS NULL
            ), opened AS (
                INSERT INTO {ledger.table} ({ledger.insert_columns})
                SELECT {ledger.insert_values} FROM claimed
            )
            SELECT * FROM claimed
            """  # noqa: S608 - names quoted by the backend, values are parameters
            params += ["lease_lost", owner, *ledger.insert_params(owner)]
        sql = f"""
            WITH expired AS MATERIALIZED (
                SELECT id FROM {table}
                WHERE status = %s AND lease_until < STATEMENT_TIMESTAMP()
                  AND attempts < max_attempts {kind_sql} {guard_sql}
                ORDER BY lease_until
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), due AS MATERIALIZED (
                SELECT id FROM {table}
                WHERE status = %s AND run_at <= STATEMENT_TIMESTAMP()
                  AND attempts < max_attempts {kind_sql}
                ORDER BY priority DESC, run_at, id
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), picked AS MATERIALIZED (
                SELECT id, TRUE AS taken_over FROM expired
                UNION ALL
                SELECT id, FALSE AS taken_over FROM due
                LIMIT %s
            ){main}
        """  # noqa: S608 - table and column names quoted by the backend, values are parameters
        return list(self.raw(sql, params))

    def _claim_portable(
        self, owner: str, seconds: float, limit: int, kinds: list[str] | None, vendor: str
    ) -> list[J]:
        # Two passes, expired leases first (rare; the pass is one cheap index probe), then due
        # jobs. Each pass's UPDATE restates the full claimable predicate.
        jobs: list[J] = []
        for takeover in (True, False):
            remaining = limit - len(jobs)
            if remaining <= 0:
                break
            if vendor == "sqlite":
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
        # SQLite runs one writer at a time and evaluates the IN (... LIMIT n) subquery once
        # into a temporary table, so this single statement claims at most `limit` rows and no
        # two connections can claim one row. The UPDATE is the transaction's first statement,
        # so it takes the write lock at once (waiting up to the busy timeout) instead of
        # failing to upgrade a read lock. Needs SQLite >= 3.35 for RETURNING.
        table, kind_sql, kind_params = self._claim_sql_parts(kinds)
        guard_sql = ""
        guard_params: list[Any] = []
        now = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
        if takeover:
            predicate, order, status = (
                f"status = %s AND lease_until < {now}",
                "lease_until",
                PROCESSING,
            )
            _, guard_sql, guard_params = takeover_guard()
        else:
            # `+run_at`: once ANALYZE has run, SQLite would rather range-scan run_at and sort
            # every due job; the unary plus keeps it walking the due index in claim order.
            predicate, order, status = (
                f"status = %s AND +run_at <= {now}",
                "priority DESC, run_at, id",
                PENDING,
            )
        sql = f"""
            UPDATE {table}
            SET status = %s,
                lease_owner = %s,
                lease_until = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %s),
                heartbeat_at = {now},
                lease_token = lease_token + 1,
                attempts = attempts + 1
            WHERE id IN (
                SELECT id FROM {table}
                WHERE {predicate} AND attempts < max_attempts {kind_sql} {guard_sql}
                ORDER BY {order}
                LIMIT %s
            )
            RETURNING *
        """  # noqa: S608 - table name quoted by the backend, values are parameters
        params = [
            PROCESSING,
            owner,
            f"+{seconds:.6f} seconds",
            status,
            *kind_params,
            *guard_params,
            limit,
        ]
        return list(self.raw(sql, params))

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
        _check_owner(owner)
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
        ledger = self._ledger_sql() if connections[self.db].vendor == "postgresql" else None
        if ledger is not None and result is None:
            self._complete_postgresql(pk, owner, token, ledger)
            return
        values: dict[str, Any] = {"status": COMPLETED, "completed_at": Now(), "last_error": ""}
        if result is not None:
            values["result"] = result
        self._holder_write(pk, owner, token, "completed", None, **values)

    @retry_deadlocks
    def _complete_postgresql(self, pk: int, owner: str, token: int, ledger: LedgerSQL) -> None:
        # The hot path of every job: the conditional UPDATE of the job and the closing of its
        # ledger row in one statement (a data-modifying CTE), so one round trip and no
        # transaction block. The ledger row is closed only if the job's UPDATE won.
        table = connections[self.db].ops.quote_name(self.model._meta.db_table)
        sql = f"""
            WITH done AS (
                UPDATE {table}
                SET status = %s, completed_at = STATEMENT_TIMESTAMP(), last_error = ''
                WHERE id = %s AND status = %s AND lease_owner = %s AND lease_token = %s
                RETURNING id, lease_token, checkpoint
            ), closed AS (
                UPDATE {ledger.table} AS a
                SET {ledger.outcome} = %s,
                    {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                    {ledger.ended_by} = %s,
                    {ledger.checkpoint} = done.checkpoint,
                    {ledger.error_class} = '',
                    {ledger.error_message} = ''
                FROM done
                WHERE a.{ledger.job_ref} = done.id AND a.{ledger.token} = done.lease_token
                  AND a.{ledger.ended_at} IS NULL
            )
            SELECT count(*) FROM done
        """  # noqa: S608 - table and column names quoted by the backend, values are parameters
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql, [COMPLETED, pk, PROCESSING, owner, token, "completed", owner])
            (won,) = cursor.fetchone()
        if not won:
            self.record_fenced(pk, token)
            raise LeaseLost(f"job {pk}: {owner} no longer holds token {token}")

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
        else:
            delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
            status = Case(When(final, then=Value(FAILED)), default=Value(PENDING))
            completed_at = Case(When(final, then=Now()), default=None)
            run_at = Case(When(final, then=F("run_at")), default=after(delay) if delay else Now())
        with transaction.atomic(using=self.db):
            won = self.held(pk, owner, token).update(
                status=status, completed_at=completed_at, run_at=run_at, last_error=last_error
            )
            if not won:
                raise LeaseLost(f"job {pk}: lease lost before its failure could be recorded")
            # The row is ours until commit; read back which branch the UPDATE took.
            new_status = self.filter(pk=pk).values_list("status", flat=True).get()
            outcome = "failed" if new_status == FAILED else "retried"
            self._close_attempt(pk, token, outcome, by=owner, error=(error_class, message))
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
                run_at=Case(
                    When(review | final, then=F("run_at")),
                    default=after(delay) if delay else Now(),
                ),
                last_error=reason[:MAX_ERROR_LENGTH],
            )
            if won:
                new_status = self.filter(pk=pk).values_list("status", flat=True).get()
                self._close_attempt(pk, token, "timed_out", by=owner, error=("", reason))
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
            "released",
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
                if not held.update(**values):
                    raise LeaseLost(f"job {pk}: {owner} no longer holds token {token}")
                if outcome is not None:
                    self._close_attempt(pk, token, outcome, by=owner, error=error)
                elif "checkpoint" in values:
                    self._ledger_update({pk: token}, checkpoint=values["checkpoint"])
        except LeaseLost:
            self.record_fenced(pk, token)
            raise

    # ---- the watcher and operators ----------------------------------------------------------

    @retry_deadlocks
    def rescue(
        self,
        job: AbstractLeasedJob,
        action: str,
        *,
        by: str,
        retry_in: float | timedelta | None = None,
        reason: str = "",
        orphaned: bool = False,
    ) -> bool:
        """Resolve the expired lease of `job` (as read by the watcher) with `action`.

        `action` is "retry" (back to pending after `retry_in`), "review" (held for an operator),
        "failed" or "completed" (a reconcile hook's verdict). The UPDATE restates everything the
        decision read: the expiry, the token, the checkpoint and `max_attempts`, so a job
        completed, renewed, claimed, checkpointed or rescued a moment ago is left alone. With
        `orphaned`, the lease may still be live but its owner is known gone (see `orphaned()`):
        the UPDATE then restates that owner instead of the expiry. Returns whether this call won.
        """
        values: dict[str, Any]
        if action == "retry":
            delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
            values = {"status": PENDING, "run_at": after(delay) if delay else Now()}
            outcome = "rescued"
        elif action == "review":
            values = {"status": REVIEW}
            outcome = "review"
        elif action in (FAILED, COMPLETED):
            values = {"status": action, "completed_at": Now()}
            outcome = action
        else:
            raise ValueError(f"unknown rescue action {action!r}")
        if reason:
            values["last_error"] = reason[:MAX_ERROR_LENGTH]
        with transaction.atomic(using=self.db):
            stale = (
                self.processing().filter(lease_owner=job.lease_owner)
                if orphaned
                else self.expired()
            )
            won = stale.filter(
                pk=job.pk,
                lease_token=job.lease_token,
                checkpoint=job.checkpoint,
                max_attempts=job.max_attempts,
            ).update(**values)
            if won:
                self._close_attempt(
                    job.pk, job.lease_token, outcome, by=by, error=("", reason) if reason else None
                )
        return bool(won)

    def requeue(self, *, force: bool = False, by: str = "operator") -> int:
        """Make the selected jobs pending and due now; return how many changed.

        Failed, cancelled, under-review and expired jobs are requeued; a processing job with a
        live lease only with `force`, which also bumps its fencing token so that the current
        holder is fenced out of every further write. Completed jobs are never requeued. A job
        without attempts left gets one more.
        """
        eligible = Q(status__in=[FAILED, CANCELLED, REVIEW, PENDING]) | Q(
            status=PROCESSING, lease_until__lt=Now()
        )
        if force:
            eligible |= Q(status=PROCESSING)
        values = {
            "status": PENDING,
            "run_at": Now(),
            "completed_at": None,
            # A requeued job gets at least one more attempt, whatever it used up.
            "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            "lease_token": F("lease_token") + 1,
        }
        return self._operator_write(eligible, values, by, event="requeued", ends="requeued")

    def release_stuck(self, *, by: str = "operator") -> int:
        """Return the selected jobs whose lease expired to pending (the watcher's retry).

        A job that used its last attempt gets one more, or it would sit pending unclaimable.
        """
        return self._operator_write(
            Q(status=PROCESSING, lease_until__lt=Now()),
            {
                "status": PENDING,
                "run_at": Now(),
                "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            },
            by,
            event="released",
            ends="rescued",
        )

    def mark_failed(self, *, reason: str, force: bool = False, by: str = "operator") -> int:
        """Fail the selected pending, under-review or expired jobs (any processing one with
        `force`, fencing out its holder); return how many changed."""
        eligible = Q(status__in=[PENDING, REVIEW]) | Q(status=PROCESSING, lease_until__lt=Now())
        if force:
            eligible |= Q(status=PROCESSING)
        values = {
            "status": FAILED,
            "completed_at": Now(),
            "last_error": reason[:MAX_ERROR_LENGTH],
            "lease_token": F("lease_token") + 1,
        }
        return self._operator_write(
            eligible, values, by, event="failed", ends="failed", reason=reason
        )

    def cancel(self, *, by: str = "operator") -> int:
        """Cancel the selected pending jobs; return how many changed."""
        values = {"status": CANCELLED, "completed_at": Now(), "last_error": f"cancelled by {by}"}
        return self._operator_write(Q(status=PENDING), values, by, event="cancelled")

    def resolve_review(self, verdict: str, *, by: str = "operator") -> int:
        """Resolve the selected jobs under review: "completed", "retry" or "failed".

        The verdict is an event of the job; it is also noted on the ledger row that put the job
        under review, if no verdict is there yet.
        """
        values: dict[str, Any]
        if verdict == "retry":
            values = {
                "status": PENDING,
                "run_at": Now(),
                "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            }
        elif verdict in (COMPLETED, FAILED):
            values = {"status": verdict, "completed_at": Now()}
        else:
            raise ValueError(f"unknown review verdict {verdict!r}")
        return self._operator_write(
            Q(status=REVIEW), values, by, event=f"review_{verdict}", resolution=verdict
        )

    def _operator_write(
        self,
        eligible: Q,
        values: dict[str, Any],
        by: str,
        *,
        event: str,
        ends: str | None = None,
        reason: str = "",
        resolution: str = "",
    ) -> int:
        """Apply an operator action to the selected jobs that are `eligible`, in batches of
        OPERATOR_BATCH_SIZE; return how many changed.

        Each changed job gets an event (`event`, `by`, `reason`); an open attempt the action
        ends is closed as `ends` by `by`. A closed attempt row is never changed.
        """
        changed = 0
        after_pk: int | None = 0
        while after_pk is not None:
            won, after_pk = self._operator_batch(
                eligible, after_pk, values, by, event, ends, reason, resolution
            )
            changed += won
        return changed

    @retry_deadlocks
    def _operator_batch(
        self,
        eligible: Q,
        after_pk: int,
        values: dict[str, Any],
        by: str,
        event: str,
        ends: str | None,
        reason: str,
        resolution: str,
    ) -> tuple[int, int | None]:
        # One transaction per batch: the jobs' UPDATE, the closing of the attempts it ended and
        # the events that record it commit together, or not at all.
        with transaction.atomic(using=self.db):
            # Lock the batch, then ONE UPDATE restating the whole precondition: the rows locked
            # are exactly the rows it changes, so events and ledger rows are written for those
            # only. PostgreSQL and MariaDB/MySQL lock the rows; on SQLite the IMMEDIATE
            # transaction holds the database write lock (see check W003). Tested on all three.
            rows = list(
                self.filter(eligible, pk__gt=after_pk)
                .order_by("pk")
                .select_for_update()
                .values_list("pk", "lease_token", "attempts")[:OPERATOR_BATCH_SIZE]
            )
            if not rows:
                return 0, None
            pks = [pk for pk, _, _ in rows]
            won = self.filter(eligible, pk__in=pks).update(**values)
            if won != len(rows):
                raise LeaseError(f"{won} of {len(rows)} locked jobs changed; rolled back")
            ledger = self._ledger()
            if ledger is not None:
                attempts = ledger.objects.using(self.db).filter(job_ref__in=pks)
                if ends is not None:
                    # A processing job's open attempt ends here, by the operator.
                    attempts.filter(ended_at__isnull=True).update(
                        outcome=ends,
                        ended_at=Now(),
                        ended_by=by,
                        checkpoint=self._job_column("checkpoint"),
                        error_class="",
                        error_message=storable(reason)[:MAX_ERROR_LENGTH],
                    )
                if resolution:
                    self._ledger_update(
                        {pk: token for pk, token, _ in rows},
                        Q(resolution=""),
                        resolution=resolution,
                        resolved_by=by,
                        resolved_at=Now(),
                    )
            self._record_events(rows, event, by, reason)
        return won, pks[-1]

    def _record_events(
        self, rows: list[tuple[int, int, int]], action: str, by: str, reason: str
    ) -> None:
        label = self.model.event_model
        if not label:
            return
        events = apps.get_model(label)
        events.objects.using(self.db).bulk_create(
            events(
                # `job` is the concrete event log's foreign key (see AbstractJobEvent).
                **{"job_id": pk},
                job_ref=pk,
                token=token,
                attempts=attempts,
                action=action,
                by=by,
                reason=storable(reason)[:MAX_ERROR_LENGTH],
            )
            for pk, token, attempts in rows
        )

    # ---- pruning -----------------------------------------------------------------------------

    def prunable(
        self, retention: Mapping[str, float | timedelta] | None = None
    ) -> LeaseQuerySet[J]:
        """Finished jobs whose `completed_at` is older than their status's retention.

        `retention` maps final statuses ("completed", "failed", "cancelled") to seconds or a
        `timedelta`; a status left out is never pruned. Default: `DJANGO_LEASES["RETENTION"]`.
        Ages are measured by the database clock.
        """
        ages = _retention(retention)
        if not ages:
            return self.none()
        return self.filter(
            reduce(or_, (Q(status=status, completed_at__lt=ago(s)) for status, s in ages.items()))
        )

    def prune(
        self,
        retention: Mapping[str, float | timedelta] | None = None,
        *,
        batch_size: int | None = None,
        keep_ledger: bool | None = None,
        on_batch: Callable[[PrunedBatch], object] | None = None,
    ) -> dict[str, int]:
        """Delete the `prunable(retention)` jobs in batches; return how many went per status.

        Each batch reads at most `batch_size` ids by the `(status, completed_at)` index, then
        deletes them in one transaction with one DELETE that restates the whole precondition,
        so a job requeued meanwhile stays. Its attempt ledger goes with it, unless `keep_ledger`:
        then the ledger rows stay, with `job` set to NULL and `job_ref` still naming the job.
        Pending, processing and under-review jobs are never touched. No delete signals are sent,
        as with `update()`.

        Args:
            retention: final status -> age; default `DJANGO_LEASES["RETENTION"]`.
            batch_size: jobs per batch; default `DJANGO_LEASES["PRUNE_BATCH_SIZE"]`.
            keep_ledger: keep the ledger rows; default `not DJANGO_LEASES["PRUNE_LEDGER"]`.
            on_batch: called after each committed batch.
        """
        ages = _retention(retention)
        size = leases_settings.PRUNE_BATCH_SIZE if batch_size is None else batch_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"batch_size must be a whole number of at least 1, got {size!r}")
        keep = not leases_settings.PRUNE_LEDGER if keep_ledger is None else keep_ledger
        deleted: dict[str, int] = {}
        for status, seconds in ages.items():
            stale = self.filter(status=status, completed_at__lt=ago(seconds))
            deleted[status] = 0
            while True:
                # Oldest first, in index order: the read stops after `size` rows of the index.
                pks = list(stale.order_by("completed_at").values_list("pk", flat=True)[:size])
                if not pks:
                    break
                batch = self._prune_batch(status, stale.filter(pk__in=pks), keep)
                deleted[status] += batch.jobs
                if on_batch is not None:
                    on_batch(batch)
        return deleted

    @retry_deadlocks
    def _prune_batch(self, status: str, batch: LeaseQuerySet[J], keep_ledger: bool) -> PrunedBatch:
        # One transaction per batch: a batch's jobs and their ledger rows go (or are detached)
        # together, and a long prune never holds locks for longer than one batch.
        attempts = 0
        with transaction.atomic(using=self.db):
            if connections[self.db].features.has_select_for_update:
                # PostgreSQL, MariaDB/MySQL: lock the batch's rows first, so that an operator's
                # requeue of one of them waits for our commit instead of losing its ledger.
                locked = batch.select_for_update().values_list("pk", flat=True)
                batch = batch.filter(pk__in=list(locked))
            # SQLite has no row locks: the ledger write below is the transaction's first write
            # and takes the database's write lock, so the batch cannot change before the DELETE.
            ledger = self._ledger()
            if ledger is not None:
                rows = ledger.objects.using(self.db).filter(job_ref__in=batch.values("pk"))
                # `job` is the concrete ledger's foreign key (see AbstractJobAttempt).
                detach = {"job_id": None}
                attempts = rows.update(**detach) if keep_ledger else rows._raw_delete(self.db)
            if self.model.event_model:
                # The operator events follow the ledger: deleted, or kept detached.
                events = apps.get_model(self.model.event_model).objects.using(self.db)
                events = events.filter(job_ref__in=batch.values("pk"))
                if keep_ledger:
                    events.update(job_id=None)
                else:
                    events._raw_delete(self.db)
            # _raw_delete: ONE statement for the whole batch. QuerySet.delete() would collect
            # the ledger's SET_NULL relation and delete in chunks of 100 ids.
            jobs = batch._raw_delete(self.db)
        return PrunedBatch(status, jobs, attempts, keep_ledger)

    # ---- the attempt ledger ------------------------------------------------------------------

    def _ledger(self) -> type[AbstractJobAttempt] | None:
        label = self.model.attempt_model
        return apps.get_model(label) if label else None

    def _ledger_sql(self) -> LedgerSQL | None:
        """Quoted ledger names for the PostgreSQL fast paths, or None where they do not apply."""
        return ledger_sql(self.model, self.db)

    def _job_column(self, name: str) -> Subquery:
        return Subquery(self.model._base_manager.filter(pk=OuterRef("job_ref")).values(name)[:1])

    def _open_attempts(self, jobs: Iterable[J], owner: str) -> None:
        ledger = self._ledger()
        jobs = list(jobs)
        if ledger is None or not jobs:
            return
        taken = [job.pk for job in jobs if getattr(job, "taken_over", False)]
        if taken:
            # The previous holders of expired leases lost them to this claim.
            ledger.objects.using(self.db).filter(job_ref__in=taken, ended_at__isnull=True).update(
                outcome="lease_lost", ended_at=Now(), ended_by=owner
            )
        ledger.objects.using(self.db).bulk_create(
            ledger(
                # `job` is the concrete ledger's foreign key (see AbstractJobAttempt).
                **{"job_id": job.pk},
                job_ref=job.pk,
                attempt=job.attempts,
                token=job.lease_token,
                owner=owner,
                last_heartbeat_at=job.heartbeat_at,
                lease_until=job.lease_until,
                checkpoint=job.checkpoint,
            )
            for job in jobs
        )

    def _ledger_update(
        self, leases: Mapping[int, int], where: Q | None = None, **values: Any
    ) -> int:
        ledger = self._ledger()
        if ledger is None:
            return 0
        pairs = reduce(or_, (Q(job_ref=pk, token=token) for pk, token in leases.items()))
        return ledger.objects.using(self.db).filter(pairs, where or Q()).update(**values)

    def _close_attempt(
        self,
        pk: int,
        token: int,
        outcome: str,
        *,
        by: str,
        error: tuple[str, str] | None,
    ) -> None:
        error_class, message = error or ("", "")
        # Only an open row: a closed attempt is never rewritten.
        self._ledger_update(
            {pk: token},
            Q(ended_at__isnull=True),
            outcome=outcome,
            ended_at=Now(),
            ended_by=by,
            checkpoint=self._job_column("checkpoint"),
            error_class=error_class,
            error_message=message,
        )

    def record_fenced(self, pk: int, token: int) -> None:
        """Note in the ledger that the holder of `token` came back and was refused.

        Never on a row the holder closed itself (a repeated completion is refused too, but
        nobody fenced that holder out).
        """
        ledger = self._ledger()
        if ledger is not None:
            closed_by_holder = Q(outcome__in=HOLDER_OUTCOMES, ended_by=F("owner"))
            ledger.objects.using(self.db).filter(
                job_ref=pk, token=token, fenced_at__isnull=True
            ).exclude(closed_by_holder).update(fenced_at=Now())


class PaymentJobQuerySet(LeaseQuerySet["PaymentJob"]):
    """`LeaseQuerySet` plus enqueueing of payment jobs."""

    def enqueue(
        self,
        kind: str,
        payload: Any = None,
        *,
        payment_id: str | None = None,
        idempotency_key: str | None = None,
        run_at: datetime | float | timedelta | None = None,
        priority: int = 0,
        max_attempts: int | None = None,
    ) -> PaymentJob:
        """Add a pending job and return it.

        Enqueueing an `idempotency_key` that already exists returns the first job and creates
        nothing. `run_at` is a datetime, or a delay (seconds or `timedelta`) from the database
        clock; None means now. Raises `InvalidPayload` (and writes nothing) if `payload` is not
        JSON.
        """
        fields = _job_fields(kind, payload, payment_id, run_at, priority, max_attempts)
        if idempotency_key is not None:
            check_text(idempotency_key, "idempotency_key", IDEMPOTENCY_KEY_LENGTH)
        with transaction.atomic(using=self.db):
            if idempotency_key is None:
                job = self.create(**fields)
            else:
                # The unique index decides between racing enqueues of one key, not a prior read:
                # the loser's INSERT fails inside its savepoint and it returns the winner's row.
                try:
                    with transaction.atomic(using=self.db):
                        job = self.create(idempotency_key=idempotency_key, **fields)
                except IntegrityError:
                    existing = self.filter(idempotency_key=idempotency_key).first()
                    if existing is None:
                        raise
                    return existing
            self._notify(kind)
        return job

    def _notify(self, kind: str) -> None:
        # NOTIFY is transactional on PostgreSQL: listeners hear it when the enqueue commits.
        connection = connections[self.db]
        if connection.vendor == "postgresql" and leases_settings.USE_NOTIFY:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_notify(%s, %s)", [notify_channel(self.model), kind])


def takeover_guard() -> tuple[Q, str, list[Any]]:
    """Return the filter (as a Q and as SQL) of expired leases a claim may take over.

    A job of a kind under the "review" stuck policy that reached a checkpoint may have done its
    risky external step (a PSP call): it is left for the watcher to hold for review, never
    re-run blindly by whichever worker polls first.
    """
    by_kind: dict[str, str] = leases_settings.STUCK_POLICY_BY_KIND
    if leases_settings.STUCK_POLICY == "retry":
        review = sorted(kind for kind, policy in by_kind.items() if policy == "review")
        if not review:
            return Q(), "", []
        placeholders = ", ".join(["%s"] * len(review))
        return (
            ~Q(kind__in=review) | Q(checkpoint=""),
            f"AND NOT (kind IN ({placeholders}) AND checkpoint <> '')",
            review,
        )
    retry = sorted(kind for kind, policy in by_kind.items() if policy == "retry")
    if not retry:
        return Q(checkpoint=""), "AND checkpoint = ''", []
    placeholders = ", ".join(["%s"] * len(retry))
    return (
        Q(kind__in=retry) | Q(checkpoint=""),
        f"AND (kind IN ({placeholders}) OR checkpoint = '')",
        retry,
    )


def ago(seconds: float) -> Any:
    """Return the SQL expression "database now - `seconds`"."""
    return Now() - timedelta(seconds=seconds)


def _retention(retention: Mapping[str, float | timedelta] | None) -> dict[str, float]:
    if retention is None:
        retention = leases_settings.RETENTION
    unknown = sorted(set(retention) - set(FINAL_STATUSES))
    if unknown:
        raise ValueError(
            f"retention can only name final statuses {FINAL_STATUSES}, got {', '.join(unknown)}: "
            "pending, processing and under-review jobs are never pruned"
        )
    return {status: to_seconds(age, f"retention of {status}") for status, age in retention.items()}


def notify_channel(model: type[models.Model]) -> str:
    """Return the LISTEN/NOTIFY channel on which enqueues of `model` are announced."""
    return f"django_leases_{model._meta.db_table}"[:63]


def _check_owner(owner: str) -> None:
    check_text(owner, "owner", OWNER_LENGTH)


def _job_fields(
    kind: str,
    payload: Any,
    payment_id: str | None,
    run_at: datetime | float | timedelta | None,
    priority: int,
    max_attempts: int | None,
) -> dict[str, Any]:
    """Check every argument of `enqueue()` against `limits` and return the job's fields.

    Raises `InvalidArgument` (`InvalidPayload`, `InvalidDuration`) naming the argument; nothing
    has been written then.
    """
    check_text(kind, "kind", KIND_LENGTH)
    payload = {} if payload is None else payload
    check_json(payload, "payload")
    check_int(priority, "priority", PRIORITY)
    if max_attempts is None:
        max_attempts = leases_settings.MAX_ATTEMPTS
    check_int(max_attempts, "max_attempts", MAX_ATTEMPTS)
    if payment_id is not None:
        check_text(payment_id, "payment_id", PAYMENT_ID_LENGTH, blank=True)
    fields: dict[str, Any] = {
        "kind": kind,
        "payload": payload,
        "payment_id": payment_id or "",
        "priority": priority,
        "max_attempts": max_attempts,
    }
    if isinstance(run_at, datetime):
        fields["run_at"] = check_datetime(run_at, "run_at")
    elif run_at is not None:
        fields["run_at"] = after(to_seconds(run_at, "run_at"))
    return fields


class AttemptQuerySet(models.QuerySet[Any]):
    """Reads of the attempt ledger (its writes live in `LeaseQuerySet`)."""

    def open(self) -> AttemptQuerySet:
        return self.filter(ended_at__isnull=True)


class WorkerQuerySet(models.QuerySet[Any]):
    """The worker registry: each worker process keeps its own row fresh."""

    def register(
        self,
        worker_id: str,
        *,
        instance: str,
        hostname: str,
        pid: int,
        kinds: list[str],
        concurrency: int,
    ) -> bool:
        """Take the registry row of `worker_id` for the process `instance`; return whether it did.

        A row that is stopped, or was not refreshed within WORKER_GONE_AFTER, is taken over; a
        live one is not: two processes never share one worker id (one's exit would mark the
        other stopped, and the watcher would rescue a live worker's jobs).
        """
        fields = {
            "instance": instance,
            "hostname": hostname,
            "pid": pid,
            "kinds": kinds,
            "concurrency": concurrency,
            "started_at": Now(),
            "last_seen_at": Now(),
            "stopped_at": None,
        }
        takeable = self.filter(worker_id=worker_id).exclude(pk__in=self.alive().values("pk"))
        if takeable.update(**fields):
            return True
        try:
            with transaction.atomic(using=self.db):
                self.create(worker_id=worker_id, **fields)
        except IntegrityError:
            # A row exists: live (refused), or it went stale between our two statements.
            return bool(takeable.update(**fields))
        return True

    def beat(self, worker_id: str, instance: str) -> bool:
        """Refresh `last_seen_at` of the row `instance` holds (database clock); False if lost."""
        return bool(
            self.filter(worker_id=worker_id, instance=instance).update(
                last_seen_at=Now(), stopped_at=None
            )
        )

    def stopped(self, worker_id: str, instance: str) -> None:
        self.filter(worker_id=worker_id, instance=instance).update(stopped_at=Now())

    def alive(self, within: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers seen within `within` seconds (default WORKER_GONE_AFTER) and not stopped."""
        seconds = to_seconds(
            within if within is not None else leases_settings.WORKER_GONE_AFTER, "within"
        )
        return self.filter(
            stopped_at__isnull=True, last_seen_at__gte=Now() - timedelta(seconds=seconds)
        )

    def gone(self, within: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers that stopped, or were not seen within `within` seconds."""
        seconds = to_seconds(
            within if within is not None else leases_settings.WORKER_GONE_AFTER, "within"
        )
        return self.filter(
            Q(stopped_at__isnull=False) | Q(last_seen_at__lt=Now() - timedelta(seconds=seconds))
        )

    def long_gone(self, retention: float | timedelta | None = None) -> WorkerQuerySet:
        """Workers stopped, or last seen, more than `retention` ago (default WORKER_RETENTION)."""
        seconds = to_seconds(
            retention if retention is not None else leases_settings.WORKER_RETENTION, "retention"
        )
        return self.filter(Q(stopped_at__lt=ago(seconds)) | Q(last_seen_at__lt=ago(seconds)))

    def prune(self, retention: float | timedelta | None = None) -> int:
        """Delete the registry rows of `long_gone(retention)` workers; return how many went."""
        # One DELETE: no relation points at the registry, and it holds a row per worker process
        # name, not per job.
        return self.long_gone(retention)._raw_delete(self.db)
