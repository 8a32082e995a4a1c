"""`UniqueWhenSet`: the idempotency key and the lock holder, unique where set, on every database;
on PostgreSQL and SQLite without an index entry for the jobs that have neither."""

import re

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Model, Q, UniqueConstraint

from django_leases.checks import check_lock_holders
from django_leases.constraints import UniqueWhenSet, is_unique
from django_leases.exceptions import InvalidArgument
from django_leases.models import PaymentJob
from django_leases.status import PENDING
from tests.testapp.models import BareJob, PayoutJob

KEYS = [(PaymentJob, "idempotency_key"), (PaymentJob, "lock_holder"), (BareJob, "lock_holder")]


def index_definitions(table: str) -> list[str]:
    """The CREATE statements of the table's indexes as the database keeps them (PostgreSQL and
    SQLite), lower case."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s", [table])
        else:
            cursor.execute(
                "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = %s"
                " AND sql IS NOT NULL",
                [table],
            )
        return [definition.lower() for (definition,) in cursor.fetchall()]


@pytest.mark.django_db
@pytest.mark.parametrize(("model", "field"), KEYS, ids=lambda v: getattr(v, "__name__", v))
def test_unique_when_set__one_index_of_the_key_partial_where_the_database_can(
    model: type[PaymentJob], field: str
) -> None:
    table = model._meta.db_table
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, table)
    on_key = {name: c for name, c in found.items() if c["columns"] == [field]}
    # One index of the key, unique: no varchar_pattern_ops twin on PostgreSQL.
    assert [c["unique"] for c in on_key.values()] == [True], on_key
    (name,) = on_key
    if connection.vendor in ("postgresql", "sqlite"):
        (definition,) = [d for d in index_definitions(table) if f" {name} " in d.replace('"', " ")]
        assert definition.startswith("create unique index"), definition
        assert re.sub(r'["()]', "", definition).endswith(f"where {field} is not null"), definition


@pytest.mark.django_db
def test_unique_when_set__refuses_a_second_row_with_the_key_and_takes_any_number_without() -> None:
    for _ in range(3):
        PaymentJob.objects.create(kind="noop")  # no key, no lock: NULL in both
    PaymentJob.objects.create(kind="noop", idempotency_key="k")
    with pytest.raises(IntegrityError), transaction.atomic():
        PaymentJob.objects.create(kind="noop", idempotency_key="k")
    held = {"kind": "noop", "status": PENDING, "lock": "payment:1", "lock_holder": "payment:1"}
    PaymentJob.objects.create(**held)
    with pytest.raises(IntegrityError), transaction.atomic():
        PaymentJob.objects.create(**held)
    assert PaymentJob.objects.count() == 5


@pytest.mark.django_db
def test_enqueue__a_key_unique_by_constraint_or_by_field_returns_the_first_job() -> None:
    # PaymentJob's key is unique by UniqueWhenSet, PayoutJob's by unique=True.
    for model in (PaymentJob, PayoutJob):
        first = model.objects.enqueue("noop", idempotency_key="once")
        assert model.objects.enqueue("noop", idempotency_key="once").pk == first.pk
        assert model.objects.count() == 1
    with pytest.raises(InvalidArgument, match="needs a unique idempotency_key field"):
        BareJob.objects.enqueue("noop", idempotency_key="once")


def test_is_unique__by_field_by_unique_when_set_not_by_a_condition_or_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert is_unique(PayoutJob, "idempotency_key")  # unique=True
    assert is_unique(PaymentJob, "idempotency_key")  # UniqueWhenSet
    # A plain conditional constraint is not created at all on MariaDB/MySQL (models.W036).
    plain_partial = UniqueConstraint(
        fields=["idempotency_key"], name="other", condition=Q(idempotency_key__isnull=False)
    )
    monkeypatch.setattr(PaymentJob._meta, "constraints", [plain_partial])
    assert not is_unique(PaymentJob, "idempotency_key")
    monkeypatch.setattr(PaymentJob._meta, "constraints", [])
    assert not is_unique(PaymentJob, "idempotency_key")


@pytest.mark.django_db
def test_unique_when_set__keeps_no_condition_in_its_migration_and_no_warning() -> None:
    constraint = UniqueWhenSet(fields=["lock_holder"], name="x_lock_holder_uniq")
    path, args, kwargs = constraint.deconstruct()
    assert (path, args, kwargs) == (
        "django_leases.constraints.UniqueWhenSet",
        (),
        {"fields": ("lock_holder",), "name": "x_lock_holder_uniq"},
    )
    assert UniqueWhenSet(*args, **kwargs) == constraint
    # Not models.W036 ("a constraint won't be created") on MariaDB/MySQL: it is, unconditional.
    for model in (PaymentJob, BareJob):
        assert w036(model) == []


@pytest.mark.django_db
def test_unique_when_set__the_warning_it_leaves_out_is_there_for_a_plain_conditional_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The control of the test above: where the database builds no partial index, Django does
    # warn of a plain conditional constraint, so the check there could fail.
    plain = UniqueConstraint(
        fields=["lock_holder"], name="x_plain", condition=Q(lock_holder__isnull=False)
    )
    monkeypatch.setattr(BareJob._meta, "constraints", [plain])
    partial = connection.features.supports_partial_indexes
    assert w036(BareJob) == ([] if partial else ["models.W036"])


def w036(model: type[Model]) -> list[str]:
    return [m.id for m in model.check(databases=["default"]) if m.id == "models.W036"]


def test_check_lock_holders__every_installed_job_model_is_clean() -> None:
    assert check_lock_holders() == []


def test_check_lock_holders__reports_a_job_model_without_lease_constraints(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = [c for c in BareJob._meta.constraints if not isinstance(c, UniqueWhenSet)]
    monkeypatch.setattr(BareJob._meta, "constraints", kept)
    (message,) = check_lock_holders()
    assert (message.id, message.obj) == ("django_leases.E039", BareJob)
    assert message.msg.startswith("testapp.BareJob.lock_holder is not unique")


BEFORE = ("django_leases", "0010_cancelled_outcome")


@pytest.mark.django_db(transaction=True)
def test_migration_0011__a_populated_table_keeps_its_keys_and_locks_unique_both_ways() -> None:
    """0011 on a table that holds keys, a lock holder and rows without either (the CI's other
    suites migrate empty tables): the rows pass into the new indexes, which then refuse
    duplicates as the old ones did; and back."""
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("django_leases")
    try:
        executor.migrate([BEFORE])
        old = MigrationExecutor(connection).loader.project_state(BEFORE).apps
        jobs = old.get_model("django_leases", "PaymentJob").objects
        jobs.create(kind="noop", idempotency_key="k1")
        jobs.create(kind="noop", lock="L", lock_holder="L", status=PENDING)
        for _ in range(3):
            jobs.create(kind="noop")
        MigrationExecutor(connection).migrate(latest)
        assert PaymentJob.objects.filter(idempotency_key="k1").count() == 1
        for refused in ({"idempotency_key": "k1"}, {"lock": "L", "lock_holder": "L"}):
            with pytest.raises(IntegrityError), transaction.atomic():
                PaymentJob.objects.create(kind="noop", **refused)
        PaymentJob.objects.create(kind="noop")  # NULL in both: any number
        MigrationExecutor(connection).migrate([BEFORE])
        with pytest.raises(IntegrityError), transaction.atomic():
            jobs.create(kind="noop", idempotency_key="k1")
    finally:
        MigrationExecutor(connection).migrate(latest)
    assert PaymentJob.objects.count() == 6
