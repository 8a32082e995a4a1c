"""`SlotPool` (`worker/slots.py`): its fields are its own, written under its lock, and nothing
slow or outside it runs under that lock: no database statement, no log line."""

import logging
import threading

import pytest
from django.db.backends.signals import connection_created

from django_leases.lease import Lease
from django_leases.models import PaymentJob
from django_leases.worker import LeaseWorker
from django_leases.worker.owners import TrackedLock, holds

from .conftest import wait_for
from .owner_rules import check
from .test_worker import fresh

Status = PaymentJob.Status


def test_slot_pool__its_fields_are_written_by_its_own_methods_under_its_lock() -> None:
    assert check("SlotPool") == []


class DiesOnce(LeaseWorker):
    """A worker whose slot thread dies (outside any handler) the first time it runs a job."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        execute = self._attempts.execute
        died: list[Lease] = []

        def dies_once(lease: Lease) -> Lease | None:
            if not died:
                died.append(lease)
                raise MemoryError("injected: the slot's own code failed")
            return execute(lease)

        self._attempts.execute = dies_once  # type: ignore[method-assign]


class UnderLock(logging.Handler):
    """Note every log line, and those written while the calling thread holds `pool_lock`."""

    def __init__(self, pool_lock: object) -> None:
        super().__init__(logging.DEBUG)
        self.pool_lock = pool_lock
        self.lines: list[str] = []
        self.under: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if holds(self.pool_lock):
            self.under.append(record.getMessage())


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_slot_pool__no_database_statement_and_no_log_line_under_its_lock() -> None:
    """A worker whose slot thread dies once (the loop frees the slot and abandons its lease),
    whose handlers succeed and fail, on real threads and connections: every statement of every
    thread and every log line of the package is watched for the pool's lock."""
    dies = PaymentJob.objects.enqueue("noop")
    done = [PaymentJob.objects.enqueue("noop") for _ in range(3)]
    failed = PaymentJob.objects.enqueue("permanent")
    lease_worker = DiesOnce(worker_id="unlocked", ttl=1.5, heartbeat=0.3, poll_interval=0.05)
    lock = lease_worker._pool._lock
    assert isinstance(lock, TrackedLock)  # the check can see who holds it
    statements: list[str] = []
    under_lock: list[str] = []

    def watch(execute, sql, params, many, context):
        statements.append(sql)
        if holds(lock):
            under_lock.append(sql)
        return execute(sql, params, many, context)

    def watched(sender: object, connection: object, **kwargs: object) -> None:
        connection.execute_wrappers.append(watch)

    lines = UnderLock(lock)
    package = logging.getLogger("django_leases")
    level = package.level
    package.addHandler(lines)
    package.setLevel(logging.DEBUG)
    connection_created.connect(watched)
    thread = threading.Thread(target=lease_worker.run)
    thread.start()
    try:
        wait_for(
            lambda: (
                all(fresh(job).status == Status.COMPLETED for job in [dies, *done])
                and fresh(failed).status == Status.FAILED
            ),
            timeout=30,
        )
    finally:
        lease_worker.stop()
        thread.join(timeout=30)
        connection_created.disconnect(watched)
        package.removeHandler(lines)
        package.setLevel(level)
    assert lease_worker.stats.abandoned == 1
    assert any("slot thread" in line and "died" in line for line in lines.lines)
    assert statements  # the watch saw the threads' statements
    assert lines.under == []
    assert under_lock == []
