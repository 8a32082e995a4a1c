"""Network timeouts: options per database, the watchdog, and a worker behind a silent partition."""

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.db import DataError, OperationalError, connection, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.test import override_settings

from django_leases.checks import check_network_timeout
from django_leases.dialects import dialect_of
from django_leases.dialects.statements import sqlstate
from django_leases.models import JobAttempt, PaymentJob
from django_leases.network import (
    CLIENT_SLACK,
    Deadline,
    Watchdog,
    harden,
    hardened_options,
    keep_usable,
    merged_options,
    network_timeout,
    statement_timeout,
    watchdog,
)
from django_leases.querysets.base import bound_cursor
from tests.testapp.models import Charge

from .conftest import ON_SQLITE, Processes, subprocess_env, wait_for
from .leasing import token_of
from .proxy import Proxy

Status = PaymentJob.Status
NEEDS_NETWORK = pytest.mark.skipif(
    ON_SQLITE, reason="SQLite is a file on this machine: there is no network to partition"
)


def test_network_timeout__auto_is_a_third_of_the_ttl_within_bounds() -> None:
    assert network_timeout(60) == 20
    assert network_timeout(3) == 2  # at least 2 s
    assert network_timeout(3600) == 30  # at most 30 s
    with override_settings(DJANGO_LEASES={"TTL": 15}):
        assert network_timeout() == 5
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": 7.5}):
        assert network_timeout(60) == 7.5
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": None}):
        assert network_timeout(60) is None


def test_hardened_options__per_database() -> None:
    assert hardened_options("postgresql", 20) == {
        "connect_timeout": 20,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 3,
        "keepalives_count": 3,
        "tcp_user_timeout": 20_000,
    }
    # The statement timeout goes with each transaction, not in the startup `options`.
    assert statement_timeout("postgresql", 20, {}) == 20_000
    # Whole seconds for the drivers, never below what they accept.
    assert hardened_options("postgresql", 1.5)["connect_timeout"] == 2
    assert statement_timeout("postgresql", 1.5, {}) == 1500
    assert statement_timeout("mysql", 20, {}) is None
    assert hardened_options("mysql", 2.5) == {
        "connect_timeout": 3,
        "read_timeout": 3,
        "write_timeout": 3,
    }
    assert hardened_options("sqlite", 20) == {}


def test_merged_options__the_projects_values_win() -> None:
    user = {"connect_timeout": 60, "keepalives": 0, "sslmode": "require"}
    merged = merged_options("postgresql", 20, user)
    assert merged["connect_timeout"] == 60
    assert merged["keepalives"] == 0
    assert merged["sslmode"] == "require"
    assert merged["tcp_user_timeout"] == 20_000
    # A project's own `options` keep their settings, and its transactions get the statement
    # timeout...
    theirs = {"options": "-c search_path=app"}
    assert merged_options("postgresql", 20, theirs)["options"] == "-c search_path=app"
    assert statement_timeout("postgresql", 20, theirs) == 20_000
    # ...unless they set one themselves.
    mine = {"options": "-c statement_timeout=0"}
    assert merged_options("postgresql", 20, mine)["options"] == mine["options"]
    assert statement_timeout("postgresql", 20, mine) is None
    assert merged_options("mysql", 20, {"read_timeout": 120})["read_timeout"] == 120


@pytest.mark.parametrize(
    "value", [0, 0.5, -1, 86401, float("nan"), "20", "off", True, [20], {"seconds": 20}]
)
def test_check_network_timeout__refuses(value: object) -> None:
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": value}):
        messages = check_network_timeout()
    assert [m.id for m in messages] == ["django_leases.E019"]
    assert "NETWORK_TIMEOUT" in messages[0].msg and repr(value) in messages[0].msg


@pytest.mark.parametrize("value", [None, "auto", 1, 2.5, 86400])
def test_check_network_timeout__accepts(value: object) -> None:
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": value}):
        assert check_network_timeout() == []
    with override_settings(DJANGO_LEASES={}):
        assert check_network_timeout() == []


@pytest.fixture
def spare() -> Iterator[BaseDatabaseWrapper]:
    """A connection of its own to the test database, as a worker thread has."""
    conn = connections.create_connection("default")
    conn.settings_dict = {**conn.settings_dict, "NAME": connection.settings_dict["NAME"]}
    yield conn
    conn.close()


@pytest.mark.django_db(transaction=True)
def test_harden__changes_this_connection_only(spare: BaseDatabaseWrapper) -> None:
    shared = dict(connections.settings["default"]["OPTIONS"])
    # This thread's own connection, as it is: an in-process watcher pass earlier in the run may
    # have hardened it already (that is harden() on the watcher's thread).
    mine = dict(connection.settings_dict["OPTIONS"])
    harden(spare, 6)
    harden(spare, 6)  # idempotent

    options = spare.settings_dict["OPTIONS"]
    assert options == merged_options(spare.vendor, 2, shared)
    assert connections.settings["default"]["OPTIONS"] == shared
    assert connection.settings_dict["OPTIONS"] == mine
    deadlines = [w for w in spare.execute_wrappers if isinstance(w, Deadline)]
    if ON_SQLITE:
        assert options == shared and deadlines == []
        return
    assert [d.seconds for d in deadlines] == [2 + CLIENT_SLACK]
    with spare.cursor() as cursor:
        if spare.vendor == "postgresql":
            assert server_timeout(cursor) == "2s"
            params = spare.connection.info.get_parameters()
            assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "2000"
        else:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)


@pytest.mark.django_db(transaction=True)
def test_keep_usable__keeps_a_connection_past_conn_max_age_and_closes_a_broken_one() -> None:
    connection.ensure_connection()
    raw = connection.connection
    connection.close_at = time.monotonic() - 1  # past CONN_MAX_AGE: Django would close it
    keep_usable()
    assert connection.connection is raw
    connection.errors_occurred = True  # an error, after which the connection still answers
    keep_usable()
    assert connection.connection is raw and not connection.errors_occurred
    if ON_SQLITE:
        return  # a file: an SQLite connection does not break
    raw.close()
    connection.errors_occurred = True
    keep_usable()
    assert connection.connection is None
    assert PaymentJob.objects.count() == 0  # the next use reconnects


@pytest.mark.django_db(transaction=True)
def test_keep_usable__asks_for_a_health_check_only_when_told() -> None:
    connection.ensure_connection()
    connection.health_check_done = True
    keep_usable()
    assert connection.health_check_done
    keep_usable(health_check=True)
    assert not connection.health_check_done


@pytest.mark.django_db(transaction=True)
def test_harden__none_leaves_connections_as_configured(spare: BaseDatabaseWrapper) -> None:
    before = dict(spare.settings_dict)
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": None}):
        harden(spare, 6)
    assert spare.settings_dict == before
    assert spare.execute_wrappers == []


ON_POSTGRESQL = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="statement_timeout is PostgreSQL's"
)
STATEMENT_TIMEOUT = "57014"  # query_canceled: the server ended the statement


def cursors(conn: BaseDatabaseWrapper) -> dict[str, Callable[[], Any]]:
    """The ways the package sends statements on `conn`: Django's cursor (the ORM), the bound
    and the literal cursors of the lease layer (its completions, the prepared claim)."""
    assert connections["spare"] is conn
    return {
        "django": conn.cursor,
        "bound": lambda: bound_cursor("spare"),
        "literal": lambda: dialect_of(conn).literal_cursor(conn),
    }


def server_timeout(cursor: Any) -> str:
    """The statement_timeout the server applies to the statement `cursor` sends now."""
    cursor.execute("SHOW statement_timeout")
    (value,) = cursor.fetchone()
    return str(value)


@pytest.fixture
def slow_spare(spare: BaseDatabaseWrapper) -> Iterator[BaseDatabaseWrapper]:
    """`spare`, hardened with a network timeout of 1 s, as the alias "spare"."""
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": 1}):
        harden(spare, 6)
    connections["spare"] = spare
    yield spare
    del connections["spare"]


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["django", "bound", "literal"])
@pytest.mark.parametrize("in_transaction", [False, True])
def test_harden__a_statement_stuck_on_a_live_server_ends_with_the_servers_error(
    slow_spare: BaseDatabaseWrapper, kind: str, in_transaction: bool
) -> None:
    """In autocommit and in a transaction (its first statement and a later one), whichever
    cursor sends it: the server cancels the statement, the watchdog never has to cut the
    connection, and the connection goes on."""
    cursor_of = cursors(slow_spare)[kind]
    fired = watchdog.fired
    with contextlib.ExitStack() as stack:
        if in_transaction:
            stack.enter_context(transaction.atomic(using="spare"))
            with cursor_of() as cursor:
                cursor.execute("SELECT 1")
        with pytest.raises(OperationalError) as caught, cursor_of() as cursor:
            cursor.execute("SELECT pg_sleep(30)")
    assert sqlstate(caught.value) == STATEMENT_TIMEOUT
    assert watchdog.fired == fired
    with cursor_of() as cursor:
        cursor.execute("SELECT %s", [2])
        assert cursor.fetchone() == (2,)
        assert server_timeout(cursor) == "1s"


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
def test_harden__a_transactions_own_bound_wins_and_a_savepoint_still_rolls_back(
    slow_spare: BaseDatabaseWrapper,
) -> None:
    with transaction.atomic(using="spare"), slow_spare.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = 0")
        with contextlib.suppress(DataError), transaction.atomic(using="spare"):
            cursor.execute("SELECT 1 / 0")  # aborts the savepoint's part
        cursor.execute("SELECT pg_sleep(1.5)")  # past the worker's bound of 1 s
        assert server_timeout(cursor) == "0"
    with slow_spare.cursor() as cursor:
        assert server_timeout(cursor) == "1s"  # the next transaction gets the bound again


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
def test_harden__a_statement_that_needs_no_transaction_block_goes_alone(
    slow_spare: BaseDatabaseWrapper,
) -> None:
    table = slow_spare.ops.quote_name(PaymentJob._meta.db_table)
    with slow_spare.cursor() as cursor:
        cursor.execute(f"VACUUM {table}")
        assert server_timeout(cursor) == "1s"  # and the next statement gets the bound


@ON_POSTGRESQL
@pytest.mark.django_db(transaction=True)
def test_harden__the_projects_own_statement_timeout_wins(spare: BaseDatabaseWrapper) -> None:
    options = {**spare.settings_dict["OPTIONS"], "options": "-c statement_timeout=4500"}
    spare.settings_dict = {**spare.settings_dict, "OPTIONS": options}
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": 1}):
        harden(spare, 6)
    with spare.cursor() as cursor:
        assert server_timeout(cursor) == "4500ms"


def through(proxy: Proxy, conn: BaseDatabaseWrapper) -> None:
    conn.settings_dict = {**conn.settings_dict, "HOST": "127.0.0.1", "PORT": proxy.port}


@NEEDS_NETWORK
@pytest.mark.django_db(transaction=True)
def test_watchdog__ends_a_call_the_network_swallowed(spare: BaseDatabaseWrapper) -> None:
    with Proxy(int(spare.settings_dict["PORT"] or default_port(spare))) as proxy:
        through(proxy, spare)
        if spare.vendor == "mysql":
            # The project's own read timeout wins, and is long: only the watchdog ends the call.
            spare.settings_dict["OPTIONS"] = {**spare.settings_dict["OPTIONS"], "read_timeout": 600}
        with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": 1}):
            harden(spare, 6)
        with spare.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
        fired = watchdog.fired
        proxy.blackhole()
        with pytest.raises(OperationalError), spare.cursor() as cursor:
            cursor.execute("SELECT 2")
        assert watchdog.fired == fired + 1
        assert proxy.dropped > 0
        # A connection the driver knows is lost is not guarded, and reports itself unusable.
        assert spare.is_usable() is False
        proxy.restore()
        spare.close()  # Django does this between requests; the worker in its outage handling
        with spare.cursor() as cursor:
            cursor.execute("SELECT 3")
            assert cursor.fetchone() == (3,)
        # The health check (CONN_HEALTH_CHECKS) talks to the server outside the execute wrappers.
        proxy.blackhole()
        assert spare.is_usable() is False
        assert watchdog.fired == fired + 2


def shut_down_after(dog: Watchdog, seconds: float, held: float) -> float | None:
    """Guard a socket for `seconds` and wait on it for up to `held` seconds; return when the
    watchdog shut it down (seconds from the start), or None if it did not."""
    ours, peer = socket.socketpair()
    started = time.monotonic()
    try:
        with dog.guard(ours.fileno(), seconds):
            ours.settimeout(held)
            try:
                ours.recv(1)  # b"" once shut down; nothing ever arrives from the peer
            except TimeoutError:
                return None
            return time.monotonic() - started
    finally:
        ours.close()
        peer.close()


def test_watchdog__a_call_with_an_earlier_deadline_wakes_it_and_a_later_one_still_fires() -> None:
    """The watchdog sleeps until the earliest deadline it knows and is woken only for an
    earlier one: a short call beside a long one is still ended on time, and so is a call whose
    deadline comes after the one the watchdog sleeps until."""
    dog = Watchdog()
    results: dict[str, float | None] = {}

    def call(name: str, seconds: float, held: float) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: results.__setitem__(name, shut_down_after(dog, seconds, held))
        )
        thread.start()
        return thread

    long_call = call("long", 60, 3)  # the watchdog now sleeps for a minute
    time.sleep(0.2)
    short_call = call("short", 0.5, 10)  # earlier: it must wake the watchdog
    time.sleep(0.1)
    later_call = call("later", 0.6, 10)  # after the short one's: no wake-up, yet it fires
    for thread in (short_call, later_call, long_call):
        thread.join()
    assert results["short"] is not None and 0.45 < results["short"] < 2
    assert results["later"] is not None and 0.55 < results["later"] < 2
    assert results["long"] is None  # held 3 s of its 60: never shut down
    assert dog.fired == 2


def default_port(conn: BaseDatabaseWrapper) -> int:
    return 5432 if conn.vendor == "postgresql" else 3306


def proxied_url(port: int) -> str:
    """DATABASE_URL of this run with its port replaced by the proxy's."""
    url = urlsplit(os.environ["DATABASE_URL"])
    netloc = url.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunsplit(url._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


class Output:
    """Collect a process's output lines as they come, on a thread of its own."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.started = time.monotonic()
        """Monotonic time the lines' timestamps (seconds, at the start of each) count from."""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(f"{time.monotonic() - self.started:7.2f} {line}")

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, predicate: Callable[[], object], timeout: float = 60) -> None:
        """Poll `predicate` until it is true; fail with the output so far at the deadline."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"condition not met within {timeout}s; the worker said:\n{self.text}")
            time.sleep(0.05)

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        self.wait_for(lambda: text in self.text, timeout)

    def finish(self) -> str:
        self._thread.join(timeout=30)
        return self.text


def attempts(job: PaymentJob) -> list[tuple[int, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "owner", "outcome")  # in token order: tokens rise with attempts
    )


@NEEDS_NETWORK
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__burst_waits_out_an_outage_instead_of_calling_the_queue_empty(
    processes: Processes,
) -> None:
    """A `--burst` worker whose claim the database does not answer has learnt nothing about
    the queue: it waits the outage out, then runs what is left, and only then exits 0. (It
    exited 0 at the first failed claim, leaving the job it had been running behind.)"""
    settings: dict[str, Any] = connections["default"].settings_dict
    port = int(settings["PORT"] or default_port(connection))
    job = PaymentJob.objects.enqueue("charge", {"durations": [3, 0]})
    with Proxy(port) as proxy:
        proc = processes.manage(
            "run_lease_worker", "--burst", "--worker-id", "burst", "--kind", "charge",
            "--poll-interval", "0.2", "--ttl", "4", "--heartbeat", "1", "-v", "2",
            env=subprocess_env(DATABASE_URL=proxied_url(proxy.port)),
        )  # fmt: skip
        log = Output(proc)
        log.wait_for_line(f"started job_id={job.pk}")
        proxy.blackhole()
        # The lease runs out behind the black hole; the claims that follow get no answer.
        log.wait_for_line(f"lease lost job_id={job.pk}")
        log.wait_for_line("database unavailable during claim")
        assert proc.poll() is None, log.text
        proxy.restore()
        assert proc.wait(timeout=60) == 0, log.finish()

    said = log.finish()
    done = PaymentJob.objects.get(pk=job.pk)
    assert (done.status, done.attempts) == (Status.COMPLETED, 2), said
    assert attempts(job) == [(1, "burst", "lease_lost"), (2, "burst", "completed")], said


@NEEDS_NETWORK
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__partition_loses_the_lease_in_time_and_recovers(processes: Processes) -> None:
    """Worker "cut" reaches the database through a proxy that turns into a black hole while it
    runs a job: it must give the lease up by its deadline, write nothing for that job, and run
    new jobs once the path is back, in the same process. Worker "peer" takes the job over."""
    settings: dict[str, Any] = connections["default"].settings_dict
    port = int(settings["PORT"] or default_port(connection))
    # Attempt 1 outlasts the partition and the TTL; the takeover's attempt 2 is quick.
    job = PaymentJob.objects.enqueue("charge", {"durations": [12, 0]})
    args = ("--poll-interval", "0.2", "--ttl", "4", "--heartbeat", "1", "-v", "2")
    with Proxy(port) as proxy:
        cut = processes.manage(
            "run_lease_worker", "--worker-id", "cut", "--kind", "charge", "noop", *args,
            # A slot stays free for new jobs while the partitioned job's handler sleeps on.
            "--concurrency", "2",
            env=subprocess_env(DATABASE_URL=proxied_url(proxy.port)),
        )  # fmt: skip
        wait_for(lambda: PaymentJob.objects.get(pk=job.pk).lease_owner == "cut", timeout=60)
        log = Output(cut)
        log.wait_for_line(f"claimed job_id={job.pk}")
        proxy.blackhole()
        peer = processes.manage(
            "run_lease_worker", "--worker-id", "peer", "--kind", "charge", *args
        )
        log.wait_for_line(f"lease lost job_id={job.pk} token={token_of(job)}")
        log.wait_for(lambda: PaymentJob.objects.get(pk=job.pk).status == Status.COMPLETED)

        proxy.restore()
        after = PaymentJob.objects.enqueue("noop")  # only "cut" runs this kind
        log.wait_for(lambda: PaymentJob.objects.get(pk=after.pk).status == Status.COMPLETED)
        # Its handler wakes at 12 s and must be fenced out, not write.
        log.wait_for_line(f"fenced out job_id={job.pk} token={token_of(job)}")

    assert cut.poll() is None, "the worker recovered without a restart"
    assert PaymentJob.objects.get(pk=after.pk).lease_owner == "cut"
    done = PaymentJob.objects.get(pk=job.pk)
    assert (done.status, done.lease_owner, done.attempts) == (Status.COMPLETED, "peer", 2)
    # Exactly one charge, by the peer: the partitioned worker wrote nothing after its lease.
    assert list(Charge.objects.values_list("job_ref", "token", "owner")) == [
        (job.pk, token_of(job, 2), "peer")
    ]
    assert attempts(job) == [(1, "cut", "lease_lost"), (2, "peer", "completed")]
    # The takeover closed the partitioned attempt; its holder never got to close it itself.
    assert JobAttempt.objects.get(job_ref=job.pk, attempt=1).ended_by == "peer"
    cut.terminate()
    peer.terminate()
    cut.wait(timeout=60)
    out = log.finish()
    assert cut.returncode == 0, out
    assert f"completed job_id={job.pk}" not in out
    assert f"completed job_id={after.pk}" in out, out
