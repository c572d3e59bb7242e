-- tower-idempotency: a unit of work in its own transaction begins, when its key is free, in
-- the round trip of its BEGIN (Once::run_in_transaction's fresh path).
--
-- idempotency_unit_begin_free, sent with BEGIN in one simple query:
-- - bounds the transaction's pauses by the lease (idle_in_transaction_session_timeout, for the
--   transaction), as idempotency_unit_begin does;
-- - takes the key's transaction-level advisory lock, the same one idempotency_unit_begin takes;
-- - raises lock_not_available (55P03) when the lock is held or the key has a row of any kind:
--   the error releases the lock, the caller rolls back and reads the key through
--   idempotency_unit_begin, which says what the row is.
-- A fresh key thus costs no statement of its own before the work.
--
-- Idempotent, like the other migrations.

CREATE OR REPLACE FUNCTION idempotency_unit_begin_free(
    p_scope text, p_key text, p_lease_ms float8
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    PERFORM set_config('idle_in_transaction_session_timeout',
                       greatest(ceil(p_lease_ms), 1)::int8 || 'ms', true);
    IF NOT pg_try_advisory_xact_lock(hashtextextended(p_key, hashtext(p_scope)))
       OR EXISTS (SELECT 1 FROM idempotency_keys k
                  WHERE k.scope = p_scope AND k.key = p_key) THEN
        RAISE EXCEPTION 'the idempotency key is held or has a row'
            USING ERRCODE = 'lock_not_available';
    END IF;
END
$$;
