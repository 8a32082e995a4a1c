"""Handlers the worker tests run. Behaviour is steered by the payload, never by globals."""

import time

from django_leases import PermanentError, job_handler


@job_handler("noop")
def noop(job, lease):
    return None


@job_handler("sleep")
def sleep(job, lease):
    deadline = time.monotonic() + float(job.payload.get("seconds", 1))
    while time.monotonic() < deadline:
        lease.check()
        time.sleep(0.05)


@job_handler("boom")
def boom(job, lease):
    raise RuntimeError(job.payload.get("message", "boom"))


@job_handler("permanent")
def permanent(job, lease):
    raise PermanentError("card declined")
