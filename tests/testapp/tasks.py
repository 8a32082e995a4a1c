"""Tasks of Django's Tasks framework, run through `LeaseBackend`."""

import asyncio
import time

import django

if django.VERSION >= (6, 0):
    from django.tasks import task
else:
    from django_tasks import task


@task
def add(a, b):
    return a + b


@task(queue_name="emails", priority=10)
def send_receipt(to):
    return {"sent_to": to}


@task
def explode():
    raise ValueError("nope")


@task(takes_context=True)
def which_attempt(context):
    return context.attempt


deep: list = []
for _ in range(40):
    deep = [deep]

UNSTORABLE = {
    "nan": float("nan"),
    "infinity": float("inf"),
    "nul": "card\x00",
    "surrogate": "\ud800",
    "too deep": deep,
    "huge int": 2**80,
}


@task
def unstorable(kind):
    """Return a value no database stores alike (or one that is not JSON at all)."""
    if kind == "object":
        return object()
    return {"value": UNSTORABLE[kind]}


@task(takes_context=True)
def slow_first(context, seconds):
    """Take `seconds` on the first attempt only; return the attempt that finished."""
    if context.attempt == 1:
        time.sleep(seconds)
    return context.attempt


not_a_task = add.func


@task
async def async_charge(job_ref):
    """An async task: awaits, then writes a charge with Django's async ORM."""
    from .models import Charge

    await asyncio.sleep(0.05)
    charge = await Charge.objects.acreate(job_ref=job_ref, token=0, owner="async task")
    return charge.pk


@task
async def async_explode():
    await asyncio.sleep(0)
    raise ValueError("async nope")


@task
def leak_card(card):
    """Insert a job whose idempotency key already exists: the IntegrityError quotes the card."""
    from django_leases.models import PaymentJob  # a task module is imported before the models

    PaymentJob.objects.enqueue("noop", idempotency_key=card)
    PaymentJob.objects.create(kind="noop", idempotency_key=card)
