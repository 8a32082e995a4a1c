"""Retry delays: exponential, capped, with full jitter."""

import random

from django_leases.conf import leases_settings

# The largest exponent 2.0 ** n takes without OverflowError.
MAX_DOUBLINGS = 1023


def reconnect_delay(failures: int, base: float, cap: float) -> float:
    """Return the seconds to wait after the `failures`-th failure in a row to reach a database:
    `base` doubled at each failure up to `cap`, drawn from the upper half of that, so that the
    processes that lost the database together do not come back together."""
    ceiling = min(cap, base * 2.0 ** min(max(failures - 1, 0), MAX_DOUBLINGS))
    return ceiling * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not cryptography


def retry_delay(attempt: int) -> float:
    """Return the seconds to wait before retrying a job whose `attempt`-th run failed.

    Full jitter (a uniform draw below the capped exponential) spreads the retries of jobs that
    failed together, e.g. during a PSP outage, instead of sending them back in one wave.
    """
    base: float = leases_settings.BACKOFF_BASE
    cap: float = leases_settings.BACKOFF_MAX
    # A float power, its exponent capped: `2 ** 1024` as an int overflows the float conversion
    # (OverflowError from attempt 1025 on); a float product past the float range is inf, and
    # min() then picks the cap.
    doublings = min(max(attempt - 1, 0), MAX_DOUBLINGS)
    ceiling = min(cap, base * 2.0**doublings)
    # Never below one base interval, so a failing job cannot spin.
    return max(base, random.uniform(0, ceiling))  # noqa: S311 - jitter, not cryptography
