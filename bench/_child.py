"""Run `module:function` with JSON keyword arguments in a Django process; print its result.

Usage (by the benchmark scripts): python -m bench._child bench.module:function '{"n": 1}'
"""

import json
import sys
from importlib import import_module

import django

from bench._common import RESULT_PREFIX


def main(target: str, kwargs: str) -> None:
    django.setup()
    module, function = target.split(":")
    result = getattr(import_module(module), function)(**json.loads(kwargs))
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
