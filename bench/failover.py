"""A primary failover under running workers, with synchronous and asynchronous replication.

Per sample: a primary and a standby built from the installed PostgreSQL on loopback ports
(tests/pgcluster.py), three workers (`--concurrency 4`, TTL 10 s) on the two-host DSN with
`target_session_attrs=read-write`, --jobs "recorded" jobs (default 3,000) of 5 ms, each of
which appends its run to a file outside the database. At 30 % done the primary is SIGKILLed
and the standby promoted at once; asynchronous samples first pause the primary's WAL sender
for --lag seconds (the standby falls that far behind). The run is tests/failover.py's, which
the failover test asserts on for the synchronous case.

Reported per sample:
- "kill->first completion": seconds from the SIGKILL to the first completion written on the
  promoted standby (promotion itself is instant here: a failover manager adds its own delay);
- "acked": jobs completed on the primary at the kill; "lost": those the new primary did not
  have (each runs again: at-least-once);
- "run twice": jobs whose handler ran twice; "tokens repeated": runs under a token an earlier
  run of the same job had (0 is the fencing rule: tokens never recur, even when the database
  forgets commits);
- "workers": how many of the three carried on (none is restarted).

    PYTHONPATH=. python bench/failover.py [--samples 2] [--lag 1 --lag 3] [--jobs 3000]
"""

from __future__ import annotations

import argparse
import sys

from tests import failover
from tests.pgcluster import Cluster, bindir


def sample(synchronous: bool, lag: float, jobs: int) -> str:
    with Cluster(synchronous=synchronous) as cluster:
        outcome = failover.run(cluster, jobs=jobs, lag=lag)
    first = outcome.first_completion
    return (
        f"{'sync' if synchronous else 'async':5} {lag:4.1f} s  "
        f"{'-' if first is None else f'{first:6.2f} s':>9}  {outcome.acknowledged:5}  "
        f"{outcome.lost:5}  {outcome.run_twice:9}  {outcome.repeated_tokens:15}  "
        f"{len(outcome.survivors)}/3"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2, help="per case (default: %(default)r)")
    parser.add_argument(
        "--lag",
        type=float,
        action="append",
        help="seconds the WAL sender is paused before an asynchronous kill (default: 1 and 3)",
    )
    parser.add_argument("--jobs", type=int, default=3000, help="per sample (default: %(default)r)")
    args = parser.parse_args(argv)
    if bindir() is None:
        parser.error("PostgreSQL's server binaries are not installed")
    if args.samples < 1 or args.jobs < 10:
        parser.error("--samples must be at least 1 and --jobs at least 10")
    lags = args.lag or [1.0, 3.0]
    if any(lag <= 0 for lag in lags):
        parser.error("--lag must be a positive number of seconds")
    print("repl   lag   kill->1st  acked   lost  run twice  tokens repeated  workers", flush=True)
    for synchronous, lag in [(True, 0.0), *((False, lag) for lag in lags)]:
        for _ in range(args.samples):
            print(sample(synchronous, lag, args.jobs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
