"""Tasks of Django's Tasks framework, run through `LeaseBackend`."""

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
