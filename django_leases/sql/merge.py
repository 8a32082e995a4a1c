"""The merge of several kinds' ordered ranges, shared by the claims of PostgreSQL and SQLite."""


def merge_keys(order: list[str]) -> tuple[str, str]:
    """Return the select list that names `id` `key_id` and the columns of `order` ("priority
    DESC", "run_at", ...) `key_0`, `key_1`, ..., and the ORDER BY of those keys."""
    terms = [term.split(maxsplit=1) for term in order]
    keys = ", ".join(["id AS key_id", *(f"{term[0]} AS key_{i}" for i, term in enumerate(terms))])
    by_key = ", ".join(" ".join([f"key_{i}", *term[1:]]) for i, term in enumerate(terms))
    return keys, by_key
