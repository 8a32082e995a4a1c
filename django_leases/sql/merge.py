"""The merge of several kinds' ordered ranges, shared by the claims of PostgreSQL and SQLite
(and the ORM path's candidate reads, `querysets.claims`)."""

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
