from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("testapp", "0007_lock_holder_unique_when_set"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="payoutattempt",
            name="tp_payout_attempt_open_idx",
        ),
    ]
