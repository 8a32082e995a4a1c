"""The queue history drawn as server-rendered SVG: jobs per bin (completed, failed and retried,
stacked), wait and run time (p50 and p95) and the backlog, over the last hour, day or week of
one kind or of every kind. Laid out here; the template only writes the shapes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import models

from django_leases.querysets.base import database_now
from django_leases.querysets.history import (
    MINUTE,
    KindMinute,
    QueueMinuteQuerySet,
    merged,
    quantile,
)
from django_leases.status import HISTORY_COUNTS


@dataclass(frozen=True)
class Span:
    """A chart's range: `bins` bars of `width` minutes each."""

    name: str
    label: str
    bins: int
    width: int


SPANS = {
    span.name: span
    for span in (
        Span("hour", "last hour", 60, 1),
        Span("day", "last day", 96, 15),
        Span("week", "last week", 168, 60),
    )
}
HEIGHT = 120
BAR = 10
STACK = HISTORY_COUNTS


def span_of(name: str | None) -> Span:
    """The span named `name`; the hour for anything else."""
    return SPANS.get(name or "", SPANS["hour"])


def binned(
    history: QueueMinuteQuerySet, job_model: type[models.Model], kind: str, span: Span
) -> tuple[datetime, list[KindMinute]]:
    """The recorded minutes of `kind` over `span`, added up per bin; the first bin's start."""
    end = database_now(history.db).replace(second=0, microsecond=0)
    start = end - span.bins * span.width * MINUTE
    bins = [KindMinute() for _ in range(span.bins)]
    for minute, row in history.series(job_model, kind, start):
        i = int((minute - start) / MINUTE) // span.width
        if 0 <= i < span.bins:
            depth = row.depth
            row.depth = None  # a backlog is a level: the bin shows its highest, not a sum
            bins[i].add(row)
            if depth is not None:
                bins[i].depth = max(bins[i].depth or 0, depth)
    return start, bins


def charts(
    history: QueueMinuteQuerySet, job_model: type[models.Model], kind: str, span: Span
) -> dict[str, Any]:
    """Lay `kind`'s history over `span` out as the three charts' shapes."""
    start, bins = binned(history, job_model, kind, span)
    width = timedelta(minutes=span.width)
    peak = max((sum(getattr(b, name) for name in STACK) for b in bins), default=0) or 1
    bars = []
    for i, b in enumerate(bins):
        y, stack = HEIGHT, []
        for name in STACK:
            h = _height(getattr(b, name), peak)
            y -= h
            stack.append({"name": name, "y": y, "h": h})
        bars.append({"x": i * BAR, "start": start + i * width, "bin": b, "stack": stack})
    times = {
        name: [quantile(b.wait if name.startswith("wait") else b.run, q) for b in bins]
        for name, q in (("wait_p50", 0.5), ("wait_p95", 0.95), ("run_p50", 0.5), ("run_p95", 0.95))
    }
    slowest = max((t for series in times.values() for t in series if t is not None), default=0.0)
    depths = [b.depth for b in bins]
    deepest = max((d for d in depths if d is not None), default=0)
    hour = merged(b.wait for b in bins), merged(b.run for b in bins)
    return {
        "span": span,
        "width": span.bins * BAR,
        "height": HEIGHT,
        "bars": bars,
        "peak": peak,
        "totals": {name: sum(getattr(b, name) for b in bins) for name in STACK},
        "times": {name: _line(series, slowest) for name, series in times.items()},
        "slowest": slowest,
        "wait_p95": quantile(hour[0], 0.95),
        "run_p95": quantile(hour[1], 0.95),
        "depth": _line(depths, deepest),
        "deepest": deepest,
        "start": start,
    }


def _height(n: int, peak: float) -> int:
    return max(1, round(n * HEIGHT / peak)) if n else 0  # one job still shows


def _line(values: list[Any], top: float) -> str:
    """SVG polyline points of `values` (None: no point) scaled to `top`."""
    top = top or 1
    return " ".join(
        f"{i * BAR + BAR / 2:g},{HEIGHT - value * HEIGHT / top:.1f}"
        for i, value in enumerate(values)
        if value is not None
    )
