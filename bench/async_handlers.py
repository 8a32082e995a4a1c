"""Throughput of `async def` handlers against plain ones, at the same concurrency.

Per round, on a throw-away database: seed `--jobs` pending jobs of one kind, start `--workers`
`run_lease_worker --burst --kind K --concurrency C` processes, and time from their start until
the last one exits (process start-up included, as an operator sees it). Kinds, each its own
round, interleaved:

- `io_sync` / `io_async`: the handler waits `--io` seconds on I/O (a PSP or webhook call):
  `time.sleep` on the slot thread, or `await asyncio.sleep` on the slot's event loop;
- `noop` / `noop_async`: no work at all, so the difference is what running a coroutine costs
  (an event loop per job, through asgiref's `async_to_sync`, on top of the slot thread).

Prints jobs/s per kind (median of the rounds, spread) and the async/sync ratio per pair.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import _common as common

PAIRS = (("io_sync", "io_async"), ("noop", "noop_async"))


def seed(count: int, kind: str, seconds: float) -> dict[str, int]:
    """Add `count` pending jobs of `kind` whose payload says how long to wait."""
    from django_leases.models import PaymentJob

    common.empty_tables("django_leases_jobattempt", "django_leases_paymentjob")
    PaymentJob.objects.bulk_create(
        (PaymentJob(kind=kind, payload={"seconds": seconds}) for _ in range(count)),
        batch_size=2000,
    )
    common.analyze("django_leases_paymentjob")
    return {"seeded": count}


def finished(kind: str) -> dict[str, int]:
    from django_leases.models import PaymentJob

    return {"completed": PaymentJob.objects.filter(kind=kind, status="completed").count()}


def one_round(
    procs: common.Processes, db: common.BenchDB, args: argparse.Namespace, kind: str
) -> float:
    seconds = args.io if kind.startswith("io_") else 0.0
    procs.call(db, "bench.async_handlers:seed", count=args.jobs, kind=kind, seconds=seconds)
    argv = common.django_command(
        "run_lease_worker",
        "--burst",
        "--kind",
        kind,
        "--concurrency",
        str(args.concurrency),
        "--poll-interval",
        "0.05",
        "-v",
        "0",
    )
    started = time.monotonic()
    workers = [
        procs.spawn(argv, common.child_env(db), f"{kind}-{n}", pipes=False)
        for n in range(args.workers)
    ]
    for worker in workers:
        worker.wait(timeout=args.timeout)
    elapsed = time.monotonic() - started
    for worker in workers:
        if worker.returncode != 0:
            raise common.ChildError(f"worker of {kind} exited {worker.returncode}", worker)
        procs.stop(worker)
    done = procs.call(db, "bench.async_handlers:finished", kind=kind)["completed"]
    if done != args.jobs:
        raise RuntimeError(f"{kind}: {done} of {args.jobs} jobs completed")
    return args.jobs / elapsed


def body(args: argparse.Namespace, procs: common.Processes) -> None:
    url = common.server_urls(args)[args.database]
    with common.temp_database(args.database, url, "async") as db:
        procs.call(db, "bench._common:migrate")
        rates: dict[str, list[float]] = {kind: [] for pair in PAIRS for kind in pair}
        kinds = [kind for pair in PAIRS for kind in pair]
        for number in range(args.rounds):
            # Rotate the order each round, so no kind always runs on a warm (or cold) machine.
            order = kinds[number % len(kinds) :] + kinds[: number % len(kinds)]
            for kind in order:
                rate = one_round(procs, db, args, kind)
                rates[kind].append(rate)
                common.note(f"round {number + 1} {kind}: {rate:.1f} jobs/s")
    rows = []
    for sync, asynchronous in PAIRS:
        for kind in (sync, asynchronous):
            median = statistics.median(rates[kind])
            rows.append([kind, f"{median:,.1f}", common.spread(rates[kind])])
        ratio = statistics.median(rates[asynchronous]) / statistics.median(rates[sync])
        rows.append([f"{asynchronous} / {sync}", f"{ratio:.2f}x", ""])
    title = (
        f"{args.jobs} jobs per round, {args.workers} worker(s) x --concurrency "
        f"{args.concurrency}, I/O wait {args.io:g}s, {args.database}, {args.rounds} rounds"
    )
    common.print_table(title, ["kind", "jobs/s (median)", "spread"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    parser.add_argument("--jobs", type=common.positive_int, default=400)
    parser.add_argument("--workers", type=common.positive_int, default=1)
    parser.add_argument("--concurrency", type=common.positive_int, default=8)
    parser.add_argument(
        "--io", type=common.positive_float, default=0.05, help="seconds of I/O per job"
    )
    parser.add_argument("--rounds", type=common.positive_int, default=3)
    parser.add_argument(
        "--database", choices=common.VENDORS, default="postgresql", help="default: %(default)s"
    )
    common.add_common_arguments(parser, databases=None, timeout=600.0)
    args = parser.parse_args(argv)
    return common.run_main(body, args)


if __name__ == "__main__":
    sys.exit(main())
