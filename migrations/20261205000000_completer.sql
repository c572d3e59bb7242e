-- tower-idempotency: what the completer needs to finish a request nobody retries.
--
-- request     the request a key was claimed for, as the layer keeps it where the application
--             opted in (IdempotencyLayer::with_kept_requests): method, path, the headers it
--             chose to keep (never credentials) and the body, bounded in size. Written with a
--             key's first recovery point, in the step's own transaction; dropped when the key
--             completes, and when another request takes the key over.
-- unfinished  why the completer could not finish the key the last time it tried (the
--             handler's answer, no request kept, …), for an operator: the admin listing shows
--             it.
--
-- The completer's scan (keys whose lease lapsed with work recorded: a recovery point in
-- flight, or a fence committed without an answer) reads a partial index: it holds only those
-- rows, a few at any time, so a scan every few seconds on every instance stays cheap whatever
-- the table's size.
--
-- Idempotent, like the other migrations.

ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS request bytea;
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS unfinished text;

CREATE INDEX IF NOT EXISTS idempotency_keys_abandoned ON idempotency_keys (lease_until)
    WHERE (state = 'in_flight' AND recovery_point IS NOT NULL)
       OR (state = 'committed' AND response IS NULL);
