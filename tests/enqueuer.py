"""An enqueueing process for the lock race tests: `python -m tests.enqueuer --help`.

It waits for `--start-at`, enqueues `--jobs` "locked_step" jobs round-robin over `--locks`, one
after the other (or `enqueue_many()` batches of `--many` jobs of one lock; with `--keys` job i of
lock L has the idempotency key "L-i"), and prints one JSON line: the pks it enqueued, in its
enqueue order.
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
    parser.add_argument("--many", type=int, default=0, help="enqueue_many() batches of this size")
    parser.add_argument("--keys", action="store_true", help="give job i of lock L the key L-i")
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django_leases.models import PaymentJob

    time.sleep(max(0.0, args.start_at - time.time()))
    payload = {"seconds": args.seconds}
    pks = []
    if args.many:
        for first in range(0, args.jobs, args.many):
            lock = args.locks[first // args.many % len(args.locks)]
            keys = [f"{lock}-{i}" if args.keys else None for i in range(first, first + args.many)]
            jobs = PaymentJob.objects.enqueue_many(
                "locked_step", [payload] * len(keys), lock=lock, idempotency_keys=keys
            )
            pks += [job.pk for job in jobs]
    else:
        for i in range(args.jobs):
            lock = args.locks[i % len(args.locks)]
            key = f"{lock}-{i}" if args.keys else None
            pks.append(
                PaymentJob.objects.enqueue(
                    "locked_step", payload, lock=lock, idempotency_key=key
                ).pk
            )
    print(json.dumps({"pks": pks}))  # noqa: T201 - the test reads this line


if __name__ == "__main__":
    main()
