"""Retry delays: exponential, capped, with full jitter."""

import random

from django_leases.conf import leases_settings


def retry_delay(attempt: int) -> float:
    """Return the seconds to wait before retrying a job whose `attempt`-th run failed.

    Full jitter (a uniform draw below the capped exponential) spreads the retries of jobs that
    failed together, e.g. during a PSP outage, instead of sending them back in one wave.
    """
    base: float = leases_settings.BACKOFF_BASE
    cap: float = leases_settings.BACKOFF_MAX
    ceiling = min(cap, base * 2 ** max(attempt - 1, 0))
    # Never below one base interval, so a failing job cannot spin.
    return max(base, random.uniform(0, ceiling))  # noqa: S311 - jitter, not cryptography
