-- tower-idempotency: the fence (and a recovery point) in PL/pgSQL, same signatures, same effect.
--
-- A LANGUAGE sql function is parsed, analysed and planned again on every call (its parse tree
-- lives only as long as the calling statement's execution): measured with perf, the fence was a
-- third of Postgres's time per unit of work, about 240 us a call. PL/pgSQL compiles the function
-- once per session and keeps its statement's plan. The plan is generic, made once, and made with
-- sequential scans priced out (the settings below hold while the function runs, planning
-- included), so it is the primary-key lookup whatever the table held when it was made: the
-- reason for 20261129000002's function, kept without planning each call. The store's own
-- connections plan its statements the same way. Idempotent, like the other migrations.

CREATE OR REPLACE FUNCTION idempotency_commit(
    p_scope text, p_key text, p_owner uuid, p_retention_ms float8, p_lease_ms float8,
    p_status smallint, p_response bytea
) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE idempotency_keys
    SET state = 'committed',
        lease_until = clock_timestamp() + p_lease_ms * interval '1 millisecond',
        suspect = false,
        expires_at = greatest(expires_at,
                              clock_timestamp() + p_retention_ms * interval '1 millisecond'),
        status = coalesce(p_status, status),
        response = coalesce(p_response, response),
        updated_at = now()
    WHERE scope = p_scope AND key = p_key AND owner = p_owner
      AND state IN ('in_flight', 'committed');
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION idempotency_advance(
    p_scope text, p_key text, p_owner uuid, p_point text, p_payload jsonb,
    p_retention_ms float8, p_lease_ms float8
) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE idempotency_keys
    SET recovery_point = p_point,
        recovery_payload = p_payload,
        lease_until = clock_timestamp() + p_lease_ms * interval '1 millisecond',
        suspect = false,
        expires_at = greatest(expires_at,
                              clock_timestamp() + p_retention_ms * interval '1 millisecond'),
        updated_at = now()
    WHERE scope = p_scope AND key = p_key AND owner = p_owner AND state = 'in_flight';
    RETURN FOUND;
END
$$;
