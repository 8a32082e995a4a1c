"""OpenTelemetry tracing: the enqueuer's trace context stored with each job, and each attempt
traced as its continuation, in the worker of this process and in a `run_lease_worker` one."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db.models.functions import Now
from django.test import override_settings
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from django_leases import job_handler, tracing
from django_leases.exceptions import InvalidArgument
from django_leases.handlers import unregister
from django_leases.models import JobAttempt, PaymentJob
from django_leases.tracing import STACK_FRAMES
from django_leases.worker import LeaseWorker
from django_leases.worker.attempt import Attempts, TracedAttempts
from tests.testapp.models import LockRun
from tests.testapp.tasks import add

from .conftest import Processes, finish, modules_importing, subprocess_env
from .spans import ids, in_memory, read_spans

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Tracer, InMemorySpanExporter]]:
    """A tracer for the test's own spans (the "request" that enqueues) and the exporter that
    keeps them and the worker's: one SDK provider of the test's own, the global one left alone."""
    provider, exporter = in_memory()
    monkeypatch.setattr(tracing, "_tracer", lambda: provider.get_tracer(tracing.SYSTEM))
    yield provider.get_tracer("tests"), exporter
    provider.shutdown()


def traceparent(span: Any) -> str:
    """The span's W3C `traceparent` header."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def drain(*kinds: str) -> None:
    LeaseWorker(
        worker_id="traced", kinds=list(kinds), burst=True, ttl=30, heartbeat=5, poll_interval=0.05
    ).run()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return sorted(
        (span for span in exporter.get_finished_spans() if span.name == name),
        key=lambda span: span.start_time or 0,
    )


def children(exporter: InMemorySpanExporter, parent: ReadableSpan) -> dict[str, ReadableSpan]:
    _, span_id = ids(parent)
    return {
        span.name: span
        for span in exporter.get_finished_spans()
        if span.parent is not None and span.parent.span_id == span_id
    }


def test_enqueue__stores_the_current_spans_context_on_every_insert_path(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, _ = spans

    async def from_async_code() -> PaymentJob:
        return await PaymentJob.objects.aenqueue("noop", {"n": 6})

    with tracer.start_as_current_span("POST /checkout") as request:
        plain = PaymentJob.objects.enqueue("noop", {"n": 1})
        keyed = PaymentJob.objects.enqueue("noop", {"n": 2}, idempotency_key="order-7")
        locked = PaymentJob.objects.enqueue_many("noop", [{"n": 3}, {"n": 4}], lock="payment:7")
        after = PaymentJob.objects.enqueue("noop", {"n": 5}, after=[plain])
        awaited = async_to_sync(from_async_code)()
    outside = PaymentJob.objects.enqueue("noop", {"n": 7})

    stored = dict(PaymentJob.objects.values_list("pk", "trace_context"))
    expected = {"traceparent": traceparent(request)}
    for job in [plain, keyed, *locked, after, awaited]:
        assert stored[job.pk] == expected, job
    assert stored[outside.pk] is None


def test_lease_backend__a_task_carries_the_trace_of_its_enqueuer(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("POST /signup") as request:
        result = add.enqueue(2, 3)
    job = PaymentJob.objects.get(pk=int(result.id))
    assert job.trace_context == {"traceparent": traceparent(request)}

    drain(job.kind)

    [process] = named(exporter, f"process {job.kind}")
    assert process.parent is not None and process.parent.span_id == ids(request)[1]
    assert process.attributes is not None
    assert process.attributes["django_leases.outcome"] == "completed"


def test_enqueue__trace_context_is_no_argument() -> None:
    with pytest.raises(InvalidArgument, match="trace_context is not a column"):
        PaymentJob.objects.enqueue("noop", trace_context={"traceparent": "00-1-2-01"})
    assert PaymentJob.objects.count() == 0


def test_worker__each_attempt_continues_the_enqueuers_trace(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = spans
    with tracer.start_as_current_span("POST /checkout") as request:
        job = PaymentJob.objects.enqueue("traced", {"fail": 1}, max_attempts=3)
    drain("traced")
    PaymentJob.objects.filter(pk=job.pk).update(run_at=Now())  # the retry is due now
    drain("traced")

    trace_id, request_id = ids(request)
    first, second = named(exporter, "process traced")
    runs = list(LockRun.objects.filter(job_ref=job.pk).order_by("pk"))
    tokens = list(JobAttempt.objects.filter(job_ref=job.pk).order_by("attempt"))
    for attempt, (process, run, ledger) in enumerate(
        zip([first, second], runs, tokens, strict=True), start=1
    ):
        assert process.kind == SpanKind.CONSUMER
        assert process.parent is not None and process.parent.span_id == request_id
        assert ids(process)[0] == trace_id
        # The handler ran inside the attempt's span: its own spans are children of it.
        assert run.lock == f"{trace_id:032x}-{ids(process)[1]:016x}"
        assert {
            key: value
            for key, value in (process.attributes or {}).items()
            if key != "messaging.client.id"
        } == {
            "messaging.system": "django_leases",
            "messaging.operation.type": "process",
            "messaging.destination.name": "traced",
            "messaging.message.id": str(job.pk),
            "django_leases.attempt": attempt,
            "django_leases.token": ledger.token,
            "django_leases.outcome": ledger.outcome,
        }
        assert (process.attributes or {})["messaging.client.id"] == ledger.owner
        inside = children(exporter, process)
        assert set(inside) == {"receive traced", "settle traced"}
        receive, settle = inside["receive traced"], inside["settle traced"]
        assert (receive.kind, settle.kind) == (SpanKind.CLIENT, SpanKind.CLIENT)
        assert (receive.attributes or {})["messaging.operation.type"] == "receive"
        assert (settle.attributes or {})["messaging.operation.type"] == "settle"
        assert (settle.attributes or {})["django_leases.outcome"] == ledger.outcome
        # The claim's span opens the attempt's, the completion's closes it.
        assert receive.start_time == process.start_time
        assert receive.end_time <= settle.start_time  # type: ignore[operator]
        assert settle.end_time == process.end_time
    assert [ledger.outcome for ledger in tokens] == ["retried", "completed"]

    failed = [event.name for event in first.events]
    assert failed == ["django_leases.attempt.started", "exception", "django_leases.attempt.ended"]
    exception = first.events[1].attributes or {}
    assert exception["exception.type"] == "builtins.ValueError"
    assert exception["exception.message"] == "card declined"
    assert first.status.status_code == StatusCode.ERROR
    assert [event.name for event in second.events] == [
        "django_leases.attempt.started",
        "django_leases.attempt.ended",
    ]
    assert second.status.status_code == StatusCode.UNSET


def test_worker__a_job_enqueued_outside_a_span_starts_a_trace_of_its_own(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    _, exporter = spans
    PaymentJob.objects.enqueue("traced")
    drain("traced")

    [process] = named(exporter, "process traced")
    assert process.parent is None
    assert set(children(exporter, process)) == {
        "receive traced",
        "settle traced",
    }


@pytest.mark.parametrize("off", ["setting", "not installed"])
def test_tracing__off_stores_no_context_and_traces_no_attempt(
    spans: tuple[Tracer, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch, off: str
) -> None:
    tracer, exporter = spans
    if off == "not installed":
        monkeypatch.setattr(tracing, "INSTALLED", False)
    with override_settings(DJANGO_LEASES={"TRACING": off != "setting"}):
        assert not tracing.enabled()
        with tracer.start_as_current_span("POST /checkout"):
            job = PaymentJob.objects.enqueue("traced")
        worker = LeaseWorker(
            worker_id="untraced", kinds=["traced"], burst=True, ttl=30, heartbeat=5
        )
        assert type(worker._attempts) is Attempts
        worker.run()

    job.refresh_from_db()
    assert (job.trace_context, job.status) == (None, PaymentJob.Status.COMPLETED)
    assert [span.name for span in exporter.get_finished_spans()] == ["POST /checkout"]


def test_worker__traced_attempts_are_chosen_when_tracing_is_on() -> None:
    worker = LeaseWorker(worker_id="traced", kinds=["noop"], ttl=30, heartbeat=5)
    assert type(worker._attempts) is TracedAttempts


@pytest.mark.concurrency
def test_run_lease_worker__its_spans_continue_the_trace_of_another_process(
    spans: tuple[Tracer, InMemorySpanExporter], processes: Processes, tmp_path: Path
) -> None:
    tracer, _ = spans
    with tracer.start_as_current_span("POST /checkout") as request:
        job = PaymentJob.objects.enqueue("traced")
    written = tmp_path / "spans.jsonl"
    env = subprocess_env(LEASES_TEST_SPANS_FILE=str(written))
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "traced", env=env)
    out = finish(proc)
    assert proc.returncode == 0, out

    exported = {span["name"]: span for span in read_spans(written)}
    trace_id, request_id = ids(request)
    process = exported["process traced"]
    assert process["context"]["trace_id"] == f"0x{trace_id:032x}"
    assert process["parent_id"] == f"0x{request_id:016x}"
    assert process["kind"] == str(SpanKind.CONSUMER)
    assert process["attributes"]["messaging.message.id"] == str(job.pk)
    assert process["attributes"]["django_leases.outcome"] == "completed"
    for child in ["receive traced", "charge the card", "settle traced"]:
        assert exported[child]["context"]["trace_id"] == f"0x{trace_id:032x}"
        assert exported[child]["parent_id"] == process["context"]["span_id"], child


WITHOUT_OPENTELEMETRY = (
    "import sys; sys.modules['opentelemetry'] = None; "
    "from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', *sys.argv[1:]])"
)


@pytest.mark.concurrency
def test_run_lease_worker__without_opentelemetry_runs_a_traced_job(
    spans: tuple[Tracer, InMemorySpanExporter], processes: Processes
) -> None:
    tracer, _ = spans
    with tracer.start_as_current_span("POST /checkout"):
        job = PaymentJob.objects.enqueue("noop")
    proc = processes.start("-c", WITHOUT_OPENTELEMETRY, "run_lease_worker", "--burst", "-v", "2")
    out = finish(proc)
    assert proc.returncode == 0, out
    job.refresh_from_db()
    assert (job.status, job.attempts) == (PaymentJob.Status.COMPLETED, 1)
    assert job.trace_context is not None  # stored by this process, left alone by the worker


def test_tracing__only_the_tracing_module_imports_opentelemetry() -> None:
    assert modules_importing("opentelemetry") == ["django_leases/tracing.py"]


def test_worker__an_exception_event_keeps_the_innermost_frames_only(
    spans: tuple[Tracer, InMemorySpanExporter],
) -> None:
    """A handler's RecursionError (a thousand frames) is recorded with its innermost
    `STACK_FRAMES` frames: no traceback of unbounded size formatted on the slot's thread."""
    _, exporter = spans

    # Two functions in turn: Python folds a run of one repeated frame, not these.
    def ping(n: int) -> int:
        return pong(n + 1) + 1

    def pong(n: int) -> int:
        return ping(n + 1) + 1

    job_handler("traced_deep")(lambda job, lease: ping(0))
    try:
        PaymentJob.objects.enqueue("traced_deep", max_attempts=1)
        drain("traced_deep")
    finally:
        unregister("traced_deep")
    [process] = named(exporter, "process traced_deep")
    [event] = [event for event in process.events if event.name == "exception"]
    assert event.attributes["exception.type"] == "builtins.RecursionError"
    frames = str(event.attributes["exception.stacktrace"]).count('  File "')
    assert frames == STACK_FRAMES
