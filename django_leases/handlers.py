"""The kind registry: each job kind's `Kind` spec (its handler, reconcile hook, timeout, ack
mode, `limit=` and `rate=`, lease length, attempt budget), filled by `@job_handler` in each
installed app's `jobs.py`.

Everything reads it (the query layer, the watcher, the admin, the checks, the worker), so it
imports nothing above it; running a handler is the worker's (`worker/attempt.py`)."""

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any

from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import HandlerError, InvalidArgument, InvalidDuration
from django_leases.limits import MAX_ATTEMPTS, MIN_TTL, check_int, check_kind
from django_leases.status import Verdict
from django_leases.throttles import Throttle, throttle

# A handler is a function of (job, lease), the lease a `django_leases.lease.Lease` (not imported:
# the registry sits below everything that runs handlers): plain, `async def`, or a plain one
# that returns an awaitable. Whatever it returns that is awaitable is awaited before the job
# counts as done (`django_leases.worker.attempt.run_handler()`).
HandlerFunc = Callable[[Any, Any], object]
# A reconcile hook is given an expired job and says what became of it: "completed", "retry" or
# "failed" (see watch_stuck_jobs). It typically asks the PSP about the job's idempotency key.
ReconcileFunc = Callable[[Any], str]
RECONCILE_VERDICTS = tuple(Verdict.values)
ACK_EACH = "each"
"""The completion is written as soon as the handler returns (the default)."""
ACK_BATCH = "batch"
"""The worker buffers completions and writes them in batches: a crash before the write runs the
job again (see `LeaseWorker`)."""
ACK_MODES = (ACK_EACH, ACK_BATCH)


@dataclass(frozen=True)
class Kind:
    """What the registry knows of one job kind, as `@job_handler` declared it."""

    kind: str
    func: HandlerFunc
    reconcile: ReconcileFunc | None = None
    timeout: float | None = None
    """Seconds an attempt may run before the worker ends it as timed out; None: no limit."""
    ack: str = ACK_EACH
    """How the worker writes a completion: "each" at once, "batch" buffered with others."""
    throttle: Throttle | None = None
    """The kind's `limit=` and `rate=` across every worker; None: neither."""
    ttl: float | None = None
    """The length of every lease of the kind in seconds; None: the worker's (`--ttl`)."""
    max_attempts: int | None = None
    """The attempts a job of the kind gets unless its `enqueue()` says; None: MAX_ATTEMPTS."""

    @property
    def name(self) -> str:
        func = self.func
        module = getattr(func, "__module__", None) or type(func).__module__
        qualname = getattr(func, "__qualname__", None) or type(func).__qualname__
        return f"{module}.{qualname}"

    @property
    def stuck_policy(self) -> str:
        """What the watcher makes of an expired job of the kind past a checkpoint: "retry" or
        "review" (DJANGO_LEASES["STUCK_POLICY_BY_KIND"], else "STUCK_POLICY")."""
        return leases_settings.stuck_policy(self.kind)

    @property
    def is_async(self) -> bool:
        """Whether the handler is an `async def` function (the worker can cancel it)."""
        return inspect.iscoroutinefunction(self.func)


_registry: dict[str, Kind] = {}
# The throttles and lease lengths of the registered kinds that have them, kept beside the
# registry: every claim and renewal reads them.
_throttles: dict[str, Throttle] = {}
_lease_lengths: dict[str, float] = {}


def job_handler(
    kind: str,
    *,
    reconcile: ReconcileFunc | None = None,
    timeout: float | timedelta | None = None,
    ack: str = ACK_EACH,
    limit: int | None = None,
    rate: tuple[int, float | timedelta] | None = None,
    ttl: float | timedelta | None = None,
    max_attempts: int | None = None,
) -> Callable[[HandlerFunc], HandlerFunc]:
    """Register the decorated function as the handler of jobs of `kind`.

    Args:
        kind: the job kind, as given to `enqueue()`.
        reconcile: optional hook the stuck watcher calls with an expired job of this kind; it
            returns "completed", "retry" or "failed".
        timeout: optional run-time limit of one attempt (seconds or a `timedelta`). An attempt
            still running then no longer holds its lease: it ends as timed out and the job
            follows its kind's retry or review policy. An `async def` handler is cancelled.
        ack: "each" (default) writes each completion at once; "batch" lets the worker write
            completions of this kind in batches (ACK_BATCH_SIZE, ACK_FLUSH_INTERVAL), one
            statement per batch. A worker killed before a batch is written leaves those jobs
            to run again: use it only for kinds that tolerate a re-run.
        limit: optional; at most this many jobs of the kind processing at once, across every
            worker on every host (a lease that expired no longer counts).
        rate: optional (N, seconds); at most N jobs of the kind claimed within any window of
            `seconds` (or a `timedelta`), across every worker, by the database clock.
        ttl: optional length of every lease of the kind (seconds or a `timedelta`), whoever
            claims or renews it; kinds without one get the worker's `--ttl`.
        max_attempts: optional attempt budget of the kind's jobs, used when `enqueue()` is
            not given one (default: DJANGO_LEASES["MAX_ATTEMPTS"]).
    """
    try:
        check_kind(kind)
    except InvalidArgument as exc:
        raise HandlerError(str(exc)) from None
    if reconcile is not None and not callable(reconcile):
        raise HandlerError(f"reconcile hook of job kind {kind!r} is not callable: {reconcile!r}")
    seconds = _timeout(kind, timeout)
    if ack not in ACK_MODES:
        raise HandlerError(
            f"job kind {kind!r}: ack must be one of {', '.join(map(repr, ACK_MODES))}, got {ack!r}"
        )

    try:
        throttled = throttle(limit, rate)
        length = None if ttl is None else to_seconds(ttl, "ttl", MIN_TTL)
        if max_attempts is not None:
            check_int(max_attempts, "max_attempts", MAX_ATTEMPTS)
    except InvalidArgument as exc:
        raise HandlerError(f"job kind {kind!r}: {exc}") from None

    def register(func: HandlerFunc) -> HandlerFunc:
        _check_callable(kind, func)
        handler = Kind(kind, func, reconcile, seconds, ack, throttled, length, max_attempts)
        existing = _registry.get(kind)
        # Re-importing the same module (autoreload, tests) registers the same function again.
        if existing is not None and existing.name != handler.name:
            raise HandlerError(
                f"job kind {kind!r} already has the handler {existing.name}; "
                f"cannot register {handler.name} too"
            )
        _registry[kind] = handler
        _keep(_throttles, kind, throttled)
        _keep(_lease_lengths, kind, length)
        lease_lengths_of.cache_clear()
        return func

    return register


def _keep(table: dict[str, Any], kind: str, value: object) -> None:
    """Set `kind`'s entry of `table` to `value`, or remove it if `value` is None."""
    if value is None:
        table.pop(kind, None)
    else:
        table[kind] = value


def _timeout(kind: str, timeout: float | timedelta | None) -> float | None:
    if timeout is None:
        return None
    try:
        return to_seconds(timeout, "timeout")
    except InvalidDuration as exc:
        raise HandlerError(f"job kind {kind!r}: {exc}") from None


def _check_callable(kind: str, func: object) -> None:
    """Refuse at import time what the worker could not run as a handler."""
    if not callable(func):
        raise HandlerError(f"the handler of job kind {kind!r} is not callable: {func!r}")
    # A generator's body runs only when iterated: the worker would record a job completed
    # whose body never ran.
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        raise HandlerError(
            f"the handler of job kind {kind!r} is a generator function ({func!r}); a handler "
            "must be a plain function or an `async def` coroutine function"
        )


def get_handler(kind: str) -> Kind:
    """Return the handler of `kind`, or raise `HandlerError`."""
    try:
        return _registry[kind]
    except KeyError:
        raise HandlerError(f"no handler is registered for job kind {kind!r}") from None


def throttles() -> dict[str, Throttle]:
    """Return the `Throttle` of every registered kind that has one (do not change it)."""
    return _throttles


def lease_lengths() -> dict[str, float]:
    """Return the `ttl=` of every registered kind that has one, in seconds (do not change it)."""
    return _lease_lengths


Lengths = tuple[tuple[str, float], ...]
"""(kind, seconds) pairs: the kinds whose leases are not of the default length, and theirs."""


@lru_cache(maxsize=256)
def lease_lengths_of(
    seconds: float, kinds: tuple[str, ...] | None, excluded: tuple[str, ...] = ()
) -> Lengths:
    """Return the kinds of `kinds` (None: every kind but `excluded`) whose `ttl=` is not
    `seconds`, with that ttl. Cached for the claims, and forgotten when a handler is
    registered or unregistered."""
    known = _lease_lengths
    wanted = known.keys() - set(excluded) if kinds is None else known.keys() & set(kinds)
    return tuple((kind, known[kind]) for kind in sorted(wanted) if known[kind] != seconds)


def lease_length(kind: str, default: float) -> float:
    """Return the length of a lease of `kind` in seconds: its `ttl=`, else `default`."""
    return _lease_lengths.get(kind, default)


def min_lease(kinds: Iterable[str], default: float) -> float:
    """Return the length in seconds of the shortest lease of `kinds` (each its `ttl=`, else
    `default`): a worker serving them bounds its waits on the database by it (NETWORK_TIMEOUT
    "auto"), so that a blocked renewal fails in time to be retried before that lease ends."""
    return min((lease_length(kind, default) for kind in kinds), default=default)


def near_window(kind: str, seconds: float) -> float:
    """Return the near-expiry window of a lease of `kind`, given `seconds` for a lease of
    DJANGO_LEASES["TTL"]: scaled to the kind's own `ttl=`, so a short lease is not always near
    its end and a long one is flagged as early in its life as a default one."""
    default = float(leases_settings.TTL)
    return seconds * lease_length(kind, default) / default


def max_attempts_of(kind: str) -> int | None:
    """Return the `max_attempts=` of `kind`'s handler, or None."""
    handler = _registry.get(kind)
    return None if handler is None else handler.max_attempts


def registered_kinds() -> list[str]:
    return sorted(_registry)


def unregister(kind: str) -> None:
    """Forget the handler of `kind` (for tests and plugins that swap handlers)."""
    _registry.pop(kind, None)
    _throttles.pop(kind, None)
    _lease_lengths.pop(kind, None)
    lease_lengths_of.cache_clear()


def autodiscover() -> None:
    """Import `jobs.py` of every installed app, the way the admin imports `admin.py`."""
    from django.utils.module_loading import autodiscover_modules

    autodiscover_modules("jobs")
