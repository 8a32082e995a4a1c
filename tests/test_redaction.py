"""Error text is redacted before it is stored or logged: by default, the values that database
errors quote; with DJANGO_LEASES["REDACT_ERRORS"], whatever the project's hook decides."""

import json
import logging
import logging.config
import re
import signal
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import (
    DatabaseError,
    DataError,
    IntegrityError,
    InternalError,
    OperationalError,
    ProgrammingError,
    connection,
    transaction,
)
from django.db.models.functions import Now
from django.test import override_settings

from django_leases import redaction
from django_leases.limits import MAX_ERROR_LENGTH
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import describe_error
from django_leases.redaction import (
    CUT,
    LOGGERS,
    REDACT_LENGTH,
    RedactExceptions,
    error_text,
    redact_database_values,
)
from django_leases.status import COMPLETED, FAILED, PROCESSING

from .conftest import ON_SQLITE, ROOT, Processes, subprocess_env, wait_for

CARD = "4111111111111111"


def only_the_class(exc: BaseException, text: str) -> str:
    """A project's hook: keep nothing of the text."""
    return f"<{type(exc).__name__}>"


def broken(exc: BaseException, text: str) -> str:
    raise RuntimeError(text)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (
            'duplicate key value violates unique constraint "shop_card_uniq"\n'
            f"DETAIL:  Key (card)=({CARD}) already exists.",
            'duplicate key value violates unique constraint "shop_card_uniq"',
        ),
        (
            'new row for relation "shop" violates check constraint "amount_positive"\n'
            f"DETAIL:  Failing row contains (1, {CARD}, -5).\nHINT:  none\nCONTEXT:  x",
            'new row for relation "shop" violates check constraint "amount_positive"',
        ),
        (
            f"invalid input syntax for type integer: \"{CARD}\"\nLINE 1: SELECT '{CARD}'::int",
            "invalid input syntax for type integer: '…'",
        ),
        (
            f"(1062, \"Duplicate entry '{CARD}' for key 'shop_payment.card'\")",
            "(1062, \"Duplicate entry '…' for key 'shop_payment.card'\")",
        ),
        (
            f"(1366, \"Incorrect integer value: '{CARD}' for column `shop`.`n` at row 1\")",
            "(1366, \"Incorrect integer value: '…' for column `shop`.`n` at row 1\")",
        ),
        (
            "UNIQUE constraint failed: shop_payment.card",
            "UNIQUE constraint failed: shop_payment.card",
        ),
    ],
)
def test_redact_database_values__strips_quoted_values_and_details(text: str, kept: str) -> None:
    assert redact_database_values(IntegrityError(text), text) == kept


def test_redact_database_values__leaves_other_errors_alone() -> None:
    text = f"card {CARD} declined: 'insufficient funds'"
    assert redact_database_values(ValueError(text), text) == text


def test_describe_error__goes_through_the_default_redaction() -> None:
    error = IntegrityError(f"duplicate key\nDETAIL:  Key (card)=({CARD}) already exists.")
    assert describe_error(error) == ("django.db.utils.IntegrityError", "duplicate key")
    assert describe_error(f"operator reason {CARD}") == ("", f"operator reason {CARD}")


@override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.only_the_class"})
def test_error_text__uses_the_project_hook() -> None:
    assert error_text(ValueError(CARD)) == "<ValueError>"
    assert describe_error(KeyError(CARD)) == ("KeyError", "<KeyError>")


@override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.broken"})
def test_error_text__a_failing_hook_keeps_no_text() -> None:
    assert error_text(ValueError(CARD)) == (
        "[error text withheld: REDACT_ERRORS raised RuntimeError]"
    )


@pytest.mark.django_db
def test_integrity_error__the_raw_text_carries_the_value_it_refused() -> None:
    """What the redaction is for: the databases that quote values do quote this one."""
    PaymentJob.objects.enqueue("noop", idempotency_key=CARD)
    with pytest.raises(IntegrityError) as raised, transaction.atomic():
        PaymentJob.objects.create(kind="noop", idempotency_key=CARD)
    # SQLite names the column only; PostgreSQL and MariaDB quote the value.
    assert (CARD in str(raised.value)) == (not ON_SQLITE), str(raised.value)
    assert CARD not in error_text(raised.value)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__integrity_error_value_kept_out_of_ledger_last_error_and_logs(
    processes: Processes,
) -> None:
    PaymentJob.objects.enqueue("noop", idempotency_key=CARD)
    job = PaymentJob.objects.enqueue("leaky", {"card": CARD}, max_attempts=1)
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "leaky", "-v", "2")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out

    job.refresh_from_db()
    attempts = list(JobAttempt.objects.filter(job_ref=job.pk).order_by("token"))
    assert [a.outcome for a in attempts] == ["failed"], out
    assert job.status == "failed"
    assert job.last_error.startswith("django.db.utils.IntegrityError: "), job.last_error
    assert {a.error_class for a in attempts} == {"django.db.utils.IntegrityError"}
    assert f"job_id={job.pk}" in out
    for text in [job.last_error, *(a.error_message for a in attempts), out]:
        assert CARD not in text
    if connection.vendor == "postgresql":
        assert "DETAIL" not in job.last_error and "unique constraint" in job.last_error
    if connection.vendor == "mysql":
        assert "Duplicate entry '…' for key" in job.last_error


# ---- every message form the three databases produce -------------------------------------------

# Collected from PostgreSQL 16, MariaDB 10.11 and SQLite 3 with card numbers in the values;
# `VALUE` holds a quote of each kind, which neither database escapes in its message.
VALUE = f"ab'cd {CARD}"
RECORDED = {
    "pg duplicate key": (
        IntegrityError,
        'duplicate key value violates unique constraint "red_t_c_key"\n'
        f"DETAIL:  Key (c)=({VALUE}) already exists.",
        'duplicate key value violates unique constraint "red_t_c_key"',
    ),
    "pg out of range": (
        DataError,
        f'value "{CARD}" is out of range for type integer\n'
        "CONTEXT:  unnamed portal parameter $1 = '...'",
        "value '…' is out of range for type integer",
    ),
    "pg invalid integer": (
        DataError,
        f'invalid input syntax for type integer: "{VALUE}"\n'
        "CONTEXT:  unnamed portal parameter $1 = '...'",
        "invalid input syntax for type integer: '…'",
    ),
    "pg invalid integer, both quotes": (
        DataError,
        f'invalid input syntax for type integer: "a\'b"c {CARD}"',
        "invalid input syntax for type integer: '…'",
    ),
    "pg invalid integer, crafted": (
        DataError,
        f'invalid input syntax for type integer: "x" is out of range for type integer {CARD}"',
        "invalid input syntax for type integer: '…'",
    ),
    "pg invalid date, newline": (
        DataError,
        f'invalid input syntax for type date: "x\n{CARD}"',
        "invalid input syntax for type date: '…'",
    ),
    "pg interval": (
        DataError,
        f'interval field value out of range: "{VALUE}"',
        "interval field value out of range: '…'",
    ),
    "pg invalid json": (
        DataError,
        f'invalid input syntax for type json\nDETAIL:  Token "{CARD}x" is invalid.\n'
        f'CONTEXT:  JSON data, line 1: {{"card": {CARD}x...',
        "invalid input syntax for type json",
    ),
    "pg check": (
        IntegrityError,
        'new row for relation "red_t" violates check constraint "red_t_a_check"\n'
        f"DETAIL:  Failing row contains (3, {CARD}, null, -1).",
        'new row for relation "red_t" violates check constraint "red_t_a_check"',
    ),
    "pg not null": (
        IntegrityError,
        'null value in column "nn" of relation "red_t" violates not-null constraint\n'
        f"DETAIL:  Failing row contains (3, {CARD}, null).",
        'null value in column "nn" of relation "red_t" violates not-null constraint',
    ),
    "pg foreign key": (
        IntegrityError,
        'insert or update on table "red_child" violates foreign key constraint '
        f'"red_child_p_fkey"\nDETAIL:  Key (p)=({CARD}) is not present in table "red_t".',
        'insert or update on table "red_child" violates foreign key constraint "red_child_p_fkey"',
    ),
    "pg too long": (
        DataError,
        "value too long for type character varying(5)",
        "value too long for type character varying(5)",
    ),
    "pg syntax": (
        ProgrammingError,
        f"syntax error at or near \"'{CARD}'\"\nLINE 1: ... VALUES (3, '{CARD}' '41111111...",
        "syntax error at or near '…'",
    ),
    "pg raise": (
        InternalError,
        f"card {CARD}\nCONTEXT:  PL/pgSQL function inline_code_block line 1 at RAISE",
        "card …",
    ),
    "pg deadlock": (
        OperationalError,
        "deadlock detected\nDETAIL:  Process 7485 waits for ShareLock on transaction 39850; "
        "blocked by process 7486.\nHINT:  See server log for query details.",
        "deadlock detected",
    ),
    "pg encoding": (
        DataError,
        'invalid byte sequence for encoding "UTF8": 0xff',
        'invalid byte sequence for encoding "UTF8": 0xff',
    ),
    "mariadb duplicate entry": (
        IntegrityError,
        str((1062, f"Duplicate entry '{VALUE}' for key 'c'")),
        str((1062, "Duplicate entry '…' for key 'c'")),
    ),
    "mariadb duplicate entry, both quotes": (
        IntegrityError,
        str((1062, f"Duplicate entry 'a'b\"c {CARD}' for key 'c'")),
        str((1062, "Duplicate entry '…' for key 'c'")),
    ),
    "mariadb duplicate entry, crafted": (
        IntegrityError,
        str((1062, f"Duplicate entry 'x' for key 'c {CARD}' for key 'c'")),
        str((1062, "Duplicate entry '…' for key 'c'")),
    ),
    "mariadb incorrect integer": (
        OperationalError,
        str((1366, f"Incorrect integer value: '{VALUE}' for column `h2`.`red_t`.`n` at row 1")),
        str((1366, "Incorrect integer value: '…' for column `h2`.`red_t`.`n` at row 1")),
    ),
    "mariadb incorrect date": (
        OperationalError,
        str((1292, f"Incorrect date value: '{VALUE}' for column `h2`.`red_t`.`d` at row 1")),
        str((1292, "Incorrect date value: '…' for column `h2`.`red_t`.`d` at row 1")),
    ),
    "mariadb incorrect string": (
        OperationalError,
        str((1366, "Incorrect string value: '\\xFF\\xFE4111...' for column `h2`.`t`.`c` at row 1")),
        str((1366, "Incorrect string value: '…' for column `h2`.`t`.`c` at row 1")),
    ),
    "mariadb truncated double": (
        DataError,
        str((1292, f"Truncated incorrect DOUBLE value: '{VALUE}'")),
        str((1292, "Truncated incorrect DOUBLE value: '…'")),
    ),
    "mariadb syntax": (
        ProgrammingError,
        str(
            (
                1064,
                f"You have an error in your SQL syntax; check the manual ... near '{VALUE}' "
                "AND' at line 1",
            )
        ),
        str(
            (1064, "You have an error in your SQL syntax; check the manual ... near '…' at line 1")
        ),
    ),
    "mariadb unknown column": (
        OperationalError,
        str((1054, f"Unknown column '{CARD}' in 'SELECT'")),
        str((1054, "Unknown column '…' in '…'")),
    ),
    "mariadb signal": (
        OperationalError,
        str((1644, f"card {CARD}")),
        str((1644, "card …")),
    ),
    "mariadb out of range": (
        DataError,
        str((1264, "Out of range value for column 'n' at row 1")),
        str((1264, "Out of range value for column 'n' at row 1")),
    ),
    "mariadb too long": (
        DataError,
        str((1406, "Data too long for column 'v' at row 1")),
        str((1406, "Data too long for column 'v' at row 1")),
    ),
    "mariadb not null": (
        IntegrityError,
        str((1048, "Column 'nn' cannot be null")),
        str((1048, "Column 'nn' cannot be null")),
    ),
    "mariadb check or json": (
        OperationalError,
        str((4025, "CONSTRAINT `red_t.j` failed for `h2`.`red_t`")),
        str((4025, "CONSTRAINT `red_t.j` failed for `h2`.`red_t`")),
    ),
    "mariadb foreign key": (
        IntegrityError,
        str(
            (
                1452,
                "Cannot add or update a child row: a foreign key constraint fails (`h2`."
                "`red_child`, CONSTRAINT `fk` FOREIGN KEY (`p`) REFERENCES `red_t` (`id`))",
            )
        ),
        str(
            (
                1452,
                "Cannot add or update a child row: a foreign key constraint fails (`h2`."
                "`red_child`, CONSTRAINT `fk` FOREIGN KEY (`p`) REFERENCES `red_t` (`id`))",
            )
        ),
    ),
    "mariadb deadlock": (
        OperationalError,
        str((1213, "Deadlock found when trying to get lock; try restarting transaction")),
        str((1213, "Deadlock found when trying to get lock; try restarting transaction")),
    ),
    "sqlite unique": (
        IntegrityError,
        "UNIQUE constraint failed: t.c",
        "UNIQUE constraint failed: t.c",
    ),
    "sqlite check": (
        IntegrityError,
        "CHECK constraint failed: a > 0",
        "CHECK constraint failed: a > 0",
    ),
    "sqlite trigger raise": (IntegrityError, f"card {CARD}", "card …"),
    "sqlite grouped card": (IntegrityError, "card 4111 1111 1111 1111", "card …"),
}


@pytest.mark.parametrize(("error", "text", "kept"), RECORDED.values(), ids=RECORDED)
def test_redact_database_values__every_recorded_message_form(
    error: type[Exception], text: str, kept: str
) -> None:
    redacted = redact_database_values(error(text), text)
    assert redacted == kept
    assert "4111" not in redacted and "cd " not in redacted


def provoked() -> list[tuple[str, str, list[object]]]:
    """Statements that fail on the test database with an error about a card-like value."""
    statements: list[tuple[str, str, list[object]]] = [
        ("duplicate key", "UPDATE <jobs> SET idempotency_key = %s", [VALUE]),
        ("not null", "UPDATE <jobs> SET kind = NULL WHERE idempotency_key = %s", [VALUE]),
        ("check", "UPDATE <jobs> SET max_attempts = 0, payment_id = %s", [CARD]),
        ("invalid json", "UPDATE <jobs> SET payload = %s", ["{" + VALUE]),
        ("syntax", "SELECT '4111111111111111' '4111111111111111' FROM WHERE", []),
    ]
    if connection.vendor != "sqlite":  # SQLite stores any text in any column
        statements += [
            ("too long", "UPDATE <jobs> SET payment_id = %s", [VALUE * 5]),
            ("integer syntax", "UPDATE <jobs> SET priority = %s", [VALUE]),
            ("out of range", "UPDATE <jobs> SET max_attempts = %s", [int(CARD)]),
            # SQLite checks foreign keys at commit only (and names no value).
            ("foreign key", "UPDATE <ledger> SET job_id = %s", [int(CARD)]),
        ]
    if connection.vendor == "postgresql":
        statements += [
            ("out of range", "SELECT %s::integer", [CARD]),
            ("date", "SELECT %s::date", [VALUE]),
        ]
    tables = {"<jobs>": PaymentJob, "<ledger>": JobAttempt}
    for name, model in tables.items():
        statements = [
            (what, sql.replace(name, connection.ops.quote_name(model._meta.db_table)), params)
            for what, sql, params in statements
        ]
    return statements


@pytest.mark.django_db
def test_error_text__keeps_no_value_of_any_error_the_test_database_raises() -> None:
    job = PaymentJob.objects.enqueue("noop", idempotency_key=VALUE)
    claimed = PaymentJob.objects.claim_job(job.pk, "w", ttl=60)
    assert claimed is not None
    PaymentJob.objects.enqueue("noop", idempotency_key="other")
    raised = []
    for name, sql, params in provoked():
        with pytest.raises(DatabaseError) as error, transaction.atomic():
            with connection.cursor() as cursor:
                if connection.vendor == "postgresql":  # Django's foreign keys are deferred
                    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
                cursor.execute(sql, params)
        raised.append((name, str(error.value)))
        text = error_text(error.value)
        assert "4111" not in text and "cd " not in text, (name, str(error.value), text)
    quoting = [name for name, raw in raised if CARD in raw]
    # What the redaction is for: PostgreSQL and MariaDB quote the values in these forms.
    assert bool(quoting) == (not ON_SQLITE), raised


# ---- texts of adversarial length ----------------------------------------------------------------

MB = 1_000_000
# Texts of 1 MB, each a long run of what one of the patterns loops on, a card inside.
ADVERSARIAL = {
    "pg quoted value": f'invalid input syntax for type integer: "{CARD}{"4" * MB}"',
    "pg quoted newlines": f'invalid input syntax for type integer: "{CARD}{chr(10) * MB}"',
    "newlines, then a detail": "refused" + "\n" * MB + f"DETAIL:  Key (c)=({CARD})",
    "blank lines": f"refused {CARD}" + "\n \t" * (MB // 3),
    "single quotes": f"'{CARD}" + "'" * MB,
    "double quotes": f': "{CARD}' + '"' * MB,
    "colon quotes": f': "{CARD}' * (MB // 19),
    "escaped quotes": f"'{CARD}" + "\\'" * (MB // 2) + "\\",
    "equals": f"{CARD}=" + "=" * MB,
    "colons": f"key {CARD}:" + ":" * MB,
    "nears": f" near '{CARD}" * (MB // 23),
    "at lines": f"' at line x{CARD}" * (MB // 27),
    "duplicate entries": f"Duplicate entry '{CARD}" * (MB // 33),
    "incorrect values": f"Incorrect integer value: '{CARD}" * (MB // 42),
    "out of range values": f'value "{CARD} is out of range for type ' * (MB // 48),
    "driver tuple": str((1366, f"Incorrect integer value: '{CARD * (MB // 16)}' for column `n`")),
    "digits": "1" * MB,
    "grouped digits": "4111 " * (MB // 5),
}


class Reading:
    """A pattern of `redaction`, run as it is, that refuses a text longer than REDACT_LENGTH:
    what each pattern reads is bounded, and each is linear in what it reads."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.read: list[int] = []

    def _reading(self, text: str) -> None:
        assert len(text) <= REDACT_LENGTH, f"{self.pattern.pattern!r} given {len(text)} chars"
        self.read.append(len(text))

    def search(self, text: str) -> re.Match[str] | None:
        self._reading(text)
        return self.pattern.search(text)

    def match(self, text: str) -> re.Match[str] | None:
        self._reading(text)
        return self.pattern.match(text)

    def sub(self, repl: object, text: str) -> str:
        self._reading(text)
        return self.pattern.sub(repl, text)  # type: ignore[call-overload]


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> list[Reading]:
    """Every pattern of `redaction`, read through `Reading`."""
    found = []
    for name in ("SECONDARY_FIELD", "QUOTED", "DRIVER_TUPLE", "CARD_NUMBER"):
        found.append(Reading(getattr(redaction, name)))
        monkeypatch.setattr(redaction, name, found[-1])
    greedy = [Reading(pattern) for pattern in redaction.GREEDY_VALUES]
    monkeypatch.setattr(redaction, "GREEDY_VALUES", greedy)
    return found + greedy


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL)
def test_redact_database_values__a_megabyte_text_is_cut_before_any_pattern_reads_it(
    readings: list[Reading], text: str
) -> None:
    redacted = redact_database_values(DataError(text), text)
    assert redacted.endswith(CUT), redacted[-80:]
    assert len(redacted) <= REDACT_LENGTH + len(CUT)
    assert "4111" not in redacted, redacted
    assert any(reading.read for reading in readings)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (ADVERSARIAL["pg quoted value"], "invalid input syntax for type integer: '…'" + CUT),
        (ADVERSARIAL["pg quoted newlines"], "invalid input syntax for type integer: '…'" + CUT),
        (ADVERSARIAL["driver tuple"], "(1366, \"Incorrect integer value: '…'" + CUT),
        (f"card {CARD[:8]}" + "9" * MB, "card" + CUT),
        # A detail within the first REDACT_LENGTH characters is still dropped.
        (f"refused\nDETAIL:  Key (c)=({CARD})" + "x" * MB, "refused" + CUT),
    ],
)
def test_redact_database_values__a_cut_value_is_redacted_to_the_cut(text: str, kept: str) -> None:
    assert redact_database_values(DataError(text), text) == kept


TEXTS_GIVEN: list[int] = []


def recording_hook(exc: BaseException, text: str) -> str:
    """A project's hook that keeps all of a text, noting its length."""
    TEXTS_GIVEN.append(len(text))
    return text * 2


@override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.recording_hook"})
def test_error_text__the_hook_is_given_a_cut_text_and_its_answer_is_cut() -> None:
    TEXTS_GIVEN.clear()
    text = error_text(ValueError(CARD + "x" * MB))
    assert TEXTS_GIVEN == [REDACT_LENGTH]
    assert text == (CARD + "x" * MB)[:REDACT_LENGTH] + CUT


def test_describe_error__a_megabyte_error_or_reason_is_stored_cut() -> None:
    name, message = describe_error(DataError(ADVERSARIAL["pg quoted newlines"]))
    assert (name, message) == (
        "django.db.utils.DataError",
        "invalid input syntax for type integer: '…'" + CUT,
    )
    assert describe_error("\x00" * MB) == ("", "\\x00" * (MAX_ERROR_LENGTH // 4))


def test_log_exception__a_megabyte_error_logs_one_cut_line(readings: list[Reading]) -> None:
    error = DataError(ADVERSARIAL["pg quoted newlines"])
    with captured("django_leases.worker", logging.DEBUG) as lines:
        try:
            raise error
        except DataError:
            logging.getLogger("django_leases.worker").exception("job_id=%s failed", 7)
    (text,) = lines
    assert text.splitlines()[0] == (
        "ERROR django_leases.worker job_id=7 failed: django.db.utils.DataError: "
        "invalid input syntax for type integer: '…'" + CUT
    )
    assert CARD not in text and len(text) < 2 * REDACT_LENGTH, len(text)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_megabyte_error_text_costs_no_other_job_its_lease(
    processes: Processes,
) -> None:
    """One job's error quotes a value of 1 MB (newlines, which the redaction once read in
    quadratic time under the GIL, freezing the worker): its error is recorded, cut and
    redacted, and the job beside it keeps its lease (a second worker would take it over)."""
    other = PaymentJob.objects.enqueue("sleep", {"seconds": 4})
    bad = PaymentJob.objects.enqueue(
        "huge_database_error", {"card": CARD, "newlines": MB}, max_attempts=1
    )
    lease = ("--ttl", "3", "--heartbeat", "0.5")
    kinds = ("--kind", "sleep", "huge_database_error")
    processes.manage("run_lease_worker", "--concurrency", "2", *lease, *kinds, "--burst")
    wait_for(lambda: PaymentJob.objects.filter(pk=other.pk, status=PROCESSING).exists())
    # Takes `other` over if its lease expires.
    rescuer = processes.manage("run_lease_worker", *lease, "--kind", "sleep", "-v", "2")

    wait_for(lambda: PaymentJob.objects.filter(pk=bad.pk, status=FAILED).exists(), timeout=30)
    wait_for(lambda: PaymentJob.objects.filter(pk=other.pk, status=COMPLETED).exists())
    rescuer.send_signal(signal.SIGTERM)
    out = rescuer.communicate(timeout=60)[0]
    assert rescuer.returncode == 0, out

    other.refresh_from_db()
    assert other.attempts == 1, out
    assert list(JobAttempt.objects.filter(job_ref=other.pk).values_list("outcome", flat=True)) == [
        "completed"
    ]
    bad.refresh_from_db()
    expected = "django.db.utils.DataError: invalid input syntax for type integer: '…'" + CUT
    assert bad.last_error == expected
    (attempt,) = JobAttempt.objects.filter(job_ref=bad.pk)
    assert (attempt.outcome, attempt.error_message) == ("failed", expected.split(": ", 1)[1])


# ---- what is logged -----------------------------------------------------------------------------


@contextmanager
def captured(name: str, level: int) -> Iterator[list[str]]:
    """Collect what the handlers of logger `name` would write, formatted, at `level`."""
    logger = logging.getLogger(name)
    lines: list[str] = []
    handler = logging.Handler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def chained_database_error() -> IntegrityError:
    """A database error as Django raises it: its driver's error, quoting the card, as cause."""
    try:
        try:
            raise sqlite3.IntegrityError(f"Duplicate entry '{VALUE}' for key 'c'")
        except sqlite3.IntegrityError as driver:
            raise IntegrityError(*driver.args) from driver
    except IntegrityError as exc:
        return exc


def test_loggers__every_logger_of_the_package_redacts() -> None:
    names = {
        name
        for path in (ROOT / "django_leases").rglob("*.py")
        for name in re.findall(r"""getLogger\(["']([\w.]+)["']\)""", path.read_text())
    }
    assert names and names <= set(LOGGERS)
    for name in LOGGERS:
        assert any(isinstance(f, RedactExceptions) for f in logging.getLogger(name).filters), name


@pytest.mark.parametrize("name", LOGGERS)
def test_log_exception__one_redacted_line_below_debug(name: str) -> None:
    error = chained_database_error()
    with captured(name, logging.INFO) as lines:
        try:
            raise error
        except IntegrityError:
            logging.getLogger(name).exception("reconcile hook failed job_id=%s", 7)
    assert lines == [
        f"ERROR {name} reconcile hook failed job_id=7: django.db.utils.IntegrityError: "
        "Duplicate entry '…' for key 'c'"
    ]


def test_log_exception__redacted_traceback_at_debug() -> None:
    error = chained_database_error()
    with captured("django_leases.worker", logging.DEBUG) as lines:
        try:
            raise error
        except IntegrityError:
            logging.getLogger("django_leases.worker").exception("slot thread %s failed", 2)
    (text,) = lines
    assert CARD not in text and "cd " not in text, text
    head, traceback = text.split("\n", 1)
    assert head.startswith("ERROR django_leases.worker slot thread 2 failed: ")
    assert traceback.startswith("Traceback (most recent call last):\n")
    assert traceback.count("Traceback (most recent call last):") == 2
    assert "sqlite3.IntegrityError: Duplicate entry '…' for key 'c'" in traceback
    assert "The above exception was the direct cause of the following exception:" in traceback
    assert "in chained_database_error" in traceback
    assert traceback.endswith("django.db.utils.IntegrityError: Duplicate entry '…' for key 'c'")


def test_log_exception__an_exception_argument_and_a_broken_hook() -> None:
    error = chained_database_error()
    with captured("django_leases.watcher", logging.INFO) as lines:
        logging.getLogger("django_leases.watcher").warning("outage: %s", error)
        with override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.broken"}):
            try:
                raise error
            except IntegrityError:
                logging.getLogger("django_leases.watcher").exception("pass failed")
    assert lines == [
        "WARNING django_leases.watcher outage: django.db.utils.IntegrityError: "
        "Duplicate entry '…' for key 'c'",
        "ERROR django_leases.watcher pass failed: django.db.utils.IntegrityError: "
        "[error text withheld: REDACT_ERRORS raised RuntimeError]",
    ]


def test_log_filter__survives_a_logging_configuration() -> None:
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "loggers": {"django_leases.worker": {"level": "INFO"}},
        }
    )
    worker = logging.getLogger("django_leases.worker")
    assert any(isinstance(f, RedactExceptions) for f in worker.filters)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("verbosity", ["1", "3"])  # the watcher's DEBUG is -v 3
def test_watcher__a_failing_reconcile_hook_logs_no_value(
    processes: Processes, verbosity: str
) -> None:
    value = CARD if connection.vendor == "postgresql" else VALUE  # out of range; a quote
    job = PaymentJob.objects.enqueue("risky_unreconcilable", {"value": value}, max_attempts=1)
    claimed = PaymentJob.objects.claim_job(job.pk, "victim", ttl=60)
    assert claimed is not None
    PaymentJob.objects.checkpoint(job.pk, "victim", claimed.lease_token, "psp_called")
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=5))
    settings = json.dumps({"STUCK_POLICY_BY_KIND": {"risky_unreconcilable": "review"}})
    env = subprocess_env(LEASES_TEST_SETTINGS=settings)

    proc = processes.manage("watch_stuck_jobs", "--once", "-v", verbosity, env=env)
    out = proc.communicate(timeout=120)[0]

    assert proc.returncode == 0, out
    assert f"reconcile hook failed job_id={job.pk} kind=risky_unreconcilable" in out, out
    assert PaymentJob.objects.get(pk=job.pk).status == "review"
    assert CARD not in out and "cd " not in out, out
    assert ("Traceback (most recent call last)" in out) == (verbosity == "3"), out
