"""After the handler returns (`worker/completion.py`): the completer a worker chooses, and the
one thing it asks of a job's lock. The group write is `test_group_commit.py`'s, the batched
acks `test_batch_acks.py`'s."""

import ast

import pytest

from django_leases.worker import LeaseWorker
from django_leases.worker.completion import ClaimsAhead, Direct, Grouped

from .owner_rules import PARTS, WORKER


@pytest.mark.parametrize(
    ("options", "completer"),
    [
        ({"max_jobs": 5}, Direct),
        ({}, Grouped),
        ({"kinds": ["noop_batch"]}, ClaimsAhead),
        ({"kinds": ["noop_batch"], "max_jobs": 5}, Direct),
        ({"kinds": ["noop_batch", "noop"]}, Grouped),
    ],
)
def test_completion__the_completer_is_chosen_once_from_the_configuration(
    options: dict[str, object], completer: type
) -> None:
    chosen = LeaseWorker(worker_id="w", ttl=30, heartbeat=5, **options)._attempts.completer  # type: ignore[arg-type]
    assert type(chosen) is completer


def test_completion__a_lock_is_read_only_to_keep_its_job_out_of_a_batch() -> None:
    # Every completion of LeaseQuerySet passes a released lock on by itself. The one thing a
    # worker part asks of a job's lock is whether its completion may wait in the ack buffer.
    reads = []
    for part in PARTS:
        tree = ast.parse((WORKER / f"{part}.py").read_text())
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                reads += [
                    (part, function.name)
                    for node in ast.walk(function)
                    if isinstance(node, ast.Attribute)
                    and node.attr == "lock"
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "job"
                ]
    assert reads == [("completion", "buffered")]
