"""The enqueue's INSERT of one row or many, in each database's words for skipping a conflicting
row and for "now + a delay" (`InsertDialect`, one in each database's module)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

Params = dict[str, Any]


@dataclass(frozen=True)
class InsertDialect:
    """How a database skips the rows a unique index refuses (a verb, or a clause after the
    values), and computes its clock plus `%(delay)s` (the parameter `delay(seconds)`)."""

    now_plus: str
    delay: Callable[[float], Any]
    skip_verb: str = "INSERT"
    skip_suffix: str = ""


def insert_jobs(
    dialect: InsertDialect,
    table: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    returning: Sequence[str],
    skip_conflicts: bool,
    delayed: tuple[str, float] | None = None,
) -> tuple[str, Params]:
    """Return one INSERT of `rows` (values in `columns`' order, parameters `v<row>_<column>`),
    RETURNING `returning` of each row inserted.

    `skip_conflicts`: a row that a unique index refuses is left out instead of failing the
    statement (and the transaction). `delayed`: (column, seconds) set to the database clock plus
    the seconds, in every row.
    """
    params: Params = {}
    if delayed:
        params["delay"] = dialect.delay(delayed[1])
    for i, row in enumerate(rows):
        params.update(zip([f"v{i}_{j}" for j in range(len(row))], row, strict=True))
    text = _text(
        dialect,
        table,
        tuple(columns),
        len(rows),
        tuple(returning),
        skip_conflicts,
        delayed[0] if delayed else None,
    )
    return text, params


@lru_cache(maxsize=256)
def _text(
    dialect: InsertDialect,
    table: str,
    columns: tuple[str, ...],
    rows: int,
    returning: tuple[str, ...],
    skip_conflicts: bool,
    delayed: str | None,
) -> str:
    """The text of `insert_jobs()`: the same for every INSERT of one shape and row count."""
    tail = f", {dialect.now_plus}" if delayed else ""
    values = ", ".join(
        f"({', '.join(f'%(v{i}_{j})s' for j in range(len(columns)))}{tail})" for i in range(rows)
    )
    verb, suffix = (dialect.skip_verb, dialect.skip_suffix) if skip_conflicts else ("INSERT", "")
    targets = ", ".join([*columns, *([delayed] if delayed else [])])
    return (
        f"{verb} INTO {table} ({targets}) VALUES {values}"  # noqa: S608 - names quoted by the caller, values are parameters
        f" {suffix} RETURNING {', '.join(returning)}"
    )
