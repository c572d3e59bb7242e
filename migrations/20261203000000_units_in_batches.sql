-- tower-idempotency: units of work in batches, in one transaction
-- (Once::run_batch_in_transaction: a consumer's window claimed, worked and completed with one
-- commit).
--
-- idempotency_units_begin_free, called first in the batch's transaction with the units' scopes
-- and keys (arrays of one length):
-- - bounds the transaction's pauses by the lease (idle_in_transaction_session_timeout, for the
--   transaction), as idempotency_unit_begin does;
-- - answers, per unit and in order, whether its key is free: no row, and its
--   transaction-level advisory lock (the one idempotency_unit_begin takes) taken now. A key
--   with a row is answered without its lock, so that a batch does not hold back the deliveries
--   that read it. A row committed between the read and the lock is not seen: the batch's
--   insert meets it, and the batch rolls back.
-- One set-based statement, its plan cached (and never a sequential scan, even when the table
-- was empty as the plan was made).
-- The batch then does each free unit's work and inserts their rows, completed with their
-- outcomes, in one statement: the work, the claims and the answers commit together or not at
-- all. The advisory locks only spare the work of a batch that would lose; the rows' primary key
-- still decides.
--
-- Idempotent, like the other migrations.

CREATE OR REPLACE FUNCTION idempotency_units_begin_free(
    p_scopes text[], p_keys text[], p_lease_ms float8
) RETURNS boolean[]
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM set_config('idle_in_transaction_session_timeout',
                       greatest(ceil(p_lease_ms), 1)::int8 || 'ms', true);
    RETURN (
        SELECT coalesce(array_agg(
                   CASE WHEN EXISTS (SELECT 1 FROM idempotency_keys k
                                     WHERE k.scope = u.scope AND k.key = u.key) THEN false
                        ELSE pg_try_advisory_xact_lock(hashtextextended(u.key, hashtext(u.scope)))
                   END ORDER BY u.n), '{}')
        FROM unnest(p_scopes, p_keys) WITH ORDINALITY AS u(scope, key, n)
    );
END
$$;
