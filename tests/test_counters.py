"""`WorkerStats` (`worker/counters.py`): what every thread of a worker counts, and what it
reports to its `Recorder`."""

import threading
from collections.abc import Callable, Mapping

from django_leases.worker.counters import WorkerStats


class Recorded:
    """A `Recorder` that keeps what it is told."""

    def __init__(self) -> None:
        self.counts: list[tuple[str, str, int]] = []

    def count(self, event: str, kind: str, n: int) -> None:
        self.counts.append((event, kind, n))

    def ran(self, kind: str, seconds: float) -> None:
        raise AssertionError("not reported by add()")

    def waited(self, kind: str, seconds: float) -> None:
        raise AssertionError("not reported by add()")

    def serve_slots(self, busy: Callable[[], Mapping[str, int]], total: int) -> None:
        raise AssertionError("not reported by add()")


def test_worker_stats__counts_from_many_threads_add_up() -> None:
    stats = WorkerStats()
    threads = [
        threading.Thread(target=lambda: [stats.add("completed") for _ in range(2000)])
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert stats.completed == 8000


def test_worker_stats__reports_an_event_with_its_kind_and_sums_up_without_the_lock() -> None:
    recorded = Recorded()
    stats = WorkerStats(recorder=recorded)
    stats.add("claimed", 3, kind="capture")
    stats.add("outages")
    assert recorded.counts == [("claimed", "capture", 3)]
    assert stats.summary().startswith("claimed=3 completed=0 ")
    assert "outages" not in stats.summary() and "lock" not in stats.summary()
