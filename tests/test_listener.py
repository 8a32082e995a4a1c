"""`Listener`: enqueue notifications on PostgreSQL; nothing (polling) elsewhere."""

import pytest
from django.db import connection

from django_leases.listener import Listener
from django_leases.models import PaymentJob

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
