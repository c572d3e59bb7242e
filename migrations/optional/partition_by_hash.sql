-- tower-idempotency, optional: idempotency_keys hash-partitioned on (scope, key).
--
-- Not part of the crate's migration set (MIGRATOR, PostgresStore::migrate): apply it once, after
-- them, when one table's indexes, vacuum or sweeps get too big for one heap. Every statement of
-- the store (claim, fence, renew, complete, release, sweeper, inspect, forget, stuck) works on
-- the partitioned table unchanged; each one names (scope, key), so Postgres prunes it to one
-- partition.
--
--   psql "$DATABASE_URL" -1 -f migrations/optional/partition_by_hash.sql
--
-- or copy it into your own migrations after the crate's, or run
-- `tower_idempotency::store::PARTITION_BY_HASH` (this file) from code.
--
-- It copies existing rows into 4 partitions (edit `partitions` below to choose another
-- number; hash partitions cannot be split later without another copy) under an ACCESS
-- EXCLUSIVE lock: claims wait for it. Run it on an empty or small table (a new deployment, or
-- in a quiet window). Applied to a table that is partitioned already, it changes nothing.
--
-- Why 4: a statement's generic plan locks every partition before it prunes to one (and, when
-- it is planned, once per connection, every partition's indexes too), and a session takes 16
-- such locks cheaply (PostgreSQL's fast-path locks, up to version 17); past them each lock goes
-- through the shared lock manager. With 4 partitions a lookup's execution takes 6 locks, all
-- fast-path; with 16, 18 (and its planning 50, of which 34 are not). Measured side by side on
-- PostgreSQL 15 (BENCHMARKS.md, "Partitioned, measured again"): 4 partitions served
-- 0.92-1.13x the plain table's fresh keys, 16 partitions 0.75-1.09x. More partitions cost every
-- statement more.

DO $$
DECLARE
    partitions constant int := 4;
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_partitioned_table p
        JOIN pg_class c ON c.oid = p.partrelid
        WHERE c.oid = to_regclass('idempotency_keys')
    ) THEN
        RETURN;
    END IF;
    LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
    ALTER TABLE idempotency_keys RENAME TO idempotency_keys_unpartitioned;
    ALTER TABLE idempotency_keys_unpartitioned
        RENAME CONSTRAINT idempotency_keys_pkey TO idempotency_keys_unpartitioned_pkey;
    ALTER INDEX idempotency_keys_expires_at RENAME TO idempotency_keys_unpartitioned_expires_at;
    ALTER INDEX IF EXISTS idempotency_keys_abandoned
        RENAME TO idempotency_keys_unpartitioned_abandoned;

    -- Same columns, defaults and checks; the primary key holds the partition key.
    CREATE TABLE idempotency_keys (
        LIKE idempotency_keys_unpartitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
        PRIMARY KEY (scope, key)
    ) PARTITION BY HASH (scope, key);
    CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
    -- The completer's scan (migration 20261205000000).
    CREATE INDEX idempotency_keys_abandoned ON idempotency_keys (lease_until)
        WHERE (state = 'in_flight' AND recovery_point IS NOT NULL)
           OR (state = 'committed' AND response IS NULL);
    FOR i IN 0 .. partitions - 1 LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF idempotency_keys FOR VALUES WITH (MODULUS %s, REMAINDER %s)',
            'idempotency_keys_p' || i, partitions, i
        );
    END LOOP;

    INSERT INTO idempotency_keys SELECT * FROM idempotency_keys_unpartitioned;
    DROP TABLE idempotency_keys_unpartitioned;
END
$$;
