"""The operators' admin: lease-aware job lists, the attempt ledger, the worker registry and a
queue overview.

No lease SQL lives here. Every filter calls a `LeaseQuerySet` read (`expired()`,
`near_expiry()`, `healthy()`), every action one `LeaseQuerySet` operator method on the selected
jobs — the conditional UPDATEs the workers and the watcher use — so an action never takes a live
lease from its holder unless its name says it forces. Lease times shown are computed by the
database clock. A project registers `LeasedJobAdmin` for its own job table to get the same.
"""

from django.contrib import admin

from django_leases.admin import audit, jobs, kinds, ledger, payments, schedules, workers
from django_leases.admin.jobs import LeasedJobAdmin
from django_leases.admin.payments import PaymentJobAdmin

# The index shows a link to the overview through this template (it extends the stock one),
# unless the project already gave the default site an index template of its own.
if admin.site.index_template is None:
    admin.site.index_template = "admin/django_leases/index.html"

__all__ = [
    "LeasedJobAdmin",
    "PaymentJobAdmin",
    "audit",
    "jobs",
    "kinds",
    "ledger",
    "payments",
    "schedules",
    "workers",
]
