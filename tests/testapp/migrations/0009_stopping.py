# The stopping status (a job cancelled or timed out while its handler may still run) and the
# status it ends as: stopping jobs hold their lock (the lock constraints list it) and count
# against their kind's limit. The new column has a constant default; the check constraints are
# rebuilt with their new conditions.
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("testapp", "0008_ledger_without_open_index"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="barejob",
            name="tp_bare_status_valid",
        ),
        migrations.RemoveConstraint(
            model_name="barejob",
            name="tp_bare_lock_held_while_active",
        ),
        migrations.RemoveConstraint(
            model_name="barejob",
            name="tp_bare_lock_holder_is_lock",
        ),
        migrations.RemoveConstraint(
            model_name="payoutjob",
            name="tp_payout_status_valid",
        ),
        migrations.RemoveConstraint(
            model_name="payoutjob",
            name="tp_payout_lock_held_while_active",
        ),
        migrations.RemoveConstraint(
            model_name="payoutjob",
            name="tp_payout_lock_holder_is_lock",
        ),
        migrations.AddField(
            model_name="barejob",
            name="ends_as",
            field=models.CharField(
                blank=True,
                choices=[
                    ("pending", "Pending"),
                    ("processing", "Processing"),
                    ("completed", "Completed"),
                    ("failed", "Failed"),
                    ("review", "Under review"),
                    ("cancelled", "Cancelled"),
                    ("waiting", "Waiting for its lock"),
                    ("stopping", "Stopping"),
                ],
                default="",
                editable=False,
                help_text="While stopping: the status the job takes when its execution ends.",
                max_length=20,
                verbose_name="ends as",
            ),
        ),
        migrations.AddField(
            model_name="payoutjob",
            name="ends_as",
            field=models.CharField(
                blank=True,
                choices=[
                    ("pending", "Pending"),
                    ("processing", "Processing"),
                    ("completed", "Completed"),
                    ("failed", "Failed"),
                    ("review", "Under review"),
                    ("cancelled", "Cancelled"),
                    ("waiting", "Waiting for its lock"),
                    ("stopping", "Stopping"),
                ],
                default="",
                editable=False,
                help_text="While stopping: the status the job takes when its execution ends.",
                max_length=20,
                verbose_name="ends as",
            ),
        ),
        migrations.AlterField(
            model_name="barejob",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("processing", "Processing"),
                    ("completed", "Completed"),
                    ("failed", "Failed"),
                    ("review", "Under review"),
                    ("cancelled", "Cancelled"),
                    ("waiting", "Waiting for its lock"),
                    ("stopping", "Stopping"),
                ],
                default="pending",
                max_length=20,
                verbose_name="status",
            ),
        ),
        migrations.AlterField(
            model_name="payoutjob",
            name="status",
            field=models.CharField(
                choices=[
                    ("pending", "Pending"),
                    ("processing", "Processing"),
                    ("completed", "Completed"),
                    ("failed", "Failed"),
                    ("review", "Under review"),
                    ("cancelled", "Cancelled"),
                    ("waiting", "Waiting for its lock"),
                    ("stopping", "Stopping"),
                ],
                default="pending",
                max_length=20,
                verbose_name="status",
            ),
        ),
        migrations.AddConstraint(
            model_name="barejob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "status__in",
                        [
                            "pending",
                            "processing",
                            "completed",
                            "failed",
                            "review",
                            "cancelled",
                            "waiting",
                            "stopping",
                        ],
                    )
                ),
                name="tp_bare_status_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="barejob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("lock", ""),
                    models.Q(
                        ("status__in", ("pending", "processing", "stopping", "review")),
                        _negated=True,
                    ),
                    models.Q(("lock_holder", models.F("lock")), ("lock_holder__isnull", False)),
                    _connector="OR",
                ),
                name="tp_bare_lock_held_while_active",
            ),
        ),
        migrations.AddConstraint(
            model_name="barejob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("lock_holder__isnull", True),
                    models.Q(
                        ("lock_holder", models.F("lock")),
                        models.Q(("lock", ""), _negated=True),
                        ("status__in", ("pending", "processing", "stopping", "review")),
                    ),
                    _connector="OR",
                ),
                name="tp_bare_lock_holder_is_lock",
            ),
        ),
        migrations.AddConstraint(
            model_name="payoutjob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    (
                        "status__in",
                        [
                            "pending",
                            "processing",
                            "completed",
                            "failed",
                            "review",
                            "cancelled",
                            "waiting",
                            "stopping",
                        ],
                    )
                ),
                name="tp_payout_status_valid",
            ),
        ),
        migrations.AddConstraint(
            model_name="payoutjob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("lock", ""),
                    models.Q(
                        ("status__in", ("pending", "processing", "stopping", "review")),
                        _negated=True,
                    ),
                    models.Q(("lock_holder", models.F("lock")), ("lock_holder__isnull", False)),
                    _connector="OR",
                ),
                name="tp_payout_lock_held_while_active",
            ),
        ),
        migrations.AddConstraint(
            model_name="payoutjob",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("lock_holder__isnull", True),
                    models.Q(
                        ("lock_holder", models.F("lock")),
                        models.Q(("lock", ""), _negated=True),
                        ("status__in", ("pending", "processing", "stopping", "review")),
                    ),
                    _connector="OR",
                ),
                name="tp_payout_lock_holder_is_lock",
            ),
        ),
    ]
