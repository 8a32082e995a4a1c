"""`@job_handler`: what it refuses at import time, and how a handler is run."""

import asyncio
import time
from datetime import timedelta

import pytest

from django_leases import job_handler
from django_leases.exceptions import HandlerError, HandlerTimeout
from django_leases.handlers import get_handler, unregister


@pytest.fixture
def kind():
    name = "test_handlers_kind"
    yield name
    unregister(name)


def plain(job, lease):
    return None


def generator(job, lease):
    yield job


async def async_generator(job, lease):
    yield job


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (generator, "is a generator function"),
        (async_generator, "is a generator function"),
        ("not.a.function", "is not callable"),
        (42, "is not callable"),
    ],
)
def test_job_handler__refuses_what_the_worker_could_not_run(kind, target, message) -> None:
    with pytest.raises(HandlerError, match=message):
        job_handler(kind)(target)
    with pytest.raises(HandlerError, match="no handler is registered"):
        get_handler(kind)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "10", True])
def test_job_handler__refuses_a_timeout_that_is_not_positive_seconds(kind, timeout) -> None:
    with pytest.raises(HandlerError, match=f"job kind {kind!r}: timeout must be"):
        job_handler(kind, timeout=timeout)


def test_job_handler__timeout_in_seconds_or_timedelta(kind) -> None:
    job_handler(kind, timeout=timedelta(minutes=2))(plain)
    assert get_handler(kind).timeout == 120.0
    unregister(kind)
    job_handler(kind, timeout=0.5)(plain)
    assert get_handler(kind).timeout == 0.5
    assert get_handler(kind).is_async is False


def test_job_handler__refuses_a_reconcile_hook_that_is_not_callable(kind) -> None:
    with pytest.raises(HandlerError, match="reconcile hook"):
        job_handler(kind, reconcile="ask_the_psp")


def test_handler_run__awaits_a_coroutine_and_what_a_plain_function_returns(kind) -> None:
    ran: list[str] = []

    async def body(job, lease):
        await asyncio.sleep(0)
        ran.append(job)

    job_handler(kind)(body)
    assert get_handler(kind).is_async
    get_handler(kind).run("async def", None)
    unregister(kind)
    job_handler(kind)(lambda job, lease: body(job, lease))
    get_handler(kind).run("returned coroutine", None)
    assert ran == ["async def", "returned coroutine"]


def test_handler_run__cancels_a_coroutine_at_its_deadline(kind) -> None:
    reached: list[str] = []

    async def slow(job, lease):
        await asyncio.sleep(30)
        reached.append("after the sleep")

    job_handler(kind, timeout=0.2)(slow)
    started = time.monotonic()
    with pytest.raises(HandlerTimeout, match="ran past its timeout of 0.2s"):
        get_handler(kind).run(None, None, deadline=started + 0.2)
    assert reached == []


def test_handler_run__the_handlers_own_timeout_error_is_not_the_run_time_limit(kind) -> None:
    async def client_timeout(job, lease):
        raise TimeoutError("the PSP did not answer")

    job_handler(kind, timeout=30)(client_timeout)
    with pytest.raises(TimeoutError, match="the PSP did not answer") as caught:
        get_handler(kind).run(None, None, deadline=time.monotonic() + 30)
    assert not isinstance(caught.value, HandlerTimeout)
