"""`Listener`: enqueue notifications on PostgreSQL; nothing (polling) elsewhere."""

import logging
import re
import time

import pytest
from django.db import connection

from django_leases.dialects.postgresql import Listening
from django_leases.listener import Listener, watchdog_guard
from django_leases.models import PaymentJob

from .ports import free_port
from .proxy import Proxy

NEXT_TRY = re.compile(r"next try in ([0-9.]+)s")

needs_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="LISTEN/NOTIFY is PostgreSQL's"
)


def test_listener__none_where_notify_is_unavailable(settings: object) -> None:
    if connection.vendor == "postgresql":
        settings.DJANGO_LEASES = {"USE_NOTIFY": False}  # type: ignore[attr-defined]
    assert Listener.for_model(PaymentJob, "default") is None


@needs_postgresql
@pytest.mark.django_db(transaction=True)
def test_listener__wakes_on_a_committed_enqueue_and_reconnects_after_close() -> None:
    listener = Listener.for_model(PaymentJob, "default")
    assert listener is not None
    try:
        assert listener.wait(0.2) is False  # listening now; nothing enqueued
        PaymentJob.objects.enqueue("capture")  # autocommit: NOTIFY is sent at commit
        assert listener.wait(10) is True
        listener.close()
        assert listener.wait(0.2) is False  # a new connection, listening again
        PaymentJob.objects.enqueue("refund")
        assert listener.wait(10) is True
    finally:
        listener.close()


@needs_postgresql
@pytest.mark.django_db(transaction=True)
def test_listener__a_listen_the_network_swallows_is_cut_off_at_its_deadline() -> None:
    """Connected, then the path turns into a black hole (a proxy that acknowledges packets and
    forwards nothing) before the LISTEN: the watchdog shuts the socket down at the deadline, so
    the worker's loop falls back to polling instead of waiting for the reply forever (it did,
    and a partitioned worker never claimed again once the path was back)."""
    import psycopg  # PostgreSQL's driver: not installed where the suite runs on SQLite alone

    params = connection.get_connection_params()
    with Proxy(int(params.get("port") or 5432)) as proxy:
        proxied = {**params, "host": "127.0.0.1", "port": proxy.port}
        listening = Listening(proxied, "leases_test_channel", watchdog_guard(1.0))
        listening.connect()
        try:
            proxy.blackhole()
            with pytest.raises(psycopg.OperationalError):
                listening.listen()
            assert proxy.dropped > 0  # the LISTEN went into the black hole
        finally:
            listening.close()


@needs_postgresql
def test_listener__a_listening_connection_that_fails_backs_off_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that is away (here a port nothing listens on): the worker polls meanwhile, and
    the listener tries again after longer and longer waits (it reconnected at every wait, each
    time with a warning: 77 in a 30 s restart), saying so once."""
    params = {**connection.get_connection_params(), "port": free_port()}
    listener = Listener(Listening(params, "leases_test_channel", watchdog_guard(1.0)))
    with caplog.at_level(logging.DEBUG, "django_leases.worker"):
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert listener.wait(0.05) is False
    listener.close()
    messages = [r.getMessage() for r in caplog.records]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    tries = [float(m[1]) for m in map(NEXT_TRY.search, messages) if m]
    assert len(warnings) == 1 and "polling until it is back" in warnings[0], messages
    assert 2 <= len(tries) <= 5 and tries == sorted(tries), messages
