# One state row per schedule instead of one per series: the row holds the series the schedule
# runs, so an edit (or a rollback to an earlier definition) is seen as one and starts the new
# series at its next tick, where a row per series let a rolled-back definition catch up. Of a
# schedule's rows, the one moved last is its current series' (each series moves its row at
# each tick it enqueues); the others go.

from django.db import migrations, models


def keep_the_latest_series(apps, schema_editor):
    states = apps.get_model("django_leases", "ScheduleState").objects.using(
        schema_editor.connection.alias
    )
    kept = set()
    stale = []
    for pk, job_model, name in states.order_by("-enqueued_at", "-pk").values_list(
        "pk", "job_model", "name"
    ):
        if (job_model, name) in kept:
            stale.append(pk)
        kept.add((job_model, name))
    states.filter(pk__in=stale).delete()


class Migration(migrations.Migration):

    dependencies = [
        ('django_leases', '0012_ledger_without_open_index'),
    ]

    operations = [
        migrations.RunPython(keep_the_latest_series, migrations.RunPython.noop),
        migrations.RemoveConstraint(
            model_name='schedulestate',
            name='dl_schedule_series_uniq',
        ),
        migrations.AlterModelOptions(
            name='schedulestate',
            options={'ordering': ['job_model', 'name'], 'verbose_name': 'schedule state', 'verbose_name_plural': 'schedule states'},
        ),
        migrations.AddField(
            model_name='schedulestate',
            name='start_tick',
            field=models.BigIntegerField(blank=True, help_text='The tick current when the series started (the schedule was added or its every, cron or tz edited): covered without a job.', null=True, verbose_name='series started at tick'),
        ),
        migrations.AddConstraint(
            model_name='schedulestate',
            constraint=models.UniqueConstraint(fields=('job_model', 'name'), name='dl_schedule_name_uniq'),
        ),
    ]
