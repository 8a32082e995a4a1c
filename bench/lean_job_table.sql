-- A what-if for `bench/throughput.py --after-migrate FILE` (PostgreSQL): the job table of
-- django_leases as a leaner migration could make it, to measure before proposing one.
-- Measured at e49f6e9 (bench/README.md): 17 index entries a drain instead of 24, 8.7 kB of
-- CHECK expressions instead of 11.3. Since migration 0011 (UniqueWhenSet) the twins are gone
-- and the unique indexes partial, so on today's table only the last two items remain:
-- * Django's varchar_pattern_ops twins of the unique idempotency_key and lock_holder go (none
--   left since 0011: the loop below finds nothing);
-- * the payment id and finished-jobs indexes hold only the rows they serve;
-- * the two lock constraints become one (the same condition: lock_holder is the lock while
--   the job of a lock is pending, processing or under review, else NULL).
DO $$
DECLARE twin record;
BEGIN
  FOR twin IN
    SELECT indexname FROM pg_indexes
    WHERE tablename = 'django_leases_paymentjob' AND indexname LIKE '%\_like'
  LOOP
    EXECUTE format('DROP INDEX %I', twin.indexname);
  END LOOP;
END $$;
DROP INDEX dl_job_payment_idx;
CREATE INDEX dl_job_payment_idx ON django_leases_paymentjob (payment_id)
  WHERE payment_id <> '';
DROP INDEX dl_job_finished_idx;
CREATE INDEX dl_job_finished_idx ON django_leases_paymentjob (status, completed_at)
  WHERE status IN ('completed', 'failed', 'cancelled');
ALTER TABLE django_leases_paymentjob
  DROP CONSTRAINT dl_job_lock_held_while_active,
  DROP CONSTRAINT dl_job_lock_holder_is_lock,
  ADD CONSTRAINT dl_job_lock_holder_is_lock CHECK (
    lock_holder IS NOT DISTINCT FROM (
      CASE WHEN lock <> '' AND status IN ('pending', 'processing', 'review') THEN lock END
    )
  );
