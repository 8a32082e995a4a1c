"""Time of the default error redaction (`redact_database_values()`) against the text's length.

Each case is a database error's text of `--sizes` characters shaped as the adversarial inputs
of the tests: PostgreSQL's quote of a whole refused value, a value of newlines (what the
secondary-field pattern once read quadratically), runs of quotes, of ` near '` (what the greedy
value patterns once searched from every occurrence of), of digits. Each is timed in a child
process of its own, stopped `--timeout` seconds into the redaction (printed as `>T`), so that
a quadratic redaction is reported instead of waited out. `--source DIR` times the
`django_leases` package found in DIR instead of this checkout's (e.g. an earlier release
unpacked with `git archive`), for a before/after comparison.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench import _common as common

SHAPES = {
    "pg quoted value": lambda n: f'invalid input syntax for type integer: "{"4" * n}"',
    "pg quoted newlines": lambda n: f'invalid input syntax for type integer: "4{chr(10) * n}"',
    "newlines and spaces": lambda n: "\n " * (n // 2),
    "single quotes": lambda n: "'" * n,
    "nears": lambda n: " near '" * (n // 7),
    "grouped digits": lambda n: "4111 " * (n // 5),
}

# The child's timer starts once it has imported everything (a loaded machine's start-up is not
# the redaction's); the regex engine checks for signals while it matches, so SIGALRM stops it.
CHILD = """
import signal, sys, time
from django.db import DataError
from bench.redaction import SHAPES
from django_leases.redaction import redact_database_values
text = SHAPES[sys.argv[1]](int(sys.argv[2]))
def stop(signum, frame):
    print("timeout")
    sys.exit(0)
signal.signal(signal.SIGALRM, stop)
signal.setitimer(signal.ITIMER_REAL, float(sys.argv[3]))
start = time.perf_counter()
redact_database_values(DataError(text), text)
print(time.perf_counter() - start)
"""


def time_case(shape: str, size: int, source: str, timeout: float) -> str:
    """Seconds one redaction of `shape` at `size` characters took, or `>timeout`."""
    path = f"{source}:{common.ROOT}"
    env = {"PYTHONPATH": path, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, shape, str(size), str(timeout)],
            cwd=source,  # `-c` puts the working directory first on the path
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout + 300,  # start-up on a loaded machine
            check=True,
        )
    except subprocess.TimeoutExpired:
        return "no start"
    out = done.stdout.strip()
    return f">{timeout:g}" if out == "timeout" else f"{float(out):.4f}"


def main(args: argparse.Namespace) -> None:
    print(f"redaction seconds ({args.source}), by text length")
    print(f"{'shape':<22}" + "".join(f"{size:>12}" for size in args.sizes))
    for shape in SHAPES:
        cells = [time_case(shape, size, args.source, args.timeout) for size in args.sizes]
        print(f"{shape:<22}" + "".join(f"{cell:>12}" for cell in cells), flush=True)


def parse_args() -> argparse.Namespace:
    parser = common.make_parser(__doc__)
    parser.add_argument(
        "--sizes",
        type=common.int_list,
        default=[20_000, 50_000, 1_000_000],
        help="text lengths in characters, comma-separated (default: %(default)r)",
    )
    parser.add_argument(
        "--timeout",
        type=common.positive_float,
        default=60.0,
        help="seconds after which one redaction is stopped (default: %(default)r)",
    )
    parser.add_argument(
        "--source",
        default=str(common.ROOT),
        help="the directory holding the django_leases package to time (default: this one)",
    )
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
