"""Payment jobs out of a database table, safely, with many workers.

Only names that do not import models are exported here, so that importing the package never
triggers app loading.
"""

from importlib.metadata import PackageNotFoundError, version

from django_leases.exceptions import Cancelled, LeaseError, LeaseLost, PermanentError
from django_leases.handlers import job_handler

try:
    __version__ = version("django-leases")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["Cancelled", "LeaseError", "LeaseLost", "PermanentError", "__version__", "job_handler"]
