"""OpenTelemetry tracing (the `otel` extra): the enqueuer's trace context stored with each job,
each attempt traced as its continuation. The only module that imports opentelemetry.

An enqueue stores the W3C trace context of the span current in the enqueuing code (a Django
request's, say) in the job's `trace_context` (`enqueue.job_values()`). A worker traces each
attempt (`worker.attempt.TracedAttempts`) with spans named and described by OpenTelemetry's
messaging conventions (`messaging.system` "django_leases", the kind as
`messaging.destination.name`, the job id as `messaging.message.id`):

- `process <kind>` (CONSUMER), a child of the stored context (a root without one), from the
  claim's statement to the written outcome; current while the handler runs, so the handler's own
  spans are its children; the attempt's start and end (attempt, token, outcome) as its events;
- `receive <kind>` (CLIENT) inside it: from the claim's statement to the handler's start (a job
  claimed ahead waits in the worker until a slot is free);
- `settle <kind>` (CLIENT) inside it: from the handler's return to the outcome written (with the
  default completer that write also claims the slot's next job).

Off (`TRACING = False`) or without opentelemetry-api, an enqueue stores nothing and the worker
runs the untraced `Attempts`, chosen once as it starts.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from django_leases.conf import leases_settings
from django_leases.redaction import error_text
from django_leases.status import AttemptOutcome

try:
    from opentelemetry import context, propagate, trace
except ImportError:  # the otel extra is not installed
    INSTALLED = False
else:
    INSTALLED = True

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


class TracedLease(Protocol):
    """What the spans read of a `lease.Lease` (typed here: the lease layer imports this module)."""

    job: Any
    pk: int
    owner: str
    attempt: int
    token: int
    outcome: str | None

    @property
    def lost(self) -> bool: ...

    def claimed_ago(self) -> float: ...


SYSTEM = "django_leases"
"""`messaging.system`: the queue, as OpenTelemetry's messaging conventions name it."""

_attempt: ContextVar[AttemptTrace] = ContextVar("django_leases_attempt")


def enabled() -> bool:
    """Whether jobs carry their enqueuer's trace context and workers trace their attempts."""
    return INSTALLED and leases_settings.TRACING is True


def current_context() -> dict[str, str] | None:
    """Return the trace context of the caller's current span as the configured propagator
    writes it (W3C `traceparent` and `tracestate` by default), or None: tracing off, or no
    span current."""
    if not INSTALLED or leases_settings.TRACING is not True:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


@cache
def _tracer() -> Tracer:
    from django_leases import __version__  # read from the metadata once, when first traced

    return trace.get_tracer(SYSTEM, __version__)


class AttemptTrace:
    """The spans of one attempt (the module's docstring), their times by the wall clock."""

    def __init__(self, lease: TracedLease) -> None:
        job = lease.job
        self.kind: str = job.kind
        self.claimed_ns = time.time_ns() - int(lease.claimed_ago() * 1e9)
        self.handled_ns: int | None = None
        self.attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM,
            "messaging.destination.name": job.kind,
            "messaging.message.id": str(lease.pk),
            "messaging.client.id": lease.owner,
            "django_leases.attempt": lease.attempt,
            "django_leases.token": lease.token,
        }
        stored = job.trace_context
        parent = propagate.extract(stored) if isinstance(stored, dict) else context.Context()
        self.span: Span = _tracer().start_span(
            f"process {job.kind}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes={**self.attributes, "messaging.operation.type": "process"},
            start_time=self.claimed_ns,
        )

    def _child(self, operation: str, name: str, start: int, end: int, **extra: Any) -> None:
        span = _tracer().start_span(
            f"{operation} {self.kind}",
            context=trace.set_span_in_context(self.span),
            kind=trace.SpanKind.CLIENT,
            attributes={
                **self.attributes,
                "messaging.operation.type": operation,
                "messaging.operation.name": name,
                **extra,
            },
            start_time=start,
        )
        span.end(end_time=end)

    def started(self) -> None:
        """Note the handler's start: the claim's span ends, the attempt's event."""
        now = time.time_ns()
        self._child("receive", "claim", self.claimed_ns, now)
        self.span.add_event("django_leases.attempt.started", self.attributes, timestamp=now)

    def raised(self, exc: BaseException) -> None:
        """Record what the handler raised, its text as REDACT_ERRORS keeps it."""
        self.span.add_event(
            "exception",
            {
                "exception.type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                "exception.message": error_text(exc),
                # The innermost frames only: a RecursionError's thousand frames would be
                # formatted on the slot's thread, and sent, for nothing more.
                "exception.stacktrace": "".join(
                    traceback.format_tb(exc.__traceback__, limit=-STACK_FRAMES)
                ),
            },
        )
        self.span.set_status(trace.StatusCode.ERROR, type(exc).__qualname__)

    def end(self, lease: TracedLease) -> None:
        """End the attempt's spans with its outcome (the completion's span if the handler ran)."""
        now = time.time_ns()
        outcome = lease.outcome or (AttemptOutcome.LEASE_LOST if lease.lost else "")
        ended = {"django_leases.outcome": str(outcome)}
        if self.handled_ns is not None:
            self._child("settle", str(outcome or "settle"), self.handled_ns, now, **ended)
        self.span.add_event("django_leases.attempt.ended", ended, timestamp=now)
        self.span.set_attributes(ended)
        self.span.end(end_time=now)


STACK_FRAMES = 30
"""The frames of a handler's traceback an exception event keeps (the innermost)."""


@contextmanager
def attempt(lease: TracedLease) -> Iterator[None]:
    """Trace `lease`'s attempt: its span current on this thread until it ends."""
    spans = AttemptTrace(lease)
    token = _attempt.set(spans)
    try:
        with trace.use_span(spans.span, end_on_exit=False, record_exception=False):
            yield
    finally:
        _attempt.reset(token)
        spans.end(lease)


@contextmanager
def handler_running() -> Iterator[None]:
    """Mark the handler's run inside the current `attempt()`: its start, what it raised, its end."""
    spans = _attempt.get()
    spans.started()
    try:
        yield
    except BaseException as exc:
        spans.raised(exc)
        raise
    finally:
        spans.handled_ns = time.time_ns()
