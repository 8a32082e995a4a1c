from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class LeasesConfig(AppConfig):
    name = "django_leases"
    label = "django_leases"
    verbose_name = _("Leased jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks

        from django_leases import checks as lease_checks
        from django_leases import conf, handlers, redaction
        from django_leases.checks import databases as database_checks
        from django_leases.checks import schedules as schedule_checks

        checks.register(lease_checks.check_settings)
        checks.register(database_checks.check_sqlite_transaction_mode)
        # Asks the database itself: runs under `manage.py check --database ALIAS` (and migrate).
        checks.register(database_checks.check_database_clock, checks.Tags.database)
        checks.register(database_checks.check_autovacuum, checks.Tags.database)
        checks.register(database_checks.check_pending_kinds, checks.Tags.database)
        checks.register(database_checks.check_horizon, checks.Tags.database)
        checks.register(lease_checks.check_tasks_framework)
        checks.register(lease_checks.check_worker_retention)
        checks.register(lease_checks.check_job_model)
        checks.register(lease_checks.check_ledgers)
        checks.register(lease_checks.check_lock_holders)
        checks.register(lease_checks.check_network_timeout)
        checks.register(schedule_checks.check_schedules)
        checks.register(lease_checks.check_ack_batching)
        checks.register(lease_checks.check_kind_leases)
        conf.connect_signals()
        redaction.install_log_filter()
        handlers.autodiscover()
