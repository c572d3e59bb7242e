-- tower-idempotency: the fence as a function.
--
-- IdempotencyClaim::commit runs in the application's own transaction, on the application's own
-- connection, where this crate cannot choose how statements are planned. A prepared statement
-- that a connection first runs while idempotency_keys is empty (every fresh deployment) may get
-- a cached generic plan that scans the whole table, and keep it as the table grows. The function
-- plans its statement on every call (SET plan_cache_mode; SQL functions are not inlined when they
-- carry a SET clause), so the fence is a primary-key lookup whatever the table's history.
--
-- Returns whether this owner held the key (in flight or committed) and now holds it committed.
-- Idempotent, like the other migrations.

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
            expires_at = greatest(expires_at, now() + p_retention_ms * interval '1 millisecond'),
            status = coalesce(p_status, status),
            response = coalesce(p_response, response),
            updated_at = now()
        WHERE scope = p_scope AND key = p_key AND owner = p_owner
          AND state IN ('in_flight', 'committed')
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM fenced)
$$;
