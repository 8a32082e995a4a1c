"""The merge of several kinds' ordered ranges, shared by the claims of PostgreSQL and SQLite
(and the candidate reads of the ORM path, `querysets.claims`, and of MariaDB/MySQL)."""

from collections.abc import Callable, Sequence
from typing import Any

CANDIDATE_SLACK = 32
"""How many jobs of each kind beyond `limit` a claim of several kinds reads, for rows that
concurrent claims hold locked and this one skips."""


def merge_keys(order: list[str]) -> tuple[str, str]:
    """Return the select list that names `id` `key_id` and the other columns of `order`
    ("priority DESC", "run_at", "id") `key_0`, `key_1`, ..., and the ORDER BY of those keys.

    `id` is named once: ordered by a second copy of it, PostgreSQL would not see that the Merge
    Append already delivers that order, and would sort (and probe) every candidate."""
    terms = [term.split(maxsplit=1) for term in order]
    names = ["key_id" if term[0] == "id" else f"key_{i}" for i, term in enumerate(terms)]
    pairs = list(zip(terms, names, strict=True))
    keys = ["id AS key_id", *(f"{term[0]} AS {name}" for term, name in pairs if name != "key_id")]
    by_key = ", ".join(" ".join([name, *term[1:]]) for term, name in pairs)
    return ", ".join(keys), by_key


MERGE_READS = 4
"""Candidate reads a claim of several kinds makes at most (`lock_in_order()`)."""


def lock_in_order(
    read: Callable[[int], list[int]], lock: Callable[[list[int]], list[int]], limit: int
) -> list[int]:
    """Lock up to `limit` candidates in claim order; return their ids. `read(count)`: the ids of
    the first `count` claimable jobs in claim order, read without locks; `lock(ids)`: the ids of
    those rows that still match, locked, rows other transactions hold skipped.

    As many are locked at a time as are still wanted. If the candidates run out first, the next
    read reaches past those tried, up to MERGE_READS reads: a claim comes back short only while
    other transactions hold more than that many of the first rows (`querysets.claims.
    lock_merged()`, which says why a claim of several kinds locks this way)."""
    tried: set[int] = set()
    locked: list[int] = []
    for _ in range(MERGE_READS):
        count = len(tried) + limit - len(locked) + CANDIDATE_SLACK
        read_ids = read(count)
        fresh = [pk for pk in read_ids if pk not in tried]
        tried.update(fresh)
        while fresh and len(locked) < limit:
            chunk, fresh = fresh[: limit - len(locked)], fresh[limit - len(locked) :]
            locked += lock(chunk)
        if len(locked) == limit or len(read_ids) < count:
            break
    return locked


def in_claim_order(rows: Sequence[Sequence[Any]], takeover: bool, count: int) -> list[int]:
    """Return the ids of the first `count` of the candidates `rows`, merged from several kinds'
    ranges, in claim order: (id, lease_until) rows by `lease_until` (`takeover`), else (id,
    priority, run_at) rows by priority (highest first), `run_at` and id."""
    if takeover:
        ordered = sorted(rows, key=lambda row: (row[1], row[0]))
    else:
        ordered = sorted(rows, key=lambda row: (-row[1], row[2], row[0]))
    return [row[0] for row in ordered[:count]]
