"""The registry of job handlers, filled by `@job_handler` in each installed app's `jobs.py`."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_leases.exceptions import HandlerError

if TYPE_CHECKING:
    from django_leases.lease import Lease

HandlerFunc = Callable[[Any, "Lease"], object]
# A reconcile hook is given an expired job and says what became of it: "completed", "retry" or
# "failed" (see watch_stuck_jobs). It typically asks the PSP about the job's idempotency key.
ReconcileFunc = Callable[[Any], str]
RECONCILE_VERDICTS = ("completed", "retry", "failed")
KIND_MAX_LENGTH = 100


@dataclass(frozen=True)
class Handler:
    kind: str
    func: HandlerFunc
    reconcile: ReconcileFunc | None = None

    @property
    def name(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"


_registry: dict[str, Handler] = {}


def job_handler(
    kind: str, *, reconcile: ReconcileFunc | None = None
) -> Callable[[HandlerFunc], HandlerFunc]:
    """Register the decorated function as the handler of jobs of `kind`.

    Args:
        kind: the job kind, as given to `enqueue()`.
        reconcile: optional hook the stuck watcher calls with an expired job of this kind; it
            returns "completed", "retry" or "failed".
    """
    if not isinstance(kind, str) or not kind or len(kind) > KIND_MAX_LENGTH:
        raise HandlerError(
            f"job kind must be a non-empty string of at most 100 characters, got {kind!r}"
        )

    def register(func: HandlerFunc) -> HandlerFunc:
        handler = Handler(kind, func, reconcile)
        existing = _registry.get(kind)
        # Re-importing the same module (autoreload, tests) registers the same function again.
        if existing is not None and existing.name != handler.name:
            raise HandlerError(
                f"job kind {kind!r} already has the handler {existing.name}; "
                f"cannot register {handler.name} too"
            )
        _registry[kind] = handler
        return func

    return register


def get_handler(kind: str) -> Handler:
    """Return the handler of `kind`, or raise `HandlerError`."""
    try:
        return _registry[kind]
    except KeyError:
        raise HandlerError(f"no handler is registered for job kind {kind!r}") from None


def registered_kinds() -> list[str]:
    return sorted(_registry)


def unregister(kind: str) -> None:
    """Forget the handler of `kind` (for tests and plugins that swap handlers)."""
    _registry.pop(kind, None)


def autodiscover() -> None:
    """Import `jobs.py` of every installed app, the way the admin imports `admin.py`."""
    from django.utils.module_loading import autodiscover_modules

    autodiscover_modules("jobs")
