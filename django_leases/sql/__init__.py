"""Raw SQL of django-leases, one module per database; nothing else in the package holds SQL text.

Each builder takes quoted names (tables, columns) and plain values and returns `(sql, params)`
with named parameters (`%(owner)s`). This package imports nothing from the app, so a statement
can be read, and tested, without models: the querysets decide what to run and with what.
"""

from collections.abc import Sequence
from typing import Any

from django_leases.sql import mysql, postgresql

Params = dict[str, Any]


def deadlocked(exc: BaseException, vendor: str) -> bool:
    """Whether the database rolled the transaction back to break a deadlock or lock wait."""
    if vendor == "mysql":
        return bool(exc.args) and exc.args[0] in mysql.DEADLOCK_ERRORS
    if vendor == "postgresql":
        return sqlstate(exc) in postgresql.DEADLOCK_SQLSTATES
    return False


def sqlstate(exc: BaseException) -> str | None:
    """Return the SQLSTATE of the PostgreSQL driver's error under Django's `exc` (psycopg 3's
    `sqlstate`, psycopg2's `pgcode`), or None."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)


def in_list(column: str, name: str, values: Sequence[Any]) -> tuple[str, Params]:
    """Return `column IN (...)` with one named parameter per value (`name_0`, `name_1`, ...)."""
    params = {f"{name}_{i}": value for i, value in enumerate(values)}
    return f"{column} IN ({', '.join(f'%({key})s' for key in params)})", params


def kinds_filter(
    kinds: Sequence[str] | None, excluded: Sequence[str] | None = None
) -> tuple[str, Params]:
    """Return the claim's `AND kind IN (...)` fragment, or nothing for every kind, or for every
    kind but `excluded` its `AND kind NOT IN (...)` (parameters `other_kind_0`, ...)."""
    if not kinds:
        if not excluded:
            return "", {}
        sql, params = in_list("kind", "other_kind", excluded)
        return f"AND NOT {sql}", params
    sql, params = in_list("kind", "kind", kinds)
    return f"AND {sql}", params


def takeover_guard(*, review_by_default: bool, exceptions: Sequence[str]) -> tuple[str, Params]:
    """Return the fragment that keeps a claim off expired leases the watcher must review.

    Under the review policy a job that reached a checkpoint is not taken over. The policy is
    review for every kind when `review_by_default`, except the kinds in `exceptions` (and the
    other way round).
    """
    if not review_by_default:
        if not exceptions:
            return "", {}
        kinds, params = in_list("kind", "review_kind", exceptions)
        return f"AND NOT ({kinds} AND checkpoint <> '')", params
    if not exceptions:
        return "AND checkpoint = ''", {}
    kinds, params = in_list("kind", "retry_kind", exceptions)
    return f"AND ({kinds} OR checkpoint = '')", params
