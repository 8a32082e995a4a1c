"""The owner rules of the worker's shared fields, checked on the package's source.

Each shared mutable field is written by the module of the part that owns it, and (where more
than one thread writes it) only under that part's lock: `SlotPool` for the slots and the jobs
claimed for them, `LeaseWorker` for `_failure`, `Heartbeat` for the leases it reported lost,
`Lease` for its own state. Each part's test module checks its own rules; `test_worker_package`
checks that a rule can fail.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "django_leases"
WORKER = PACKAGE / "worker"
PARTS = tuple(sorted(path.stem for path in WORKER.glob("*.py")))
"""The worker package's modules, `__init__` included."""
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
        "worker.slots",
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
        under_lock=frozenset({"_take_ready", "clear"}),
    ),
    "LeaseWorker._failure": Rule("worker.loop", {"_failure"}, lock="_failure_lock"),
    "Heartbeat._reported_lost": Rule("worker.heartbeat", {"_reported_lost"}, lock="_lock"),
    # A lease's state is written by its own methods (on whichever thread makes the write);
    # `ending` also by the slot thread's attempt, as its handler returns.
    "Lease": Rule("lease", {"finished", "outcome"}),
    "Lease lost": Rule(
        "lease", {"_lost_reason", "_cancelled", "_renewed_until", "_on_cancel"}, lock="_marking"
    ),
    "Lease.ending": Rule("lease", {"ending"}, also=("worker.attempt",)),
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


def check(name: str) -> list[str]:
    """Where the package breaks rule `name`."""
    return violations(RULES[name], package_sources())
