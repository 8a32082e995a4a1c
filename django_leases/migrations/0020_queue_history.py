# The queue history (QueueMinute: one row per job table, kind and minute, written once by the
# first watcher to close the minute), the ledger's claimed_at index (written by the INSERT
# alone, so closing an attempt stays a HOT update on PostgreSQL), the "run a schedule now"
# permission and its operator event.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0019_groups'),
    ]

    operations = [
        migrations.CreateModel(
            name='QueueMinute',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('job_model', models.CharField(max_length=100, verbose_name='job table')),
                ('kind', models.CharField(blank=True, max_length=100, verbose_name='kind')),
                ('minute', models.DateTimeField(verbose_name='minute')),
                ('completed', models.PositiveIntegerField(default=0, verbose_name='jobs completed')),
                ('failed', models.PositiveIntegerField(default=0, verbose_name='jobs failed')),
                ('retried', models.PositiveIntegerField(default=0, verbose_name='attempts retried')),
                ('depth', models.PositiveIntegerField(blank=True, help_text='The backlog as the minute was recorded; unknown for a minute filled in late.', null=True, verbose_name='due pending jobs')),
                ('wait_p50', models.FloatField(blank=True, null=True, verbose_name='wait p50 (s)')),
                ('wait_p95', models.FloatField(blank=True, null=True, verbose_name='wait p95 (s)')),
                ('run_p50', models.FloatField(blank=True, null=True, verbose_name='run time p50 (s)')),
                ('run_p95', models.FloatField(blank=True, null=True, verbose_name='run time p95 (s)')),
                ('wait_counts', models.JSONField(default=list, help_text='Jobs per wait bucket: due to start.', verbose_name='wait buckets')),
                ('run_counts', models.JSONField(default=list, help_text='Jobs per run time bucket.', verbose_name='run time buckets')),
            ],
            options={
                'verbose_name': 'queue minute',
                'verbose_name_plural': 'queue history',
            },
        ),
        migrations.AlterModelOptions(
            name='schedulestate',
            options={'ordering': ['job_model', 'name'], 'permissions': [('run_schedule', 'Can run a schedule now')], 'verbose_name': 'schedule state', 'verbose_name_plural': 'schedule states'},
        ),
        migrations.AlterField(
            model_name='jobevent',
            name='action',
            field=models.CharField(choices=[('requeued', 'Requeued'), ('released', 'Stuck lease released'), ('failed', 'Marked failed'), ('cancelled', 'Cancelled'), ('review_completed', 'Review resolved: completed'), ('review_retry', 'Review resolved: retry'), ('review_failed', 'Review resolved: failed'), ('run_now', 'Enqueued by running its schedule now')], max_length=20, verbose_name='action'),
        ),
        migrations.AddIndex(
            model_name='jobattempt',
            index=models.Index(fields=['claimed_at'], name='dl_attempt_claimed_idx'),
        ),
        migrations.AddIndex(
            model_name='queueminute',
            index=models.Index(fields=['job_model', 'minute'], name='dl_minute_idx'),
        ),
        migrations.AddConstraint(
            model_name='queueminute',
            constraint=models.UniqueConstraint(fields=('job_model', 'kind', 'minute'), name='dl_minute_kind_uniq'),
        ),
    ]
