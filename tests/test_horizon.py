"""What holds the vacuum horizon (InnoDB's purge) back: read, logged by the watcher, counted by
the gauges, shown on the overview and reported by `check --database`, with a real session left
idle in a transaction."""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
from django.core import checks
from django.db import connection, connections
from django.test import Client, override_settings
from django.urls import path, reverse

from django_leases import metrics
from django_leases.horizon import HorizonPin, oldest_pin
from django_leases.models import PaymentJob

from .conftest import Processes, subprocess_env, wait_for

# Serial: on MariaDB/MySQL the oldest transaction is the server's (InnoDB's purge is shared by
# every database), and the other test processes' transactions would hide this test's own.
pytestmark = pytest.mark.serial

SOON = {"HORIZON_WARN_AFTER": 0.5}
"""A bound the test's own pin passes within a second."""

urlpatterns = [path("metrics/", metrics.queue_metrics)]


class Session(NamedTuple):
    """The test's session idle in a transaction: its id and when it began (monotonic)."""

    name: str
    began: float


@contextmanager
def idle_in_transaction() -> Iterator[Session]:
    """A session of its own on the test database, idle in a transaction that holds a
    snapshot and a transaction id, as a `psql` left at `BEGIN` does; yields its id (PostgreSQL's
    backend pid, MariaDB/MySQL's connection id, as `HorizonPin.name` gives it)."""
    session = connections.create_connection("default")
    session.settings_dict = {**connection.settings_dict}
    try:
        session.set_autocommit(False)
        with session.cursor() as cursor:
            table = PaymentJob._meta.db_table
            if session.vendor == "postgresql":
                cursor.execute("SELECT pg_backend_pid(), txid_current()")
            else:
                cursor.execute("SELECT CONNECTION_ID()")
            (name, *_) = cursor.fetchone()
            cursor.execute(f"SELECT COUNT(*) FROM {session.ops.quote_name(table)}")  # noqa: S608
        yield Session(str(name), time.monotonic())
    finally:
        session.close()


def seen(session: Session) -> HorizonPin | None:
    """The oldest pin, if it is `session` or, on MariaDB/MySQL, one at least as old: InnoDB's
    oldest transaction is the server's, and another database's (or test process's) may be
    older than the test's own."""
    pin = oldest_pin(connection.alias)
    if pin is None or pin.seconds is None:
        return None
    if pin.name == session.name:
        return pin
    older = pin.seconds >= time.monotonic() - session.began - 1
    return pin if connection.vendor == "mysql" and older else None


def pinned_by(session: Session) -> HorizonPin | None:
    """`seen()`, once past its bound."""
    pin = seen(session)
    return pin if pin is not None and pin.pinned else None


def names(pin: HorizonPin, session: Session) -> set[str]:
    """What a later read may name: on PostgreSQL the test's session; on MariaDB/MySQL, whose
    oldest transaction is the server's (and a closed session's stays listed a while), the
    oldest transaction it then finds, whichever."""
    if connection.vendor == "mysql":
        return {"transaction "}
    return {f" {pin.name} ", f" {session.name} "}


@pytest.fixture
def relational() -> None:
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no vacuum horizon: one writer, no row versions kept for readers")


@pytest.mark.django_db(transaction=True)
def test_oldest_pin__names_a_session_idle_in_transaction(relational: None) -> None:
    with override_settings(DJANGO_LEASES=SOON), idle_in_transaction() as session:
        pin = wait_for(lambda: pinned_by(session))
        assert isinstance(pin, HorizonPin)
        assert pin.source in {"session", "transaction"} and pin.seconds is not None
        assert pin.seconds >= 0.5 and f" {pin.name} " in f" {pin.describe()} "
        if connection.vendor == "postgresql":
            assert pin.name == session.name and pin.xids is not None and pin.xids >= 1
            assert "idle in transaction" in pin.detail
    name = session.name
    # Ended: the horizon moves on, whatever else the server runs. (MariaDB keeps a closed
    # session's transaction listed for a while, seen here for over 30 s: PostgreSQL's only.)
    if connection.vendor == "postgresql":
        wait_for(lambda: (pin := oldest_pin(connection.alias)) is None or pin.name != name)


@pytest.mark.django_db(transaction=True)
def test_oldest_pin__not_past_its_bound_until_horizon_warn_after(relational: None) -> None:
    with (
        override_settings(DJANGO_LEASES={"HORIZON_WARN_AFTER": 3600}),
        idle_in_transaction() as session,
    ):
        pin = wait_for(lambda: seen(session))
        assert isinstance(pin, HorizonPin) and not pin.pinned


@pytest.mark.django_db(transaction=True)
def test_oldest_pin__its_age_whatever_the_session_time_zone(relational: None) -> None:
    """MariaDB/MySQL give a transaction's start in the system time zone, NOW() in the
    session's: a session zone west of UTC once made every pin look young."""
    if connection.vendor != "mysql":
        pytest.skip("only MariaDB/MySQL have a session zone that moves NOW()")
    with idle_in_transaction() as session:
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '-03:00'")
        try:
            pin = wait_for(lambda: seen(session))
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET time_zone = '+00:00'")
    assert isinstance(pin, HorizonPin) and pin.seconds is not None
    assert 0 <= pin.seconds < 3600, pin


@pytest.mark.django_db
def test_oldest_pin__sqlite_has_none() -> None:
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's")
    with connection.cursor():
        assert oldest_pin(connection.alias) is None


def test_horizon_pin__bounds_by_time_else_by_transactions() -> None:
    with override_settings(DJANGO_LEASES={"HORIZON_WARN_AFTER": 60, "HORIZON_WARN_XIDS": 1000}):
        assert HorizonPin("session", "1", "", 61.0, 5).pinned
        assert not HorizonPin("session", "1", "", 59.0, 10**6).pinned
        assert HorizonPin("replication slot", "s", "", None, 1000).pinned
        assert not HorizonPin("replication slot", "s", "", None, 999).pinned
        assert not HorizonPin("transaction", "7", "", None, None).pinned


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_watcher__warns_of_the_session_that_pins_the_horizon(
    processes: Processes, relational: None
) -> None:
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(SOON))
    with idle_in_transaction() as session:
        with override_settings(DJANGO_LEASES=SOON):
            pin = wait_for(lambda: pinned_by(session))
        watcher = processes.manage("watch_stuck_jobs", "--once", "-v", "2", env=env)
        out, _ = watcher.communicate(timeout=60)
    assert watcher.returncode == 0 and isinstance(pin, HorizonPin), out
    assert "vacuum horizon of database 'default' is pinned by" in out, out
    assert any(name in out for name in names(pin, session)), out


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls(__name__)
def test_gauges_and_check__report_the_pin(client: Client, relational: None) -> None:
    with override_settings(DJANGO_LEASES=SOON), idle_in_transaction() as session:
        pin = wait_for(lambda: pinned_by(session))
        metrics.GAUGES.clear()
        text = client.get("/metrics/").content.decode()
        warnings = [
            message
            for message in checks.run_checks(databases=[connection.alias])
            if message.id == "django_leases.W015"
        ]
    ages: dict[str, Any] = {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("django_leases_horizon_pin_age_seconds{")
    }
    [(label, seconds)] = ages.items()
    assert label in {'source="session"', 'source="transaction"'} and seconds >= 0.5, text
    assert isinstance(pin, HorizonPin) and len(warnings) == 1, warnings
    assert any(name in warnings[0].msg for name in names(pin, session)), warnings


@pytest.mark.django_db(transaction=True)
def test_overview__says_what_pins_the_horizon(admin_client: Client, relational: None) -> None:
    with override_settings(DJANGO_LEASES=SOON), idle_in_transaction() as session:
        pin = wait_for(lambda: pinned_by(session))
        page = admin_client.get(reverse("admin:django_leases_paymentjob_overview")).content.decode()
    assert isinstance(pin, HorizonPin) and 'id="dl-horizon"' in page, page
    assert any(name in page for name in names(pin, session)), page
    page = admin_client.get(reverse("admin:django_leases_paymentjob_overview")).content.decode()
    assert 'id="dl-horizon"' not in page
