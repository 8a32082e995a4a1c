# A project's own job tables after django_leases 0011: lease_constraints() makes lock_holder
# unique with UniqueWhenSet. The constraints come before the fields drop unique=True, as
# docs/upgrading.md asks of a project's own migration.

from django.db import migrations, models

import django_leases.constraints


class Migration(migrations.Migration):
    dependencies = [
        ("testapp", "0006_cancelled_outcome"),
    ]

    operations = [
        migrations.AddConstraint(
            model_name="barejob",
            constraint=django_leases.constraints.UniqueWhenSet(
                fields=("lock_holder",), name="tp_bare_lock_holder_uniq"
            ),
        ),
        migrations.AddConstraint(
            model_name="payoutjob",
            constraint=django_leases.constraints.UniqueWhenSet(
                fields=("lock_holder",), name="tp_payout_lock_holder_uniq"
            ),
        ),
        migrations.AlterField(
            model_name="barejob",
            name="lock_holder",
            field=models.CharField(
                blank=True,
                editable=False,
                help_text="The lock this job holds: next in line, running or under review.",
                max_length=255,
                null=True,
                verbose_name="holds lock",
            ),
        ),
        migrations.AlterField(
            model_name="payoutjob",
            name="lock_holder",
            field=models.CharField(
                blank=True,
                editable=False,
                help_text="The lock this job holds: next in line, running or under review.",
                max_length=255,
                null=True,
                verbose_name="holds lock",
            ),
        ),
    ]
