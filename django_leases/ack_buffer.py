"""`AckBuffer`: completions of `ack="batch"` kinds waiting to be written together.

The worker's slots add to it; its writer thread (`RunsAttempts._ack_loop`) takes due batches.
"""

from __future__ import annotations

import math
import threading
import time

from django_leases.conf import leases_settings, to_seconds
from django_leases.lease import Lease
from django_leases.limits import ACK_BATCH_SIZE


class AckBuffer:
    """Completions of ack="batch" kinds waiting to be written together. Thread-safe.

    A batch is due when it holds `size` leases, when the oldest has waited `interval` seconds,
    or when a buffered lease comes within `margin` seconds of the time it must be taken as lost
    (the heartbeat no longer renews it: its handler is done), and at once after `close()`.
    """

    def __init__(self, *, size: int, interval: float, margin: float) -> None:
        self.size = size
        self.interval = interval
        self.margin = margin
        self._leases: list[Lease] = []
        self._buffered_at: list[float] = []
        self._in_hand = 0
        self._expiry = math.inf
        self._ready = threading.Condition()
        self._closed = False

    @classmethod
    def configured(cls, size: int | None, interval: float | None, *, margin: float) -> AckBuffer:
        """Return a buffer of `size` and `interval`, the ACK_* settings where None."""
        size = size if size is not None else leases_settings.ACK_BATCH_SIZE
        low, high = ACK_BATCH_SIZE
        if not low <= size <= high:
            raise ValueError(f"ack batch size must be from {low} to {high}, got {size}")
        if interval is None:
            interval = leases_settings.ACK_FLUSH_INTERVAL
        return cls(size=size, interval=to_seconds(interval, "ack_flush_interval"), margin=margin)

    def __len__(self) -> int:
        with self._ready:
            return len(self._leases)

    @property
    def pending(self) -> int:
        """Completions buffered or taken and not yet written (`written()`)."""
        with self._ready:
            return len(self._leases) + self._in_hand

    def narrow(self, size: int) -> None:
        """Make batches due at `size` completions if that is fewer."""
        with self._ready:
            self.size = min(self.size, size)

    def add(self, lease: Lease) -> bool:
        """Buffer `lease`'s completion; False once closed (the caller writes it at once)."""
        with self._ready:
            if self._closed:
                return False
            self._leases.append(lease)
            self._buffered_at.append(time.monotonic())
            self._expiry = min(self._expiry, lease.valid_until - self.margin)
            # Wake the writer only when its deadline moved: a first lease, or a batch now due.
            if len(self._leases) == 1 or self._due_in() <= 0:
                self._ready.notify()
            return True

    def take(self) -> list[Lease] | None:
        """Wait for a due batch and return it, oldest first; None once closed and empty."""
        with self._ready:
            while (due := self._due_in()) > 0:
                if self._closed and not self._leases:
                    return None
                self._ready.wait(None if due == math.inf else due)
            batch, self._leases = self._leases[: self.size], self._leases[self.size :]
            del self._buffered_at[: self.size]
            self._in_hand = len(batch)
            self._expiry = min(
                (lease.valid_until - self.margin for lease in self._leases), default=math.inf
            )
            return batch

    def written(self) -> None:
        """Note that the batch last taken is written (or given up: its writer died)."""
        with self._ready:
            self._in_hand = 0

    def close(self) -> None:
        """Make everything buffered due now and refuse more."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _due_in(self) -> float:
        """Seconds until the buffered batch is due (<= 0: now; infinite: nothing buffered)."""
        if not self._leases:
            return math.inf
        if self._closed or len(self._leases) >= self.size:
            return 0.0
        return min(self._buffered_at[0] + self.interval, self._expiry) - time.monotonic()
