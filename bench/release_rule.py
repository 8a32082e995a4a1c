"""The release rule, measured on real workers: how long two jobs of one lock run at once after a
cancel or a time-out of the first, and how many handlers of a limited kind run at once.

    DATABASE_URL=postgres://.../db python -m bench.release_rule [--runs N]

DATABASE_URL names a database of yours (default: a SQLite file in a temporary directory); the
script migrates it with the test settings (their `spanned` handlers record each run's start and
end by the database clock) and leaves its rows there. Scenarios, each `--runs` times:

- lock-cancel-polls: the lock's first job polls `lease.check()` every 10 ms and returns at once
  when told; it is cancelled while it runs. Overlap: the second job's start minus the first's end.
- lock-cancel-ignores: the same, its handler ignores the stop for 1.5 s.
- lock-time-out: the first job runs 2.5 s past its kind's 1 s timeout, on its last attempt.
- limit-time-outs / limit-cancel: most handlers at once of a kind with limit=2 whose handlers run
  past their timeout, or one of which is cancelled while a third job waits.

Unlike the other scripts this one sets Django up in its own process: it only enqueues, cancels
and reads, and the worker runs as `manage.py run_lease_worker` beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench._common import ROOT, in_this_process

WORKER = ("--ttl", "5", "--heartbeat", "0.5", "--poll-interval", "0.05", "--concurrency", "4")


def wait(predicate: Callable[[], object], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {predicate}")
        time.sleep(0.05)


def most_at_once(spans: list[tuple[Any, Any]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    in_this_process(lambda: measure(args.runs))


def measure(runs: int) -> None:
    from django_leases.models import PaymentJob
    from tests.testapp.models import LockRun
    from tests.throttled import SPANNED, SPANNED_UNTIMED

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.throttled", "--worker-id", "bench", *WORKER]
    worker = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        for name, scenario in SCENARIOS.items():
            results = [scenario(PaymentJob, LockRun, SPANNED, SPANNED_UNTIMED) for _ in range(runs)]
            print(f"{name:22} {' '.join(results)}", flush=True)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def runs_of(run_model: Any, jobs: list[Any], count: int) -> list[tuple[Any, Any]]:
    pks = [job.pk for job in jobs]
    ended = run_model.objects.filter(job_ref__in=pks, finished_at__isnull=False)
    wait(lambda: ended.count() >= count)
    return list(ended.order_by("started_at").values_list("started_at", "finished_at"))


def lock_cancel(payload: dict[str, Any]) -> Callable[..., str]:
    def scenario(job_model: Any, run_model: Any, timed: str, untimed: str) -> str:
        lock = f"bench:{time.monotonic_ns()}"
        first = job_model.objects.enqueue(untimed, payload, lock=lock)
        second = job_model.objects.enqueue(untimed, {"seconds": 0}, lock=lock)
        wait(lambda: run_model.objects.filter(job_ref=first.pk).exists())
        job_model.objects.filter(pk=first.pk).cancel(by="bench")
        (_, first_end), (second_start, _) = runs_of(run_model, [first, second], 2)
        return overlap(first_end, second_start)

    return scenario


def lock_time_out(job_model: Any, run_model: Any, timed: str, untimed: str) -> str:
    lock = f"bench:{time.monotonic_ns()}"
    first = job_model.objects.enqueue(timed, {"seconds": 2.5}, lock=lock, max_attempts=1)
    second = job_model.objects.enqueue(timed, {"seconds": 0}, lock=lock)
    (_, first_end), (second_start, _) = runs_of(run_model, [first, second], 2)
    return overlap(first_end, second_start)


def overlap(first_end: Any, second_start: Any) -> str:
    return f"{max(0.0, (first_end - second_start).total_seconds()):.2f}s"


def limit_time_outs(job_model: Any, run_model: Any, timed: str, untimed: str) -> str:
    jobs = [
        job_model.objects.enqueue(timed, {"durations": [2.5, 0]}, max_attempts=2) for _ in range(4)
    ]
    return f"{most_at_once(runs_of(run_model, jobs, 8))}"


def limit_cancel(job_model: Any, run_model: Any, timed: str, untimed: str) -> str:
    running = [job_model.objects.enqueue(untimed, {"seconds": 2}) for _ in range(2)]
    wait(lambda: run_model.objects.filter(job_ref__in=[job.pk for job in running]).count() == 2)
    later = job_model.objects.enqueue(untimed, {"seconds": 0})
    job_model.objects.filter(pk=running[0].pk).cancel(by="bench")
    return f"{most_at_once(runs_of(run_model, [*running, later], 3))}"


SCENARIOS: dict[str, Callable[..., str]] = {
    "lock-cancel-polls": lock_cancel({"seconds": 60, "polls": True}),
    "lock-cancel-ignores": lock_cancel({"seconds": 1.5}),
    "lock-time-out": lock_time_out,
    "limit-time-outs": limit_time_outs,
    "limit-cancel": limit_cancel,
}


if __name__ == "__main__":
    main()
