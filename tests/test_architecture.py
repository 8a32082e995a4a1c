"""The rules of the package's layout (docs/architecture.md), checked on its source.

- `sql/` imports nothing from the app but `status.py`: its builders take names and values, and
  write the status words in as literals.
- The database backend is named only where its dialect is chosen (`dialects.py`).
- SQL text (any statement, and the vendor words of the claim) is written only in `sql/` (and in
  migrations).
- Status, outcome and verdict words are spelled out only in `status.py` (and in migrations).
- Lease fields are written only by `querysets/`.
"""

import ast
from pathlib import Path

import pytest

from django_leases.status import AttemptOutcome, JobStatus, StuckPolicy, Verdict

PACKAGE = Path(__file__).resolve().parent.parent / "django_leases"
SQL_TEXT = ("SKIP LOCKED", "RETURNING", "STATEMENT_TIMESTAMP", "make_interval", "STRFTIME",
            "pg_notify")  # fmt: skip
STATEMENTS = ("SELECT ", "UPDATE ", "INSERT ", "DELETE ", "WITH ", "SET ")
WORDS = {*JobStatus.values, *AttemptOutcome.values, *StuckPolicy.values, *Verdict.values}
LEASE_FIELDS = {"lease_owner", "lease_until", "lease_token", "heartbeat_at", "attempts",
                "lock_holder"}  # fmt: skip


def modules(*, outside: tuple[str, ...] = ()) -> list[Path]:
    skip = ("migrations", *outside)
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(part in skip for part in path.relative_to(PACKAGE).with_suffix("").parts)
    ]


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', '?')}"


def test_architecture__sql_imports_nothing_from_the_app() -> None:
    found = []
    for path in sorted((PACKAGE / "sql").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            found += [
                where(path, node)
                for name in names
                if name.startswith("django_leases")
                and not name.startswith("django_leases.sql")
                and name != "django_leases.status"
            ]
    assert found == []


def test_architecture__the_backend_is_named_only_where_its_dialect_is_chosen() -> None:
    # `connection.vendor` (any `.vendor`) outside `dialects.py`: a vendor switch of its own.
    # Migrations are frozen history and keep theirs.
    found = [
        where(path, node)
        for path in modules(outside=("dialects",))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "vendor"
    ]
    assert found == []


def strings(path: Path) -> list[ast.Constant]:
    """The string constants of a module, docstrings (which may describe SQL) left out."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_architecture__sql_text_only_in_sql() -> None:
    found = [
        f"{where(path, node)} {text}"
        for path in modules(outside=("sql",))
        for node in strings(path)
        for text in SQL_TEXT
        if text in node.value
    ]
    # Any other statement: a string that starts like one.
    found += [
        f"{where(path, node)} {node.value.split()[0]}"
        for path in modules(outside=("sql",))
        for node in strings(path)
        if node.value.lstrip().startswith(STATEMENTS)
    ]
    assert found == []


def test_architecture__status_words_only_in_status() -> None:
    # The sql/ builders write the words in from status.py (`sql.literal()`).
    found = [
        f"{where(path, node)} {node.value!r}"
        for path in modules(outside=("status",))
        for node in strings(path)
        if node.value in WORDS
    ]
    assert found == []


@pytest.mark.parametrize(
    "path", modules(outside=("querysets", "sql", "models")), ids=lambda p: p.name
)
def test_architecture__lease_fields_written_only_by_querysets(path: Path) -> None:
    # An update(...) or create(...) call naming a lease field outside querysets/.
    found = [
        f"{where(path, node)} {keyword.arg}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in {"update", "create", "bulk_update"}
        for keyword in node.keywords
        if keyword.arg in LEASE_FIELDS
    ]
    assert found == []


def test_architecture__lease_queryset_is_one_door_not_a_tower_of_mixins() -> None:
    # Its helpers are functions taking the queryset (claims, acks, operators, enqueue, prune,
    # ledger, locks), not base classes: a reader finds each transition in one jump.
    from django_leases.querysets import LeaseQuerySet

    ours = [cls for cls in LeaseQuerySet.__mro__ if cls.__module__.startswith("django_leases")]
    assert len(ours) <= 3, [cls.__qualname__ for cls in ours]


@pytest.mark.parametrize(
    "path",
    [*sorted((PACKAGE / "querysets").glob("*.py")), *sorted((PACKAGE / "sql").glob("*.py")),
     PACKAGE / "dialects.py"],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)  # fmt: skip
def test_architecture__lease_layer_modules_stay_readable(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 500
