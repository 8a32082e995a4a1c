"""`Listener`: enqueue notifications on PostgreSQL; nothing (polling) elsewhere."""

import pytest
from django.db import connection

from django_leases.listener import DJANGO_ONLY_PARAMS, Listener
from django_leases.models import PaymentJob

from .proxy import Proxy

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

    params = {
        key: value
        for key, value in connection.get_connection_params().items()
        if key not in DJANGO_ONLY_PARAMS
    }
    with Proxy(int(params.get("port") or 5432)) as proxy:
        proxied = {**params, "host": "127.0.0.1", "port": proxy.port}
        listener = Listener(proxied, "leases_test_channel", deadline=1.0)
        conn = psycopg.connect(autocommit=True, **proxied)
        try:
            proxy.blackhole()
            with pytest.raises(psycopg.OperationalError):
                listener._listen(conn)
            assert proxy.dropped > 0  # the LISTEN went into the black hole
        finally:
            conn.close()
