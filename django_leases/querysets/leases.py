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
from django_leases.exceptions import LeaseError, LeaseLost
from django_leases.handlers import lease_lengths_of
from django_leases.limits import (
    CHECKPOINT_LENGTH,
    check_json_size,
    check_text,
)
from django_leases.querysets import (
    acks,
    base,
    claim_by_id,
    claims,
    edits,
    endings,
    groups,
    ledger,
    operators,
    pauses,
    steps,
)
from django_leases.querysets import enqueue as enqueueing
from django_leases.querysets import prune as pruning
from django_leases.querysets.base import (
    LeaseKey,
    after,
    key_groups,
    keys_filter,
    lease_keys,
    lease_until,
    retry_deadlocks,
    writes,
)
from django_leases.querysets.ledger import (
    MAX_ERROR_LENGTH,
    J,
    describe_error,
    job_column,
    ledger_update,
)
from django_leases.querysets.reads import LeaseReads, takeover_guard
from django_leases.status import (
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
    pruning (`prune`); they share the ledger writes (`ledger`) and the taking of a lock
    (`locks`). Every execution, the holder's included, ends through `endings` (`Ending`), which
    gives back what it held.
    The database's own statements are chosen by its dialect (`dialects/`). Every transition
    runs on the database the routers send the model's writes to, unless the queryset names one
    (`writes()`): never on a replica.
    """

    # ---- acquisition (claims.py) --------------------------------------------------------------

    claim = writes(claims.claim)
    claim_job = writes(claim_by_id.claim_job)
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
    enqueue_now = writes(operators.enqueue_now)
    edit_pending = writes(edits.edit_pending)

    # ---- where an execution ends (endings.py) -------------------------------------------------

    acknowledge_stops = endings.acknowledge_stops
    end_expired_stops = endings.end_expired_stops

    # ---- paused kinds (pauses.py) ---------------------------------------------------------------

    pause_kind = pauses.pause_kind
    resume_kind = pauses.resume_kind
    paused_kinds = pauses.paused_kinds
    kind_paused = pauses.paused_now

    # ---- enqueueing (enqueue.py) ----------------------------------------------------------------

    enqueue = enqueueing.enqueue
    enqueue_many = enqueueing.enqueue_many
    aenqueue = enqueueing.aenqueue
    aenqueue_many = enqueueing.aenqueue_many
    enqueue_group = groups.enqueue_group
    aenqueue_group = groups.aenqueue_group
    writing_to = base.writing_to

    # ---- retention (prune.py) and the ledger (ledger.py) ----------------------------------------

    prunable = pruning.prunable
    prune = writes(pruning.prune)
    attempt_rows = ledger.attempt_rows
    finished_by = writes(ledger.finished_by)
    record_fenced = writes(ledger.record_fenced)

    # ---- resumable steps (steps.py) -------------------------------------------------------------

    recorded_step = writes(steps.recorded_step)
    start_step = writes(steps.start_step)
    record_step = writes(steps.record_step)

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
    @retry_deadlocks
    def checkpoint(self, pk: int, owner: str, token: int, step: str) -> None:
        """Record that the holder reached `step`; the watcher's review policy reads it.

        Refused (`LeaseLost`) once the lease has expired, even if nobody took the job over: the
        watcher may already have decided the job's fate from the checkpoint it read.
        """
        check_text(step, "checkpoint step", CHECKPOINT_LENGTH)
        live = self.held(pk, owner, token).filter(lease_until__gte=Now())
        # One transaction: the job's checkpoint and its ledger row's commit together.
        with transaction.atomic(using=self.db):
            won = live.update(checkpoint=step)
            if won:
                ledger_update(self, [(pk, token)], checkpoint=step)
        if not won:
            self.record_fenced(pk, token)
            raise self._lost(pk, token, f"{owner} no longer holds token {token}")

    @writes
    def complete(self, pk: int, owner: str, token: int, *, result: Any = None) -> None:
        """Mark the job completed, storing `result` (JSON) if given.

        Raises `LeaseLost` if `owner` no longer holds the job.
        """
        if result is None:
            if endings.complete_at_once(self, owner, (pk, token)):
                return
            self._end(pk, owner, token, endings.completion(owner))
            return
        check_json_size(result, "result", leases_settings.MAX_PAYLOAD_BYTES)
        self._end(pk, owner, token, endings.completion(owner, result=result))

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
        left; it fails for good when `permanent` or when it used its last attempt. A retry
        keeps the job's lock: the jobs behind it wait for its last attempt.
        """
        error_class, message = describe_error(error)
        last_error = f"{error_class}: {message}" if error_class else message
        final = Q(attempts__gte=F("max_attempts"))
        values: dict[str, Any]
        if permanent:
            values = {"status": FAILED, "completed_at": Now()}
        else:
            delay = to_seconds(retry_in, "retry_in") if retry_in is not None else 0.0
            values = {
                "status": Case(When(final, then=Value(FAILED)), default=Value(PENDING)),
                "completed_at": Case(When(final, then=Now()), default=None),
                "run_at": Case(
                    When(final, then=F("run_at")), default=after(delay) if delay else Now()
                ),
            }
        ending = endings.Ending(
            {**values, "last_error": last_error},
            releases=True if permanent else final,
            outcome={FAILED: AttemptOutcome.FAILED, PENDING: AttemptOutcome.RETRIED},
            by=owner,
            error=(error_class, message),
        )
        status = endings.end_one(self, self.held(pk, owner, token), (pk, token), ending)
        if status is None:
            raise self._lost(pk, token, "lease lost before its failure could be recorded")
        return status

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
        stop = endings.Ending(
            {
                "ends_as": Case(
                    When(review, then=Value(REVIEW)),
                    When(final, then=Value(FAILED)),
                    default=Value(PENDING),
                ),
                "run_at": Case(
                    When(review | final, then=F("run_at")),
                    default=after(delay) if delay else Now(),
                ),
                "last_error": reason[:MAX_ERROR_LENGTH],
                "status": STOPPING,
            },
            releases=False,
            outcome=TIMED_OUT,
            by=owner,
            error=("", reason),
            stops=True,
        )
        with transaction.atomic(using=self.db):
            won = endings.end_one(self, self.held(pk, owner, token), (pk, token), stop)
            if won:
                ends_as = self.filter(pk=pk).values_list("ends_as", flat=True).get()
                if not running:
                    endings.acknowledge_stops(self, owner, [(pk, token)])
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
        values = {"status": PENDING, "run_at": Now(), "max_attempts": F("max_attempts") + 1}
        ending = endings.Ending(values, releases=False, outcome=AttemptOutcome.RELEASED, by=owner)
        self._end(pk, owner, token, ending)

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
    def _end(self, pk: int, owner: str, token: int, ending: endings.Ending) -> None:
        """End the execution `owner` holds under `token` as `ending` says (`endings.end_one()`);
        raise `LeaseLost` (`Cancelled`), noted in the ledger, if it no longer holds it."""
        if endings.end_one(self, self.held(pk, owner, token), (pk, token), ending) is None:
            self.record_fenced(pk, token)
            raise self._lost(pk, token, f"{owner} no longer holds token {token}")

    def _lost(self, pk: int, token: int, why: str) -> LeaseLost:
        """Return the error of a refused holder write: `Cancelled` if an operator's cancel
        ended that lease, else `LeaseLost`."""
        return operators.refused(self, pk, token, why)
