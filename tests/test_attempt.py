"""One attempt on a slot thread (`worker/attempt.py`): a sync or async handler run, its
deadline and its own errors. What the worker makes of each end is `test_worker*.py`'s."""

import asyncio
import time

import pytest

from django_leases import job_handler
from django_leases.exceptions import HandlerTimeout
from django_leases.handlers import get_handler, unregister
from django_leases.worker.attempt import run_handler


@pytest.fixture
def kind():
    name = "test_attempt_kind"
    yield name
    unregister(name)


def test_handler_run__awaits_a_coroutine_and_what_a_plain_function_returns(kind) -> None:
    ran: list[str] = []

    async def body(job, lease):
        await asyncio.sleep(0)
        ran.append(job)

    job_handler(kind)(body)
    assert get_handler(kind).is_async
    run_handler(get_handler(kind), "async def", None)
    unregister(kind)
    job_handler(kind)(lambda job, lease: body(job, lease))
    run_handler(get_handler(kind), "returned coroutine", None)
    assert ran == ["async def", "returned coroutine"]


def test_handler_run__cancels_a_coroutine_at_its_deadline(kind) -> None:
    reached: list[str] = []

    async def slow(job, lease):
        await asyncio.sleep(30)
        reached.append("after the sleep")

    job_handler(kind, timeout=0.2)(slow)
    started = time.monotonic()
    with pytest.raises(HandlerTimeout, match="ran past its timeout of 0.2s"):
        run_handler(get_handler(kind), None, None, deadline=started + 0.2)
    assert reached == []


def test_handler_run__the_handlers_own_timeout_error_is_not_the_run_time_limit(kind) -> None:
    async def client_timeout(job, lease):
        raise TimeoutError("the PSP did not answer")

    job_handler(kind, timeout=30)(client_timeout)
    with pytest.raises(TimeoutError, match="the PSP did not answer") as caught:
        run_handler(get_handler(kind), None, None, deadline=time.monotonic() + 30)
    assert not isinstance(caught.value, HandlerTimeout)
