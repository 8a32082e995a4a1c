"""The enqueue's INSERT: jobs that share every field but their payload and key, in as few
statements as the database takes, the rows a unique index refuses skipped on request, each
inserted job built from RETURNING."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from django.db import connections
from django.db.models import Field, JSONField, Model
from django.db.models.base import DEFERRED, ModelState
from django.db.models.signals import post_init, pre_init

from django_leases.dialects import dialect_of
from django_leases.dialects.insert import AS_JSON, InsertDialect, insert_arrays, insert_jobs
from django_leases.querysets.ledger import J

MAX_PARAMETERS = 65535
"""PostgreSQL's limit of parameters in one statement; SQLite's is the backend's own."""

Row = tuple[Any, str | None]
"""A job of an INSERT: its payload and its idempotency key (None: none)."""


def returns_rows(alias: str) -> bool:
    """Whether the database `alias` returns columns from an INSERT (not MySQL: MariaDB does)."""
    return bool(connections[alias].features.can_return_columns_from_insert)


@dataclass(frozen=True)
class _Plan:
    """What every INSERT of one shape (model, database, fields given, keys or not) shares,
    worked out once."""

    shared: list[Field[Any, Any]]  # the same value in every row: the fields given, the defaults
    own: list[Field[Any, Any]]  # a value per row: payload, key, a default that is called
    returning: list[tuple[Field[Any, Any], list[Any], Any]]  # field, its converters, its column
    table: str
    quoted: list[str]  # the shared columns, then the own ones
    quoted_returning: list[str]
    run_at: str
    dialect: InsertDialect
    types: list[str] | None  # the columns' types, for rows as arrays (PostgreSQL); None: VALUES
    batch: int  # rows per statement of VALUES
    names: list[str]  # the attributes of `model`'s concrete fields, in order
    places: tuple[list[str], list[str]]  # the attributes of own, returned


@lru_cache(maxsize=256)
def _plan(
    model: type[Model], alias: str, given: frozenset[str], keyed: bool, delayed: bool, by_key: bool
) -> _Plan:
    """The INSERT of `model`'s rows on `alias` given the fields `given` (the rest take their
    defaults; a database default is left to the database, and `run_at` too if `delayed`), the
    key a value per row if `keyed`, RETURNING the id and database defaults (and the key if
    `by_key`)."""
    connection = connections[alias]
    quote: Any = connection.ops.quote_name  # django-stubs: `(str | None) -> str`
    meta = model._meta
    by_name = {field.name: field for field in meta.concrete_fields}
    shared, called = [], []
    for field in meta.concrete_fields:
        if (
            field.primary_key
            or field.generated
            or field.name == "payload"
            or (field.name == "idempotency_key" and keyed)
            or (delayed and field.name == "run_at")
            or (field.name not in given and field.has_db_default() and not field.has_default())
        ):
            continue
        if field.name not in given and field.has_default() and callable(field.default):
            called.append(field)  # a default called for each job, as `Model()` calls it
        else:
            shared.append(field)
    own = [by_name["payload"], *([by_name["idempotency_key"]] if keyed else []), *called]
    returning = [by_name[meta.pk.name], *(f for f in meta.concrete_fields if f.has_db_default())]
    if delayed and by_name["run_at"] not in returning:
        returning.append(by_name["run_at"])
    if by_key:
        returning.append(by_name["idempotency_key"])
    # The words that skip a conflicting row are Django's (`connection.ops`), as in bulk_create().
    chosen = dialect_of(connection)
    dialect = replace(chosen.insert, skip=chosen.insert_skipping(connection))
    limit = dialect.parameters or connection.features.max_query_params or MAX_PARAMETERS
    names = [field.attname for field in meta.concrete_fields]
    return _Plan(
        shared=shared,
        own=own,
        returning=[
            (
                field,
                connection.ops.get_db_converters(col) + field.get_db_converters(connection),
                col,
            )
            for field in returning
            for col in [field.get_col(meta.db_table)]
        ],
        table=quote(meta.db_table),
        quoted=[quote(field.column) for field in [*shared, *own]],
        quoted_returning=[quote(field.column) for field in returning],
        run_at=quote(by_name["run_at"].column),
        dialect=dialect,
        types=_array_types(shared, own, connection) if dialect.arrays else None,
        batch=max(1, (limit - len(shared) - 1) // len(own)),
        names=names,
        places=([f.attname for f in own], [f.attname for f in returning]),
    )


def _array_types(
    shared: list[Field[Any, Any]], own: list[Field[Any, Any]], connection: Any
) -> list[str] | None:
    """The types to cast the columns to for rows as arrays, or None if one cannot be: the test
    of Django's own UNNEST for `bulk_create()` (PostgreSQL's `SQLInsertCompiler`), and a JSON
    column of each row's own, the payload, a plain `JSONField` (its values go as one document)."""
    for field in [*shared, *own]:
        if (
            hasattr(field, "get_placeholder")
            or hasattr(field, "get_placeholder_sql")
            or (field.target_field if field.is_relation else field).get_internal_type()  # type: ignore[attr-defined]
            not in connection.data_types
        ):
            return None
    # Without the length (varchar, not varchar(100)): a cast would cut a longer value.
    types = [str(field.db_type(connection)).split("(")[0] for field in [*shared, *own]]
    json = [field for field, kind in zip(own, types[len(shared) :], strict=True) if kind == "jsonb"]
    return types if json == [own[0]] and type(own[0]) is JSONField else None


def insert(
    model: type[J],
    alias: str,
    values: dict[str, Any],
    rows: Sequence[Row],
    *,
    skip_conflicts: bool,
    delay: float | None,
    notify: tuple[str, str] | None = None,
) -> list[J | None]:
    """INSERT a job of `model` into the database `alias` per row of `rows`, each with the
    fields `values` and its row's payload and key; return each job saved (its id and database
    defaults set), or None for a row left out, in the order of `rows`.

    Without `skip_conflicts` every row is inserted or the statement fails. With it, a row that a
    unique index refuses is left out; the rows with a key are told apart by it, those without by
    their order. `delay`: `run_at` is the database clock plus these seconds. `notify`: (channel,
    message) announced by the same statement when it inserts a row (a database whose dialect
    has `notify`), heard once its transaction commits.
    """
    if not rows:
        return []
    connection = connections[alias]
    keyed = any(key is not None for _, key in rows)
    # Skipped rows leave gaps: the rows returned with a key are matched by it.
    by_key = skip_conflicts and keyed
    plan = _plan(model, alias, frozenset(values), keyed, delay is not None, by_key)
    # One unsaved job gives every shared field's value as `Model()` and `save()` would:
    # defaults, relations given as instances, `pre_save()` (auto_now_add).
    template = model(**values)
    shared = [f.get_db_prep_save(f.pre_save(template, True), connection) for f in plan.shared]
    called = plan.own[1 + keyed :]
    saved: list[J | None] = []
    step = len(rows) if plan.types is not None else plan.batch
    for start in range(0, len(rows), step):
        batch = rows[start : start + step]
        # A row's own values, in the order of `plan.own`: its payload, its key if keyed
        # (without a key the row's None is past the end), the defaults that are called.
        own: Sequence[Sequence[Any]] = batch
        if called:
            own = [(*row[: 1 + keyed], *(f.get_default() for f in called)) for row in batch]
        shape: dict[str, Any] = {
            "returning": plan.quoted_returning,
            "skip_conflicts": skip_conflicts,
            "delayed": None if delay is None else (plan.run_at, delay),
            "notify": notify,
        }
        if plan.types is not None and len(batch) > 1:
            kinds = plan.types[len(plan.shared) :]
            arrays = [
                _array(field, kind, [row[j] for row in own], connection)
                for j, (field, kind) in enumerate(zip(plan.own, kinds, strict=True))
            ]
            sql, params = insert_arrays(
                plan.dialect, plan.table, plan.quoted, shared, arrays, types=plan.types, **shape
            )
        else:
            prepared = [
                [f.get_db_prep_save(v, connection) for f, v in zip(plan.own, row, strict=False)]
                for row in own
            ]
            sql, params = insert_jobs(
                plan.dialect, plan.table, plan.quoted, shared, prepared, **shape
            )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            returned = cursor.fetchall()
        if notify is not None:
            returned = [found[:-1] for found in returned]  # the NOTIFY's column
        matched = _matched(batch, returned, by_key) if skip_conflicts else returned
        saved.extend(_saved(model, alias, plan, template, own, matched))
    return saved


def _array(field: Field[Any, Any], kind: str, values: list[Any], connection: Any) -> Any:
    """The parameter of `insert_arrays()` for the column of `field` (of type `kind`) holding
    `values`: a list of them prepared, or one JSON document of them (`AS_JSON`), adapted as
    Django adapts one JSON value; the payloads as the field adapts one."""
    if isinstance(field, JSONField):
        return connection.ops.adapt_json_value(values, field.encoder)
    prepared = [field.get_db_prep_save(value, connection) for value in values]
    return connection.ops.adapt_json_value(prepared, None) if kind in AS_JSON else prepared


def _matched(rows: Sequence[Row], returned: list[Any], by_key: bool) -> list[Any | None]:
    """The row RETURNING gave for each of `rows`, or None for a row left out: by its key (the
    last column returned, if `by_key`) for a row with one, by order for the others, unless
    one of those was left out (refused by another unique column): then all of them."""
    keys = {found[-1]: found for found in returned if found[-1] is not None} if by_key else {}
    keyless = [found for found in returned if not by_key or found[-1] is None]
    unkeyed = sum(key is None for _, key in rows)
    order = iter(keyless if len(keyless) == unkeyed else [None] * unkeyed)
    return [next(order) if key is None else keys.get(key) for _, key in rows]


def _saved(
    model: type[J],
    alias: str,
    plan: _Plan,
    template: Model,
    rows: Sequence[Sequence[Any]],
    found: list[Any | None],
) -> list[J | None]:
    """Build the saved job of each row from its own values and its RETURNING row (None: left
    out), as Django builds a row it reads (`Model.from_db()`); if no receiver of `pre_init` or
    `post_init` awaits them and the model keeps Django's `__init__()`, as Django builds a job it
    unpickles (`model_unpickle()`:
    `Model.__new__()`, then the fields' values as its `__dict__`), without `__init__()`."""
    connection = connections[alias]
    # A generated column is left to be read when asked for, as a deferred field.
    base = {
        field.attname: template.__dict__[field.attname]
        for field in model._meta.concrete_fields
        if not field.generated and field.attname in template.__dict__
    }
    cache = template._state.fields_cache  # the relations given as instances
    # A model of the project's own that overrides __init__() is built through it, as a read is.
    signalled = (
        pre_init.has_listeners(model)
        or post_init.has_listeners(model)
        or model.__init__ is not Model.__init__
    )
    converted = any(converters for _, converters, _ in plan.returning)
    own, returned = plan.places
    saved: list[J | None] = []
    for row, columns in zip(rows, found, strict=True):
        if columns is None:
            saved.append(None)
            continue
        if converted:
            columns = [
                _convert(value, converters, col, connection)
                for (_, converters, col), value in zip(plan.returning, columns, strict=True)
            ]
        values = base.copy()
        values.update(zip(own, row, strict=False))  # a row may end in a None key
        values.update(zip(returned, columns, strict=True))
        if signalled:
            fields = [values.get(name, DEFERRED) for name in plan.names]
            job = model.from_db(alias, plan.names, fields)
        else:
            job = model.__new__(model)
            job.__dict__ = values
            job._state = state = ModelState()
            state.adding, state.db = False, alias
        if cache:
            job._state.fields_cache = dict(cache)
        saved.append(job)
    return saved


def _convert(value: Any, converters: list[Any], col: Any, connection: Any) -> Any:
    for converter in converters:
        value = converter(value, col, connection)
    return value
