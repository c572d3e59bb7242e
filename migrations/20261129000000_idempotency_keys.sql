-- tower-idempotency: one row per (scope, key), the source of truth for every claim.
--
-- state       in_flight: owner runs the handler until lease_until (renewed while it runs)
--             committed: the handler's business write committed (IdempotencyClaim::commit);
--                        the key can no longer be released or reclaimed, only completed
--             completed: response holds the stored answer until expires_at
-- expires_at  when the row stops counting: the lease deadline while in flight, the retention
--             deadline once committed or completed. A claim takes over an expired row; the
--             sweeper deletes expired rows.
-- fence       from idempotency_fence: grows with every claim and reclaim, across releases too.
--
-- Idempotent (IF NOT EXISTS), so applying it through two migration trackers is harmless.

CREATE SEQUENCE IF NOT EXISTS idempotency_fence;

CREATE TABLE IF NOT EXISTS idempotency_keys (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    state        text        NOT NULL CHECK (state IN ('in_flight', 'committed', 'completed')),
    owner        uuid        NOT NULL,
    fence        bigint      NOT NULL,
    lease_until  timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    status       smallint,
    response     bytea,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key),
    CHECK ((state = 'completed') = (response IS NOT NULL))
);

-- The sweeper's scan: oldest expired rows first.
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
