"""The worker's parts and who owns their fields, checked on the package's source.

Each shared mutable field is written by the module of the part that owns it, and (where more
than one thread writes it) only under that part's lock: `SlotPool` for the slots and the jobs
claimed for them, `LeaseWorker` for `_failure`, `Heartbeat` for the leases it reported lost,
`Lease` for its own state.
"""

import ast
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import pytest

from django_leases.completers import ClaimsAhead, Direct, Grouped
from django_leases.lease import Lease
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import LeaseQuerySet
from django_leases.worker import LeaseWorker
from tests.leasing import claim_one, expire

PACKAGE = Path(__file__).resolve().parent.parent / "django_leases"
PARTS = ("worker", "attempts", "heartbeat", "ack_buffer", "group_commit", "lease", "slots",
         "completers", "outcomes", "worker_stats")  # fmt: skip
MUTATORS = {"append", "extend", "appendleft", "popleft", "pop", "remove", "clear", "update",
            "add", "discard", "insert", "setdefault"}  # fmt: skip


class Rule:
    """`fields` are written only in `module`; with a `lock`, only inside `with self.<lock>:`
    (or `__init__`, or a function of `under_lock`, each called only with the lock held)."""

    def __init__(
        self,
        module: str,
        fields: set[str],
        lock: str | None = None,
        under_lock: frozenset[str] = frozenset(),
        also: tuple[str, ...] = (),
    ) -> None:
        self.module, self.fields, self.lock = module, fields, lock
        self.under_lock, self.also = under_lock, also


RULES = {
    "SlotPool": Rule(
        "slots",
        {
            "_slots",
            "_ready",
            "_queued_at",
            "_closing",
            "_abandoned",
            "thread",
            "lease",
            "started",
            "deadline",
        },  # fmt: skip
        lock="_lock",
        under_lock=frozenset({"_take_ready", "_replace_dead_slot", "clear"}),
    ),
    "LeaseWorker._failure": Rule("worker", {"_failure"}, lock="_failure_lock"),
    "Heartbeat._reported_lost": Rule("heartbeat", {"_reported_lost"}, lock="_lock"),
    # A lease's state is written by its own methods (on whichever thread makes the write);
    # `ending` also by the slot thread's attempt, as its handler returns.
    "Lease": Rule("lease", {"finished", "outcome", "_renewed_until"}),
    "Lease lost": Rule("lease", {"_lost_reason", "_cancelled"}, lock="_marking"),
    "Lease.ending": Rule("lease", {"ending"}, also=("attempts",)),
}


def written(node: ast.AST) -> list[tuple[str, ast.Attribute]]:
    """The attributes a statement or expression writes: assigned, deleted, or mutated in place."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target] if node.value is not None or isinstance(node, ast.AugAssign) else []
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MUTATORS
    ):
        targets = [node.func.value]
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        elif isinstance(target, ast.Subscript):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            found.append((target.attr, target))
    return found


def holds(with_node: ast.With, lock: str) -> bool:
    return any(
        isinstance(item.context_expr, ast.Attribute) and item.context_expr.attr == lock
        for item in with_node.items
    )


def violations(rule: Rule, sources: dict[str, str]) -> list[str]:
    """Where `sources` (module name -> source text) break `rule`. Outside the owner's module,
    `self.<field>` is another class's own attribute of that name, and is not the owner's."""
    found: list[str] = []
    for module, source in sources.items():
        walk(rule, module, ast.parse(source), "<module>", False, found)
    return found


def walk(
    rule: Rule, module: str, node: ast.AST, function: str, locked: bool, found: list[str]
) -> None:
    owner = module in (rule.module, *rule.also)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        function, locked = node.name, False
    if isinstance(node, ast.With) and rule.lock and holds(node, rule.lock):
        locked = True
    for field, target in written(node):
        if field not in rule.fields or (not owner and is_self(target)):
            continue
        where = f"{module}:{getattr(node, 'lineno', '?')} {field} in {function}()"
        if not owner:
            found.append(f"{where}: written outside {rule.module}")
        elif rule.lock and not (locked or function in ("__init__", *rule.under_lock)):
            found.append(f"{where}: written without {rule.lock}")
    if (
        owner
        and rule.lock
        and isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in rule.under_lock
        and not (locked or function in rule.under_lock)
    ):
        found.append(f"{module}:{node.lineno} {node.func.attr}() called without the lock")
    for child in ast.iter_child_nodes(node):
        walk(rule, module, child, function, locked, found)


def is_self(target: ast.Attribute) -> bool:
    return isinstance(target.value, ast.Name) and target.value.id == "self"


def package_sources() -> dict[str, str]:
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if "migrations" not in path.parts
    }


@pytest.mark.parametrize("name", RULES)
def test_worker_parts__each_shared_field_is_written_by_its_owner_only(name: str) -> None:
    assert violations(RULES[name], package_sources()) == []


@pytest.mark.parametrize(
    ("name", "module", "source", "why"),
    [
        ("SlotPool", "worker", "def f(self):\n    self._pool._ready.clear()\n", "outside slots"),
        ("SlotPool", "slots", "def f(self, slot):\n    slot.lease = None\n", "without _lock"),
        ("SlotPool", "slots", "def f(self, slot):\n    slot.clear()\n", "without the lock"),
        ("LeaseWorker._failure", "worker", "def f(self):\n    self._failure = 'x'\n", "_lock"),
        ("LeaseWorker._failure", "heartbeat", "def f(w):\n    w._failure = 'x'\n", "outside"),
        (
            "Heartbeat._reported_lost",
            "heartbeat",
            "def f(s):\n    s._reported_lost.add(1)\n",
            "without _lock",
        ),  # fmt: skip
        ("Lease", "outcomes", "def f(lease):\n    lease.finished = True\n", "outside lease"),
    ],
)
def test_worker_parts__the_owner_rules_catch_a_write_elsewhere(
    name: str, module: str, source: str, why: str
) -> None:
    """The check above can fail: each of these writes breaks a rule (and with the lock held,
    where the rule has one, the same write passes)."""
    [problem] = violations(RULES[name], {module: source})
    assert why in problem
    lock = RULES[name].lock
    if lock and module == RULES[name].module:
        body = "".join(f"    {line}\n" for line in source.splitlines()[1:])
        held = f"{source.splitlines()[0]}\n    with self.{lock}:\n{body}"
        assert violations(RULES[name], {module: held}) == []


def test_worker_parts__no_mixins_stubs_or_long_modules() -> None:
    assert LeaseWorker.__mro__ == (LeaseWorker, object)
    for part in PARTS:
        source = (PACKAGE / f"{part}.py").read_text()
        assert "NotImplementedError" not in source, part
        assert len(source.splitlines()) <= 500, part


def test_worker_parts__a_lock_is_read_only_to_keep_its_job_out_of_a_batch() -> None:
    # Every completion of LeaseQuerySet passes a released lock on by itself. The one thing a
    # worker part asks of a job's lock is whether its completion may wait in the ack buffer.
    reads = []
    for part in PARTS:
        tree = ast.parse((PACKAGE / f"{part}.py").read_text())
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
    assert reads == [("completers", "buffered")]


def imports(module: str, names: set[str]) -> set[str]:
    """The package's modules `module` imports (any import, TYPE_CHECKING ones included)."""
    found = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            found |= {name.removeprefix("django_leases.") for name in imported} & names
    return found


def test_worker_parts__import_no_circle() -> None:
    names = set(PARTS)
    graph = {part: imports(part, names) for part in PARTS}
    seen: set[str] = set()

    def visit(part: str, path: tuple[str, ...]) -> None:
        assert part not in path, " -> ".join((*path, part))
        if part not in seen:
            seen.add(part)
            for other in graph[part]:
                visit(other, (*path, part))

    for part in PARTS:
        visit(part, ())


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
def test_worker_parts__the_completer_is_chosen_once_from_the_configuration(
    options: dict[str, object], completer: type
) -> None:
    chosen = LeaseWorker(worker_id="w", ttl=30, heartbeat=5, **options)._attempts.completer  # type: ignore[arg-type]
    assert type(chosen) is completer


@pytest.mark.django_db
@pytest.mark.parametrize(("outcome", "noted_by_worker"), [("completed", 0), ("failed", 1)])
def test_worker_parts__a_refused_outcome_is_noted_fenced_once(
    outcome: str, noted_by_worker: int
) -> None:
    """A completion refused after a takeover is noted in the ledger by the queryset's own
    write; the worker adds no second note. A refused failure (the queryset notes none) the
    worker notes itself."""
    PaymentJob.objects.enqueue("noop")
    zombie = claim_one("w1")
    expire(zombie)
    claim_one("w2")
    outcomes = LeaseWorker(worker_id="w1", ttl=30, heartbeat=5)._outcomes
    lease = Lease(zombie, ttl=30)
    write = lease.complete if outcome == "completed" else partial(lease.fail, "boom")
    notes: list[str] = []
    real = LeaseQuerySet.record_fenced

    def record_fenced(self: LeaseQuerySet, pk: int, token: int) -> None:
        notes.append("worker" if calls_from_outcomes() else "queryset")
        real(self, pk, token)

    with mock.patch.object(LeaseQuerySet, "record_fenced", record_fenced):
        outcomes.record(lease, outcome, write)

    assert notes.count("worker") == noted_by_worker
    assert len(notes) == 1
    assert outcomes.stats.lost == 1
    row = JobAttempt.objects.get(job_ref=zombie.pk, token=zombie.lease_token)
    assert row.fenced_at is not None


def calls_from_outcomes() -> bool:
    """Whether `record_fenced()` was called by `Outcomes` (the worker), not the queryset."""
    return sys._getframe(2).f_code.co_filename.endswith("outcomes.py")
