"""A primary failover under running workers: a primary and a synchronous standby built from the
installed PostgreSQL (tests/pgcluster.py), the primary SIGKILLed mid-run, the standby promoted.

Opt-in (LEASES_TEST_FAILOVER=1; .ci/run sets it): it builds two servers and runs ~1,500 jobs.
bench/failover.py measures the same run, with asynchronous replication too.
"""

import os

import pytest

from .conftest import ON_SQLITE

pytest.importorskip("psycopg", reason="the cluster is PostgreSQL: psycopg is not installed")

from tests import failover  # noqa: E402
from tests.pgcluster import Cluster, bindir  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        ON_SQLITE or not os.environ.get("DATABASE_URL", "").startswith("postgres"),
        reason="a failover is between PostgreSQL servers",
    ),
    pytest.mark.skipif(
        not os.environ.get("LEASES_TEST_FAILOVER"),
        reason="builds a primary and a standby: set LEASES_TEST_FAILOVER=1 (CI does)",
    ),
    pytest.mark.skipif(bindir() is None, reason="PostgreSQL's server binaries are not installed"),
]


# Serial: three workers and two servers beside other test processes would time the failover
# on a machine too busy to tell anything.
@pytest.mark.serial
@pytest.mark.concurrency
def test_failover__to_a_synchronous_standby_loses_nothing_and_runs_nothing_twice() -> None:
    with Cluster(synchronous=True) as cluster:
        outcome = failover.run(cluster, jobs=1500, workers=3, kill_at=0.3)
    said = "\n".join(f"== {name}\n{text}" for name, text in outcome.outputs.items())

    # The primary died mid-run: some jobs were done, most were not.
    assert 0 < outcome.acknowledged < outcome.jobs, said
    # Every completion a worker was told of is on the new primary...
    assert outcome.lost == 0, said
    # ...and every job ran once, each run under a token of its own.
    assert len(outcome.executions) == outcome.jobs, said
    assert outcome.run_twice == 0, said
    assert outcome.repeated_tokens == 0, said
    # No worker was restarted: each one carried on against the promoted standby.
    assert outcome.survivors == ["fo-0", "fo-1", "fo-2"], said
    assert outcome.completed_after == {"fo-0", "fo-1", "fo-2"}, said
    assert outcome.first_completion is not None, said
