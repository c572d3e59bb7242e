-- tower-idempotency: the duplicates that wait for a key, told the moment it ends.
--
-- waited  a duplicate waits for this key, on some instance of the fleet: set by the waiter
--         while the key is held (in flight, or committed without an answer), so that the
--         owner's completion or release tells the instances that listen
--         (NOTIFY tower_idempotency). A key nobody waits for is never told: its completion
--         costs nothing more.
--
-- A constant default: adding the column writes no row. Idempotent, like the other migrations.

ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS waited boolean NOT NULL DEFAULT false;
