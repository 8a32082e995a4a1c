"""An enqueueing process for the lock race tests: `python -m tests.enqueuer --help`.

It waits for `--start-at`, enqueues `--jobs` "locked_step" jobs round-robin over `--locks`, one
after the other, and prints one JSON line: the pks it enqueued, in its enqueue order.
"""

import argparse
import json
import os
import time

import django


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, required=True)
    parser.add_argument("--locks", nargs="+", required=True)
    parser.add_argument("--seconds", type=float, default=0.05, help="each job's handler time")
    parser.add_argument("--start-at", type=float, default=0.0, help="epoch seconds to start at")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_leases.models import PaymentJob

    time.sleep(max(0.0, args.start_at - time.time()))
    pks = [
        PaymentJob.objects.enqueue(
            "locked_step", {"seconds": args.seconds}, lock=args.locks[i % len(args.locks)]
        ).pk
        for i in range(args.jobs)
    ]
    print(json.dumps({"pks": pks}))  # noqa: T201 - the test reads this line


if __name__ == "__main__":
    main()
