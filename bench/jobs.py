"""The django-leases handler of the benchmarks (discovered by `run_lease_worker`)."""

from typing import Any

from django_leases import job_handler


@job_handler("noop")
def noop(job: Any, lease: Any) -> None:
    """Do nothing: the benchmarks measure the queue, not the work."""
