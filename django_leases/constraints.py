"""`UniqueWhenSet`, the unique constraint of a job's optional keys (idempotency key, lock
holder), and `is_unique()`, which the checks and `enqueue()` ask of a job model."""

from collections.abc import Sequence
from typing import Any

from django.db import models
from django.db.models import Q


class UniqueWhenSet(models.UniqueConstraint):
    """Unique among the rows where every one of `fields` is set (not NULL).

    PostgreSQL and SQLite get a partial unique index (`WHERE ... IS NOT NULL`): the rows
    without a value (most jobs have no idempotency key and hold no lock) add no entry to it, at
    their insert or at any later update. MariaDB/MySQL, which build no partial index, get a
    plain unique index: NULLs are distinct there too, so it means the same. A `unique=True`
    field would also build, on PostgreSQL, a `varchar_pattern_ops` twin of the index for LIKE.
    """

    def __init__(self, *, fields: Sequence[str], name: str) -> None:
        present = Q(**{f"{field}__isnull": False for field in fields})
        super().__init__(fields=fields, name=name, condition=present)

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        path, args, kwargs = super().deconstruct()
        kwargs.pop("condition")
        return path, args, kwargs

    def _get_condition_sql(self, model: type[models.Model], schema_editor: Any) -> str | None:
        if not schema_editor.connection.features.supports_partial_indexes:
            return None  # a plain unique index: see the class docstring
        return super()._get_condition_sql(model, schema_editor)  # type: ignore[misc]

    def check(self, model: type[models.Model], connection: Any) -> list[Any]:  # Django 6
        return _partial_kept(super().check(model, connection))

    def _check(self, model: type[models.Model], connection: Any) -> list[Any]:  # Django 5.2
        return _partial_kept(super()._check(model, connection))  # type: ignore[misc]


def _partial_kept(errors: list[Any]) -> list[Any]:
    # models.W036 says the constraint is not created where partial indexes are missing; this
    # one is, as a plain unique index.
    return [error for error in errors if error.id != "models.W036"]


def is_unique(model: type[models.Model], name: str) -> bool:
    """Whether the field `name` of `model` is unique by itself: `unique=True`, or a unique
    constraint of it alone that holds for every row where it is set."""
    field = model._meta.get_field(name)
    if getattr(field, "unique", False):
        return True
    return any(
        isinstance(constraint, models.UniqueConstraint)
        and tuple(constraint.fields) == (name,)
        and (constraint.condition is None or isinstance(constraint, UniqueWhenSet))
        and not constraint.expressions
        for constraint in model._meta.constraints
    )
