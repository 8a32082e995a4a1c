"""A PostgreSQL primary and a streaming standby of its own, built from the installed server's
binaries on free loopback ports: the failover test's and bench/failover.py's cluster.

The standby is built with `pg_basebackup` and replicates synchronously (the primary's commits
wait for it: `synchronous_standby_names`) or asynchronously. `kill_primary()` SIGKILLs the
primary's every process, as a lost host would; `promote()` makes the standby the primary, as a
failover manager would. Clients reach whichever takes writes with libpq's two-host form:
`hosts()`, `ports()` and `target_session_attrs=read-write`. The servers run as `postgres` when
this process is root (PostgreSQL refuses to run as root), from a directory of their own in the
system's temporary directory.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import psycopg

from tests.ports import free_port

STARTUP_TIMEOUT = 60.0


def bindir() -> Path | None:
    """The directory of the newest installed server's postgres, initdb and pg_basebackup (Debian
    keeps them out of PATH), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: len(p))
    if found:
        return Path(found[-1]).parent
    program = shutil.which("postgres")
    return Path(program).parent if program else None


class Server:
    """One postgres process on `port`, over the data directory `data`."""

    def __init__(self, cluster: Cluster, name: str, port: int) -> None:
        self.cluster = cluster
        self.name = name
        self.port = port
        self.data = cluster.directory / name
        self.log = cluster.directory / f"{name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def configure(self, **settings: str) -> None:
        # Read after postgresql.conf; it holds what `pg_basebackup -R` wrote (its primary_conninfo).
        with (self.data / "postgresql.auto.conf").open("a") as conf:
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def start(self) -> None:
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen(
                self.cluster.command("postgres", "-D", str(self.data)),
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text(errors='replace')}")
            try:
                self.connect("postgres").close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} does not answer: {self.logs()}") from None
                time.sleep(0.1)

    def connect(self, dbname: str) -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="root", dbname=dbname, autocommit=True,
            connect_timeout=5,
        )  # fmt: skip

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend: the host is gone."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Cluster:
    """A primary and a standby replicating from it, `synchronous` or not."""

    def __init__(self, *, synchronous: bool) -> None:
        found = bindir()
        assert found is not None, "PostgreSQL's server binaries are not installed"
        self.bin = found
        self.synchronous = synchronous
        self.directory = Path(tempfile.mkdtemp(prefix="pgcluster-"))
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.directory, "postgres", "postgres")
        self.primary = Server(self, "primary", free_port())
        self.standby = Server(self, "standby", free_port())
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def command(self, program: str, *args: str) -> list[str]:
        run = [str(self.bin / program), *args]
        return ["runuser", "-u", "postgres", "--", *run] if self.as_postgres else run

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(self.command(program, *args), check=True, capture_output=True)

    def _build(self) -> None:
        primary, standby = self.primary, self.standby
        self._run("initdb", "-D", str(primary.data), "-U", "root", "--auth=trust", "--no-sync")
        common = {
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.directory}'",
            "max_connections": "100",
            "fsync": "off",  # a killed process loses nothing the OS has; only its memory
            "wal_level": "replica",
            "max_wal_senders": "4",
            "wal_keep_size": "'256MB'",
        }
        primary.configure(port=str(primary.port), **common)
        if self.synchronous:
            primary.configure(synchronous_standby_names="'standby'")
        primary.start()
        self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "root",
            "-D", str(standby.data), "-X", "stream", "--no-sync", "-R",
        )  # fmt: skip
        # The copy holds the primary's settings: its own port, and no sync standby of its own
        # once promoted (its commits would wait for one forever).
        standby.configure(
            port=str(standby.port),
            synchronous_standby_names="''",
            primary_conninfo=(
                f"'host=127.0.0.1 port={primary.port} user=root application_name=standby'"
            ),
        )
        standby.start()
        expected = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with primary.connect("postgres") as conn:
            while (
                conn.execute(
                    "SELECT 1 FROM pg_stat_replication WHERE application_name = 'standby' "
                    "AND state = 'streaming' AND sync_state = %s",
                    [expected],
                ).fetchone()
                is None
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby does not stream: {standby.logs()}")
                time.sleep(0.1)

    def hosts(self) -> str:
        return "127.0.0.1,127.0.0.1"

    def ports(self) -> str:
        return f"{self.primary.port},{self.standby.port}"

    def create_database(self, name: str) -> None:
        with self.primary.connect("postgres") as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def pause_replication(self) -> int:
        """SIGSTOP the primary's WAL sender: the standby falls behind from now (asynchronous
        replication's lag; a synchronous primary's commits would wait). Return its pid."""
        with self.primary.connect("postgres") as conn:
            row = conn.execute(
                "SELECT pid FROM pg_stat_replication WHERE application_name = 'standby'"
            ).fetchone()
        assert row is not None, "no WAL sender"
        os.kill(row[0], signal.SIGSTOP)
        return int(row[0])

    def kill_primary(self) -> None:
        self.primary.kill()

    def promote(self) -> None:
        """Make the standby the primary; return once it takes writes."""
        with self.standby.connect("postgres") as conn:
            conn.execute("SELECT pg_promote(wait => true, wait_seconds => 60)")

    def close(self) -> None:
        for server in (self.standby, self.primary):
            server.kill()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
