"""`@job_handler`: what it refuses at import time and what the registry keeps of a kind."""

from datetime import timedelta

import pytest

from django_leases import job_handler
from django_leases.exceptions import HandlerError
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


def test_kind__its_stuck_policy_is_the_settings_for_it(kind, settings) -> None:
    job_handler(kind)(plain)
    settings.DJANGO_LEASES = {"STUCK_POLICY": "retry", "STUCK_POLICY_BY_KIND": {kind: "review"}}
    assert get_handler(kind).stuck_policy == "review"
    settings.DJANGO_LEASES = {"STUCK_POLICY": "review"}
    assert get_handler(kind).stuck_policy == "review"
    settings.DJANGO_LEASES = {"STUCK_POLICY": "retry"}
    assert get_handler(kind).stuck_policy == "retry"
