"""The worker: `LeaseWorker` (`loop.py`) and the parts it builds once when it starts.

- `loop.py`: `LeaseWorker`, the claim loop, its supervision and shutdown;
- `slots.py`: `SlotPool`, the slots and the jobs claimed for them, under one lock;
- `attempt.py`: one attempt on a slot thread, running a sync or async handler;
- `completion.py`: after the handler returns: the completer, the group write, the ack buffer
  and its writer (`group_commit.py`: the flat combining the group write runs on);
- `outcomes.py`: every lease's end written, counted and logged, retried while the database is
  away;
- `heartbeat.py`: the renewals, the lease clock and the worker's registry row;
- `counters.py`: the worker's counters and the `Recorder` protocol the metrics implement;
- `owners.py`: which thread writes which shared field, checked while the test suite runs.
"""

from django_leases.worker.loop import LeaseWorker

__all__ = ["LeaseWorker"]
