"""One primary failover under running workers, from the first job to the last: the failover
test's and bench/failover.py's run.

Worker processes on the two-host DSN of a `Cluster` (libpq connects to whichever server takes
writes) drain jobs of the "recorded" kind, each of which appends "pk token owner" to a file
outside the database. Once a share of the jobs is done, the primary is SIGKILLed and the
standby promoted at once (a failover manager's part); with `lag`, the primary's WAL sender is
paused that long first, so that an asynchronous standby misses the last commits. The run ends
when every job is completed on the new primary, and reads what happened from the file and from
the new primary's ledger.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from django_leases.status import AttemptOutcome, JobStatus
from tests.pgcluster import Cluster, Server

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "leases"
KIND = "recorded"


@dataclass
class Outcome:
    jobs: int
    acknowledged: int
    """Jobs completed on the primary at the kill: every worker was told so."""
    lost: int
    """Of those, the jobs the new primary did not have as completed when it was promoted."""
    executions: Counter[int]
    """Handler runs per job, as the file recorded them."""
    repeated_tokens: int
    """Runs that had the token of an earlier run of the same job (fencing could not tell them
    apart)."""
    first_completion: float | None
    """Seconds from the kill to the first completion written on the new primary."""
    survivors: list[str]
    """The workers still running at the end (none was restarted)."""
    completed_after: set[str]
    """The workers that completed a job on the new primary."""
    outputs: dict[str, str] = field(default_factory=dict)

    @property
    def run_twice(self) -> int:
        return sum(1 for count in self.executions.values() if count > 1)


def environment(cluster: Cluster) -> dict[str, str]:
    """The environment of a process of the test project on the cluster's two-host DSN."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("LEASES_TEST_DB_NAME", "LEASES_TEST_OTHER_DB_NAME")
    }
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=f"postgres://root@127.0.0.1:{cluster.primary.port}/{DATABASE}",
        LEASES_TEST_DB_HOSTS=cluster.hosts(),
        LEASES_TEST_DB_PORTS=cluster.ports(),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    return env


def completed(server: Server) -> set[int]:
    with server.connect(DATABASE) as conn:
        rows = conn.execute(
            "SELECT id FROM django_leases_paymentjob WHERE status = %s", [JobStatus.COMPLETED.value]
        )
        return {pk for (pk,) in rows}


def wait_for_completed(server: Server, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with server.connect(DATABASE) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM django_leases_paymentjob WHERE status = %s",
                    [JobStatus.COMPLETED.value],
                ).fetchone()
            if row is not None and row[0] >= count:
                return
        except psycopg.OperationalError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} jobs completed within {timeout}s")
        time.sleep(0.05)


def run(
    cluster: Cluster,
    *,
    jobs: int = 1500,
    workers: int = 3,
    concurrency: int = 4,
    seconds: float = 0.005,
    kill_at: float = 0.3,
    lag: float = 0.0,
    ttl: float = 10.0,
    timeout: float = 180.0,
) -> Outcome:
    """Run `jobs` jobs on `workers` worker processes; fail over once `kill_at` of them are done."""
    cluster.create_database(DATABASE)
    env = environment(cluster)
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
    directory = Path(tempfile.mkdtemp(prefix="failover-"))
    log = directory / "executions.log"
    enqueue = (
        "from django_leases.models import PaymentJob; "
        f"PaymentJob.objects.enqueue_many({KIND!r}, [{{'log': {str(log)!r}, "
        f"'seconds': {seconds}}}] * {jobs})"
    )
    subprocess.run([*manage, "shell", "-v", "0", "-c", enqueue], env=env, cwd=ROOT, check=True)
    names = [f"fo-{n}" for n in range(workers)]
    procs: dict[str, subprocess.Popen[str]] = {}
    outputs = {name: directory / f"{name}.out" for name in names}
    try:
        for name in names:
            with outputs[name].open("w") as out:
                procs[name] = subprocess.Popen(
                    [
                        *manage, "run_lease_worker", "--worker-id", name,
                        "--concurrency", str(concurrency), "--ttl", str(ttl),
                        "--heartbeat", str(ttl / 10), "--poll-interval", "0.1",
                    ],
                    env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                    start_new_session=True,
                )  # fmt: skip
        wait_for_completed(cluster.primary, int(jobs * kill_at), timeout)
        if lag:
            cluster.pause_replication()
            time.sleep(lag)
        acknowledged = completed(cluster.primary)
        killed_at = time.time()
        cluster.kill_primary()
        cluster.promote()
        kept = completed(cluster.standby)
        wait_for_completed(cluster.standby, jobs, timeout)
        with cluster.standby.connect(DATABASE) as conn:
            after = conn.execute(
                "SELECT extract(epoch FROM ended_at), owner FROM django_leases_jobattempt "
                "WHERE outcome = %s AND ended_at > to_timestamp(%s) ORDER BY ended_at",
                [AttemptOutcome.COMPLETED.value, killed_at],
            ).fetchall()
        survivors = [name for name, proc in procs.items() if proc.poll() is None]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    runs = [tuple(line.split()) for line in log.read_text().splitlines()]
    outcome = Outcome(
        jobs=jobs,
        acknowledged=len(acknowledged),
        lost=len(acknowledged - kept),
        executions=Counter(int(pk) for pk, _, _ in runs),
        repeated_tokens=sum(count - 1 for count in Counter((pk, t) for pk, t, _ in runs).values()),
        first_completion=float(after[0][0]) - killed_at if after else None,
        survivors=survivors,
        completed_after={owner for _, owner in after},
        outputs={name: path.read_text(errors="replace") for name, path in outputs.items()},
    )
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()
    return outcome
