"""Errors raised by django-leases. Every one derives from `LeaseError`."""

from django.db import OperationalError


class LeaseError(Exception):
    """Base class of every django-leases error."""


class LeaseLost(LeaseError):
    """The holder no longer owns the job: its lease expired, was taken over or was fenced out."""


class Cancelled(LeaseLost):
    """An operator cancelled the job while this holder ran it: stop; nothing more is written."""


class PermanentError(LeaseError):
    """Raised by a handler for an error that must not be retried: the job fails at once."""


class InvalidTaskJob(PermanentError):
    """A job of a task queue names no task of a `LeaseBackend`: it fails without running."""


class InvalidArgument(LeaseError, ValueError):
    """An argument is of the wrong type or outside its range; nothing was written."""


class InvalidPayload(InvalidArgument):
    """The payload (or a task's result) cannot be stored as JSON; nothing was written."""


class IdempotencyKeyReused(LeaseError, ValueError):
    """An idempotency key names a job of another kind or payload than the one enqueued with it:
    nothing was enqueued, and that job is untouched."""


class PayloadTooLarge(InvalidPayload):
    """A payload (or a handler's result) is larger than `MAX_PAYLOAD_BYTES` as JSON; nothing
    was written."""


class InvalidDuration(InvalidArgument):
    """A duration argument is not positive seconds or a `timedelta`, or is too long."""


class HandlerError(LeaseError):
    """A job handler is registered twice for one kind, or is missing for a kind."""


class HandlerTimeout(LeaseError):
    """A handler ran past its kind's `timeout`: the attempt ends as timed out."""


class WorkerIdTaken(LeaseError):
    """Another live worker process already runs under this worker id."""


class TaskFailed(LeaseError):
    """Stands for the error of a failed task, its text redacted, while `task_finished` is sent:
    the Tasks framework logs the exception being handled, which must not be the raw one."""


class DatabaseMisconfigured(LeaseError):
    """The database refuses the project's settings (login, database name, options, session
    clock) or lacks the tables: waiting cannot help. The message names what to fix."""


class GateBusy(LeaseError, OperationalError):
    """A claim waited for a throttled kind's gate longer than its bound: another session holds
    it. The claim takes the other kinds; this kind waits for a later claim."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"the gate of job kind {kind!r} was held past the claim's wait")
        self.kind = kind
