//! Fences drawn per key on the node that runs the claim: growing across releases, reclaims and a
//! shard moved, padded by the clock skew, renewed without waiting, and index lookups on a grown
//! table; and what the doctor says of a Citus coordinator.

use super::*;

/// Fences are drawn per key, from the clock of the worker that runs the claim, and grow on every
/// take-over: a key claimed and released (its row kept, its lease ended), claimed again once its
/// shard moved to the other worker (the store's map stale: the statement forwarded), then
/// abandoned, moved back and taken over once its lease ended, never sees a fence smaller than
/// one it had; keys on either worker meanwhile neither.
pub(crate) async fn citus_fences_grow_per_key_across_releases_reclaims_and_a_moved_shard() {
    let cluster = CitusCluster::start(2).await;
    distribute(&cluster.url()).await;
    let store = PostgresStore::new(pool(&cluster.url()).await).on_citus();
    let lease = Duration::from_millis(100);
    let mut fences = Vec::new();
    // Claimed, and released by its owner: the row stays, its lease ended.
    let held = acquire(&store, &claim_request("moving", lease)).await;
    fences.push(held.fence());
    assert_eq!(store.release(&held).await.unwrap(), Ownership::Held);
    // Claimed fresh once its shard moved to the other worker, then abandoned.
    cluster
        .move_shard_of("idempotency_keys", "moving", "block_writes")
        .await;
    fences.push(
        acquire(&store, &claim_request("moving", lease))
            .await
            .fence(),
    );
    // Moved back, and taken over once its lease ended.
    cluster
        .move_shard_of("idempotency_keys", "moving", "block_writes")
        .await;
    tokio::time::sleep(lease * 2).await;
    fences.push(
        acquire(&store, &claim_request("moving", lease))
            .await
            .fence(),
    );
    // Keys on either worker meanwhile.
    for k in 0..20 {
        let key = format!("other-{k}");
        fences.push(acquire(&store, &claim_request(&key, lease)).await.fence());
    }
    assert!(
        fences.windows(2).all(|pair| pair[0] < pair[1]),
        "fences did not grow: {fences:?}"
    );
}

/// The doctor on a Citus coordinator: a local table, a distributed one with a store not built
/// for it, all as it should be, fence functions in an earlier Citus form (slower), and fence
/// functions a later migration put back in the form Citus cannot route.
pub(crate) async fn the_doctor_knows_a_citus_coordinator_and_how_the_table_is_distributed() {
    let cluster = CitusCluster::start(1).await;
    let pool = pool(&cluster.url()).await;
    let plain = PostgresStore::new(pool.clone());
    let citus = PostgresStore::new(pool.clone()).on_citus();
    let finding = async |store: &PostgresStore| {
        let diagnosis = store.diagnose().await;
        let finding = diagnosis
            .of("citus")
            .next()
            .expect("a citus finding")
            .clone();
        (finding.severity, finding.message)
    };
    MIGRATOR.run(&pool).await.unwrap();
    let (severity, message) = finding(&plain).await;
    assert_eq!(severity, Severity::Warning, "{message}");
    assert!(message.contains("local table"), "{message}");

    sqlx::raw_sql(DISTRIBUTE_ON_CITUS)
        .execute(&pool)
        .await
        .unwrap();
    let (severity, message) = finding(&plain).await;
    assert_eq!(severity, Severity::Warning, "{message}");
    assert!(message.contains("not built with on_citus"), "{message}");
    let (severity, message) = finding(&citus).await;
    assert_eq!(severity, Severity::Ok, "{message}");
    assert!(
        message.starts_with("distributed by key in 32 shards"),
        "{message}"
    );
    // One machine, one clock: within the bound; and past a bound no clock can keep.
    let clocks = async |store: &PostgresStore| {
        let diagnosis = store.diagnose().await;
        let finding = diagnosis.of("clocks").next().expect("a clocks finding");
        (finding.severity, finding.message.clone())
    };
    let (severity, message) = clocks(&citus).await;
    assert_eq!(severity, Severity::Ok, "{message}");
    let strict = citus.clone().with_clock_skew(Duration::ZERO);
    let (severity, message) = clocks(&strict).await;
    assert_eq!(severity, Severity::Risk, "{message}");
    assert!(message.contains("with_clock_skew"), "{message}");

    // The fence functions as an earlier DISTRIBUTE_ON_CITUS made them: planning every call.
    for function in ["idempotency_commit", "idempotency_advance"] {
        let earlier = format!(
            "ALTER FUNCTION {function} RESET ALL;
             ALTER FUNCTION {function} SET plan_cache_mode = force_custom_plan"
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(earlier))
            .execute(&pool)
            .await
            .unwrap();
    }
    let (severity, message) = finding(&citus).await;
    assert_eq!(severity, Severity::Warning, "{message}");
    assert!(message.contains("earlier Citus form"), "{message}");

    // A later migration that replaces the fence function with the one-Postgres form.
    let plpgsql = MIGRATOR.iter().find(|m| m.version == 20261202000000);
    let plpgsql = plpgsql.unwrap().sql.as_str().to_owned();
    sqlx::raw_sql(sqlx::AssertSqlSafe(plpgsql))
        .execute(&pool)
        .await
        .unwrap();
    let (severity, message) = finding(&citus).await;
    assert_eq!(severity, Severity::Risk, "{message}");
    assert!(message.contains("DISTRIBUTE_ON_CITUS again"), "{message}");
}

/// Each node reads its own clock, so a key is taken as expired only once its expiry is past by
/// more than the skew the store allows for (`with_clock_skew`): a completed key whose retention
/// just ended still refuses another request and stays through a sweep, and is free once the
/// bound has passed too.
pub(crate) async fn citus_a_key_expires_only_once_past_the_clock_skew() {
    let cluster = cluster().await;
    // Long enough for the checks within it to run on a busy machine.
    let skew = Duration::from_secs(2);
    let store = PostgresStore::new(pool(&cluster.url()).await)
        .on_citus()
        .with_clock_skew(skew);
    let key = format!("{}-skew", uuid::Uuid::new_v4().simple());
    let retention = Duration::from_millis(100);
    let claim = tower_idempotency::conformance::claim_request("t", &key, "first", retention);
    let lease = acquire(&store, &claim).await;
    let answer = answer_done();
    let completed = store.complete(&lease, &answer, retention).await.unwrap();
    assert_eq!(completed, Ownership::Held);
    tokio::time::sleep(retention * 3).await;
    let other = tower_idempotency::conformance::claim_request("t", &key, "second", retention);
    let within = store.claim(&other).await.unwrap();
    assert!(
        matches!(within, ClaimOutcome::Mismatch),
        "past its retention, within the skew: {within:?}"
    );
    store.sweep().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(&key)
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1, "swept within the skew");
    tokio::time::sleep(skew).await;
    let past = store.claim(&other).await.unwrap();
    assert!(
        matches!(past, ClaimOutcome::Acquired { .. }),
        "past the skew too: {past:?}"
    );
}

/// The fence runs in the application's session, where the store chooses nothing about how
/// statements are planned: its function keeps one plan per session, pruned to the key's shard
/// on each call, and that plan must stay a primary-key lookup after the table grew from empty
/// (a fresh deployment). On a cluster of its own (its table starts empty), one application
/// session on the worker: 51 fences after 200,000 rows arrived make no sequential scan of the
/// shards, nor do the store's claims and completions around them.
pub(crate) async fn citus_fences_stay_index_lookups_after_the_table_grew_from_empty() {
    let cluster = CitusCluster::start(1).await;
    distribute(&cluster.url()).await;
    let admin = pool(&cluster.url()).await;
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&admin)
        .await
        .unwrap();
    let worker = &cluster.workers[0];
    let application = PgPoolOptions::new()
        .max_connections(1)
        .connect(&worker.url())
        .await
        .unwrap();
    // The shards' statistics, which Citus hides from other sessions' catalog queries.
    let shards: sqlx::postgres::PgConnectOptions = worker.url().parse().unwrap();
    let shards = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(shards.options([("citus.override_table_visibility", "false")]))
        .await
        .unwrap();
    let store = PostgresStore::new(pool(&cluster.url()).await)
        .on_citus()
        .with_max_connections(1);
    let lease = acquire(&store, &claim_request("warm-up", LONG)).await;
    until_routed(&store, &lease, worker.port).await;

    let mut n = 0;
    let mut claim_and_fence = async || {
        n += 1;
        let lease = acquire(&store, &claim_request(&format!("k-{n}"), LONG)).await;
        let mut tx = application.begin().await.unwrap();
        let claim = IdempotencyClaim::new(lease.clone(), LONG);
        claim.commit(&mut tx).await.unwrap();
        tx.commit().await.unwrap();
        let completed = store.complete(&lease, &answer_done(), LONG).await.unwrap();
        assert_eq!(completed, Ownership::Held);
    };
    // More than the five executions after which Postgres may settle on a generic plan.
    for _ in 0..10 {
        claim_and_fence().await;
    }
    support::grow_by_200000_completed_rows(&admin).await;
    // Statistics reach the collector from each session at most once a second, at the end of
    // a transaction: wait, and end one on each session.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    claim_and_fence().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let before = shard_scans(&shards).await;
    for _ in 0..50 {
        claim_and_fence().await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    claim_and_fence().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let after = shard_scans(&shards).await;
    assert_eq!(after.0 - before.0, 0, "sequential scans of a grown table");
    assert!(after.1 - before.1 >= 51, "{before:?} → {after:?}");
}

/// Renewals on Citus (a flat statement Citus plans once, in a transaction that waits at most
/// 10 ms for the row), on sessions that refuse any multi-shard statement: held for their owner,
/// lost for a key another owner took over, and busy at once for a row another transaction
/// holds, then held once it is let go; renewed at the destination.
pub(crate) async fn citus_renewals_answer_held_lost_and_busy_without_waiting() {
    let cluster = cluster().await;
    let store = PostgresStore::new(pool(&cluster.single_shard_url()).await)
        .on_citus()
        .with_clock_skew(Duration::ZERO);
    let admin = pool(&cluster.url()).await;
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let key = |name: &str| format!("{prefix}-{name}");
    let held = acquire(&store, &claim_request(&key("held"), LONG)).await;
    let short = Duration::from_millis(100);
    let taken = acquire(&store, &claim_request(&key("taken"), short)).await;
    tokio::time::sleep(short * 3).await;
    acquire(&store, &claim_request(&key("taken"), LONG)).await;
    let locked = acquire(&store, &claim_request(&key("locked"), LONG)).await;
    until_routed(&store, &held, worker_of(cluster, &key("held")).await).await;

    let renewal = Duration::from_secs(600);
    assert_eq!(store.renew(&held, renewal).await.unwrap(), Ownership::Held);
    assert_eq!(store.renew(&taken, renewal).await.unwrap(), Ownership::Lost);
    let mut holder = admin.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
        .bind(key("locked"))
        .execute(&mut *holder)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    assert_eq!(
        store.renew(&locked, renewal).await.unwrap(),
        Ownership::Busy
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    holder.rollback().await.unwrap();
    assert_eq!(
        store.renew(&locked, renewal).await.unwrap(),
        Ownership::Held
    );

    let renewed: Vec<String> = sqlx::query_scalar(
        "SELECT key FROM idempotency_keys
         WHERE key LIKE $1 || '-%' AND lease_until > now() + interval '5 minutes' ORDER BY key",
    )
    .bind(&prefix)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(renewed, [key("held"), key("locked")]);
}

/// Sequential and index scans of `idempotency_keys`' shards on the node so far.
pub(crate) async fn shard_scans(node: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT sum(seq_scan)::int8, sum(coalesce(idx_scan, 0))::int8 FROM pg_stat_user_tables
         WHERE relname ~ '^idempotency_keys_[0-9]+$'",
    )
    .fetch_one(node)
    .await
    .unwrap()
}
