"""Acknowledgements: completing a batch of held jobs in one round trip (`ack="batch"` kinds).

`LeaseQuerySet.complete_many()`, a function taking the queryset first: each row of a batch is
still conditional on its own id, `processing`, owner and fencing token; the completions are
those of `endings`, where every execution ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from django_leases.limits import check_owner
from django_leases.querysets.base import LeaseKey, lease_keys, retry_deadlocks
from django_leases.querysets.endings import complete_many_by_dialect
from django_leases.querysets.ledger import record_fenced_many
from django_leases.querysets.reads import J, LeaseReads


@retry_deadlocks
def complete_many(
    qs: LeaseReads[J], owner: str, leases: Iterable[LeaseKey] | Mapping[int, int]
) -> set[LeaseKey]:
    """Complete every job of `leases` ((job id, token) pairs) that `owner` still holds under
    that token; return the pairs completed.

    One statement on PostgreSQL, one transaction of set-based statements elsewhere, for the
    jobs without a lock. Each row is still conditional on its own id, `processing`, owner
    and token: a job lost, taken over, released or finished meanwhile is left alone (and its
    ledger row noted as fenced), the others complete, with their open ledger rows closed in
    the same transaction. A job of a lock completes too, and passes its lock on, as in
    `complete()`.
    """
    check_owner(owner)
    keys = lease_keys(leases)
    if not keys:
        return set()
    won = complete_many_by_dialect(qs, owner, keys)
    lost = [key for key in keys if key not in won]
    if lost:
        record_fenced_many(qs, lost)
    return won
