"""`run_lease_worker --processes N`: the options of each worker process, and its supervisor."""

from typing import Any

from django.core.management.base import CommandError

from django_leases.limits import PORT
from django_leases.listener import Listener
from django_leases.management.commands._options import stop_signals
from django_leases.supervisor import Supervisor
from django_leases.worker import LeaseWorker

# Options passed on as they were given (None: not given, the process reads the setting).
PASSED_ON = (
    "ttl",
    "heartbeat",
    "concurrency",
    "max_jobs",
    "poll_interval",
    "database",
    "grace_period",
    "ack_batch_size",
    "ack_flush_interval",
    "metrics_address",
)
FLAGS = ("burst", "traceback", "no_color", "force_color")
WORKER_ID_ROOM = 240
"""The longest --worker-id with --processes: each process adds "-<start number>"."""


def worker_arguments(options: dict[str, Any], number: int, start: int) -> list[str]:
    """The options of worker process `number` (from 1), the supervisor's `start`-th start:
    the supervisor's own, its worker id suffixed with the start and its metrics port with the
    process's place (0: each picks a free one). The supervisor ran the system checks."""
    arguments = [f"--verbosity={options['verbosity']}", "--skip-checks"]
    arguments += [
        f"--{name.replace('_', '-')}={options[name]}"
        for name in PASSED_ON
        if options[name] is not None
    ]
    arguments += [f"--{name.replace('_', '-')}" for name in FLAGS if options.get(name)]
    if options["kinds"]:
        arguments += ["--kind", *options["kinds"]]
    if options["model"] is not None:
        arguments.append(f"--model={options['model']._meta.label}")
    if options["worker_id"] is not None:
        arguments.append(f"--worker-id={options['worker_id']}-{start}")
    if options["metrics_port"] is not None:
        port = options["metrics_port"] and options["metrics_port"] + number - 1
        arguments.append(f"--metrics-port={port}")
    return arguments


def supervise(worker: LeaseWorker, processes: int, options: dict[str, Any]) -> None:
    """Run `processes` worker processes configured as `worker` (checked, never run) until they
    are done or stopped; a `CommandError` if one refused its options or database."""
    port = options["metrics_port"]
    if port and port + processes - 1 > PORT[1]:
        raise CommandError(
            f"--metrics-port {port} with --processes {processes}: the processes serve ports "
            f"{port} to {port + processes - 1}, past {PORT[1]}"
        )
    if options["worker_id"] is not None and len(options["worker_id"]) > WORKER_ID_ROOM:
        raise CommandError(
            f"--worker-id with --processes is at most {WORKER_ID_ROOM} characters (each "
            'process adds "-<start number>")'
        )
    supervisor = Supervisor(
        processes,
        lambda number, start: worker_arguments(options, number, start),
        listener=Listener.for_model(worker.model, worker.using, worker.min_lease),
        burst=worker.burst,
    )
    with stop_signals(supervisor.stop, at_second=supervisor.pass_on):
        supervisor.run()
    if supervisor.failure is not None:
        raise CommandError(supervisor.failure)
