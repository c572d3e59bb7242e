-- tower-idempotency, optional: idempotency_keys distributed on Citus, sharded by key.
--
-- Not part of the crate's migration set (MIGRATOR, PostgresStore::migrate): run it on the Citus
-- coordinator after them, and again after every `migrate` that brings new migrations (it is
-- idempotent, and puts back the Citus forms of the functions below, which a migration may
-- have replaced). Then build the store with `PostgresStore::on_citus()`, which sends only
-- statements Citus routes to one worker.
--
--   psql "$DATABASE_URL" -1 -f migrations/optional/distribute_on_citus.sql
--
-- or run `tower_idempotency::store::DISTRIBUTE_ON_CITUS` (this file) from code.
--
-- The distribution column. `key` (the default) spreads one tenant's keys over every shard.
-- `scope` keeps a tenant on one shard: its business tables can be distributed by tenant and
-- co-located, but one busy tenant loads one worker. Every statement of the store names both
-- columns, so either routes to one shard; the application's tables must be distributed by the
-- same value, co-located (`colocate_with => 'idempotency_keys'`), for `claim.commit` to be a
-- single-shard transaction.
--
-- The shard count is Citus's `citus.shard_count` when the table is distributed (32 by
-- default). The store sends the claims and completions of one shard that queue together as one
-- statement, so fewer shards a worker make cheaper keys under load, and more make finer moves
-- between workers (a shard is what moves): the sizing guide measures both. To choose it:
--
--   PGOPTIONS='-c citus.shard_count=8' psql "$DATABASE_URL" -1 -f migrations/optional/distribute_on_citus.sql
--
-- and later `SELECT alter_distributed_table('idempotency_keys', shard_count := 16,
-- cascade_to_colocated := true)` (it rewrites the table and the ones co-located with it,
-- blocking writes meanwhile).
--
-- Connect the store's pool to the coordinator: the store reads the shard map from it and sends
-- each key's statements straight to the worker that holds its shard; take the handlers'
-- transactions from `PostgresStore::pool_for(&claim)`, on that worker too. Fences are drawn per
-- key from the clock of the node that runs the claim (the `idempotency_fence` sequence lives on
-- the coordinator only, and is not used on Citus): see `PostgresStore::on_citus` for what that
-- asks of the nodes' clocks.

-- The fence and a recovery point as Citus runs them: in the handler's transaction, on the key's
-- worker (or through the coordinator), their UPDATE routed to the key's shard, and the clock
-- read into variables first (Citus refuses a volatile function in an UPDATE of a distributed
-- table). Same signatures and effect as 20261202000000_fence_in_plpgsql.sql, and planned as it
-- is: once per session, a generic plan that Citus prunes to the key's shard on each call, made
-- with sequential scans priced out, so that the plan it keeps for the shard is the primary-key
-- lookup whatever the table held when it was made. Planning each call instead (an earlier
-- form) cost about twice as much: pgbench on a worker, a business row and the fence in one
-- transaction, 505-695 against 244-386 us of the worker's CPU. A plan over more than one shard
-- would be an error, not a slow fence (and the setting tells the doctor this is the Citus form).

CREATE OR REPLACE FUNCTION idempotency_commit(
    p_scope text, p_key text, p_owner uuid, p_retention_ms float8, p_lease_ms float8,
    p_status smallint, p_response bytea
) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET citus.multi_task_query_log_level = error
AS $$
DECLARE
    v_lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
    v_expires timestamptz := clock_timestamp() + p_retention_ms * interval '1 millisecond';
BEGIN
    UPDATE idempotency_keys
    SET state = 'committed', lease_until = v_lease, suspect = false,
        expires_at = greatest(expires_at, v_expires),
        status = coalesce(p_status, status), response = coalesce(p_response, response),
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
SET citus.multi_task_query_log_level = error
AS $$
DECLARE
    v_lease timestamptz := clock_timestamp() + p_lease_ms * interval '1 millisecond';
    v_expires timestamptz := clock_timestamp() + p_retention_ms * interval '1 millisecond';
BEGIN
    UPDATE idempotency_keys
    SET recovery_point = p_point, recovery_payload = p_payload, lease_until = v_lease,
        suspect = false, expires_at = greatest(expires_at, v_expires), updated_at = now()
    WHERE scope = p_scope AND key = p_key AND owner = p_owner AND state = 'in_flight';
    RETURN FOUND;
END
$$;

-- After the functions: Citus refuses a function command in a transaction once it sharded a
-- table in parallel.
DO $$
DECLARE
    distribution_column constant text := 'key';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition
                   WHERE logicalrelid = 'idempotency_keys'::regclass) THEN
        PERFORM create_distributed_table('idempotency_keys', distribution_column);
    END IF;
END
$$;
