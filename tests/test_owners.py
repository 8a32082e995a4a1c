"""`worker/owners.py`: the owner checks are on in the suite, and refuse a write by the wrong
thread or without the lock, on real threads."""

import threading

import pytest

from django_leases.worker import LeaseWorker
from django_leases.worker.owners import Owner, OwnerError, TrackedLock, checking, holds


def built() -> LeaseWorker:
    return LeaseWorker(worker_id="owners", ttl=30, heartbeat=5)


def on_thread(call: object) -> list[BaseException]:
    """Run `call` on a new thread; return what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            raised.append(exc)

    thread = threading.Thread(target=run, name="intruder")
    thread.start()
    thread.join(timeout=30)
    return raised


def test_owners__the_suite_runs_with_the_checks_on() -> None:
    assert checking()
    assert isinstance(built()._pool._lock, TrackedLock)


def test_owners__a_loop_field_written_by_another_thread_is_refused() -> None:
    lease_worker = built()
    lease_worker._loop.bind()  # this thread runs the loop
    [error] = on_thread(lease_worker._pool.close)
    assert isinstance(error, OwnerError)
    assert "written by the loop thread" in str(error) and "not by intruder" in str(error)
    lease_worker._pool.close()  # the loop itself may
    assert lease_worker._pool._closing


def test_owners__any_thread_until_the_owner_binds() -> None:
    owner = Owner("loop")
    assert on_thread(lambda: owner.writes("field")) == []
    owner.bind()
    [error] = on_thread(lambda: owner.writes("field"))
    assert isinstance(error, OwnerError)


def test_owners__a_slots_fields_are_written_under_the_pool_lock_only() -> None:
    pool = built()._pool
    slot = pool._slots[0]
    with pytest.raises(OwnerError, match="under its part's lock"):
        slot.clear()
    with pool._lock:
        assert holds(pool._lock)
        slot.clear()
    assert not holds(pool._lock)


def test_owners__a_tracked_lock_knows_its_holder_and_serves_a_condition() -> None:
    lock = TrackedLock()
    ready = threading.Condition(lock)  # type: ignore[arg-type]
    woken: list[bool] = []

    def waiter() -> None:
        with ready:
            ready.wait_for(lambda: bool(woken), timeout=30)
            woken.append(holds(lock))

    thread = threading.Thread(target=waiter)
    thread.start()
    with ready:
        assert holds(lock)
        woken.append(True)
        ready.notify()
    thread.join(timeout=30)
    assert woken == [True, True]
    assert not lock.locked()
