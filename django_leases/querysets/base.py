"""What every queryset of the package shares: database-clock expressions and deadlock retries."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any, Literal, TypeVar

from django.db import OperationalError, connections, models
from django.db.models.functions import Now

from django_leases.limits import OWNER_LENGTH, check_text
from django_leases.sql import deadlocked

DEADLOCK_RETRIES = 5

F_ = TypeVar("F_", bound=Callable[..., Any])


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
