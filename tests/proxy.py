"""A TCP forwarder on 127.0.0.1 that can turn into a black hole: a silent network partition.

`blackhole()` stops forwarding while every socket stays open: bytes from either side are read
and dropped, nothing is refused or reset, so the client waits for answers that never come — as
behind a dead router or a proxy that lost its upstream. `restore()` forwards again; new
connections work at once, and a connection whose request was dropped stays silent until its
client gives up on it.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType


class Proxy:
    """Forward 127.0.0.1:<port> (chosen by the system) to `target_port` on 127.0.0.1."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._server.getsockname()[1]
        self._blackholed = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self.dropped = 0
        """Bytes read and thrown away while blackholed."""
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    def blackhole(self) -> None:
        self._blackholed.set()

    def restore(self) -> None:
        self._blackholed.clear()

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept_loop(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # While blackholed, a new connection is accepted (the kernel would anyway) and
            # then hears nothing: its upstream is opened only once the path is back.
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ)
        with self._lock:
            self._sockets.add(client)
        try:
            while not self._stop.is_set():
                if upstream is None and not self._blackholed.is_set():
                    upstream = socket.create_connection(self.target, timeout=5)
                    upstream.settimeout(None)
                    selector.register(upstream, selectors.EVENT_READ)
                    with self._lock:
                        self._sockets.add(upstream)
                for key, _ in selector.select(timeout=0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    data = sock.recv(65536)
                    if not data:
                        return
                    if self._blackholed.is_set():
                        self.dropped += len(data)
                        continue
                    other = upstream if sock is client else client
                    if other is None:
                        self.dropped += len(data)
                        continue
                    other.sendall(data)
        except OSError:
            return
        finally:
            selector.close()
            with self._lock:
                for sock in (client, upstream):
                    if sock is not None:
                        self._sockets.discard(sock)
                        sock.close()
