"""The enqueue's INSERT: unsaved jobs in as few statements as the database takes, the rows a
unique index refuses skipped on request, each inserted instance completed from RETURNING."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django.db import connections
from django.db.models import Field, Model
from django.db.models.expressions import DatabaseDefault

from django_leases.dialects import dialect_of
from django_leases.querysets.ledger import J
from django_leases.sql.insert import InsertDialect, insert_jobs

MAX_PARAMETERS = 65535
"""PostgreSQL's limit of parameters in one statement; SQLite's is the backend's own."""


def returns_rows(alias: str) -> bool:
    """Whether the database `alias` returns columns from an INSERT (not MySQL: MariaDB does)."""
    return bool(connections[alias].features.can_return_columns_from_insert)


@dataclass(frozen=True)
class _Plan:
    """What every INSERT of one shape (model, database, columns set) shares, worked out once."""

    columns: list[Field[Any, Any]]
    returning: list[tuple[Field[Any, Any], list[Any], Any]]  # field, its converters, its column
    table: str
    quoted: list[str]
    quoted_returning: list[str]
    run_at: str
    dialect: InsertDialect
    batch: int


@lru_cache(maxsize=256)
def _plan(
    model: type[Model], alias: str, defaults: frozenset[str], delayed: bool, by_key: bool
) -> _Plan:
    """The INSERT of `model`'s rows on `alias`, leaving the columns `defaults` (and `run_at` if
    `delayed`) to the database, RETURNING the id and database defaults (and the key if
    `by_key`)."""
    connection = connections[alias]
    quote: Any = connection.ops.quote_name  # django-stubs: `(str | None) -> str`
    meta = model._meta
    by_name = {field.name: field for field in meta.concrete_fields}
    columns = [
        field
        for field in meta.concrete_fields
        if not field.primary_key
        and not field.generated
        and not (delayed and field.name == "run_at")
        and field.name not in defaults
    ]
    returning = [by_name[meta.pk.name], *(f for f in meta.concrete_fields if f.has_db_default())]
    if delayed and by_name["run_at"] not in returning:
        returning.append(by_name["run_at"])
    if by_key:
        returning.append(by_name["idempotency_key"])
    limit = connection.features.max_query_params or MAX_PARAMETERS
    return _Plan(
        columns=columns,
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
        quoted=[quote(field.column) for field in columns],
        quoted_returning=[quote(field.column) for field in returning],
        run_at=quote(by_name["run_at"].column),
        dialect=dialect_of(connection).insert,
        batch=max(1, (limit - 1) // max(1, len(columns))),
    )


def insert(alias: str, jobs: Sequence[J], *, skip_conflicts: bool, delay: float | None) -> list[J]:
    """INSERT `jobs` (unsaved, of one model, setting the same columns) into the database
    `alias`; return the ones inserted, saved: their id and database defaults set.

    Without `skip_conflicts` every job is inserted or the statement fails. With it, a job that a
    unique index refuses is left out; each job of several then needs its own idempotency key, by
    which the returned rows are matched. `delay`: `run_at` is the database clock plus these seconds.
    """
    if not jobs:
        return []
    connection = connections[alias]
    first = jobs[0]
    defaults = frozenset(
        field.name
        for field in first._meta.concrete_fields
        if isinstance(getattr(first, field.attname), DatabaseDefault)
    )
    # Skipped rows leave gaps: the rows returned are matched by key, unless there is one job.
    by_key = skip_conflicts and len(jobs) > 1
    plan = _plan(type(first), alias, defaults, delay is not None, by_key)
    inserted = []
    for start in range(0, len(jobs), plan.batch):
        batch = jobs[start : start + plan.batch]
        sql, params = insert_jobs(
            plan.dialect,
            plan.table,
            plan.quoted,
            [
                [f.get_db_prep_save(f.pre_save(job, True), connection) for f in plan.columns]
                for job in batch
            ],
            returning=plan.quoted_returning,
            skip_conflicts=skip_conflicts,
            delayed=None if delay is None else (plan.run_at, delay),
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            rows = cursor.fetchall()
        if by_key:
            returned = {row[-1]: row for row in rows}
            pairs = [
                (job, returned[key])
                for job in batch
                if (key := getattr(job, "idempotency_key", None)) in returned
            ]
        else:
            pairs = list(zip(batch, rows, strict=not skip_conflicts))
        for job, row in pairs:
            for (field, converters, col), value in zip(plan.returning, row, strict=True):
                for converter in converters:
                    value = converter(value, col, connection)
                setattr(job, field.attname, value)
            job._state.adding, job._state.db = False, alias
            inserted.append(job)
    return inserted
