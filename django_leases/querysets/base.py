"""What every queryset of the package shares: database-clock expressions and deadlock retries."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from functools import cache, wraps
from typing import Any, TypeVar

from django.core.exceptions import FieldDoesNotExist
from django.db import OperationalError, connections, models, router
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.db.models import Case, F, Func, Q, Value, When
from django.db.models.functions import Greatest, Now
from django.db.models.sql import Query
from django.db.models.sql.compiler import SQLCompiler
from django.utils.connection import ConnectionDoesNotExist

from django_leases.dialects import dialect_of
from django_leases.exceptions import InvalidArgument
from django_leases.handlers import Lengths
from django_leases.limits import JOB_ID, check_int, shown

DEADLOCK_RETRIES = 10
"""Tries of a transition InnoDB chose as a deadlock's victim: an operator's cancel of a running
job of a limited kind lost five in a row to a busy worker's heartbeats (MariaDB, in tests)."""

LeaseKey = tuple[int, int]
"""(job id, fencing token): one acquisition of a job. Writes over many leases are keyed by it,
never by the job id alone: one worker may hold an old lease and a new one of the same job (an
operator's forced requeue, then its own next claim)."""

KEYS_PER_STATEMENT = 500
"""Leases one statement filters on at most (`key_groups()`): its parameters stay far below every
database's bounds, whatever the worker's concurrency."""

F_ = TypeVar("F_", bound=Callable[..., Any])
M = TypeVar("M", bound=models.Model)
QS = TypeVar("QS", bound=models.QuerySet[Any])


def bound_cursor(using: str) -> CursorWrapper:
    """Return a cursor of `using` for the lease layer's own statements, as its dialect chooses
    (`Dialect.bound_cursor()`: on PostgreSQL one that lets the driver prepare them where the
    project allows it), through Django's cursor wrapper: the execute wrappers (the outage
    watchdog) and query logging apply."""
    connection = connections[using]
    return dialect_of(connection).bound_cursor(connection)


@cache
def quoted_table(model: type[models.Model], alias: str) -> str:
    """Return `model`'s table name quoted for `alias`'s database, built once per process: the
    raw statements of claims and completions need it every time."""
    return connections[alias].ops.quote_name(model._meta.db_table)


def raw_rows(
    queryset: models.QuerySet[M],
    statement: tuple[str, Any],
    cursor_for: Callable[[], CursorWrapper] | None = None,
) -> list[M]:
    """Run `statement` on `bound_cursor()` (or on `cursor_for()`) and return its rows as
    models, as `raw()` does (`RowLoader`)."""
    sql, params = statement
    db = queryset.db
    with bound_cursor(db) if cursor_for is None else cursor_for() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
        if not rows:
            # A claim that found nothing: the driver may build the description (psycopg: an
            # object for each of ~25 columns) anew at every call, a sixth of such a claim's
            # Python.
            return []
        columns = tuple(column[0] for column in cursor.description)
    connection = connections[db]
    loaders: dict[tuple[type, tuple[str, ...]], RowLoader] | None = getattr(
        connection, LOADERS, None
    )
    if loaders is None:
        loaders = {}
        setattr(connection, LOADERS, loaders)
    shape = loaders.get((queryset.model, columns))
    if shape is None:
        shape = loaders[queryset.model, columns] = RowLoader(connection, queryset.model, columns)
    instances: list[M] = []
    for row in rows:
        values = list(row)
        for n, (converters, expression) in shape.converters:
            value = values[n]
            for convert in converters:
                value = convert(value, expression, connection)
            values[n] = value
        instance = queryset.model.from_db(db, shape.names, [values[n] for n in shape.positions])
        for column, n in shape.extra:
            setattr(instance, column, values[n])
        instances.append(instance)
    return instances


LOADERS = "django_leases_row_loaders"
"""The attribute of a database connection (Django's, one per thread) that keeps its
`RowLoader`s by model and columns: only the connection's thread reads or adds to it, and they
go with the connection, whose converters they hold."""


class RowLoader:
    """How `raw_rows()` turns a row of `columns` into a `model` instance, as `raw()` does: each
    column of a field through the field's converters into `Model.from_db()`, every other column
    set as an attribute of the instance.

    What `raw()` works out anew at every call (which column is which field, their converters)
    is worked out here once per connection and columns: for a batched worker's claims that was
    a sixth of the claiming thread's Python (bench/README.md, "Batched acks: CPU a job")."""

    def __init__(
        self, connection: BaseDatabaseWrapper, model: type[models.Model], columns: tuple[str, ...]
    ) -> None:
        identifier = connection.introspection.identifier_converter
        by_column = {identifier(f.column): f for f in model._meta.fields if f.column}
        names = [identifier(column) for column in columns]
        present = [column for column in by_column if column in names]
        self.names = [by_column[column].attname for column in present]
        if model._meta.pk.attname not in self.names:
            raise FieldDoesNotExist("Raw query must include the primary key")
        self.positions = [names.index(column) for column in present]
        self.extra = [(column, n) for n, column in enumerate(names) if column not in by_column]
        fields = [by_column.get(column) for column in names]
        cols = [f.get_col(f.model._meta.db_table) if f else None for f in fields]
        compiler = connection.ops.compiler("SQLCompiler")(
            Query(model), connection, connection.alias
        )
        # A column that is no field (None) has no converters, as in `raw()`.
        self.converters = list(compiler.get_converters(cols).items())  # type: ignore[arg-type]


def after(seconds: float) -> Any:
    """Return the SQL expression "database now + `seconds`"."""
    return Now() + timedelta(seconds=seconds)


def lease_until(seconds: float, lengths: Lengths = ()) -> Any:
    """Return the SQL expression of the end of a lease taken or renewed now: database now +
    `seconds`, or + its kind's length of `lengths`."""
    if not lengths:
        return after(seconds)
    arms = [When(kind=kind, then=after(length)) for kind, length in lengths]
    return Case(*arms, default=after(seconds), output_field=models.DateTimeField())


def database_now(using: str) -> datetime:
    """Return the database clock's current time (one `SELECT` of `Now()`, no table read)."""
    query = Query(None)
    query.add_annotation(Now(), "now")
    row = next(query.get_compiler(using).results_iter())
    now: datetime = row[0]
    return now


def ago(seconds: float) -> Any:
    """Return the SQL expression "database now - `seconds`"."""
    return Now() - timedelta(seconds=seconds)


class FencingClock(Func):
    """The database clock in microseconds since the epoch (`Dialect.fencing_clock`)."""

    output_field = models.BigIntegerField()

    def as_sql(
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        function: str | None = None,
        template: str | None = None,
        arg_joiner: str | None = None,
        **extra_context: Any,
    ) -> tuple[str, tuple[Any, ...]]:
        return dialect_of(connection).fencing_clock, ()


def next_token() -> Any:
    """Return the SQL expression of a job's next fencing token: one more than its last, and at
    least the database clock in microseconds, so a token issued after a failover that lost
    commits (and their tokens) is still one no earlier acquisition had."""
    return Greatest(
        F("lease_token") + 1, FencingClock(), output_field=models.PositiveBigIntegerField()
    )


def _is_connection(alias: str) -> bool:
    """Whether `alias` names a database: one of DATABASES or a connection set up in code."""
    try:
        connections[alias]
    except ConnectionDoesNotExist:
        return False
    return True


def writing_to(qs: QS, using: str | None = None) -> QS:
    """This queryset on the database `using`; None: its own, else the routers' choice
    for writes of the model. Raises `InvalidArgument` for an alias not in DATABASES."""
    chosen: Any = qs  # its alias, `_db`, is Django's; django-stubs does not declare it
    alias = using if using is not None else chosen._db or router.db_for_write(qs.model)
    if not isinstance(alias, str) or not _is_connection(alias):
        raise InvalidArgument(
            f"using must name a database of DATABASES ({', '.join(connections.settings)}), "
            f"got {shown(alias)}"
        )
    return qs if chosen._db == alias else qs.using(alias)


def writes(method: F_) -> F_:
    """Run the lease transition `method` on its queryset bound to the database the routers send
    the model's writes to, unless the queryset names its own (`writing_to()`).

    A queryset from `Model.objects` reads from the routers' `db_for_read`: a replica, under a
    read/write-split router. Bound, the transition's locking reads, its UPDATEs, the reads that
    decide them, its ledger rows and its transaction all go to the one database it writes.
    """

    @wraps(method)
    def wrapper(self: models.QuerySet[Any], *args: Any, **kwargs: Any) -> Any:
        return method(writing_to(self), *args, **kwargs)

    return wrapper  # type: ignore[return-value]


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
                if nested or attempt >= DEADLOCK_RETRIES:
                    raise
                if not dialect_of(connection).deadlocked(exc):
                    raise
            time.sleep(random.uniform(0.005, 0.05) * attempt)  # noqa: S311 - jitter
            attempt += 1

    return wrapper  # type: ignore[return-value]


def lease_keys(leases: Iterable[LeaseKey] | Mapping[int, int]) -> list[LeaseKey]:
    """Return `leases` ((job id, token) pairs, or a mapping of job id to token) as checked pairs,
    each once, in their order."""
    pairs = leases.items() if isinstance(leases, Mapping) else leases
    keys: dict[LeaseKey, None] = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(f"a lease is a (job id, fencing token) pair, got {pair!r}")
        keys[(check_int(pair[0], "pk", JOB_ID), check_int(pair[1], "token", JOB_ID))] = None
    return list(keys)


def key_groups(keys: Iterable[LeaseKey]) -> Iterator[dict[int, int]]:
    """Split `keys` into groups of at most KEYS_PER_STATEMENT with one token per job each: what
    one statement filters on (`keys_filter()`). Nearly always one group; a job held under two
    tokens puts its second one in a later group."""
    groups: list[dict[int, int]] = []
    for pk, token in keys:
        group = next((g for g in groups if pk not in g and len(g) < KEYS_PER_STATEMENT), None)
        if group is None:
            group = {}
            groups.append(group)
        group[pk] = token
    yield from groups


JOB_KEY = ("pk", "lease_token")
"""The job table's fields of a lease key."""
LEDGER_KEY = ("job_ref", "token")
"""The attempt ledger's fields of a lease key."""


def keys_filter(group: Mapping[int, int], fields: tuple[str, str] = JOB_KEY) -> Q:
    """Return the filter of the rows whose (job id, token) `fields` are one of `group`
    ({job id: token}): `id IN (...) AND token = CASE WHEN id = ... THEN ... END`.

    Never a chain of ORs: SQLite refuses expression trees deeper than 1000, and the IN list lets
    every database find the rows by their key (tested on the three at KEYS_PER_STATEMENT).
    """
    job, token = fields
    tokens = Case(
        *(When(**{job: pk}, then=Value(t)) for pk, t in group.items()),
        output_field=models.BigIntegerField(),
    )
    return Q(**{f"{job}__in": list(group), token: tokens})
