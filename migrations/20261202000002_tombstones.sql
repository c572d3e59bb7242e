-- tower-idempotency: tombstones, a completed key kept past its answer's retention.
--
-- state       tombstone: the answer is gone (past its retention); the row keeps the key, its
--             fingerprint, the status it completed with and when (updated_at), until the
--             store's horizon after that (expires_at). A retry of the same request is refused
--             (answer expired), another request with the key is a mismatch. Written only by the
--             sweeper of a store built with_tombstones, which deletes the row at the horizon.
--
-- idempotency_unit_begin (units in their own transaction) answers tombstones too: it takes the
-- store's horizon and says whether the row is one (buried), with its status and age. A store
-- without tombstones (horizon 0) reads a buried row as an expired one.
--
-- Idempotent, like the other migrations.

ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_state_check;
ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_state;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_state
    CHECK (state IN ('in_flight', 'committed', 'completed', 'tombstone'));

DROP FUNCTION IF EXISTS idempotency_unit_begin(text, text, float8);

CREATE OR REPLACE FUNCTION idempotency_unit_begin(
    p_scope text, p_key text, p_lease_ms float8, p_horizon_ms float8
) RETURNS TABLE (
    locked boolean, state text, fingerprint bytea, fence bigint, response bytea,
    leased boolean, live boolean, lease_ms int8, buried boolean, status smallint, ran_ms int8
)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended(p_key, hashtext(p_scope))) THEN
        RETURN QUERY SELECT false, NULL::text, NULL::bytea, NULL::bigint, NULL::bytea,
                            NULL::boolean, NULL::boolean, NULL::int8, NULL::boolean,
                            NULL::smallint, NULL::int8;
        RETURN;
    END IF;
    PERFORM set_config('idle_in_transaction_session_timeout',
                       greatest(ceil(p_lease_ms), 1)::int8 || 'ms', true);
    RETURN QUERY
    SELECT true, k.state, k.fingerprint, k.fence, k.response,
           k.lease_until > clock_timestamp(),
           k.expires_at > clock_timestamp() AND k.state <> 'tombstone',
           ceil(extract(epoch FROM k.lease_until - clock_timestamp()) * 1000)::int8,
           p_horizon_ms > 0
           AND ((k.state = 'tombstone' AND k.expires_at > clock_timestamp())
                OR (k.state <> 'tombstone' AND k.expires_at <= clock_timestamp()
                    AND (k.state = 'completed' OR k.response IS NOT NULL)
                    AND k.updated_at + p_horizon_ms * interval '1 millisecond'
                        > clock_timestamp())),
           k.status,
           ceil(extract(epoch FROM clock_timestamp() - k.updated_at) * 1000)::int8
    FROM idempotency_keys k
    WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        RETURN QUERY SELECT true, NULL::text, NULL::bytea, NULL::bigint, NULL::bytea,
                            NULL::boolean, NULL::boolean, NULL::int8, NULL::boolean,
                            NULL::smallint, NULL::int8;
    END IF;
END
$$;
