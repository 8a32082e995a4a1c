-- A what-if for `bench/throughput.py` or `bench/wakeup_latency.py --after-migrate FILE`
-- (PostgreSQL): the job table of django_leases without any CHECK constraint. Not a proposal:
-- the constraints are the database's own proof of the lease states. It bounds what leaner
-- constraints could buy, since PostgreSQL rebuilds every CHECK expression of a table from its
-- stored text for each statement that writes a row (about 50 us of the server's CPU per
-- single-row INSERT or UPDATE of a job on the machine of bench/README.md).
DO $$
DECLARE checks record;
BEGIN
  FOR checks IN
    SELECT conname FROM pg_constraint
    WHERE conrelid = 'django_leases_paymentjob'::regclass AND contype = 'c'
  LOOP
    EXECUTE format('ALTER TABLE django_leases_paymentjob DROP CONSTRAINT %I', checks.conname);
  END LOOP;
END $$;
