"""`LeaseQuerySet`: every lease write of django-leases is one of its methods; no module outside
`querysets/` writes lease fields. The holder's writes are here; the other transitions are the
functions of `claims`, `acks`, `operators`, `enqueue` and `prune`, bound in its class body.

Each transition is ONE conditional UPDATE whose WHERE restates the full precondition; the row
count it returns is the decision. Holder writes (heartbeat, checkpoint, complete, fail, release)
always filter on id + processing + owner + fencing token, so a worker that paused past its lease
cannot touch a job that someone else now owns. Every lease time comes from the database clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Now

from django_leases.conf import leases_settings, to_seconds
from django_leases.dialects import dialect_of
from django_leases.exceptions import Cancelled, LeaseError, LeaseLost
from django_leases.handlers import lease_lengths_of
from django_leases.limits import (
    CHECKPOINT_LENGTH,
    check_json_size,
    check_text,
)
from django_leases.querysets import acks, base, claims, endings, ledger, operators
from django_leases.querysets import enqueue as enqueueing
from django_leases.querysets import prune as pruning
from django_leases.querysets.base import (
    LeaseKey,
    after,
    bound_cursor,
    key_groups,
    keys_filter,
    lease_keys,
    lease_until,
    quoted_table,
    retry_deadlocks,
    writes,
)
from django_leases.querysets.dependencies import release_dependents
from django_leases.querysets.ledger import (
    MAX_ERROR_LENGTH,
    J,
    close_attempt,
    describe_error,
    job_column,
    ledger_of,
    ledger_update,
)
from django_leases.querysets.locks import pass_lock
from django_leases.querysets.reads import LeaseReads, takeover_guard
from django_leases.sql.postgresql import LedgerNames
from django_leases.status import (
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    STOPPING,
    TIMED_OUT,
    AttemptOutcome,
)


class LeaseQuerySet(LeaseReads[J]):
    """Reads and lease transitions of any `AbstractLeasedJob` table: the one door to it.

    The chainable reads come from `LeaseReads`; every transition is a method of this class.
    The holder's writes are written out here; the others are the functions of their modules,
    each taking the queryset first, bound here as methods: claims (`claims`), batched
    completions (`acks`), throttled claims (`throttles`), the watcher's rescue and the operator
    actions (`operators`), the end of a stopped execution (`endings`), enqueueing (`enqueue`),
    pruning (`prune`); they share the ledger writes (`ledger`) and the lock queue (`locks`).
    The database's own statements are chosen by its dialect (`dialects.py`). Every transition
    runs on the database the routers send the model's writes to, unless the queryset names one
    (`writes()`): never on a replica.
    """

    # ---- acquisition (claims.py) --------------------------------------------------------------

    claim = writes(claims.claim)
    claim_job = writes(claims.claim_job)
    complete_and_claim = writes(claims.complete_and_claim)

    # ---- batched completions (acks.py) --------------------------------------------------------

    complete_many = writes(acks.complete_many)

    # ---- the watcher's rescue and the operator actions (operators.py) -------------------------

    rescue = writes(operators.rescue)
    requeue = writes(operators.requeue)
    release_stuck = writes(operators.release_stuck)
    mark_failed = writes(operators.mark_failed)
    cancel = writes(operators.cancel)
    cancelled_leases = writes(operators.cancelled_leases)
    resolve_review = writes(operators.resolve_review)

    # ---- where an execution ends (endings.py) -------------------------------------------------

    acknowledge_stops = endings.acknowledge_stops
    end_expired_stops = endings.end_expired_stops

    # ---- enqueueing (enqueue.py) ----------------------------------------------------------------

    enqueue = enqueueing.enqueue
    enqueue_many = enqueueing.enqueue_many
    aenqueue = enqueueing.aenqueue
    aenqueue_many = enqueueing.aenqueue_many
    writing_to = base.writing_to

    def _enqueue_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Return `enqueue()`'s keyword arguments as this table's enqueue takes them; a subclass
        derives the lock from its own columns (`PaymentJobQuerySet`)."""
        return options

    # ---- retention (prune.py) and the ledger (ledger.py) ----------------------------------------

    prunable = pruning.prunable
    prune = writes(pruning.prune)
    attempt_rows = ledger.attempt_rows
    finished_by = writes(ledger.finished_by)
    record_fenced = writes(ledger.record_fenced)

    # ---- holder writes ----------------------------------------------------------------------

    @writes
    @retry_deadlocks
    def heartbeat(
        self,
        owner: str,
        leases: Iterable[LeaseKey] | Mapping[int, int],
        *,
        ttl: float | timedelta,
    ) -> set[LeaseKey]:
        """Renew every live lease of `leases` ((job id, token) pairs) that `owner` holds for
        `ttl` seconds (or its kind's `ttl=`, `@job_handler`), in one statement (one per
        `KEYS_PER_STATEMENT` leases, in one transaction).

        Returns the (job id, token) pairs renewed. A lease that already expired is not renewed:
        its holder must assume somebody else owns the job now. An older lease of a job that the
        same owner claimed again is refused like any other lost one: only the current token
        matches.
        """
        seconds = to_seconds(ttl, "ttl")
        until = lease_until(seconds, lease_lengths_of(seconds, None))
        keys = lease_keys(leases)
        renewed: set[LeaseKey] = set()
        with transaction.atomic(using=self.db):
            for group in key_groups(keys):
                live = self.filter(
                    keys_filter(group), status=PROCESSING, lease_owner=owner, lease_until__gte=Now()
                )
                won = live.update(lease_until=until, heartbeat_at=Now())
                if won == len(group):
                    renewed.update(group.items())
                elif won:
                    # Rare: some leases were lost. The rows we renewed are locked by us and
                    # still match; the lost ones cannot match again (tokens only grow).
                    renewed.update(live.values_list("pk", "lease_token"))
            if renewed:
                ledger_update(
                    self,
                    renewed,
                    last_heartbeat_at=job_column(self, "heartbeat_at"),
                    lease_until=job_column(self, "lease_until"),
                )
        return renewed

    @writes
    def checkpoint(self, pk: int, owner: str, token: int, step: str) -> None:
        """Record that the holder reached `step`; the watcher's review policy reads it.

        Refused (`LeaseLost`) once the lease has expired, even if nobody took the job over: the
        watcher may already have decided the job's fate from the checkpoint it read.
        """
        check_text(step, "checkpoint step", CHECKPOINT_LENGTH)
        self._holder_write(pk, owner, token, None, None, live=True, checkpoint=step)

    @writes
    def complete(self, pk: int, owner: str, token: int, *, result: Any = None) -> None:
        """Mark the job completed, storing `result` (JSON) if given.

        Raises `LeaseLost` if `owner` no longer holds the job.
        """
        ledger = ledger_of(self)
        if result is None and ledger and self._complete_at_once(pk, owner, token, ledger):
            return
        values: dict[str, Any] = {
            "status": COMPLETED,
            "completed_at": Now(),
            "last_error": "",
            "lock_holder": None,
        }
        if result is not None:
            check_json_size(result, "result", leases_settings.MAX_PAYLOAD_BYTES)
            values["result"] = result
        self._holder_write(pk, owner, token, AttemptOutcome.COMPLETED, None, **values)

    @retry_deadlocks
    def _complete_at_once(self, pk: int, owner: str, token: int, ledger: LedgerNames) -> bool:
        """Complete a job without a lock or dependents in one statement where the database has
        one (`Dialect.complete()`); False leaves the job (lost, or of a lock, which is passed on
        in a transaction, or with dependents, released so) to the general path."""
        dialect = dialect_of(connections[self.db])
        if not dialect.completes_at_once:
            return False
        with bound_cursor(self.db) as cursor:
            return dialect.complete(
                cursor, quoted_table(self.model, self.db), ledger, owner, (pk, token)
            )

    @writes
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
                raise self._lost(pk, token, "lease lost before its failure could be recorded")
            # The row is ours until commit; read back which branch the UPDATE took.
            new_status, lock = self.filter(pk=pk).values_list("status", "lock").get()
            outcome = AttemptOutcome.FAILED if new_status == FAILED else AttemptOutcome.RETRIED
            close_attempt(self, pk, token, outcome, by=owner, error=(error_class, message))
            if new_status == FAILED and lock:
                pass_lock(self, pk)
        return new_status

    @writes
    @retry_deadlocks
    def time_out(
        self,
        pk: int,
        owner: str,
        token: int,
        *,
        retry_in: float | None,
        reason: str,
        running: bool = False,
    ) -> str:
        """End the holder's attempt at its run-time limit; return the status the job ends as.

        The job follows its kind's stuck policy, as an expired lease would: held for review
        after a risky checkpoint, failed without attempts left, else pending after `retry_in`.
        If the handler is still `running` (a thread cannot be stopped) the job is stopping: it
        keeps its lock and its `limit=` slot until the holder acknowledges the stop or its lease
        expires (`endings`); else its execution ends here.
        """
        guard = takeover_guard()[0]
        review = ~guard if guard else Q(pk__in=[])
        final = Q(attempts__gte=F("max_attempts"))
        delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
        with transaction.atomic(using=self.db):
            won = self.held(pk, owner, token).update(
                ends_as=Case(
                    When(review, then=Value(REVIEW)),
                    When(final, then=Value(FAILED)),
                    default=Value(PENDING),
                ),
                run_at=Case(
                    When(review | final, then=F("run_at")),
                    default=after(delay) if delay else Now(),
                ),
                last_error=reason[:MAX_ERROR_LENGTH],
                status=Value(STOPPING),
            )
            if won:
                ends_as = self.filter(pk=pk).values_list("ends_as", flat=True).get()
                close_attempt(
                    self, pk, token, TIMED_OUT, by=owner, error=("", reason), stopping=True
                )
                if not running:
                    self.acknowledge_stops(owner, [(pk, token)])
        if not won:
            self.record_fenced(pk, token)
            raise self._lost(pk, token, f"{owner} no longer holds token {token}")
        return str(ends_as)

    @writes
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

    @writes
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
            raise self._lost(pk, token, "lease lost; the transaction is rolled back")

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
                    raise self._lost(pk, token, f"{owner} no longer holds token {token}")
                if outcome is not None:
                    close_attempt(self, pk, token, outcome, by=owner, error=error)
                elif "checkpoint" in values:
                    ledger_update(self, [(pk, token)], checkpoint=values["checkpoint"])
        except LeaseLost:
            self.record_fenced(pk, token)
            raise

    def _lost(self, pk: int, token: int, why: str) -> LeaseLost:
        """Return the error of a refused holder write: `Cancelled` if an operator's cancel
        ended that lease, else `LeaseLost`."""
        by = self.cancelled_leases([(pk, token)]).get((pk, token))
        if by is not None:
            return Cancelled(f"job {pk}: cancelled by {by}")
        return LeaseLost(f"job {pk}: {why}")

    def _held_update(self, held: LeaseQuerySet[J], pk: int, values: dict[str, Any]) -> bool:
        """Apply the holder's write `values` to `held` (the job `pk` as its holder holds it);
        one that releases the job's lock passes it on.

        A job without a lock or dependents is updated in one statement, as before locks
        existed; one of a lock, or with dependents, fails that statement's condition and takes
        the second, then passes its lock on and releases its dependents if it completed.
        """
        if "lock_holder" not in values:
            return bool(held.update(**values))
        if held.filter(lock="", dependents__isnull=True).update(**values):
            return True
        if not held.filter(~Q(lock="") | Q(dependents__isnull=False)).update(**values):
            return False
        pass_lock(self, pk)
        if values.get("status") == COMPLETED:
            release_dependents(self, [pk])
        return True
