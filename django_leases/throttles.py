"""Limits per job kind across every worker: `@job_handler("capture", limit=4, rate=(10, 1))`.

`limit=N`: at most N jobs of the kind processing with a live lease at once. `rate=(N, seconds)`:
at most N jobs of the kind claimed within any window of `seconds` of the database clock. Both
are decided in the claim's transaction, serialised per kind (`querysets/throttles.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django_leases.conf import to_seconds
from django_leases.exceptions import InvalidArgument
from django_leases.limits import KIND_LIMIT, check_int, shown


@dataclass(frozen=True)
class Throttle:
    """The limits of one kind; at least one of them is set."""

    limit: int | None = None
    """Jobs of the kind processing (live lease) at once, at most."""
    rate: tuple[int, float] | None = None
    """(N, seconds): jobs of the kind claimed within any window of `seconds`, at most N."""

    def describe(self) -> str:
        """Say the limits in a few words, for the admin, logs and errors."""
        parts = [] if self.limit is None else [f"{self.limit} at once"]
        if self.rate is not None:
            parts.append(f"{self.rate[0]} per {self.rate[1]:g}s")
        return ", ".join(parts)


def throttle(limit: Any, rate: Any) -> Throttle | None:
    """Return the `Throttle` of a handler's `limit=` and `rate=`, or None for neither.

    Raises:
        InvalidArgument: naming the option and what it takes.
    """
    if limit is None and rate is None:
        return None
    if limit is not None:
        check_int(limit, "limit", KIND_LIMIT)
    return Throttle(limit, None if rate is None else _rate(rate))


def _rate(rate: Any) -> tuple[int, float]:
    if not isinstance(rate, tuple | list) or len(rate) != 2:
        raise InvalidArgument(
            f"rate must be a pair (jobs, seconds), e.g. (10, 1), got {shown(rate)}"
        )
    count, window = rate
    check_int(count, "rate's job count", KIND_LIMIT)
    return count, to_seconds(window, "rate's window")
