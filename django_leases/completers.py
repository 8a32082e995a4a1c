"""How a slot's finished job is completed, and where its next job comes from.

A worker picks one `Completer` when it starts, from its configuration (`choose()`); a slot's
attempt only ever calls `complete(lease)` after a handler succeeded, or `next_job()` after any
other end, and starts the lease either returns next.

- `Direct` (`max_jobs` set: the loop counts, so it claims): the completion is written on its
  own, or buffered for the acknowledgement writer if the kind batches its acks.
- `Grouped` (the default): the completion and the claim of the slot's next job go in one group
  write with those of every other slot finishing at the same moment (`GroupCommit`); once the
  worker stops it completes as `Direct` does, and nothing is claimed.
- `ClaimsAhead` (every kind batches its acks): the completion is buffered, and the slot starts a
  job claimed ahead by an earlier batch's write (`AckWriter`); once the buffer is closed it
  completes as `Grouped` does.

A job with a lock takes the same route as any other, but is never buffered (`buffered()`): the
job waiting behind it would wait for the batch too. Every completion of `LeaseQuerySet` passes
a released lock on by itself.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from django.db import DatabaseError

from django_leases.ack_buffer import AckBuffer
from django_leases.group_commit import GroupCommit
from django_leases.handlers import ACK_BATCH, get_handler
from django_leases.lease import Lease
from django_leases.outcomes import Outcomes
from django_leases.querysets import LeaseQuerySet
from django_leases.slots import SlotPool

logger = logging.getLogger("django_leases.worker")


class Completer(Protocol):
    def complete(self, lease: Lease) -> Lease | None:
        """Complete `lease`, whose handler succeeded; return the slot's next lease, if any."""

    def next_job(self) -> Lease | None:
        """Return the slot's next lease after an attempt with nothing to complete, if any."""


def buffered(acks: AckBuffer, lease: Lease) -> bool:
    """Buffer `lease`'s completion for the acknowledgement writer; False for a job of a lock
    (the job waiting behind it would wait for the batch too) and once the buffer is closed (the
    worker is writing its last batch)."""
    if lease.job.lock or not acks.add(lease):
        return False
    logger.debug("ack buffered job_id=%s token=%s", lease.pk, lease.token)
    return True


class Direct:
    """Each completion its own statement, or buffered for kinds that batch their acks."""

    def __init__(self, outcomes: Outcomes, acks: AckBuffer) -> None:
        self.outcomes = outcomes
        self.acks = acks

    def complete(self, lease: Lease) -> Lease | None:
        if get_handler(lease.job.kind).ack != ACK_BATCH or not buffered(self.acks, lease):
            self.outcomes.complete(lease)
        return None

    def next_job(self) -> Lease | None:
        return None


@dataclass(frozen=True)
class GroupCompletion:
    """What `Grouped.write()` did for one lease."""

    written: bool
    """False: nothing was written; the slot writes the completion on its own."""
    won: bool = False
    """The completion won (else the lease was lost before it)."""
    following: Lease | None = None
    """The slot's next job, claimed in the same statement."""
    failed: bool = False
    """The statement was sent and failed: part of it may have committed."""


class Grouped:
    """Complete and claim each slot's next job in one group write; `Direct` once stopping."""

    def __init__(
        self,
        outcomes: Outcomes,
        jobs: LeaseQuerySet[Any],
        *,
        kinds: list[str],
        stopping: threading.Event,
        direct: Direct,
    ) -> None:
        self.outcomes = outcomes
        self.jobs = jobs
        self.kinds = kinds
        self.stopping = stopping
        self.direct = direct
        self.commit: GroupCommit[Lease | None, GroupCompletion] = GroupCommit(self.write)

    def complete(self, lease: Lease) -> Lease | None:
        """A completion the group statement could not write is written on its own, where
        `record()` retries it or records why it cannot."""
        if self.stopping.is_set():
            return self.direct.complete(lease)
        group = self.commit.submit(lease)
        if not group.written:
            # After a failed group statement a completion found done may be our own.
            self.outcomes.complete(lease, maybe_written=group.failed)
        elif group.won:
            self.outcomes.completed(lease)
        else:
            self.outcomes.fenced_out(lease, "lease lost before its completion", recorded=True)
        return group.following

    def next_job(self) -> Lease | None:
        # Once the worker stops, nothing is claimed.
        return None if self.stopping.is_set() else self.commit.submit(None).following

    def write(self, items: list[Lease | None]) -> list[GroupCompletion]:
        """Complete the leases of `items` and claim a next job for each item, in one statement
        where the database allows it (`complete_and_claim()`): one commit for the jobs finished
        and the next ones, however many slots asked at the same moment.

        A statement refused, or lost to an outage, leaves each completion to its slot (elsewhere
        than PostgreSQL its completions may have committed before its claim failed). A claim of
        it that committed unseen expires and is taken over, as any claim whose answer was lost.
        """
        if self.stopping.is_set():
            return [GroupCompletion(written=False) for _ in items]
        started = time.monotonic()
        try:
            won, jobs = self.jobs.complete_and_claim(
                self.outcomes.worker_id,
                [lease.key for lease in items if lease is not None],
                ttl=self.outcomes.ttl,
                limit=len(items),
                kinds=self.kinds,
            )
        except Exception as exc:  # noqa: BLE001 - each slot's record() retries, or records why
            if not isinstance(exc, DatabaseError):  # a database's refusal record() logs itself
                logger.exception("group write failed; each slot writes its completion alone")
            return [GroupCompletion(written=False, failed=True) for _ in items]
        self.outcomes.note_claimed(jobs)
        following: list[Lease | None] = list(self.outcomes.leases(jobs, started))
        following += [None] * (len(items) - len(jobs))
        return [
            GroupCompletion(
                written=True, won=lease is not None and lease.key in won, following=next_lease
            )
            for lease, next_lease in zip(items, following, strict=True)
        ]


class ClaimsAhead:
    """Buffer every completion; each batch's write claims the slots' jobs ahead."""

    def __init__(self, pool: SlotPool, acks: AckBuffer, grouped: Grouped) -> None:
        self.pool = pool
        self.acks = acks
        self.grouped = grouped

    def complete(self, lease: Lease) -> Lease | None:
        if buffered(self.acks, lease):
            return self.pool.next_ready()
        return self.grouped.complete(lease)

    def next_job(self) -> Lease | None:
        return self.pool.next_ready()


def choose(
    outcomes: Outcomes,
    jobs: LeaseQuerySet[Any],
    *,
    pool: SlotPool,
    acks: AckBuffer,
    kinds: list[str],
    stopping: threading.Event,
    counts_claims: bool,
    claims_ahead: bool,
) -> Completer:
    """The completer of a worker: `Direct` if it `counts_claims` (`max_jobs`), `ClaimsAhead` if
    it `claims_ahead`, else `Grouped`."""
    direct = Direct(outcomes, acks)
    if counts_claims:
        return direct
    grouped = Grouped(outcomes, jobs, kinds=kinds, stopping=stopping, direct=direct)
    return ClaimsAhead(pool, acks, grouped) if claims_ahead else grouped
