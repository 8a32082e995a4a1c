"""PostgreSQL: keep the job table's partial indexes free of dead entries.

Every claim and completion leaves a dead index entry behind. Since PostgreSQL 14, VACUUM skips
index cleanup when dead rows sit on under 2% of the table's pages, which is always true of a
small queue inside a large table of finished jobs: claims then walk ever more dead entries.
Other databases need nothing.
"""

from django.db import migrations

SETTINGS = (
    "vacuum_index_cleanup = on, "
    "autovacuum_vacuum_scale_factor = 0.02, "
    "autovacuum_vacuum_insert_scale_factor = 0.02"
)
RESET = (
    "vacuum_index_cleanup, autovacuum_vacuum_scale_factor, autovacuum_vacuum_insert_scale_factor"
)


def _alter(apps, schema_editor, clause):
    if schema_editor.connection.vendor != "postgresql":
        return
    table = apps.get_model("django_leases", "PaymentJob")._meta.db_table
    schema_editor.execute(f"ALTER TABLE {schema_editor.quote_name(table)} {clause}")


def tune(apps, schema_editor):
    _alter(apps, schema_editor, f"SET ({SETTINGS})")


def untune(apps, schema_editor):
    _alter(apps, schema_editor, f"RESET ({RESET})")


class Migration(migrations.Migration):
    dependencies = [("django_leases", "0001_initial")]

    operations = [migrations.RunPython(tune, untune, elidable=False)]
