"""SQLite statements: one pass of the claim. Needs SQLite 3.35+ for RETURNING."""

from typing import Any

Params = dict[str, Any]

NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
"""The database clock, in the text format Django stores datetimes in (UTC)."""


def claim_pass(
    table: str,
    *,
    owner: str,
    seconds: float,
    limit: int,
    takeover: bool,
    kinds: tuple[str, Params],
    guard: tuple[str, Params],
    pending: str,
    processing: str,
) -> tuple[str, Params]:
    """Return one pass of the claim: expired leases (`takeover`) or due pending jobs.

    SQLite runs one writer at a time and evaluates the IN (... LIMIT n) subquery once into a
    temporary table, so this single statement claims at most `limit` rows and no two
    connections can claim one row. The UPDATE is the transaction's first statement, so it takes
    the write lock at once (waiting up to the busy timeout) instead of failing to upgrade a read
    lock.
    """
    kind_sql, kind_params = kinds
    guard_sql, guard_params = guard
    if takeover:
        predicate, order = f"status = %(processing)s AND lease_until < {NOW}", "lease_until"
    else:
        # `+run_at`: once ANALYZE has run, SQLite would rather range-scan run_at and sort every
        # due job; the unary plus keeps it walking the due index in claim order.
        predicate, order = f"status = %(pending)s AND +run_at <= {NOW}", "priority DESC, run_at, id"
    sql = f"""
        UPDATE {table}
        SET status = %(processing)s,
            lease_owner = %(owner)s,
            lease_until = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %(lease)s),
            heartbeat_at = {NOW},
            lease_token = lease_token + 1,
            attempts = attempts + 1
        WHERE id IN (
            SELECT id FROM {table}
            WHERE {predicate} AND attempts < max_attempts {kind_sql} {guard_sql}
            ORDER BY {order}
            LIMIT %(limit)s
        )
        RETURNING *
    """  # noqa: S608 - names quoted by the caller, values are parameters
    params = {
        **kind_params,
        **guard_params,
        "owner": owner,
        "lease": f"+{seconds:.6f} seconds",
        "limit": limit,
        "pending": pending,
        "processing": processing,
    }
    return sql, params
