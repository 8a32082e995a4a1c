# The unique indexes of lock_holder and idempotency_key become partial (WHERE ... IS NOT NULL)
# on PostgreSQL and SQLite, and lose PostgreSQL's varchar_pattern_ops twins: a job without a key
# or a lock adds no entry to them. Written by hand so that the new indexes exist before the old
# ones go (MariaDB/MySQL run DDL outside a transaction: the order keeps both keys unique
# throughout); makemigrations would drop the old ones first.

import django_leases.constraints
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0010_cancelled_outcome'),
    ]

    operations = [
        migrations.AddConstraint(
            model_name='paymentjob',
            constraint=django_leases.constraints.UniqueWhenSet(fields=('lock_holder',), name='dl_job_lock_holder_uniq'),
        ),
        migrations.AddConstraint(
            model_name='paymentjob',
            constraint=django_leases.constraints.UniqueWhenSet(fields=('idempotency_key',), name='dl_job_idempotency_key_uniq'),
        ),
        migrations.AlterField(
            model_name='paymentjob',
            name='idempotency_key',
            field=models.CharField(blank=True, max_length=255, null=True, verbose_name='idempotency key'),
        ),
        migrations.AlterField(
            model_name='paymentjob',
            name='lock_holder',
            field=models.CharField(blank=True, editable=False, help_text='The lock this job holds: next in line, running or under review.', max_length=255, null=True, verbose_name='holds lock'),
        ),
    ]
