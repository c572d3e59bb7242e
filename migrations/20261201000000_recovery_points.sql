-- tower-idempotency: recovery points for multi-step handlers.
--
-- recovery_point    how far a multi-step handler got (a name of the handler's choosing), set by
--                   the owner inside each step's own short transaction (idempotency_advance); a
--                   retry that takes the key over resumes from it instead of starting again
-- recovery_payload  what the step left for the next one (JSON: say the charge id a provider
--                   returned)
--
-- A key with a recovery point is never deleted while in flight: releasing it ends its lease
-- instead (the next attempt resumes), its row is kept for the retention period, and only the
-- request it was first claimed for may resume it (another gets 422).
--
-- Idempotent, like the other migrations.

ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS recovery_point text;
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS recovery_payload jsonb;

-- Advances the key's recovery point, if p_owner holds it in flight: in the handler's own
-- transaction, so the step's writes and its recovery point commit together or not at all.
-- Keeps the row (and so the progress) for the retention period, and restarts the lease.
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
            expires_at = greatest(expires_at, now() + p_retention_ms * interval '1 millisecond'),
            updated_at = now()
        WHERE scope = p_scope AND key = p_key AND owner = p_owner AND state = 'in_flight'
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM advanced)
$$;
