-- tower-idempotency: the fence's (and a recovery point's) retention counts from the fence, not
-- from the start of the handler's transaction.
--
-- now() is the time the transaction began: a handler that worked for minutes before fencing
-- had its answer kept for minutes less than the retention when its instance died before the
-- layer completed the key (completion sets the expiry again, from its own statement).
-- clock_timestamp() is the time of the fence itself. Idempotent, like the other migrations.

CREATE OR REPLACE FUNCTION idempotency_commit(
    p_scope text, p_key text, p_owner uuid, p_retention_ms float8, p_lease_ms float8,
    p_status smallint, p_response bytea
) RETURNS boolean
LANGUAGE sql VOLATILE
SET plan_cache_mode = force_custom_plan
AS $$
    WITH fenced AS (
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
          AND state IN ('in_flight', 'committed')
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM fenced)
$$;

-- The same for a recovery point: its progress is kept for the retention after the step.
CREATE OR REPLACE FUNCTION idempotency_advance(
    p_scope text, p_key text, p_owner uuid, p_point text, p_payload jsonb,
    p_retention_ms float8, p_lease_ms float8
) RETURNS boolean
LANGUAGE sql VOLATILE
SET plan_cache_mode = force_custom_plan
AS $$
    WITH advanced AS (
        UPDATE idempotency_keys
        SET recovery_point = p_point,
            recovery_payload = p_payload,
            lease_until = clock_timestamp() + p_lease_ms * interval '1 millisecond',
            suspect = false,
            expires_at = greatest(expires_at,
                                  clock_timestamp() + p_retention_ms * interval '1 millisecond'),
            updated_at = now()
        WHERE scope = p_scope AND key = p_key AND owner = p_owner AND state = 'in_flight'
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM advanced)
$$;
