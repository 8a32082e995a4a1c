"""The enqueue's INSERT of one row or many, in each database's words for skipping a conflicting
row (Django's, as `bulk_create(ignore_conflicts=True)` writes them, where they mean the same:
`Dialect.insert_skipping()`) and for "now + a delay"
(`InsertDialect`, one in each database's module)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

Params = dict[str, Any]

AS_JSON = {
    "jsonb": "jsonb_array_elements",
    "varchar": "jsonb_array_elements_text",
    "text": "jsonb_array_elements_text",
}
"""The column types whose values `insert_arrays()` takes as one JSON array, and the function
that reads it (psycopg dumps a list of them element by element in Python, `json` at once)."""


@dataclass(frozen=True)
class InsertDialect:
    """How a database skips the rows a unique index refuses (`skip`: the INSERT's words before
    the table and after the values, as Django writes them for `ignore_conflicts`:
    `Dialect.insert_skipping()`), and computes its clock plus `%(delay)s` (the parameter
    `delay(seconds)`).
    `arrays`: the rows can come as one array per column, `unnest()`ed (PostgreSQL).
    `parameters`: the most parameters one statement should take (0: the database's limit).
    `notify`: an expression of `%(channel)s` and `%(message)s` that announces the rows inserted
    to the listening workers, once the statement's transaction commits ("": no NOTIFY)."""

    now_plus: str
    delay: Callable[[float], Any]
    skip: tuple[str, str] = ("INSERT INTO", "")
    arrays: bool = False
    parameters: int = 0
    notify: str = ""


def insert_jobs(
    dialect: InsertDialect,
    table: str,
    columns: Sequence[str],
    shared: Sequence[Any],
    rows: Sequence[Sequence[Any]],
    *,
    returning: Sequence[str],
    skip_conflicts: bool,
    delayed: tuple[str, float] | None = None,
    notify: tuple[str, str] | None = None,
) -> tuple[str, Params]:
    """Return one INSERT of `rows`, RETURNING `returning` of each row inserted.

    Every row takes the values `shared` in the first columns (parameters `s<column>`) and its
    own values in the others (`v<row>_<column>`). `skip_conflicts`: a row that a unique index
    refuses is left out instead of failing the statement (and the transaction). `delayed`:
    (column, seconds) set to the database clock plus the seconds, in every row. `notify`:
    (channel, message) announced if a row is inserted, by the dialect's `notify` expression,
    returned as one more column after `returning`.
    """
    params = _shared(dialect, shared, delayed, notify)
    own = len(columns) - len(shared)
    for i, row in enumerate(rows):
        params.update(zip([f"v{i}_{j}" for j in range(own)], row, strict=True))
    shape = _shape(columns, returning, skip_conflicts, delayed, notify)
    return _text(dialect, table, len(shared), len(rows), *shape), params


def insert_arrays(
    dialect: InsertDialect,
    table: str,
    columns: Sequence[str],
    shared: Sequence[Any],
    arrays: Sequence[Any],
    *,
    types: Sequence[str],
    returning: Sequence[str],
    skip_conflicts: bool,
    delayed: tuple[str, float] | None = None,
    notify: tuple[str, str] | None = None,
) -> tuple[str, Params]:
    """Return one INSERT of the rows `arrays` hold, as `insert_jobs()` does, for a database
    of `arrays` (PostgreSQL): the rows' own values come as one parameter per column (`a<column>`),
    an array of them, or for a column of a type of `AS_JSON` one JSON array of them, so that the
    text and the parameters are the same few whatever the rows; `types` are the columns' types.
    """
    params = _shared(dialect, shared, delayed, notify)
    params.update((f"a{j}", array) for j, array in enumerate(arrays))
    shape = _shape(columns, returning, skip_conflicts, delayed, notify)
    return _text(dialect, table, len(shared), tuple(types), *shape), params


def _shape(
    columns: Sequence[str],
    returning: Sequence[str],
    skip_conflicts: bool,
    delayed: tuple[str, float] | None,
    notify: tuple[str, str] | None,
) -> tuple[tuple[str, ...], tuple[str, ...], bool, str | None, bool]:
    """What `_text()` needs to know of an INSERT besides its table and rows."""
    column = delayed[0] if delayed else None
    return tuple(columns), tuple(returning), skip_conflicts, column, notify is not None


def _shared(
    dialect: InsertDialect,
    shared: Sequence[Any],
    delayed: tuple[str, float] | None,
    notify: tuple[str, str] | None,
) -> Params:
    params = {f"s{j}": value for j, value in enumerate(shared)}
    if delayed:
        params["delay"] = dialect.delay(delayed[1])
    if notify:
        params["channel"], params["message"] = notify
    return params


@lru_cache(maxsize=256)
def _text(
    dialect: InsertDialect,
    table: str,
    shared: int,
    rows: int | tuple[str, ...],
    columns: tuple[str, ...],
    returning: tuple[str, ...],
    skip_conflicts: bool,
    delayed: str | None,
    notify: bool,
) -> str:
    """The text of an INSERT of `rows` rows of VALUES, or with the columns' types the rows of
    arrays: the same for every INSERT of one shape."""
    tail = [dialect.now_plus] if delayed else []
    own = range(len(columns) - shared)
    if isinstance(rows, tuple):
        source = _select(rows, shared, own, tail)
    else:
        values = [f"%(s{j})s" for j in range(shared)]
        source = "VALUES " + ", ".join(
            f"({', '.join([*values, *(f'%(v{i}_{j})s' for j in own), *tail])})" for i in range(rows)
        )
    verb, suffix = dialect.skip if skip_conflicts else ("INSERT INTO", "")
    targets = ", ".join([*columns, *([delayed] if delayed else [])])
    return (
        f"{verb} {table} ({targets}) {source}"  # noqa: S608 - names quoted by the caller, values are parameters
        f" {suffix} RETURNING {', '.join([*returning, *([dialect.notify] if notify else [])])}"
    )


def _select(types: tuple[str, ...], shared: int, own: range, tail: list[str]) -> str:
    """The rows of `insert_arrays()`: the arrays' elements side by side (ROWS FROM), in the
    arrays' order, which the ids follow, as Django's `bulk_create()` of UNNEST relies on too
    (tested on 15). Each shared value is cast: a parameter alone in a select list has no type
    of its own."""
    arrays = ", ".join(
        f"{AS_JSON[kind]}(%(a{j})s::jsonb)" if kind in AS_JSON else f"unnest(%(a{j})s::{kind}[])"
        for j in own
        for kind in [types[shared + j]]
    )
    values = [
        *(f"%(s{j})s::{types[j]}" for j in range(shared)),
        *(f"u.c{j}" for j in own),
        *tail,
    ]
    names = ", ".join(f"c{j}" for j in own)
    return f"SELECT {', '.join(values)} FROM ROWS FROM ({arrays}) AS u({names})"  # noqa: S608
