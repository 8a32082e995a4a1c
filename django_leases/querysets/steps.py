"""Resumable steps (`Lease.step()`): a step's record and the job's checkpoint, both conditional
on the holder's fencing token, bound as methods of `LeaseQuerySet`.

A step is started (its marker goes in the job's empty checkpoint, so that the kind's review
policy covers a crash while it runs), then recorded in the transaction that holds the step's own
writes (the record and the marker's removal commit with them, or nothing does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.db import connections, transaction
from django.db.models import Case, Exists, F, Value, When
from django.db.models.functions import Now

from django_leases.exceptions import LeaseError, LeaseLost
from django_leases.limits import STEP_MARKER
from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.ledger import J, job_column, ledger_update, record_fenced
from django_leases.querysets.operators import refused
from django_leases.querysets.reads import LeaseReads

if TYPE_CHECKING:
    from django_leases.models import AbstractJobStep


def step_model(qs: LeaseReads[J]) -> type[AbstractJobStep]:
    """Return the step record of `qs`'s job table; raise `LeaseError` if it has none."""
    label = qs.model.step_model
    if label is None:
        raise LeaseError(
            f"{qs.model._meta.label} has no step record (`step_model`): lease.step() needs one"
        )
    model: type[AbstractJobStep] = apps.get_model(label)
    return model


def recorded_step(
    qs: LeaseReads[J], pk: int, owner: str, token: int, name: str
) -> tuple[bool, Any]:
    """Return (True, its result) if the step `name` of job `pk` is recorded and `owner` holds
    the job under `token` with a live lease, else (False, None).

    One statement: a holder whose lease expired finds no step, and its start is refused, so
    it can neither skip a step nor run one.
    """
    live = qs.held(pk, owner, token).filter(lease_until__gte=Now())
    steps = step_model(qs)._default_manager.using(qs.db).filter(job_ref=pk, name=name)
    found = list(steps.filter(Exists(live)).values_list("pk", "result")[:1])
    return (True, found[0][1]) if found else (False, None)


@retry_deadlocks
def start_step(qs: LeaseReads[J], pk: int, owner: str, token: int, name: str) -> None:
    """Mark the step `name` of job `pk` as started: its marker goes in the job's checkpoint if
    that is empty (the open attempt's checkpoint follows the job's). Refused (`LeaseLost`) once
    the lease expired, as a checkpoint is: the watcher may already have decided from the
    checkpoint it read.

    A checkpoint the handler set itself stays: the job passed a risky point of its own, and a
    crash from there on is reviewed whatever step it happened in.
    """
    marker = STEP_MARKER + name
    live = qs.held(pk, owner, token).filter(lease_until__gte=Now())
    try:
        # One transaction: the job's checkpoint and its attempt's commit together.
        with transaction.atomic(using=qs.db):
            empty = When(checkpoint="", then=Value(marker))
            if not live.update(checkpoint=Case(empty, default=F("checkpoint"))):
                raise refused(qs, pk, token, f"{owner} no longer holds token {token}")
            ledger_update(qs, [(pk, token)], checkpoint=job_column(qs, "checkpoint"))
    except LeaseLost:
        record_fenced(qs, pk, token)
        raise


def record_step(
    qs: LeaseReads[J], pk: int, owner: str, token: int, attempt: int, name: str, result: Any
) -> None:
    """Record the step `name` of job `pk` with `result` (checked JSON), in the current
    transaction, and take its marker out of the job's (and the attempt's) checkpoint; raise
    `LeaseLost` (the transaction must then roll back) if `owner` no longer holds the job under
    `token`.
    """
    if not connections[qs.db].in_atomic_block:
        raise LeaseError("record_step() must run inside transaction.atomic()")
    marker = STEP_MARKER + name
    # The conditional UPDATE takes the job row's lock (on SQLite, the database's write lock)
    # until the step's transaction ends, so no claim takes the job over between this check and
    # the commit; a newer token than ours means the step's writes roll back. Not restricted to
    # a live lease, as a completion is not: the token alone says whether anyone else ran.
    cleared = When(checkpoint=marker, then=Value(""))
    if not qs.held(pk, owner, token).update(checkpoint=Case(cleared, default=F("checkpoint"))):
        raise refused(
            qs, pk, token, "lease lost; the step is not recorded and its writes roll back"
        )
    # The attempt's checkpoint follows: a crash from here on is not that step's (the review
    # policy reads the job's checkpoint, an auditor the attempt's).
    ledger_update(qs, [(pk, token)], checkpoint=job_column(qs, "checkpoint"))
    # `job` is the concrete step record's foreign key (see AbstractJobStep).
    row: dict[str, Any] = {"job_id": pk, "job_ref": pk, "name": name, "result": result}
    step_model(qs)._default_manager.using(qs.db).create(**row, token=token, attempt=attempt)
