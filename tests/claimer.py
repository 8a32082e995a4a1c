"""A claiming process for the race tests: `python -m tests.claimer --help`.

It claims (or claim_job()s) until nothing is left, completes what it won, and prints one JSON
line: the pks it won and the largest batch a claim returned.
"""

import argparse
import json
import os
import time

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--owner", required=True)
    parser.add_argument("--limit", type=int, default=1)
    parser.add_argument("--kinds", default="", help="comma-separated kinds to claim (all)")
    parser.add_argument("--mode", choices=["claim", "claim_job"], default="claim")
    parser.add_argument("--start-at", type=float, default=0.0, help="epoch seconds to start at")
    parser.add_argument(
        "--step", type=float, default=0.004, help="claim_job: seconds between two jobs' races"
    )
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_leases.models import PaymentJob

    jobs = PaymentJob.objects
    ids = list(jobs.order_by("pk").values_list("pk", flat=True)) if args.mode == "claim_job" else []
    time.sleep(max(0.0, args.start_at - time.time()))
    won: list[int] = []
    largest = 0
    if args.mode == "claim":
        idle = 0
        while idle < 3:
            kinds = args.kinds.split(",") if args.kinds else None
            batch = jobs.claim(args.owner, ttl=300, limit=args.limit, kinds=kinds)
            largest = max(largest, len(batch))
            idle = 0 if batch else idle + 1
            for job in batch:
                jobs.complete(job.pk, args.owner, job.lease_token)
                won.append(job.pk)
    else:
        # Every process reaches job i at start + i * step by the wall clock, so each job is a
        # race, not just the first one.
        for i, pk in enumerate(ids):
            time.sleep(max(0.0, args.start_at + i * args.step - time.time()))
            job = jobs.claim_job(pk, args.owner, ttl=300)
            if job is not None:
                won.append(job.pk)
    summary = {"owner": args.owner, "won": won, "tried": len(ids), "largest_batch": largest}
    print(json.dumps(summary))  # noqa: T201


if __name__ == "__main__":
    main()
