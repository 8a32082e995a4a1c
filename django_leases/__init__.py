"""Payment jobs out of a database table, safely, with many workers.

Only names that do not import models are exported here, so that importing the package never
triggers app loading.
"""

from typing import Any

from django_leases.exceptions import (
    Cancelled,
    IdempotencyKeyReused,
    LeaseError,
    LeaseLost,
    PermanentError,
)
from django_leases.handlers import job_handler


def __getattr__(name: str) -> Any:
    """Read `__version__` from the installed metadata when first asked for: importing
    `importlib.metadata` and reading it took ~10 ms of every worker's start-up."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("django-leases")
    except PackageNotFoundError:  # running from a source checkout that was never installed
        found = "0+unknown"
    globals()["__version__"] = found
    return found


__all__ = [
    "Cancelled",
    "IdempotencyKeyReused",
    "LeaseError",
    "LeaseLost",
    "PermanentError",
    "__version__",
    "job_handler",
]
