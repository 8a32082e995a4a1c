"""Idempotency keys bound to what they protect: a key reused with another kind or payload is
refused (`IdempotencyKeyReused`, naming the key), the same key with the same kind and payload
gives back the job it names. `enqueue.py` calls these after its INSERT skipped a conflict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_leases.exceptions import IdempotencyKeyReused
from django_leases.querysets import inserts
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import table_jobs

if TYPE_CHECKING:
    from django_leases.querysets.reads import LeaseReads


def undo_if_reused(
    qs: LeaseReads[J], kind: str, rows: list[inserts.Row], jobs: list[J]
) -> IdempotencyKeyReused | None:
    """Return the error of the first of `jobs` (enqueued for `rows`) whose key names a job of
    another kind or payload, having deleted the jobs the batch added (all or nothing); None if
    there is none. Deleted rather than rolled back, so that the error leaves a caller's own
    transaction usable, as it does without a conflict: no savepoint on the path without one.
    """
    for position, (row, job) in enumerate(zip(rows, jobs, strict=True)):
        try:
            check_bound(job, kind, row, f"payloads[{position}]: ")
        except IdempotencyKeyReused as exc:
            added = [job.pk for row, job in zip(rows, jobs, strict=True) if job.payload is row[0]]
            table_jobs(qs).filter(pk__in=added).delete()
            return exc
    return None


def check_bound(job: J, kind: str, row: inserts.Row, place: str = "") -> J:
    """Return `job`, the job enqueued for `row` or the first of its idempotency key; raise
    `IdempotencyKeyReused` naming the key if that one is of another kind or payload.

    The payloads are compared as JSON values, in Python, as each database gives them back
    (objects by key, arrays in order, a boolean never equal to a number), so that the verdict
    is the same on every database. A job just inserted holds `row`'s own payload: no
    comparison, and no statement, on the path without a conflict.
    """
    payload, key = row
    if key is None or (
        job.kind == kind and (job.payload is payload or same_json(job.payload, payload))
    ):
        return job
    differs = "kind" if job.kind != kind else "payload"
    raise IdempotencyKeyReused(
        f"{place}idempotency_key {key!r} already names job {job.pk} of kind {job.kind!r} with "
        f"another {differs}: a key stands for one kind and payload; nothing was enqueued"
    )


def same_json(stored: Any, given: Any) -> bool:
    """Whether `stored` (a JSON value read back) and `given` (one `check_json()` passed: tuples
    may stand for arrays) are the same JSON value."""
    if isinstance(stored, bool) or isinstance(given, bool):
        return type(stored) is type(given) and stored == given
    if isinstance(stored, dict):
        return (
            isinstance(given, dict)
            and stored.keys() == given.keys()
            and all(same_json(stored[name], given[name]) for name in stored)
        )
    if isinstance(stored, list):
        return (
            isinstance(given, list | tuple)
            and len(stored) == len(given)
            and all(same_json(a, b) for a, b in zip(stored, given, strict=True))
        )
    if isinstance(given, dict | list | tuple):
        return False
    return bool(stored == given)
