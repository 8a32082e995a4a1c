"""Throttled kinds for the tests, and a worker that runs them: `python -m tests.throttled
--worker-id w1 ...` (the options of `run_lease_worker`).

Registered only by `register()` (the worker here, or a test's fixture), never on import: a
throttled kind in the registry makes every claim of all kinds (`kinds=None`) in that process
take its gate.
"""

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import django

CAPPED, CAPPED_LIMIT = "capped", 2
# Limited, with a run-time limit and without, run by `tests.testapp.jobs.spanned` (which records
# its runs).
SPANNED, SPANNED_UNTIMED, SPANNED_LIMIT = "capped_spanned", "capped_spanned_untimed", 2
RATED, RATED_RATE = "rated", (3, 1.0)


def capped(job: Any, lease: Any) -> None:
    """Run as long as the payload says (per attempt), or until the lease is lost."""
    from tests.testapp.jobs import duration

    deadline = time.monotonic() + duration(job, lease)
    while time.monotonic() < deadline and not lease.lost:
        time.sleep(0.02)


def rated(job: Any, lease: Any) -> None:
    return None


def register() -> None:
    from django_leases import job_handler

    job_handler(CAPPED, limit=CAPPED_LIMIT)(capped)
    job_handler(RATED, rate=RATED_RATE)(rated)


def register_spanned() -> None:
    """Register the limited kinds whose handlers record their runs (the worker here only)."""
    from django_leases import job_handler
    from tests.testapp.jobs import spanned

    job_handler(SPANNED, limit=SPANNED_LIMIT, timeout=1)(spanned)
    job_handler(SPANNED_UNTIMED, limit=SPANNED_LIMIT)(spanned)


def unregister() -> None:
    from django_leases.handlers import unregister

    unregister(CAPPED)
    unregister(RATED)


HOLDER = "silent-gate-holder"


@contextmanager
def held_gate(kind: str) -> Iterator[str]:
    """Hold the gate of `kind` from a connection of its own that then sits idle in its
    transaction, as a frozen or partitioned client would; yield what names that session in a
    claim's log (PostgreSQL: its application_name; MariaDB: its thread id). Not on SQLite: a
    writer there holds the whole database."""
    from django.db import connections

    from django_leases.models import KindGate

    KindGate.objects.get_or_create(job_model="django_leases.paymentjob", kind=kind)
    holder = connections.create_connection("default")
    try:
        holder.set_autocommit(False)
        with holder.cursor() as cursor:
            if holder.vendor == "postgresql":
                cursor.execute("SET application_name = %s", [HOLDER])
                name = f"application_name={HOLDER!r}"
            else:
                cursor.execute("SELECT CONNECTION_ID()")
                name = f"thread_id={cursor.fetchone()[0]}"
            table = holder.ops.quote_name(KindGate._meta.db_table)
            cursor.execute(f"UPDATE {table} SET last_claim_at = NULL WHERE kind = %s", [kind])  # noqa: S608
        yield name
    finally:
        holder.close()  # its transaction ends with the session


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.core.management import call_command

    register()
    register_spanned()
    call_command("run_lease_worker", *sys.argv[1:])


if __name__ == "__main__":
    main()
