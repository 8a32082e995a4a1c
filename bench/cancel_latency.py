"""How long a running handler takes to learn that an operator cancelled its job.

Per sample, on a throw-away database: one job is enqueued whose handler either loops on
`lease.check()` every 10 ms (`bench_cancel_sync`) or awaits for an hour (`bench_cancel_async`),
and one worker with the case's heartbeat claims it. Once its ledger row is open and a random 0 to
HEARTBEAT seconds have passed (so the cancel falls anywhere between two heartbeats), a child
calls `cancel()` on the job and notes the time its transaction committed; the handler notes the
time `lease.check()` raised `Cancelled` (or its coroutine was cancelled). Both are wall-clock
times of this one host. The bound the docs give: one heartbeat interval.

Each --case is KIND/HEARTBEAT/SAMPLES, KIND "sync" or "async"; the worker's TTL is --ttl (at
least 3 x HEARTBEAT).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _common as common


@dataclass(frozen=True)
class Case:
    kind: str
    heartbeat: float
    samples: int

    def label(self) -> str:
        return f"{self.kind}/{self.heartbeat:g}/{self.samples}"


def case(text: str) -> Case:
    try:
        kind, heartbeat, samples = text.split("/")
        result = Case(kind, float(heartbeat), int(samples))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected KIND/HEARTBEAT/SAMPLES (e.g. sync/0.5/5), got {text!r}"
        ) from None
    if result.kind not in ("sync", "async") or result.heartbeat <= 0 or result.samples < 1:
        raise argparse.ArgumentTypeError(f"need sync|async, HEARTBEAT > 0, SAMPLES >= 1: {text!r}")
    return result


DEFAULT_CASES = [case(text) for text in ("sync/0.5/5", "async/0.5/5", "sync/2/3", "async/2/3")]


# ---- Django side -------------------------------------------------------------------------------


def fresh_job(kind: str, path: str) -> dict[str, Any]:
    """Empty the event, ledger, job and worker tables; enqueue one job of `kind`."""
    from django_leases.models import JobEvent, PaymentJob

    # Rows that point to a job first: SQLite deletes table by table, its foreign keys checked.
    events = JobEvent._meta.db_table
    common.empty_tables(events, common.LEDGER_TABLE, common.JOB_TABLE, common.WORKER_TABLE)
    return {"id": PaymentJob.objects.enqueue(kind, {"path": path}).pk}


def cancel_job(id: int) -> dict[str, Any]:  # noqa: A002 - the job's id, as the caller names it
    """Cancel the job; return how many changed and the time the cancel committed."""
    from django_leases.models import PaymentJob

    changed = PaymentJob.objects.filter(pk=id).cancel(by="bench")
    return {"changed": changed, "at": time.time()}


# ---- orchestration ---------------------------------------------------------------------------


def sample(
    args: argparse.Namespace, procs: common.Processes, db: common.BenchDB, case: Case, n: int
) -> float:
    path = Path(tempfile.mkdtemp(prefix="bench_cancel_")) / "learned"
    kind = f"bench_cancel_{case.kind}"
    job = procs.call(db, "bench.cancel_latency:fresh_job", kind=kind, path=str(path))["id"]
    argv = common.django_command(
        "run_lease_worker",
        f"--kind={kind}",
        "--concurrency=1",
        "--poll-interval=0.1",
        f"--worker-id=bench-cancel-{n}",
        f"--ttl={max(args.ttl, case.heartbeat * 3):g}",
        f"--heartbeat={case.heartbeat:g}",
    )
    worker = procs.spawn(argv, common.child_env(db), "worker", pipes=False)
    conn = db.connect()
    try:
        common.wait_for_claim(db, conn, job, timeout=args.timeout, what="the claim", watch=[worker])
        time.sleep(random.uniform(0, case.heartbeat))  # noqa: S311
        done = procs.call(db, "bench.cancel_latency:cancel_job", id=job)
        if done["changed"] != 1:
            raise common.ChildError("the cancel changed no job", worker)
        deadline = time.monotonic() + args.timeout
        while not path.exists() or not path.read_text():
            if time.monotonic() > deadline or worker.poll() is not None:
                raise common.ChildError("the handler never learned of the cancel", worker)
            time.sleep(0.01)
        return float(path.read_text()) - done["at"]
    finally:
        conn.close()
        procs.stop(worker)


def measure(args: argparse.Namespace, procs: common.Processes, db: common.BenchDB) -> list[list]:
    common.note(f"migrating {db.name} ...")
    procs.call(db, "bench._common:migrate")
    rows = []
    for c in args.cases:
        learned = []
        for n in range(c.samples):
            learned.append(sample(args, procs, db, c, n))
            common.note(f"{db.vendor} {c.label()} sample {n + 1}: {learned[-1]:.3f}s")
        rows.append(
            [
                db.vendor,
                c.kind,
                f"{c.heartbeat:g}",
                len(learned),
                common.median_range(learned),
                f"{max(learned) / c.heartbeat:.2f}",
            ]
        )
    return rows


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    skipped: dict[str, str] = {}
    rows = common.each_database(args, "cancel", lambda db: measure(args, procs, db), skipped)
    common.print_table(
        "seconds from the cancel's commit to the handler learning it (lease.check() raising "
        "Cancelled, or its coroutine cancelled)",
        ["database", "handler", "heartbeat s", "samples", "learned after s", "max / heartbeat"],
        rows,
    )
    print("\nmedian (min-max) over the samples; the bound is one heartbeat (max / heartbeat <= 1).")
    common.print_skipped(skipped)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_case_argument(parser, case, "KIND/HEARTBEAT/SAMPLES", DEFAULT_CASES)
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=60.0)
    args = parser.parse_args(argv)
    args.cases = args.cases or DEFAULT_CASES
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
