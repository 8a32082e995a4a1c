# The ledger's (job_ref, ended_at) index goes: a job's open row is found by the (job_ref, token)
# index of the unique constraint, and with no index on a column that closing an attempt writes,
# the close is a HOT update on PostgreSQL (it enters no index). Dropping an index is quick on
# every database; the statements that used it take the other index's job_ref prefix.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0011_unique_when_set'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='jobattempt',
            name='dl_attempt_open_idx',
        ),
    ]
