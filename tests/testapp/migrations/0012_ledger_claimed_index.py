# The ledger's claimed_at index, as django_leases 0020 adds it to JobAttempt.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("testapp", "0011_groups"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="payoutattempt",
            index=models.Index(fields=["claimed_at"], name="tp_payout_attempt_claimed_idx"),
        ),
    ]
