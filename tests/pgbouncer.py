"""A real PgBouncer in front of the test database's PostgreSQL server, on a free loopback port.

Its configuration is PgBouncer's default but for what a test needs to reach it: where it
listens, the server it forwards every database to, trust logins of the test's user, its pool
mode and pool size, and files in a directory of its own. In particular it refuses the startup
parameter `options`, as the stock configuration does (`ignore_startup_parameters` is left
empty). PgBouncer refuses to run as root: it is then run as `nobody`, from a directory of its own in
the system's temporary directory (pytest's are private to their user).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import unquote, urlsplit

EXECUTABLE = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")
"""The pgbouncer program (Debian installs it in /usr/sbin), or None when it is not installed."""

STARTUP_TIMEOUT = 30.0


def version() -> str:
    """Return the installed PgBouncer's version line ("PgBouncer 1.18.0")."""
    assert EXECUTABLE is not None
    out = subprocess.run([EXECUTABLE, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0]


class PgBouncer:
    """A PgBouncer process forwarding every database to the server of `database_url`."""

    def __init__(self, database_url: str, *, pool_mode: str, pool_size: int, port: int) -> None:
        assert EXECUTABLE is not None
        self.pool_mode = pool_mode
        self.port = port
        self.directory = directory = Path(tempfile.mkdtemp(prefix=f"pgbouncer-{pool_mode}-"))
        url = urlsplit(database_url)
        self.user = unquote(url.username or "")
        server = f"host={url.hostname or '127.0.0.1'} port={url.port or 5432}"
        if url.password:
            server += f" password={unquote(url.password)}"
        self.log = directory / "pgbouncer.log"
        config = directory / "pgbouncer.ini"
        users = directory / "userlist.txt"
        config.write_text(
            "[databases]\n"
            f"* = {server}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {pool_mode}\n"
            f"default_pool_size = {pool_size}\n"
            f"logfile = {self.log}\n"
            f"pidfile = {directory / 'pgbouncer.pid'}\n"
        )
        users.write_text(f'"{self.user}" ""\n')
        command = [EXECUTABLE, str(config)]
        if os.geteuid() == 0:
            directory.chmod(0o777)  # its log and pid files, written as nobody
            for path in (config, users):
                path.chmod(0o644)
            command[1:1] = ["-u", "nobody"]
        with (directory / "pgbouncer.out").open("w") as out:
            self._proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_until_listening()

    def _wait_until_listening(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self._proc.returncode}: {self.logs()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"pgbouncer is not listening: {self.logs()}") from None
                time.sleep(0.05)

    def logs(self) -> str:
        """Return what PgBouncer logged so far, and wrote before it could open its log."""
        files = (self.directory / "pgbouncer.out", self.log)
        return "".join(path.read_text(errors="replace") for path in files if path.exists())

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
