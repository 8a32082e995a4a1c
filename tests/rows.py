"""Rows in bulk, for the tests and bench/: copies of one row made by the database in one
INSERT ... SELECT, so that thousands of rows cost no Python (nor SQL compilation) per row."""

from collections.abc import Sequence
from typing import Any

from django.db import connection


def series(vendor: str, count: int) -> tuple[str, str]:
    """Return (prefix, FROM source) that yield `count` rows on `vendor`."""
    if vendor == "postgresql":
        return "", f"generate_series(1, {count})"
    if vendor == "mysql":
        if not connection.mysql_is_mariadb:
            raise RuntimeError("bulk loading on MySQL needs MariaDB's SEQUENCE engine")
        return "", f"seq_1_to_{count}"
    return (
        f"WITH RECURSIVE seq(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM seq WHERE n < {count})",  # noqa: S608 - a number
        "seq",
    )


def copy_sql(model: Any, source: str, where: str, values: dict[str, str]) -> str:
    """Return INSERT ... SELECT copying the `source` row(s) of `model`'s table, with `values`
    (column -> SQL) replacing columns. Columns come from the model, so new fields need no change
    here."""
    quote = connection.ops.quote_name
    columns = [f.column for f in model._meta.concrete_fields if not f.primary_key]
    selected = ", ".join(values.get(c, f"t.{quote(c)}") for c in columns)
    return (
        f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(map(quote, columns))}) "  # noqa: S608 - names quoted
        f"SELECT {selected} FROM {quote(model._meta.db_table)} t, {source} WHERE {where}"
    )


def copy_row(model: Any, pk: int, count: int, values: dict[str, str] | None = None) -> None:
    """Insert `count` copies (new ids) of the row `pk` of `model`'s table in one statement, with
    `values` (column -> SQL) replacing columns; fail unless exactly `count` rows were made."""
    prefix, source = series(connection.vendor, count)
    sql = f"{prefix} {copy_sql(model, source, 't.id = %s', values or {})}"
    params: Sequence[Any] = [pk]
    before = model._default_manager.count()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)  # its rowcount is -1 on SQLite, for a statement WITH ...
    made = model._default_manager.count() - before
    assert made == count, f"{made} copies of {model.__name__} {pk}, wanted {count}"
