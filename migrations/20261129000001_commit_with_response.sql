-- tower-idempotency: liveness of committed keys, and responses stored with the fence.
--
-- suspect     set by a claim that finds a committed key whose lease has lapsed: its owner gets
--             one more half lease to renew (which clears it) before the key is reported
--             orphaned. An owner whose renewals waited on its own fence's row lock is alive.
-- response    may now be stored by the fence itself (committed), so that a committed key whose
--             instance died answers retries with the handler's response.
--
-- Idempotent, like the first migration.

ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS suspect boolean NOT NULL DEFAULT false;

ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_check;
ALTER TABLE idempotency_keys DROP CONSTRAINT IF EXISTS idempotency_keys_response;
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_response
    CHECK (CASE state WHEN 'in_flight' THEN response IS NULL
                      WHEN 'completed' THEN response IS NOT NULL
                      ELSE true END);
