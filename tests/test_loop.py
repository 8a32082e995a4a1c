"""`LeaseWorker`'s own fields (`worker/loop.py`); the worker end to end is `test_worker.py`."""

import threading

import pytest

from django_leases.worker import LeaseWorker

from .owner_rules import check


def test_loop__its_failure_is_written_under_its_lock_only() -> None:
    assert check("LeaseWorker._failure") == []


@pytest.mark.django_db(transaction=True)
def test_loop__the_thread_that_runs_it_owns_its_parts_threads() -> None:
    lease_worker = LeaseWorker(worker_id="loop-owner", ttl=30, heartbeat=5, burst=True)
    assert lease_worker._loop.thread is None  # built on one thread, run on another
    thread = threading.Thread(target=lease_worker.run, name="the-loop")
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert lease_worker._loop.thread is thread
    assert lease_worker._heartbeat._loop is lease_worker._loop
    assert lease_worker._pool._loop is lease_worker._loop
    assert lease_worker._ack_writer._loop is lease_worker._loop
