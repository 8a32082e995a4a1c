"""A lease holder for the admin race tests: `python -m tests.holder --help`.

It claims one job and prints a JSON line with its pk and fencing token, then renews the lease
every `--heartbeat` seconds for at most `--hold` seconds, stopping early when a heartbeat is
refused. Then it tries to complete the job and prints a JSON line saying whether it did or got
`LeaseLost`.
"""

import argparse
import json
import os
import time

import django


def say(**line: object) -> None:
    print(json.dumps(line), flush=True)  # noqa: T201


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--owner", required=True)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--heartbeat", type=float, default=0.2)
    parser.add_argument("--hold", type=float, default=120.0)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_leases.exceptions import LeaseLost
    from django_leases.models import PaymentJob

    jobs = PaymentJob.objects
    claimed: list[PaymentJob] = []
    deadline = time.monotonic() + 60
    while not claimed and time.monotonic() < deadline:
        claimed = jobs.claim(args.owner, ttl=args.ttl)
        if not claimed:
            time.sleep(0.05)
    if not claimed:
        say(error="nothing to claim")
        raise SystemExit(1)
    job = claimed[0]
    pk, token = job.pk, job.lease_token
    say(claimed=pk, token=token)

    renewed = True
    until = time.monotonic() + args.hold
    while renewed and time.monotonic() < until:
        time.sleep(args.heartbeat)
        renewed = (pk, token) in jobs.heartbeat(args.owner, [(pk, token)], ttl=args.ttl)
    say(heartbeat_refused=not renewed)
    try:
        jobs.complete(pk, args.owner, token)
    except LeaseLost as exc:
        say(lease_lost=str(exc))
    else:
        say(completed=pk)


if __name__ == "__main__":
    main()
