"""The worker package as a whole: its modules, their imports, and the owner rules' own check.

Each part's own rules are checked by its test module (`test_slots`, `test_loop`,
`test_heartbeat`, `test_lease`); here, that a rule can fail at all, that no part hides behind
a mixin or a stub, and that the kind registry sits below everything that runs handlers.
"""

import ast

import pytest

from django_leases.worker import LeaseWorker

from .owner_rules import PACKAGE, PARTS, RULES, WORKER, violations


@pytest.mark.parametrize(
    ("name", "module", "source", "why"),
    [
        (
            "SlotPool",
            "worker.loop",
            "def f(self):\n    self._pool._ready.clear()\n",
            "outside worker.slots",
        ),  # fmt: skip
        (
            "SlotPool",
            "worker.slots",
            "def f(self, slot):\n    slot.lease = None\n",
            "without _lock",
        ),
        ("SlotPool", "worker.slots", "def f(self, slot):\n    slot.clear()\n", "without the lock"),
        (
            "LeaseWorker._failure",
            "worker.loop",
            "def f(self):\n    self._failure = 'x'\n",
            "_lock",
        ),  # fmt: skip
        (
            "LeaseWorker._failure",
            "worker.heartbeat",
            "def f(w):\n    w._failure = 'x'\n",
            "outside",
        ),
        (
            "Heartbeat._reported_lost",
            "worker.heartbeat",
            "def f(s):\n    s._reported_lost.add(1)\n",
            "without _lock",
        ),  # fmt: skip
        ("Lease", "worker.outcomes", "def f(lease):\n    lease.finished = True\n", "outside lease"),
        (
            "Lease lost",
            "lease",
            "def f(self):\n    self._renewed_until = 1.0\n",
            "without _marking",
        ),  # fmt: skip
    ],
)
def test_worker_package__the_owner_rules_catch_a_write_elsewhere(
    name: str, module: str, source: str, why: str
) -> None:
    """The rules can fail: each of these writes breaks one (and with the lock held, where the
    rule has one, the same write passes)."""
    [problem] = violations(RULES[name], {module: source})
    assert why in problem
    lock = RULES[name].lock
    if lock and module == RULES[name].module:
        body = "".join(f"    {line}\n" for line in source.splitlines()[1:])
        held = f"{source.splitlines()[0]}\n    with self.{lock}:\n{body}"
        assert violations(RULES[name], {module: held}) == []


def test_worker_package__no_mixins_stubs_or_long_modules() -> None:
    assert LeaseWorker.__mro__ == (LeaseWorker, object)
    assert {"loop", "slots", "attempt", "completion", "outcomes", "heartbeat"} <= set(PARTS)
    for part in PARTS:
        source = (WORKER / f"{part}.py").read_text()
        assert "NotImplementedError" not in source, part
        assert len(source.splitlines()) <= 500, part


def imports(path: str) -> set[str]:
    """The package's modules the module at `path` (under the package) imports, `if
    TYPE_CHECKING:` and function-level imports included, with the packages they run first."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / path).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("django_leases."):
                parts = name.removeprefix("django_leases.").split(".")
                found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return found


def module_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        relative = path.relative_to(PACKAGE).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        name = ".".join(parts)
        # A package's own modules may import it: its `__init__` runs before them anyway.
        own = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = imports(str(path.relative_to(PACKAGE))) - own
    return {name: {m for m in found if m in graph} for name, found in graph.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_worker_package__no_import_circle_through_the_worker_the_registry_or_the_lease() -> None:
    """Type-only imports counted: no module of the worker, nor the registry, nor `lease.py`
    imports one that imports it back."""
    graph = module_graph()
    mine = [name for name in graph if name.startswith("worker") or name in ("handlers", "lease")]
    assert {"worker", "worker.loop", "handlers", "lease"} <= set(mine)
    circles = [name for name in mine if name in reachable(graph, name)]
    assert circles == []


def test_worker_package__the_registry_imports_nothing_that_runs_handlers() -> None:
    below = reachable(module_graph(), "handlers")
    assert "lease" not in below
    assert not {name for name in below if name.startswith("worker")}
    assert "conf" in below  # the check reads the registry's real imports
