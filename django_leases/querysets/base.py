"""What every queryset of the package shares: database-clock expressions and deadlock retries."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import timedelta
from functools import cache, wraps
from typing import Any, Literal, TypeVar

from django.db import OperationalError, connections, models
from django.db.backends.utils import CursorWrapper
from django.db.models.functions import Now
from django.db.models.query import RawQuerySet
from django.db.models.sql.query import RawQuery

from django_leases.limits import OWNER_LENGTH, check_text
from django_leases.sql import deadlocked

DEADLOCK_RETRIES = 5

F_ = TypeVar("F_", bound=Callable[..., Any])
M = TypeVar("M", bound=models.Model)


def bound_cursor(using: str) -> CursorWrapper:
    """Return a cursor of `using` that sends parameters apart from the statement's text.

    On PostgreSQL with psycopg 3 the text is then the same at every call, so psycopg prepares
    it once the project allows prepared statements (`"prepare_threshold"` in the database's
    OPTIONS, Django's switch, off by default for connection poolers): the server then parses
    and plans the lease layer's statements once per connection, not once per job. Elsewhere,
    or with psycopg 2, Django's usual cursor. Either way through Django's cursor wrapper, so the
    execute wrappers (the outage watchdog) and query logging apply.
    """
    return _driver_cursor(using, "ServerBindingCursor")


@cache
def quoted_table(model: type[models.Model], alias: str) -> str:
    """Return `model`'s table name quoted for `alias`'s database, built once per process: the
    raw statements of claims and completions need it every time."""
    return connections[alias].ops.quote_name(model._meta.db_table)


def literal_cursor(using: str) -> CursorWrapper:
    """Return a cursor of `using` that writes the parameters into the statement as literals.

    What an EXECUTE of a prepared statement needs on PostgreSQL, which takes no bind parameters
    there, whatever Django's `server_side_binding` option says. Through Django's cursor wrapper,
    as `bound_cursor()`.
    """
    return _driver_cursor(using, "Cursor")


def _driver_cursor(using: str, cursor_class: str) -> CursorWrapper:
    """Return a cursor of Django's psycopg 3 class `cursor_class` on `using`, through Django's
    cursor wrapper; elsewhere, or with psycopg2, Django's usual cursor."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return connection.cursor()
    from django.db.backends.postgresql import base

    factory = getattr(base, cursor_class, None)  # defined with psycopg 3 only
    if factory is None:
        return connection.cursor()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        cursor: Any = factory(connection.connection)
    if connection.queries_logged:
        return connection.make_debug_cursor(cursor)
    return connection.make_cursor(cursor)


class BoundRawQuery(RawQuery):
    """A raw query run on `bound_cursor()`."""

    cursor_for: Callable[[str], CursorWrapper] = staticmethod(bound_cursor)

    def _execute_query(self) -> None:
        self.cursor = self.cursor_for(self.using)
        self.cursor.execute(self.sql, self.params)


class LiteralRawQuery(BoundRawQuery):
    """A raw query run on `literal_cursor()`."""

    cursor_for = staticmethod(literal_cursor)


def bound_raw(queryset: models.QuerySet[M], statement: tuple[str, Any]) -> list[M]:
    """Run `statement` on `bound_cursor()` and return its rows as models, as `raw()` does."""
    return _raw(queryset, statement, BoundRawQuery)


def literal_raw(queryset: models.QuerySet[M], statement: tuple[str, Any]) -> list[M]:
    """Run `statement` on `literal_cursor()` and return its rows as models, as `raw()` does."""
    return _raw(queryset, statement, LiteralRawQuery)


def _raw(
    queryset: models.QuerySet[M], statement: tuple[str, Any], query_class: type[BoundRawQuery]
) -> list[M]:
    sql, params = statement
    query = query_class(sql, queryset.db, params)
    rows = RawQuerySet(sql, model=queryset.model, query=query, using=queryset.db)  # type: ignore[arg-type]
    return list(rows)


def after(seconds: float) -> Any:
    """Return the SQL expression "database now + `seconds`"."""
    return Now() + timedelta(seconds=seconds)


def ago(seconds: float) -> Any:
    """Return the SQL expression "database now - `seconds`"."""
    return Now() - timedelta(seconds=seconds)


def retry_deadlocks(method: F_) -> F_:
    """Run a lease transition again when the database aborted it to break a deadlock.

    InnoDB picks deadlock victims among concurrent claims and completions even when every
    statement is correct. The victim's transaction was rolled back whole, and every transition
    here is a conditional UPDATE, so running it again is safe. Inside a caller's transaction
    nothing can be retried: the error propagates.
    """

    @wraps(method)
    def wrapper(self: models.QuerySet[Any], *args: Any, **kwargs: Any) -> Any:
        connection = connections[self.db]
        nested = connection.in_atomic_block
        attempt = 1
        while True:
            try:
                return method(self, *args, **kwargs)
            except OperationalError as exc:
                if nested or attempt >= DEADLOCK_RETRIES or not deadlocked(exc, connection.vendor):
                    raise
            time.sleep(random.uniform(0.005, 0.05) * attempt)  # noqa: S311 - jitter
            attempt += 1

    return wrapper  # type: ignore[return-value]


ClaimPath = Literal["postgresql+ledger", "postgresql", "sqlite", "orm"]
"""How a claim runs: PostgreSQL's one statement (with the ledger's CTEs, or the ledger written
after it), SQLite's UPDATE ... RETURNING passes, or the ORM's SELECT ... FOR UPDATE SKIP LOCKED
then conditional UPDATE (MariaDB/MySQL, and the specification the others are tested against)."""


def check_owner(owner: str) -> None:
    """Refuse an owner (a worker id) that does not fit the lease_owner column."""
    check_text(owner, "owner", OWNER_LENGTH)
