-- tower-idempotency: a unit of work claimed inside its own transaction
-- (Once::run_in_transaction), for work whose effects are all in this database.
--
-- idempotency_unit_begin, called first in the delivery's transaction:
-- - takes a transaction-level advisory lock on the key if it is free (locked = false when
--   another delivery in this mode holds it: the caller rolls back and tries again shortly, up
--   to its wait), so deliveries of one key in this mode run one after the other. The lock ends
--   with the transaction, committed, rolled back or its session gone, so nothing needs
--   releasing after a crash;
-- - bounds the transaction's pauses by p_lease_ms (idle_in_transaction_session_timeout, for this
--   transaction only): a process stalled between its statements for longer than its lease has
--   its session ended by the server, so a stalled delivery holds its key no longer than a lease
--   holds it in the other mode, and commits nothing afterwards;
-- - reads the key's row only once the lock is held, with a snapshot of its own, so a delivery
--   that follows another sees what that one committed.
-- The delivery then does its work and writes the key's row with the outcome (state completed)
-- in the same transaction: one commit for the work, the claim and the answer together. The
-- advisory lock only spares the work of a delivery that would lose; the row's primary key
-- still decides.
--
-- Idempotent, like the other migrations.

CREATE OR REPLACE FUNCTION idempotency_unit_begin(p_scope text, p_key text, p_lease_ms float8)
RETURNS TABLE (
    locked boolean, state text, fingerprint bytea, fence bigint, response bytea,
    leased boolean, live boolean, lease_ms int8
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended(p_key, hashtext(p_scope))) THEN
        RETURN QUERY SELECT false, NULL::text, NULL::bytea, NULL::bigint, NULL::bytea,
                            NULL::boolean, NULL::boolean, NULL::int8;
        RETURN;
    END IF;
    PERFORM set_config('idle_in_transaction_session_timeout',
                       greatest(ceil(p_lease_ms), 1)::int8 || 'ms', true);
    RETURN QUERY
    SELECT true, k.state, k.fingerprint, k.fence, k.response,
           k.lease_until > clock_timestamp(), k.expires_at > clock_timestamp(),
           ceil(extract(epoch FROM k.lease_until - clock_timestamp()) * 1000)::int8
    FROM idempotency_keys k
    WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        RETURN QUERY SELECT true, NULL::text, NULL::bytea, NULL::bigint, NULL::bytea,
                            NULL::boolean, NULL::boolean, NULL::int8;
    END IF;
END
$$;
