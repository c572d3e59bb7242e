//! The Postgres store against real servers: the machine's (a schema per test) and, for tests
//! that stop it, a cluster of their own.

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{Request, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use http::HeaderMap;
use http_body_util::BodyExt;
use sqlx::PgPool;
use support::{
    Fault, FaultProxy, Faulty, PgCluster, StoreFault, TestSchema, acquire, claim_request,
    database_url, pool_in_schema, schema_options,
};
use tokio::sync::{Notify, Semaphore};
use tower::ServiceExt;
use tower_idempotency::{
    Fingerprint, IdempotencyClaim, IdempotencyKey, IdempotencyLayer, StoredResponse, problem,
    store::{
        ClaimOutcome, ClaimRequest, FenceError, Lease, MIGRATOR, Ownership, PARTITION_BY_HASH,
        PostgresStore, RecordKey, Store,
    },
};
use uuid::Uuid;

tower_idempotency::store_conformance_tests!(async {
    let store =
        PostgresStore::new(pool_in_schema(&database_url(), "tower_idempotency_conformance").await);
    // The shared schema outlives the run: keep it from growing.
    store.sweep().await.unwrap();
    store
});

/// Applies the optional partitioning to the schema `pool` works in (once: concurrent callers
/// wait on an advisory lock, and a partitioned table is left alone).
async fn partition(pool: &PgPool) {
    let mut connection = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(727275)")
        .execute(&mut *connection)
        .await
        .unwrap();
    sqlx::raw_sql(PARTITION_BY_HASH)
        .execute(&mut *connection)
        .await
        .unwrap();
    sqlx::query("SELECT pg_advisory_unlock(727275)")
        .execute(&mut *connection)
        .await
        .unwrap();
}

/// The conformance suite on a hash-partitioned `idempotency_keys`.
mod partitioned {
    use super::*;

    tower_idempotency::store_conformance_tests!(async {
        let pool = pool_in_schema(&database_url(), "tower_idempotency_partitioned").await;
        partition(&pool).await;
        let store = PostgresStore::new(pool);
        store.sweep().await.unwrap();
        store
    });
}

fn response(status: StatusCode) -> StoredResponse {
    StoredResponse::new(status, HeaderMap::new(), Some("body".into()), None)
}

const LONG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_from_two_instances_yield_one_owner_every_round() {
    let schema = TestSchema::new().await;
    let instances = [
        PostgresStore::new(pool_in_schema(&database_url(), &schema.name).await),
        PostgresStore::new(pool_in_schema(&database_url(), &schema.name).await),
    ];
    for round in 0..100 {
        let key = format!("race-{round}");
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let store = instances[i % 2].clone();
                let request = claim_request(&key, LONG);
                tokio::spawn(async move { store.claim(&request).await.unwrap() })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            match task.await.unwrap() {
                ClaimOutcome::Acquired { .. } => acquired += 1,
                ClaimOutcome::InFlight { .. } => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1, "round {round}: {acquired} owners");
    }
    schema.drop().await;
}

#[tokio::test]
async fn the_fence_refuses_a_stale_owner_and_is_idempotent_for_the_current_one() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let stale = claim_request("k-fence", Duration::from_millis(200));
    let stale_lease = acquire(&store, &stale).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let current = claim_request("k-fence", LONG);
    let current_lease = acquire(&store, &current).await;
    assert!(current_lease.fence() > stale_lease.fence());

    let claim_of = |lease: &Lease| claim_for(lease.clone(), LONG);
    let mut tx = schema.pool.begin().await.unwrap();
    match claim_of(&stale_lease).commit(&mut tx).await {
        Err(FenceError::LeaseLost { record, fence }) => {
            assert_eq!(record.key().as_str(), "k-fence");
            assert_eq!(fence, stale_lease.fence());
        }
        other => panic!("a stale owner's fence must fail, got {other:?}"),
    }
    drop(tx);

    let mut tx = schema.pool.begin().await.unwrap();
    claim_of(&current_lease).commit(&mut tx).await.unwrap();
    claim_of(&current_lease).commit(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        store.release(&current_lease).await.unwrap(),
        Ownership::Committed
    );
    assert_eq!(store.release(&stale_lease).await.unwrap(), Ownership::Lost);
    assert_eq!(
        store
            .complete(&current_lease, &response(StatusCode::OK), LONG)
            .await
            .unwrap(),
        Ownership::Held
    );
    schema.drop().await;
}

/// The claim a handler holding `lease` receives, from a layer whose lease is `lease_duration`.
fn claim_for(lease: Lease, lease_duration: Duration) -> IdempotencyClaim {
    IdempotencyClaim::new(lease, LONG).with_lease_duration(lease_duration)
}

#[tokio::test]
async fn a_committed_key_whose_owner_died_never_runs_again() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let request = claim_request("k-orphan", Duration::from_millis(200));
    let lease = acquire(&store, &request).await;
    let mut tx = schema.pool.begin().await.unwrap();
    claim_for(lease.clone(), request.lease())
        .commit(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // The owner "dies": no renewal, no completion. Its lease runs out, the commit stands. The
    // first claim after that gives the owner half a lease to show it is alive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    match store.claim(&request).await.unwrap() {
        ClaimOutcome::InFlight { retry_after } => {
            assert_eq!(retry_after, request.lease() / 2)
        }
        other => panic!("a lapsed owner was declared dead without a grace: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.claim(&request).await.unwrap(), ClaimOutcome::Orphaned);
    assert_eq!(
        store.claim(&claim_request("k-orphan", LONG)).await.unwrap(),
        ClaimOutcome::Orphaned
    );
    schema.drop().await;
}

/// A payment API over Postgres whose handler writes its row through the fence; the first attempt
/// stalls (until the test lets it go) after its insert and before its fence.
struct Payments {
    pool: PgPool,
    attempts: AtomicUsize,
    stalled: Notify,
    unstall: Semaphore,
}

async fn create_payment(State(app): State<Arc<Payments>>, claim: IdempotencyClaim) -> Response {
    let attempt = app.attempts.fetch_add(1, SeqCst) as i32 + 1;
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO payments (key, attempt) VALUES ($1, $2)")
        .bind(claim.key().as_str())
        .bind(attempt)
        .execute(&mut *tx)
        .await
        .unwrap();
    if attempt == 1 {
        app.stalled.notify_one();
        let _permit = app.unstall.acquire().await.unwrap();
    }
    match claim.commit(&mut tx).await {
        Ok(()) => {
            tx.commit().await.unwrap();
            (StatusCode::CREATED, format!("attempt {attempt}")).into_response()
        }
        // `tx` is dropped: the insert rolls back.
        Err(FenceError::LeaseLost { .. }) => (StatusCode::CONFLICT, "lost the key").into_response(),
        Err(error) => panic!("{error}"),
    }
}

fn payments_app(layer: IdempotencyLayer, app: &Arc<Payments>) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .layer(layer)
        .with_state(Arc::clone(app))
}

async fn post_payment(app: &Router, key: &str) -> (StatusCode, HeaderMap, String) {
    let request = Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handler_that_lost_its_lease_cannot_commit_a_second_payment() {
    let schema = TestSchema::new().await;
    sqlx::query("CREATE TABLE payments (key text NOT NULL, attempt int NOT NULL)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let store = PostgresStore::new(schema.pool.clone());
    let state = Arc::new(Payments {
        pool: schema.pool.clone(),
        attempts: AtomicUsize::new(0),
        stalled: Notify::new(),
        unstall: Semaphore::new(0),
    });
    let stalled_layer = IdempotencyLayer::new(Faulty {
        inner: store.clone(),
        fault: StoreFault::FrozenRenewals,
    })
    .with_lease(Duration::from_millis(300));
    let stalled = payments_app(stalled_layer.clone(), &state);
    let healthy = payments_app(IdempotencyLayer::new(store.clone()), &state);

    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { post_payment(&stalled, "pay-once").await }
    });
    state.stalled.notified().await;
    tokio::time::sleep(Duration::from_millis(700)).await;

    // The lease ran out while the first attempt stalled: the retry reclaims and commits.
    let (status, _, body) = post_payment(&healthy, "pay-once").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));

    state.unstall.add_permits(1);
    // The stale attempt's fence failed (its handler answered "lost the key"), and its caller
    // got the key's real answer instead of that.
    let (status, headers, body) = first.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));
    assert_eq!(headers["idempotent-replayed"], "true");

    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT key, attempt FROM payments")
        .fetch_all(&schema.pool)
        .await
        .unwrap();
    assert_eq!(
        rows,
        [("pay-once".to_owned(), 2)],
        "exactly one business commit"
    );
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);

    let (status, headers, body) = post_payment(&healthy, "pay-once").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(state.attempts.load(SeqCst), 2);
    schema.drop().await;
}

#[tokio::test]
async fn a_committed_key_is_completed_whatever_the_response() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/refunds",
            post({
                let (pool, runs) = (schema.pool.clone(), Arc::clone(&runs));
                move |claim: IdempotencyClaim| async move {
                    runs.fetch_add(1, SeqCst);
                    let mut tx = pool.begin().await.unwrap();
                    claim.commit(&mut tx).await.unwrap();
                    tx.commit().await.unwrap();
                    // A 503 would normally release the key; after the commit it must not.
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .layer(IdempotencyLayer::new(store));
    let send = || async {
        let request = Request::post("/refunds")
            .header("idempotency-key", "refund-1")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(request).await.unwrap()
    };
    assert_eq!(send().await.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = send().await;
    assert_eq!(retry.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.load(SeqCst), 1);
    schema.drop().await;
}

#[tokio::test]
async fn an_orphaned_key_answers_outcome_unknown_through_the_layer() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/x",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    runs.fetch_add(1, SeqCst);
                    StatusCode::OK
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(100)));

    // An earlier attempt of this request claimed and committed, then its instance died.
    committed_then_died(&store, &schema, "k-dead").await;

    let request = Request::post("/x")
        .header("idempotency-key", "k-dead")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(response.headers().get("retry-after").is_none());
    let body: serde_json::Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["type"], problem::OUTCOME_UNKNOWN);
    assert_eq!(runs.load(SeqCst), 0);
    schema.drop().await;
}

/// A statement's generic plan (the store's connections force them) locks every partition and
/// its indexes before it prunes to one: the migration's partitions keep a key lookup within the
/// locks a session takes without the shared lock manager (its fast-path locks; 16 partitions
/// took 34 others, and cost up to 0.75x the plain table's throughput).
#[tokio::test]
async fn a_key_lookup_on_the_partitioned_table_takes_only_fast_path_locks() {
    let schema = TestSchema::new().await;
    partition(&schema.pool).await;
    let mut tx = schema.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL plan_cache_mode = force_generic_plan")
        .execute(&mut *tx)
        .await
        .unwrap();
    let lookup = "SELECT state FROM idempotency_keys WHERE scope = $1 AND key = $2";
    let found: Option<String> = sqlx::query_scalar(lookup)
        .bind("tenant")
        .bind("k-locks")
        .fetch_optional(&mut *tx)
        .await
        .unwrap();
    assert_eq!(found, None);
    let locks: Vec<(bool, i64)> = sqlx::query_as(
        "SELECT fastpath, count(*) FROM pg_locks
         WHERE pid = pg_backend_pid() AND locktype = 'relation' GROUP BY fastpath",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    let slow: i64 = locks.iter().filter(|(fast, _)| !fast).map(|(_, n)| n).sum();
    let all: i64 = locks.iter().map(|(_, n)| n).sum();
    assert!(
        all > 4,
        "the lookup locked {all} relations: not the partitioned table?"
    );
    assert_eq!(
        slow, 0,
        "{slow} of {all} relation locks missed the fast path"
    );
}

/// On the partitioned table: rows spread over the partitions, the fence commits and stores its
/// response, the sweeper deletes expired rows in every partition, the admin operations find
/// keys; and the table is partitioned (the test would pass on a plain one otherwise).
#[tokio::test]
async fn the_fence_the_sweeper_and_the_admin_work_on_the_partitioned_table() {
    let schema = TestSchema::new().await;
    partition(&schema.pool).await;
    partition(&schema.pool).await;
    let partitioned: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = 'idempotency_keys'::regclass)",
    )
    .fetch_one(&schema.pool)
    .await
    .unwrap();
    assert!(partitioned);
    let store = PostgresStore::new(schema.pool.clone());
    let short = Duration::from_millis(100);
    for k in 0..64 {
        let request = claim_request(&format!("k-{k}"), LONG);
        let lease = acquire(&store, &request).await;
        if k % 2 == 0 {
            let mut tx = schema.pool.begin().await.unwrap();
            let answer = http::Response::builder()
                .status(StatusCode::CREATED)
                .body(bytes::Bytes::from_static(b"{}"))
                .unwrap();
            claim_for(lease.clone(), LONG)
                .commit_with_response(&mut tx, &answer)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
        store
            .complete(&lease, &response(StatusCode::CREATED), short)
            .await
            .unwrap();
    }
    acquire(&store, &claim_request("live", LONG)).await;
    let partitions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT tableoid) FROM idempotency_keys")
            .fetch_one(&schema.pool)
            .await
            .unwrap();
    assert_eq!(partitions, 4, "65 keys in {partitions} partitions");
    let live = claim_request("live", LONG).record().clone();
    let info = store.inspect(&live).await.unwrap().unwrap();
    assert_eq!(info.state, tower_idempotency::store::RecordState::InFlight);
    assert_eq!(store.stuck(Duration::ZERO, 10).await.unwrap().len(), 1);

    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(store.sweep().await.unwrap(), 64);
    assert!(store.forget(&live).await.unwrap());
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    schema.drop().await;
}

#[tokio::test]
async fn the_sweeper_removes_only_expired_rows() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweepers_in_parallel_skip_rows_others_hold() {
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
#[tokio::test]
async fn the_compiled_in_migrations_are_the_files_as_sqlx_reads_them() {
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

#[tokio::test]
async fn migrations_apply_as_a_plain_sqlx_migrator_and_twice_through_the_store() {
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

/// A layer over a Postgres of the test's own, with a handler that counts its runs.
fn counting_app(store: PostgresStore, runs: &Arc<AtomicUsize>) -> Router {
    let runs = Arc::clone(runs);
    Router::new()
        .route(
            "/orders",
            post(move || async move {
                runs.fetch_add(1, SeqCst);
                (StatusCode::CREATED, "ordered")
            }),
        )
        .layer(IdempotencyLayer::new(store))
}

async fn order(app: &Router, key: &str) -> Response {
    let request = Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_is_down_means_503_and_no_execution_until_it_returns() {
    let mut cluster = PgCluster::start().await;
    let pool = pool_in_schema(&cluster.url(), "public").await;
    let store = PostgresStore::new(pool).with_timeout(Duration::from_secs(3));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(store, &runs);
    assert_eq!(order(&app, "before").await.status(), StatusCode::CREATED);

    cluster.stop_server();
    let mut answered = 0;
    for key in ["before", "during-1", "during-2"] {
        let started = Instant::now();
        let response = order(&app, key).await;
        assert_eq!(
            response.status(),
            StatusCode::SERVICE_UNAVAILABLE,
            "key {key}"
        );
        assert!(response.headers().contains_key("retry-after"));
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "503 took {:?}",
            started.elapsed()
        );
        answered += 1;
    }
    assert_eq!(answered, 3);
    assert_eq!(runs.load(SeqCst), 1, "a handler ran without a claim");

    cluster.start_server().await;
    let started = Instant::now();
    let response = loop {
        let response = order(&app, "during-1").await;
        if response.status() != StatusCode::SERVICE_UNAVAILABLE {
            break response;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "still 503 after the restart"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(response.status(), StatusCode::CREATED);
    let replay = order(&app, "before").await;
    assert_eq!(
        replay.headers()["idempotent-replayed"],
        "true",
        "the completed key was lost"
    );
    assert_eq!(runs.load(SeqCst), 2);
}

#[tokio::test]
async fn busy_store_connections_are_a_fast_503_and_the_application_pool_is_untouched() {
    let schema = TestSchema::new().await;
    // The application's pool has one connection, which the application holds.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(schema_options(&database_url(), &schema.name))
        .await
        .unwrap();
    let held = pool.acquire().await.unwrap();
    let store = PostgresStore::new(pool.clone())
        .with_max_connections(1)
        .with_timeout(Duration::from_millis(500));
    let runs = Arc::new(AtomicUsize::new(0));
    let app = counting_app(store, &runs);
    // The store has connections of its own: the application's busy pool is no obstacle.
    assert_eq!(order(&app, "k-own").await.status(), StatusCode::CREATED);

    // Its one connection stuck behind a lock: the next claim is a 503 within the bound.
    let mut locker = PgPool::connect_with(schema_options(&database_url(), &schema.name))
        .await
        .unwrap()
        .begin()
        .await
        .unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let stuck = tokio::spawn({
        let app = app.clone();
        async move { order(&app, "k-stuck").await.status() }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    assert_eq!(
        order(&app, "k-busy").await.status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(stuck.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(SeqCst), 1);
    locker.rollback().await.unwrap();
    assert_eq!(order(&app, "k-busy").await.status(), StatusCode::CREATED);
    drop(held);
    pool.close().await;
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_client_gave_up_on_never_acquires_later() {
    let schema = TestSchema::new().await;
    // One connection, which has run the claim before: its statement is prepared, so the claim
    // is sent whole and waits on the lock in the server.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(schema_options(&database_url(), &schema.name))
        .await
        .unwrap();
    let store = PostgresStore::new(pool).with_timeout(Duration::from_millis(300));
    acquire(&store, &claim_request("k-warm-up", LONG)).await;
    // Another transaction holds the table: the claim waits on it and the client gives up.
    let mut locker = schema.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let started = Instant::now();
    let given_up = store.claim(&claim_request("k-given-up", LONG)).await;
    assert!(
        matches!(
            given_up,
            Err(tower_idempotency::store::StoreError::Timeout { .. })
        ),
        "{given_up:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(300)).await;
    locker.commit().await.unwrap();
    // The statement the client abandoned ran once the lock was gone: it must not have acquired.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind("k-given-up")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(
        rows, 0,
        "a claim the client gave up on acquired the key later"
    );
    acquire(&store, &claim_request("k-given-up", LONG)).await;
    schema.drop().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_and_fences_stay_index_lookups_after_the_table_grew_from_empty() {
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
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, key, fingerprint, state, owner, fence, lease_until,
                                       expires_at, status, response)
         SELECT 'grown', 'g' || i, '\\x00', 'completed', gen_random_uuid(), i, now(),
                now() + interval '1 day', 200, '\\x00'
         FROM generate_series(1, 200000) AS i",
    )
    .execute(&schema.pool)
    .await
    .unwrap();
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
#[tokio::test]
async fn a_claim_that_settles_a_locked_row_leaves_no_transaction_open() {
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

/// Recovery points: advanced in the handler's own transaction, fenced; kept when the owner
/// dies (the sweeper leaves the row); resumed only by the request the key was claimed for; and a
/// key with progress is never deleted by a release, only left for the next attempt.
#[tokio::test]
async fn recovery_points_outlive_their_owner_and_resume_only_for_the_same_request() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let short = Duration::from_millis(200);
    let first = claim_request("k-steps", short);
    let lease = acquire(&store, &first).await;
    let claim = claim_for(lease.clone(), short);
    let mut connection = schema.pool.acquire().await.unwrap();
    assert_eq!(claim.recovery_point(&mut connection).await.unwrap(), None);
    let progress = serde_json::json!({ "payment_id": "pay_1" });
    let mut tx = schema.pool.begin().await.unwrap();
    claim
        .advance(&mut tx, "intent_recorded", &progress)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let point = claim
        .recovery_point(&mut connection)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (point.name(), point.payload()),
        ("intent_recorded", &progress)
    );

    // The owner dies: its lease runs out, and the sweeper leaves the progress alone.
    tokio::time::sleep(short * 3).await;
    store.sweep().await.unwrap();
    // Another request with the key may not take the progress over.
    let other = tower_idempotency::conformance::claim_request("tenant", "k-steps", "other", LONG);
    assert_eq!(store.claim(&other).await.unwrap(), ClaimOutcome::Mismatch);
    // The same request takes the key over and resumes.
    let retry = claim_request("k-steps", LONG);
    let resumed = acquire(&store, &retry).await;
    assert!(resumed.fence() > lease.fence());
    let resumed_claim = claim_for(resumed.clone(), LONG);
    let point = resumed_claim
        .recovery_point(&mut connection)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (point.name(), point.payload()),
        ("intent_recorded", &progress)
    );
    // The stale owner can no longer advance, nor read the key as its own.
    let mut tx = schema.pool.begin().await.unwrap();
    let stale = claim
        .advance(&mut tx, "charged", &serde_json::Value::Null)
        .await;
    assert!(
        matches!(stale, Err(FenceError::LeaseLost { .. })),
        "{stale:?}"
    );
    drop(tx);
    assert!(matches!(
        claim.recovery_point(&mut connection).await,
        Err(FenceError::LeaseLost { .. })
    ));

    // A release (the provider failed, say) ends the lease instead of deleting the progress.
    assert_eq!(store.release(&resumed).await.unwrap(), Ownership::Held);
    let again = acquire(&store, &claim_request("k-steps", LONG)).await;
    let point = claim_for(again, LONG)
        .recovery_point(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        point.map(|p| p.name().to_owned()).as_deref(),
        Some("intent_recorded")
    );
    // A claim of another store (the memory store here) has no row to advance: said so.
    let elsewhere = tower_idempotency::MemoryStore::new();
    let foreign = acquire(&elsewhere, &claim_request("k-elsewhere", LONG)).await;
    let mut tx = schema.pool.begin().await.unwrap();
    let refused = claim_for(foreign, LONG)
        .advance(&mut tx, "x", &serde_json::Value::Null)
        .await;
    assert!(
        matches!(refused, Err(FenceError::NoRecord { .. })),
        "{refused:?}"
    );
    drop(tx);
    drop(connection);
    schema.drop().await;
}

/// With a recovery hook, a key committed by an owner that died before storing an answer gets
/// the answer the application rebuilds from its own rows, stored and replayed, instead of 24 h of
/// outcome-unknown; the hook runs once.
#[tokio::test]
async fn the_recovery_hook_answers_a_key_committed_without_an_answer() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let recovered = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(100))
        .with_recovery({
            let recovered = Arc::clone(&recovered);
            move |record: RecordKey| {
                recovered.fetch_add(1, SeqCst);
                async move {
                    // The handler's business row, looked up by the key.
                    let body = format!(r#"{{"payment":"pay_for_{}"}}"#, record.key());
                    Some(
                        http::Response::builder()
                            .status(StatusCode::CREATED)
                            .header("content-type", "application/json")
                            .body(bytes::Bytes::from(body))
                            .unwrap(),
                    )
                }
            }
        });
    let app = Router::new()
        .route(
            "/x",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    runs.fetch_add(1, SeqCst);
                    StatusCode::OK
                }
            }),
        )
        .layer(layer);

    // An earlier attempt committed with plain `commit`, then its instance died.
    committed_then_died(&store, &schema, "k-recovered").await;

    let send = || {
        app.clone().oneshot(
            Request::post("/x")
                .header("idempotency-key", "k-recovered")
                .body(Body::empty())
                .unwrap(),
        )
    };
    for _ in 0..2 {
        let response = send().await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, r#"{"payment":"pay_for_k-recovered"}"#);
    }
    assert_eq!(recovered.load(SeqCst), 1, "stored once, then replayed");
    assert_eq!(runs.load(SeqCst), 0, "the handler never ran again");
    schema.drop().await;
}

/// Postgres terminates the store's connections (as a restart or a failover does) and answers
/// again at once: the next claims all succeed. A connection that failed with "terminating
/// connection due to administrator command" was taken back as still usable (a database error),
/// failed again with EOF, and most of the next new keys got 503.
#[tokio::test]
async fn terminated_connections_are_never_lent_again_and_claims_go_on() {
    let schema = TestSchema::new().await;
    let (pool, application) = named_pool(&schema, "terminated").await;
    let store = PostgresStore::new(pool.clone());
    // Idle connections of the store's own, several of them.
    let warm: Vec<_> = (0..8)
        .map(|k| claim_request(&format!("warm-{k}"), LONG))
        .collect();
    let claims = warm.iter().map(|request| store.claim(request));
    for outcome in futures_util::future::join_all(claims).await {
        assert!(
            matches!(outcome, Ok(ClaimOutcome::Acquired { .. })),
            "{outcome:?}"
        );
    }
    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(&application)
    .fetch_all(&schema.pool)
    .await
    .unwrap();
    assert!(
        terminated.len() >= 2,
        "the store's connections: {terminated:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut failed = 0;
    for k in 0..16 {
        match store
            .claim(&claim_request(&format!("after-{k}"), LONG))
            .await
        {
            Ok(ClaimOutcome::Acquired { .. }) => {}
            other => {
                failed += 1;
                println!("after-{k}: {other:?}");
            }
        }
    }
    assert_eq!(
        failed, 0,
        "claims failed after the connections were terminated"
    );
    pool.close().await;
    schema.drop().await;
}

/// A `POST /x` with no body and `key`, claimed and committed with plain `commit` by an owner that
/// then died: its lease (100 ms) and grace are over when this returns.
async fn committed_then_died(store: &PostgresStore, schema: &TestSchema, key: &str) {
    let parts = Request::post("/x").body(()).unwrap().into_parts().0;
    let dead = ClaimRequest::new(
        RecordKey::new(
            tower_idempotency::scope::ANONYMOUS_SCOPE,
            IdempotencyKey::try_from(key).unwrap(),
        ),
        Fingerprint::of_request(&parts, &[], b""),
        Uuid::new_v4(),
        Duration::from_millis(100),
    );
    let lease = acquire(store, &dead).await;
    let mut tx = schema.pool.begin().await.unwrap();
    claim_for(lease, dead.lease())
        .commit(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// One key, one stored answer: a response stored with the fence that varies on a request
/// header (`Vary`) is stored as the layer stores it, with the request's value of that header, so
/// a retry that meets it (here before the handler even returned) is replayed, not refused 406;
/// and the layer's completion keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_stored_with_the_fence_is_the_one_every_retry_gets() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let pool = schema.pool.clone();
    let handler = move |claim: IdempotencyClaim| {
        let pool = pool.clone();
        async move {
            let response = http::Response::builder()
                .status(StatusCode::CREATED)
                .header("vary", "accept-language")
                .header("content-language", "fr")
                .body(bytes::Bytes::from_static(b"paiement"))
                .unwrap();
            let mut tx = pool.begin().await.unwrap();
            claim
                .commit_with_response(&mut tx, &response)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            // The answer is stored; the handler is still busy.
            tokio::time::sleep(Duration::from_millis(400)).await;
            response.map(Body::from)
        }
    };
    let app = Router::new()
        .route("/pay", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    let request = || {
        Request::post("/pay")
            .header("idempotency-key", "k-vary")
            .header("accept-language", "fr")
            .body(Body::empty())
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(request()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let early = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        early.status(),
        StatusCode::CREATED,
        "the answer stored with the fence"
    );
    assert_eq!(early.headers()["idempotent-replayed"], "true");
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let late = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(late.status(), StatusCode::CREATED);
    let body = late.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "paiement");
    schema.drop().await;
}

/// A pool of two connections in `schema`, whose sessions (and the store's own, made from its
/// options) carry an application name of their own: the name, to find them in
/// `pg_stat_activity`.
async fn named_pool(schema: &TestSchema, prefix: &str) -> (PgPool, String) {
    let application = format!("{prefix}-{}", Uuid::new_v4().simple());
    let options = schema_options(&database_url(), &schema.name).application_name(&application);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .unwrap();
    (pool, application)
}

/// What callers saw while Postgres went through a fault under load.
#[derive(Debug)]
struct UnderLoad {
    /// Keys answered 201 (each once, then the caller moved on).
    keys: usize,
    /// 503 answers in all, and those to requests sent after Postgres answered again.
    unavailable: usize,
    unavailable_after: usize,
    /// 409 answers (a key in flight, its completion waiting for Postgres).
    in_flight: usize,
}

/// 16 callers send fresh keys one after another through a layer on `store` (a handler that takes
/// 20 ms), each sending its key
/// again after a 503 or a 409 (50 ms later), while `fault` runs and for 2 s after it returns
/// (when Postgres answers again); every handler run counted per key.
async fn under_load(
    store: PostgresStore,
    fault: impl Future<Output = ()>,
) -> (UnderLoad, std::collections::HashMap<String, usize>) {
    use std::{collections::HashMap, sync::Mutex, sync::atomic::AtomicBool};
    let runs = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let counted = Arc::clone(&runs);
    let app = Router::new()
        .route(
            "/orders",
            post(move |headers: HeaderMap| async move {
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                *counted.lock().unwrap().entry(key).or_default() += 1;
                // Work that takes a while: keys are in flight when Postgres goes.
                tokio::time::sleep(Duration::from_millis(20)).await;
                (StatusCode::CREATED, "ordered")
            }),
        )
        .layer(IdempotencyLayer::new(store).with_lease(Duration::from_secs(2)));
    let stop = Arc::new(AtomicBool::new(false));
    let answered_again = Arc::new(std::sync::OnceLock::<Instant>::new());
    let callers: Vec<_> = (0..16)
        .map(|caller| {
            let (app, stop) = (app.clone(), Arc::clone(&stop));
            let answered_again = Arc::clone(&answered_again);
            tokio::spawn(async move {
                let (mut keys, mut unavailable, mut after, mut in_flight) = (0, 0, 0, 0);
                while !stop.load(SeqCst) {
                    let key = format!("caller-{caller}-{keys}");
                    loop {
                        let sent = Instant::now();
                        match order(&app, &key).await.status() {
                            StatusCode::CREATED => break,
                            StatusCode::SERVICE_UNAVAILABLE => {
                                unavailable += 1;
                                let again = answered_again.get();
                                after += usize::from(again.is_some_and(|&at| sent > at));
                            }
                            StatusCode::CONFLICT => in_flight += 1,
                            other => panic!("{key}: unexpected {other}"),
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    keys += 1;
                }
                (keys, unavailable, after, in_flight)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    fault.await;
    answered_again.set(Instant::now()).unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, SeqCst);
    let mut seen = UnderLoad {
        keys: 0,
        unavailable: 0,
        unavailable_after: 0,
        in_flight: 0,
    };
    for caller in callers {
        let (keys, unavailable, after, in_flight) = caller.await.unwrap();
        seen.keys += keys;
        seen.unavailable += unavailable;
        seen.unavailable_after += after;
        seen.in_flight += in_flight;
    }
    let runs = runs.lock().unwrap().clone();
    (seen, runs)
}

fn assert_once_each(seen: &UnderLoad, runs: &std::collections::HashMap<String, usize>) {
    let twice: Vec<_> = runs.iter().filter(|&(_, &n)| n > 1).collect();
    assert!(twice.is_empty(), "keys that ran twice: {twice:?}");
    assert_eq!(runs.len(), seen.keys, "every answered key ran, once");
    assert_eq!(
        seen.unavailable_after, 0,
        "503 to requests sent after Postgres answered again: {seen:?}"
    );
}

/// Postgres restarts (`pg_ctl restart -m fast`: every session terminated) while 16 callers send
/// fresh keys: no key runs twice, and no request sent once it answers again gets a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_under_load_runs_nothing_twice_and_503s_end_when_it_answers() {
    let mut cluster = PgCluster::start().await;
    let store = PostgresStore::new(pool_in_schema(&cluster.url(), "public").await);
    let (seen, runs) = under_load(store, cluster.restart_server()).await;
    println!("postgres restarted under load: {seen:?}");
    assert_once_each(&seen, &runs);
}

/// The primary dies (`-m immediate`) while 16 callers send fresh keys; its synchronous standby
/// is promoted and the address the store uses moves to it (a virtual IP or DNS name): no key
/// runs twice, keys in flight complete on the new primary, and no request sent once it answers
/// gets a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_failover_under_load_runs_nothing_twice_and_503s_end_when_it_answers() {
    let mut primary = PgCluster::start().await;
    let standby = primary.start_standby().await;
    let address = FaultProxy::start(vec![primary.address()], vec![Fault::None]).await;
    let url = support::postgres_url(address.port);
    let store = PostgresStore::new(pool_in_schema(&url, "public").await);
    let failover = async {
        primary.stop_server();
        tokio::task::block_in_place(|| standby.promote());
        address.point_at(vec![standby.address()]);
    };
    let (seen, runs) = under_load(store, failover).await;
    println!("postgres failed over under load: {seen:?}");
    assert_once_each(&seen, &runs);
}

/// The fence's retention counts from the fence, not from the start of the handler's
/// transaction: a key fenced at the end of a long transaction (1.5 s of work here) and never
/// completed (its instance died) keeps its answer for the whole retention after the commit.
#[tokio::test]
async fn the_fences_retention_counts_from_the_commit_not_the_transactions_start() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let request = claim_request("long-transaction", Duration::from_secs(3));
    let lease = acquire(&store, &request).await;
    let retention = Duration::from_secs(10);
    let mut tx = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_sleep(1.5)")
        .execute(&mut *tx)
        .await
        .unwrap();
    IdempotencyClaim::new(lease, retention)
        .commit(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let info = store
        .inspect(request.record())
        .await
        .unwrap()
        .expect("the committed record");
    assert!(
        info.expires_in > retention - Duration::from_millis(500),
        "expires in {:?} of a {retention:?} retention: counted from the transaction's start",
        info.expires_in
    );
    schema.drop().await;
}
