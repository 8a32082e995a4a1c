# The worker registry learns each process's role (worker or watcher) and report interval, so a
# worker that missed two heartbeats shows late long before WORKER_GONE_AFTER, and a watcher's
# rows say when it made its last pass and what the pass did. Columns with defaults or NULL:
# quick on every database.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0013_schedule_state_per_name'),
    ]

    operations = [
        migrations.AddField(
            model_name='worker',
            name='heartbeat',
            field=models.FloatField(blank=True, null=True, verbose_name='reports every (seconds)'),
        ),
        migrations.AddField(
            model_name='worker',
            name='last_pass',
            field=models.JSONField(blank=True, null=True, verbose_name='last pass'),
        ),
        migrations.AddField(
            model_name='worker',
            name='last_pass_at',
            field=models.DateTimeField(blank=True, null=True, verbose_name='last pass at'),
        ),
        migrations.AddField(
            model_name='worker',
            name='role',
            field=models.CharField(choices=[('worker', 'worker'), ('watcher', 'watcher')], db_default='worker', default='worker', max_length=16, verbose_name='role'),
        ),
    ]
