//! The table over time: migrations, the sweeper, index lookups as it grows, and no transaction left open.

use super::*;

pub(crate) async fn the_sweeper_removes_only_expired_rows() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let short = Duration::from_millis(100);

    // Expired: an in-flight claim whose lease ran out, a completed key past its retention.
    acquire(&store, &claim_request("expired-in-flight", short)).await;
    let lease = acquire(&store, &claim_request("expired-completed", LONG)).await;
    store
        .complete(&lease, &response(StatusCode::OK), short)
        .await
        .unwrap();
    // Alive: a live claim, a completed key within retention, and a committed key whose lease
    // ran out (its retention counts from the commit).
    acquire(&store, &claim_request("live-in-flight", LONG)).await;
    let lease = acquire(&store, &claim_request("live-completed", LONG)).await;
    store
        .complete(&lease, &response(StatusCode::OK), LONG)
        .await
        .unwrap();
    let lease = acquire(&store, &claim_request("committed", short)).await;
    let mut tx = schema.pool.begin().await.unwrap();
    claim_for(lease, short).commit(&mut tx).await.unwrap();
    tx.commit().await.unwrap();

    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.sweep().await.unwrap(), 2);
    let mut keys: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys")
        .fetch_all(&schema.pool)
        .await
        .unwrap();
    keys.sort();
    assert_eq!(keys, ["committed", "live-completed", "live-in-flight"]);
    assert_eq!(store.sweep().await.unwrap(), 0);
    schema.drop().await;
}

pub(crate) async fn sweepers_in_parallel_skip_rows_others_hold() {
    let schema = TestSchema::new().await;
    sqlx::query(
        "INSERT INTO idempotency_keys
             (scope, key, fingerprint, state, owner, fence, lease_until, expires_at)
         SELECT 's', 'k' || i, '\\x00', 'in_flight', gen_random_uuid(), i,
                now() - interval '1 hour', now() - interval '1 hour'
         FROM generate_series(1, 3000) AS i",
    )
    .execute(&schema.pool)
    .await
    .unwrap();

    // Another instance holds 100 expired rows (a sweep in progress, say).
    let mut holder = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT key FROM idempotency_keys WHERE key IN (SELECT 'k' || i FROM generate_series(1, 100) i) FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let store = PostgresStore::new(schema.pool.clone()).with_sweep_batch(200);
    let started = Instant::now();
    let (a, b) = tokio::join!(store.sweep(), store.sweep());
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a + b, 2900, "the two sweepers deleted {a} and {b}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "sweepers waited on each other or on held rows: {:?}",
        started.elapsed()
    );

    holder.rollback().await.unwrap();
    assert_eq!(store.sweep().await.unwrap(), 100);
    schema.drop().await;
}

/// The compiled-in set must be the one sqlx resolves from `migrations/` (what `sqlx::migrate!`
/// and `sqlx migrate run` apply): same versions, descriptions, checksums, transaction mode. A
/// database migrated by either then never reports a changed or missing migration.
pub(crate) async fn the_compiled_in_migrations_are_the_files_as_sqlx_reads_them() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let resolved = sqlx::migrate::Migrator::new(dir).await.unwrap();
    let summary = |migrator: &sqlx::migrate::Migrator| {
        migrator
            .iter()
            .map(|m| {
                (
                    m.version,
                    m.description.to_string(),
                    m.migration_type,
                    m.checksum.to_vec(),
                    m.no_tx,
                    m.sql.as_str().to_owned(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert!(resolved.iter().count() >= 3);
    assert_eq!(summary(&MIGRATOR), summary(&resolved));
}

pub(crate) async fn migrations_apply_as_a_plain_sqlx_migrator_and_twice_through_the_store() {
    let name = format!("test_{}", Uuid::new_v4().simple());
    let admin = PgPool::connect(&database_url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(r#"CREATE SCHEMA "{name}""#)))
        .execute(&admin)
        .await
        .unwrap();
    let pool = PgPool::connect_with(schema_options(&database_url(), &name))
        .await
        .unwrap();
    MIGRATOR.run(&pool).await.unwrap();
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1",
    )
    .bind(&name)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "_sqlx_migrations",
            "_tower_idempotency_migrations",
            "idempotency_keys"
        ]
    );
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"DROP SCHEMA "{name}" CASCADE"#
    )))
    .execute(&admin)
    .await
    .unwrap();
}

/// Sequential and index scans of `idempotency_keys` so far, as the statistics collector has them.
async fn scans(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables
         WHERE relid = 'idempotency_keys'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

pub(crate) async fn claims_and_fences_stay_index_lookups_after_the_table_grew_from_empty() {
    let schema = TestSchema::new().await;
    // One connection for the store and one for the application: every statement below runs on
    // the same two sessions, as on a long-lived instance.
    let app_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(schema_options(&database_url(), &schema.name))
        .await
        .unwrap();
    let store = PostgresStore::new(app_pool.clone()).with_max_connections(1);
    // A fresh deployment: the table is empty, and analyzed so.
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&schema.pool)
        .await
        .unwrap();
    let mut n = 0;
    let mut claim_and_fence = async |store: &PostgresStore| {
        n += 1;
        let request = claim_request(&format!("k-{n}"), LONG);
        let lease = acquire(store, &request).await;
        let mut tx = app_pool.begin().await.unwrap();
        claim_for(lease.clone(), LONG)
            .commit(&mut tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        store
            .complete(&lease, &response(StatusCode::OK), LONG)
            .await
            .unwrap();
    };
    // More than the five executions after which Postgres may settle on a generic plan.
    for _ in 0..10 {
        claim_and_fence(&store).await;
    }
    support::grow_by_200000_completed_rows(&schema.pool).await;
    // Statistics reach the collector from each session at most once a second, at the end of
    // a transaction: wait, and end one on each session.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    claim_and_fence(&store).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = scans(&schema.pool).await;
    for _ in 0..50 {
        claim_and_fence(&store).await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    claim_and_fence(&store).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let after = scans(&schema.pool).await;
    println!(
        "200k rows grown under 2 sessions: 51 claims, fences and completions made {} sequential \
         and {} index scans",
        after.0 - before.0,
        after.1 - before.1
    );
    assert_eq!(after.0 - before.0, 0, "sequential scans of a grown table");
    assert!(after.1 - before.1 >= 51, "{before:?} → {after:?}");
    schema.drop().await;
}

/// A claim that settles a row under its lock and finds it taken (another transaction holds it)
/// ends its transaction before its connection goes back: a transaction left open on an idle
/// connection keeps its locks until that connection's next use, so a quiet system would see
/// the key in flight, and `DROP SCHEMA` (or a migration) wait, for as long.
pub(crate) async fn a_claim_that_settles_a_locked_row_leaves_no_transaction_open() {
    let schema = TestSchema::new().await;
    let (pool, application) = named_pool(&schema, "settle").await;
    let store = PostgresStore::new(pool.clone());
    let short = Duration::from_millis(100);
    acquire(&store, &claim_request("k-locked", short)).await;
    tokio::time::sleep(short * 3).await;

    // The expired row is locked by a transaction of someone else's: the claim must settle it
    // under its lock, finds it taken, and answers in flight.
    let mut holder = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'k-locked' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    let outcome = store.claim(&claim_request("k-locked", LONG)).await.unwrap();
    assert!(
        matches!(outcome, ClaimOutcome::InFlight { .. }),
        "{outcome:?}"
    );
    holder.rollback().await.unwrap();

    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND state LIKE 'idle in transaction%'",
    )
    .bind(&application)
    .fetch_one(&schema.pool)
    .await
    .unwrap();
    assert_eq!(
        open, 0,
        "the store left a transaction open on an idle connection"
    );
    // And the key is claimable at once, not after the idle connection's next use.
    acquire(&store, &claim_request("k-locked", LONG)).await;
    pool.close().await;
    schema.drop().await;
}
