"""Every claim path against the ORM path, its readable specification, on generated job sets.

The ORM path (`SELECT ... FOR UPDATE SKIP LOCKED`, then the conditional `filter(...).update(...)`)
is the specification (the base `Dialect`); PostgreSQL's, SQLite's and MariaDB/MySQL's dialects
run statements of their own (`dialects/`). On the
same rows each path must claim the same jobs, in the same order, with the same ledger rows: the
attempts it opens and the expired holders' rows it closes.
"""

import enum
import random
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import FieldDoesNotExist
from django.db import connection, transaction
from django.db.models.functions import Now

from django_leases.dialects import Dialect, named
from django_leases.dialects import postgresql_prepared as prepared_sql
from django_leases.dialects import postgresql_statements as postgresql
from django_leases.dialects import statements as sql
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets.base import LOADERS, raw_rows
from django_leases.querysets.claims import claim_by_dialect
from django_leases.querysets.endings import complete_many_by_dialect
from django_leases.querysets.ledger import ledger_names
from django_leases.status import COMPLETED, PENDING, PROCESSING, AttemptOutcome

pytestmark = pytest.mark.django_db

KINDS = ("capture", "refund", "webhook")
SEEDS = range(12)


Path = tuple[Dialect, bool]
"""A claim's dialect, and whether its statements write the stock ledger's rows (else the ORM
writes them after the claim)."""

ORM: Path = (Dialect(), False)
"""The specification: the base dialect, the ORM's statements."""


def paths() -> list[Path]:
    """The fast paths this database runs besides the ORM path: its dialect with the stock
    ledger's rows in its own statements, and (where they can leave them out) without."""
    own = named(connection.vendor)
    if connection.vendor in ("postgresql", "mysql"):
        return [(own, True), (own, False)]
    return [(own, True)]


def generate(seed: int) -> None:
    """Enqueue a mix of due, future, expired, live and exhausted jobs, some past a checkpoint,
    some of them behind an earlier job of their lock (waiting: no path may claim those)."""
    rng = random.Random(seed)
    PaymentJob.objects.enqueue("refund")  # at least one job is due
    for _ in range(rng.randint(5, 25)):
        job = PaymentJob.objects.enqueue(
            rng.choice(KINDS),
            priority=rng.choice([0, 0, 1, 5, -1]),
            max_attempts=rng.choice([1, 3, 5]),
            lock=rng.choice(["", "", "", "payment:a", "payment:b"]),
        )
        if job.status == PaymentJob.Status.WAITING:
            continue
        if rng.random() < 0.35:
            held = PaymentJob.objects.claim_job(job.pk, f"old-{job.pk}", ttl=60)
            assert held is not None
            lease_until = Now() - timedelta(seconds=rng.choice([5, 30, 90]))
            if rng.random() < 0.3:
                lease_until = Now() + timedelta(seconds=600)  # a live lease
            checkpoint = rng.choice(["", "", "psp_called"])
            PaymentJob.objects.filter(pk=job.pk).update(
                lease_until=lease_until, checkpoint=checkpoint
            )
        else:
            # Whole seconds apart and never near "now": the paths' clocks differ by
            # milliseconds. Equal run_at values (the -60s pair) leave the order to priority, id.
            offset = timedelta(seconds=rng.choice([-300, -120, -60, -60, 3600]))
            PaymentJob.objects.filter(pk=job.pk).update(run_at=Now() + offset)


def outcome_of(
    path: Path, owner: str, limit: int, kinds: list[str] | None, *, takeover: bool = True
) -> Any:
    """Claim with `path` (not `takeover`: due jobs only), return what it did, and roll every
    write back."""
    dialect, stock_ledger = path
    with transaction.atomic():
        before = dict(PaymentJob.objects.values_list("pk", "lease_token"))
        qs = PaymentJob.objects.all()
        jobs = claim_by_dialect(
            qs,
            owner,
            60.0,
            limit,
            kinds,
            dialect=dialect,
            stock_ledger=stock_ledger,
            takeover=takeover,
        )
        outcome = claim_outcome(jobs, before)
        transaction.set_rollback(True)
    return outcome


def claim_outcome(jobs: list[Any], before: dict[int, int]) -> Any:
    """What a claim that returned `jobs` did: the jobs in claim order, every ledger row and every
    job's lease state. A token above the job's in `before` (its token before the claim) reads
    "new": new tokens are database-clock numbers, never the same in two claims."""

    def token(pk: int, value: int) -> int | str:
        return "new" if value > before[pk] else value

    claimed = [
        (job.pk, job.attempts, token(job.pk, job.lease_token), job.lease_owner) for job in jobs
    ]
    rows = sorted(
        (job, attempt, token(job, value), *rest)
        for job, attempt, value, *rest in JobAttempt.objects.values_list(
            "job_ref", "attempt", "token", "owner", "outcome", "ended_by"
        )
    )
    states = sorted(
        (pk, status, attempts, token(pk, value), holder)
        for pk, status, attempts, value, holder in PaymentJob.objects.values_list(
            "pk", "status", "attempts", "lease_token", "lock_holder"
        )
    )
    return claimed, rows, states


@pytest.mark.parametrize("seed", SEEDS)
def test_claim_paths__claim_what_the_orm_path_claims(seed: int, settings: Any) -> None:
    if not paths():
        pytest.skip(f"{connection.vendor} claims through the ORM path only")
    rng = random.Random(seed)
    policy = rng.choice(["retry", "review"])
    settings.DJANGO_LEASES = {
        "STUCK_POLICY": policy,
        "STUCK_POLICY_BY_KIND": {"capture": "review" if policy == "retry" else "retry"},
    }
    generate(seed)
    for limit, kinds in [(1, None), (3, None), (50, None), (4, ["capture", "webhook"])]:
        expected = outcome_of(ORM, "w", limit, kinds)
        assert kinds or expected[0], "a due job is always claimable"
        for path in paths():
            assert outcome_of(path, "w", limit, kinds) == expected, (path, limit, kinds)
    waiting = set(PaymentJob.objects.waiting().values_list("pk", flat=True))
    assert not waiting & {pk for pk, *_ in outcome_of(ORM, "w", 50, None)[0]}


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_claim_paths__without_takeover_claim_due_jobs_only_as_the_orm_path_does(seed: int) -> None:
    """A worker's claim between its takeovers (`takeover=False`) leaves every expired lease to
    a later claim or the watcher, on every path alike, and takes the due jobs a full claim would
    take after the expired leases."""
    generate(seed)
    held = set(PaymentJob.objects.filter(status=PROCESSING).values_list("pk", flat=True))
    for limit, kinds in [(1, None), (50, None), (4, ["capture", "webhook"])]:
        expected = outcome_of(ORM, "w", limit, kinds, takeover=False)
        claimed = {pk for pk, *_ in expected[0]}
        assert claimed and not claimed & held, (limit, kinds)
        taken_over = [row for row in expected[1] if row[4] == AttemptOutcome.LEASE_LOST]
        assert taken_over == [], "no holder's ledger row closed"
        due_only = [pk for pk, *_ in outcome_of(ORM, "w", 50, kinds)[0] if pk not in held]
        assert [pk for pk, *_ in expected[0]] == due_only[:limit], (limit, kinds)
        for path in paths():
            assert outcome_of(path, "w", limit, kinds, takeover=False) == expected, (path, kinds)


def completion_paths() -> list[Dialect]:
    """The fast paths of `complete_many()` on this database besides the ORM path: its
    dialect's own statements."""
    return [named(connection.vendor)]


def held_and_lost(seed: int) -> dict[int, int]:
    """Claim jobs for "w", then lose, finish or fence some of them; return the acks ({pk:
    token}) a worker would send, valid or not, and some for jobs "w" never held."""
    rng = random.Random(seed)
    jobs = PaymentJob.objects
    acks = {}
    for job in jobs.claim("w", ttl=60, limit=rng.randint(1, 30)):
        pk, token = job.pk, job.lease_token
        fate = rng.choice(["held", "held", "held", "taken", "released", "done", "failed", "stale"])
        if rng.random() < 0.3:
            jobs.checkpoint(pk, "w", token, "psp_called")
        if fate == "taken":
            # Taken over by "x", unless out of attempts: then merely expired (still held).
            jobs.filter(pk=pk).update(lease_until=Now() - timedelta(seconds=5))
            jobs.claim_job(pk, "x", ttl=60)
        elif fate == "released":
            jobs.release(pk, "w", token)
        elif fate == "done":
            jobs.complete(pk, "w", token)
        elif fate == "failed":
            jobs.fail(pk, "w", token, "psp 502", retry_in=30)
        acks[pk] = token + (fate == "stale")
    for job in jobs.exclude(pk__in=acks).exclude(lease_token=0)[:3]:
        acks[job.pk] = job.lease_token  # held by someone else, or finished
    return acks


def completion_of(dialect: Dialect, owner: str, acks: dict[int, int]) -> Any:
    """Complete `acks` with `dialect`, return what it did, and roll every write back."""
    with transaction.atomic():
        qs = PaymentJob.objects.all()
        won = complete_many_by_dialect(qs, owner, list(acks.items()), dialect=dialect)
        states = sorted(
            (*row[:-1], row[-1] is None)
            for row in PaymentJob.objects.values_list(
                "pk", "status", "lease_owner", "lease_token", "last_error", "lock_holder",
                "completed_at",
            )
        )  # fmt: skip
        rows = sorted(
            (*row[:-1], row[-1] is None)
            for row in JobAttempt.objects.values_list(
                "job_ref", "attempt", "token", "owner", "outcome", "ended_by", "checkpoint",
                "error_class", "error_message", "fenced_at", "ended_at",
            )
        )  # fmt: skip
        transaction.set_rollback(True)
    return won, states, rows


@pytest.mark.parametrize("seed", SEEDS)
def test_complete_many_paths__complete_what_the_orm_path_completes(seed: int) -> None:
    if not completion_paths():
        pytest.skip(f"{connection.vendor} completes batches through the ORM path only")
    generate(seed)
    acks = held_and_lost(seed)
    expected = completion_of(ORM[0], "w", acks)
    assert expected[0], "some acks are valid"
    assert expected[0] != set(acks), "some acks are refused"
    for path in completion_paths():
        assert completion_of(path, "w", acks) == expected, path


# ---- the PostgreSQL statement's text ------------------------------------------------------------

STATUS_WORDS = (PENDING, PROCESSING, COMPLETED, AttemptOutcome.RUNNING, AttemptOutcome.LEASE_LOST)


def claim_statement(
    kinds: list[str] | None,
    completing: tuple[list[int], list[int]] | None,
    review: tuple[str, ...] = (),
    *,
    owner: str = "w",
    limit: int = 4,
) -> tuple[str, dict[str, Any]]:
    claim = sql.Claim(
        owner,
        60.0,
        limit,
        sql.kinds_filter(kinds),
        sql.takeover_guard(review_by_default=False, exceptions=review),
        completing,
    )
    return postgresql.claim('"job"', claim, ledger=ledger_names(PaymentJob, connection.alias))


def test_postgresql_claim__one_text_per_shape_with_the_status_words_written_in() -> None:
    """The text is built once per shape and the values travel as parameters, so psycopg can
    prepare it; the status words are literals, so a generic plan still proves the partial
    indexes' predicates."""
    text, params = claim_statement(["capture"], ([1, 2], [7, 8]))
    again, other = claim_statement(["refund"], ([5], [1]), owner="x", limit=2)
    assert again is text
    assert (other["owner"], other["limit"], other["kind_0"]) == ("x", 2, "refund")
    assert (other["pks"], other["tokens"]) == ([5], [1])
    assert (params["pks"], params["tokens"]) == ([1, 2], [7, 8])
    for word in STATUS_WORDS:
        assert f"'{word}'" in text
    assert not set(params) & {"pending", "processing", "completed", "running", "lease_lost"}
    assert "%(" + "pks)s" in text and "%(" + "pks)s" not in claim_statement(["capture"], None)[0]
    shapes = {
        claim_statement(kinds, completing, review)[0]
        for kinds in (None, ["capture"], ["capture", "refund"])
        for completing in (None, ([1], [1]))
        for review in ((), ("refund",))
    }
    assert len(shapes) == 12
    with pytest.raises(ValueError, match="not a status word"):
        sql.literal("pending' OR '1")


def test_prepared_claim__is_named_by_a_digest_of_its_text_with_its_window_written_in() -> None:
    statement = claim_statement(["capture"], ([1, 2], [3, 4]), limit=3)
    prepared, params = prepared_sql.prepared_claim(statement)
    assert prepared.name.startswith(prepared_sql.PREPARED_PREFIX) and len(prepared.name) <= 63
    assert "LIMIT 4" in prepared.prepare and "%(" not in prepared.prepare  # window 4 for limit 3
    assert params == {k: v for k, v in statement[1].items() if k not in ("window", "candidates")}
    assert params["limit"] == 3  # the claim still takes 3
    arguments = ", ".join(f"%({name})s" for name in params)
    assert prepared.execute == f"EXECUTE {prepared.name} ({arguments})"
    # The same text, window and types: the very same statement, whatever the values.
    same, _ = prepared_sql.prepared_claim(
        claim_statement(["refund"], ([5], [6]), owner="x", limit=4)
    )
    assert same is prepared
    # Another window, or another number of kinds: another text, so another name.
    for other in [
        claim_statement(["capture"], ([1], [2]), limit=5),
        claim_statement(["capture", "refund"], ([1], [2]), limit=3),
        claim_statement(["capture"], None, limit=3),
    ]:
        assert prepared_sql.prepared_claim(other)[0].name != prepared.name


class Kind(enum.StrEnum):
    CAPTURE = "capture"


class Pk(enum.IntEnum):
    ONE = 1


def test_prepared__types_its_parameters_and_refuses_what_it_cannot_type_or_write_in() -> None:
    statement = ("SELECT %(a)s || '%%', %(b)s, %(c)s, %(d)s LIMIT %(n)s", {
        "a": "x", "b": True, "c": 1.5, "d": [1, 2], "n": 3
    })  # fmt: skip
    prepared, values = prepared_sql.prepared(statement, written_in={"n": 3})
    assert prepared.prepare == (
        f"PREPARE {prepared.name} (text, boolean, double precision, bigint[]) AS "
        "SELECT $1 || '%', $2, $3, $4 LIMIT 3"
    )
    assert values == {"a": "x", "b": True, "c": 1.5, "d": [1, 2]}
    # Subclasses take their base's type: a StrEnum kind, IntEnum pks (a bool is not a bigint).
    statement = ("SELECT %(k)s, %(p)s, %(f)s", {"k": Kind.CAPTURE, "p": [Pk.ONE], "f": [False]})
    with pytest.raises(TypeError, match="no type to prepare parameter f"):
        prepared_sql.prepared(statement, written_in={})
    del statement[1]["f"]
    statement = (statement[0].replace(", %(f)s", ""), statement[1])
    prepared, _ = prepared_sql.prepared(statement, written_in={})
    assert prepared.prepare == f"PREPARE {prepared.name} (text, bigint[]) AS SELECT $1, $2"
    with pytest.raises(TypeError, match="no type"):
        prepared_sql.prepared(("SELECT %(a)s", {"a": None}), written_in={})
    with pytest.raises(TypeError, match="no type"):
        prepared_sql.prepared(("SELECT %(a)s", {"a": [1, "x"]}), written_in={})
    with pytest.raises(TypeError, match="only integers"):
        prepared_sql.prepared(("SELECT 1 LIMIT %(n)s", {"n": 2.5}), written_in={"n": 2.5})  # type: ignore[dict-item]


def test_postgresql_literals__write_integers_here_and_keep_what_the_driver_quotes() -> None:
    quoted: list[Any] = []

    def quote(value: Any) -> str:
        quoted.append(value)
        return f"<{value!r}>"

    def written(*values: Any) -> str:
        names = {f"v{n}": value for n, value in enumerate(values)}
        execute = "EXECUTE x (" + ", ".join(f"%({name})s" for name in names) + ")"
        return literals.execute(execute, names, quote)

    literals = postgresql.Literals()
    assert written(7, [1, 22], [], "w", 1.0, "w", 1.0) == (
        "EXECUTE x (7, '{1,22}', '{}', <'w'>, <1.0>, <'w'>, <1.0>)"
    )
    assert quoted == ["w", 1.0]  # each text and float quoted once, then kept
    # What is not an int, a list of ints, a text or a float is quoted every time, as it is.
    written(True, Pk.ONE, [Pk.ONE], Kind.CAPTURE, True)
    assert quoted == ["w", 1.0, True, Pk.ONE, [Pk.ONE], Kind.CAPTURE, True]
    # A float kept apart from the equal int and bool (1.0 == 1 == True); a % stays as it is.
    assert written(1, 1.0, "%s") == "EXECUTE x (1, <1.0>, <'%s'>)"
    prepared, values = prepared_sql.prepared(
        ("SELECT %(a)s, %(b)s LIMIT %(n)s", {"a": "x", "b": [3], "n": 2}), written_in={"n": 2}
    )
    assert literals.execute(prepared.execute, values, quote) == (
        f"EXECUTE {prepared.name} (<'x'>, '{{3}}')"
    )


@pytest.mark.django_db(transaction=True)
def test_prepared_claim__writes_each_owner_kind_and_length_in_as_itself() -> None:
    # Quotes, a backslash and percent signs (an owner has no spaces): on PostgreSQL the EXECUTE
    # goes without parameters, its texts written in by the driver's quoting; two owners and
    # lengths on one connection.
    owners = ["o'wner\\1%s", "o'wner\\2%(x)s"]
    PaymentJob.objects.bulk_create(PaymentJob(kind="cap'ture%") for _ in range(4))
    for owner, ttl in zip(owners, (60.0, 30.5), strict=True):
        jobs = PaymentJob.objects.claim(owner, ttl=ttl, limit=2, kinds=["cap'ture%"])
        assert [job.lease_owner for job in jobs] == [owner, owner]
    rows = PaymentJob.objects.values_list("lease_owner", "lease_until", "heartbeat_at")
    lengths = {owner: round((until - beat).total_seconds(), 2) for owner, until, beat in rows}
    assert lengths == {owners[0]: 60.0, owners[1]: 30.5}
    keys = [(job.pk, job.lease_token) for job in jobs]
    won, claimed = PaymentJob.objects.complete_and_claim(owners[1], keys, ttl=30.5, limit=2)
    assert (won, claimed) == (set(keys), [])


def test_raw_rows__load_fields_through_their_converters_and_other_columns_as_attributes() -> None:
    job = PaymentJob.objects.create(kind="capture", payload={"amount": [1, "2"]})
    table = connection.ops.quote_name(PaymentJob._meta.db_table)
    statement = (f"SELECT *, 1 AS extra FROM {table} WHERE id = %(pk)s", {"pk": job.pk})  # noqa: S608
    qs = PaymentJob.objects.all()
    (loaded,) = raw_rows(qs, statement)
    assert loaded.payload == {"amount": [1, "2"]} and loaded.extra == 1  # type: ignore[attr-defined]
    # As the ORM loads the row (create() may leave a database default unread).
    orm = PaymentJob.objects.get(pk=job.pk)
    assert [getattr(loaded, f.attname) for f in PaymentJob._meta.concrete_fields] == [
        getattr(orm, f.attname) for f in PaymentJob._meta.concrete_fields
    ]
    assert loaded._state.db == qs.db and not loaded._state.adding
    # One loader per connection and columns, kept with the connection.
    before = dict(getattr(connection, LOADERS))
    raw_rows(qs, statement)
    other = (statement[0].replace("1 AS extra", "2 AS other"), statement[1])
    assert raw_rows(qs, other)[0].other == 2  # type: ignore[attr-defined]
    loaders = getattr(connection, LOADERS)
    assert all(loaders[key] is loader for key, loader in before.items())
    assert [columns[-1] for _, columns in loaders.keys() - before.keys()] == ["other"]
    with pytest.raises(FieldDoesNotExist, match="primary key"):
        raw_rows(qs, (f"SELECT kind FROM {table}", {}))  # noqa: S608


def test_raw_rows__an_empty_result_asks_nothing_of_its_columns() -> None:
    """A claim that finds nothing returns before the driver describes the result's columns
    (psycopg 3 builds an object per column at every call: a sixth of such a claim's Python)."""
    asked: list[str] = []

    class Watched:
        """The real cursor, the reads of its description counted."""

        def __init__(self, cursor: Any) -> None:
            self.cursor = cursor

        def __getattr__(self, name: str) -> Any:
            if name == "description":
                asked.append(name)
            return getattr(self.cursor, name)

        def __enter__(self) -> "Watched":
            return self

        def __exit__(self, *exc: object) -> None:
            self.cursor.close()

    table = connection.ops.quote_name(PaymentJob._meta.db_table)
    query = f"SELECT * FROM {table} WHERE id = %(pk)s"  # noqa: S608
    qs = PaymentJob.objects.all()
    assert raw_rows(qs, (query, {"pk": -1}), lambda: Watched(connection.cursor())) == []  # type: ignore[arg-type, return-value]
    assert asked == []
    job = PaymentJob.objects.create(kind="capture")
    found = raw_rows(qs, (query, {"pk": job.pk}), lambda: Watched(connection.cursor()))  # type: ignore[arg-type, return-value]
    assert [loaded.pk for loaded in found] == [job.pk]
    assert asked == ["description"]
