# The stopping status (a job cancelled or timed out while its handler may still run) and the
# status it ends as: stopping jobs hold their lock (the lock constraints list it) and count
# against their kind's limit. The new column has a constant default; the check constraints are
# rebuilt with their new conditions.
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0014_worker_roles_and_intervals'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='paymentjob',
            name='dl_job_status_valid',
        ),
        migrations.RemoveConstraint(
            model_name='paymentjob',
            name='dl_job_lock_held_while_active',
        ),
        migrations.RemoveConstraint(
            model_name='paymentjob',
            name='dl_job_lock_holder_is_lock',
        ),
        migrations.AddField(
            model_name='paymentjob',
            name='ends_as',
            field=models.CharField(blank=True, choices=[('pending', 'Pending'), ('processing', 'Processing'), ('completed', 'Completed'), ('failed', 'Failed'), ('review', 'Under review'), ('cancelled', 'Cancelled'), ('waiting', 'Waiting for its lock'), ('stopping', 'Stopping')], default='', editable=False, help_text='While stopping: the status the job takes when its execution ends.', max_length=20, verbose_name='ends as'),
        ),
        migrations.AlterField(
            model_name='paymentjob',
            name='status',
            field=models.CharField(choices=[('pending', 'Pending'), ('processing', 'Processing'), ('completed', 'Completed'), ('failed', 'Failed'), ('review', 'Under review'), ('cancelled', 'Cancelled'), ('waiting', 'Waiting for its lock'), ('stopping', 'Stopping')], default='pending', max_length=20, verbose_name='status'),
        ),
        migrations.AddConstraint(
            model_name='paymentjob',
            constraint=models.CheckConstraint(condition=models.Q(('status__in', ['pending', 'processing', 'completed', 'failed', 'review', 'cancelled', 'waiting', 'stopping'])), name='dl_job_status_valid'),
        ),
        migrations.AddConstraint(
            model_name='paymentjob',
            constraint=models.CheckConstraint(condition=models.Q(('lock', ''), models.Q(('status__in', ('pending', 'processing', 'stopping', 'review')), _negated=True), models.Q(('lock_holder', models.F('lock')), ('lock_holder__isnull', False)), _connector='OR'), name='dl_job_lock_held_while_active'),
        ),
        migrations.AddConstraint(
            model_name='paymentjob',
            constraint=models.CheckConstraint(condition=models.Q(('lock_holder__isnull', True), models.Q(('lock_holder', models.F('lock')), models.Q(('lock', ''), _negated=True), ('status__in', ('pending', 'processing', 'stopping', 'review'))), _connector='OR'), name='dl_job_lock_holder_is_lock'),
        ),
    ]
