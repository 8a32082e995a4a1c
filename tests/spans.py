"""The OpenTelemetry SDK of the tracing tests: spans kept in memory by a tracer provider of the
test's own, or, in a worker subprocess, written by the global one to a file, one JSON a line."""

import json
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


def in_memory() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider whose ended spans the returned exporter keeps."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def export_to_file(path: str) -> None:
    """Make the global tracer provider write each span, as it ends, to `path`."""
    out = Path(path).open("a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans a worker subprocess wrote to `path`, as `ReadableSpan.to_json()` gives them."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def ids(span: ReadableSpan) -> tuple[int, int]:
    """(trace id, span id) of an in-memory span."""
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id
