//! The Postgres store on Citus (a coordinator and two workers the tests start themselves,
//! `idempotency_keys` distributed by key): the conformance suite, every statement of a request's
//! path routed to one shard, and fences that grow per key across a shard moved between workers.
//! Citus must be installed in the machine's PostgreSQL (docs/testing.md#citus); where it is
//! not, every test here is reported as not run. The fleet on Citus is in `tests/fleet/citus.rs`.

#[path = "support/mod.rs"]
mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use sqlx::{PgPool, postgres::PgPoolOptions};
use support::{CitusCluster, Need, acquire, claim_request};
use tokio::sync::OnceCell;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer,
    completer::KeptRequests,
    scope::ANONYMOUS_SCOPE,
    store::{
        ClaimOutcome, ClaimRequest, DISTRIBUTE_ON_CITUS, Lease, MIGRATOR, Ownership, PostgresStore,
        RecordKey, RecordState, Severity, Store,
    },
};

/// One cluster for the conformance suite and the routing test, started by the first test that
/// needs it and stopped when the test process exits.
static CLUSTER: OnceCell<CitusCluster> = OnceCell::const_new();

async fn cluster() -> &'static CitusCluster {
    CLUSTER
        .get_or_init(|| async {
            let cluster = CitusCluster::start(2).await;
            cluster.stop_when_this_process_exits();
            distribute(&cluster.url()).await;
            // The coordinator keeps its records of two-phase commits, which a test counts.
            let coordinator = &cluster.coordinator;
            let keep = "ALTER SYSTEM SET citus.recover_2pc_interval = -1";
            coordinator.execute(keep).await.unwrap();
            coordinator
                .execute("SELECT pg_reload_conf()")
                .await
                .unwrap();
            cluster
        })
        .await
}

/// The crate's migrations and the optional one for Citus, on the coordinator at `url`.
async fn distribute(url: &str) {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await
        .unwrap();
    MIGRATOR.run(&pool).await.unwrap();
    sqlx::raw_sql(DISTRIBUTE_ON_CITUS)
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
}

async fn pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .unwrap()
}

/// Every test here needs Citus: without it, each is reported as not run (see
/// `tests/support/needs.rs`). The conformance cases are named `citus::…`.
fn main() -> std::process::ExitCode {
    let needs = &[Need::Citus];
    let mut tests = support::conformance(
        "citus",
        needs,
        tower_idempotency::conformance::cases(),
        // One machine, one clock: no skew to allow for, and keys expire when the cases expect.
        || async {
            PostgresStore::new(pool(&cluster().await.url()).await)
                .on_citus()
                .with_clock_skew(Duration::ZERO)
        },
    );
    tests.extend(crate::tests![needs;
        citus_routes_every_statement_of_a_requests_path_to_one_shard,
        citus_fences_grow_per_key_across_releases_reclaims_and_a_moved_shard,
        the_doctor_knows_a_citus_coordinator_and_how_the_table_is_distributed,
        citus_a_business_table_elsewhere_commits_by_two_phase_commit_still_once,
        citus_the_completer_finishes_a_key_abandoned_after_its_first_step,
        citus_worker_hash_is_postgres_hashtext,
        citus_keys_on_live_workers_are_served_while_the_coordinator_is_down,
        citus_a_key_expires_only_once_past_the_clock_skew,
        citus_a_worker_is_reached_where_with_citus_node_says,
        citus_pool_for_answers_outside_a_runtime,
        citus_a_store_built_in_steps_reads_the_map_once,
        citus_claims_and_completions_of_one_shard_share_a_statement_each_with_its_own_answer,
        citus_fences_stay_index_lookups_after_the_table_grew_from_empty,
        citus_renewals_answer_held_lost_and_busy_without_waiting,
    ]);
    support::run(tests)
}

/// A request's whole path through the layer (a fresh key with a recovery point, renewals and
/// the fence in the handler's transaction on a co-located table, on the key's worker, a replay, a duplicate in
/// flight, a different request, a release, an expired key taken over) and the operator's
/// commands for one key, on sessions where any multi-shard statement is an error: each of them
/// is routed to one shard. The check itself is shown to bite: a statement over every shard
/// fails on those sessions.
async fn citus_routes_every_statement_of_a_requests_path_to_one_shard() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let routed = pool(&cluster.single_shard_url()).await;
    let across = sqlx::query("SELECT count(*) FROM idempotency_keys")
        .execute(&routed)
        .await;
    assert!(across.is_err(), "a multi-shard statement was allowed");

    // One machine, one clock: the sweep below need not wait out a skew.
    let store = PostgresStore::new(routed.clone())
        .on_citus()
        .with_clock_skew(Duration::ZERO);
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (store, runs) = (store.clone(), Arc::clone(&runs));
        move |claim: IdempotencyClaim, body: String| async move {
            runs.fetch_add(1, SeqCst);
            let key = claim.key().as_str().to_owned();
            if body == "fail" {
                return StatusCode::INTERNAL_SERVER_ERROR;
            }
            let pool = store.pool_for(&claim);
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO orders (key, step) VALUES ($1, 'placed')")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            claim
                .advance(&mut tx, "placed", &serde_json::json!({ "order": key }))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            // Longer than the lease: the owner renews it meanwhile.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO orders (key, step) VALUES ($1, 'paid')")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            claim.commit(&mut tx).await.unwrap();
            tx.commit().await.unwrap();
            StatusCode::CREATED
        }
    };
    let app = Router::new().route("/orders", post(handler)).layer(
        IdempotencyLayer::new(store.clone())
            .with_lease(Duration::from_millis(300))
            // The recovery point keeps the request too: one statement more, routed.
            .with_kept_requests(KeptRequests::new()),
    );
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let send = |key: String, body: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::from(body))
                .unwrap();
            app.oneshot(request).await.unwrap()
        }
    };

    // A fresh key, and a duplicate while it runs.
    let placed = format!("{prefix}-placed");
    let first = tokio::spawn(send(placed.clone(), "order"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The duplicate finds it in flight, waits for it, and gets its answer.
    let duplicate = send(placed.clone(), "order").await;
    assert_eq!(first.await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(duplicate.status(), StatusCode::CREATED);
    assert_eq!(duplicate.headers()["idempotent-replayed"], "true");
    // The replay, and another request with the same key.
    let replay = send(placed.clone(), "order").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let other = send(placed.clone(), "another order").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);

    // A handler that fails releases its key; the retry runs.
    let failed = format!("{prefix}-failed");
    let answer = send(failed.clone(), "fail").await;
    assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let answer = send(failed.clone(), "fail").await;
    assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_ne!(
        answer
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );

    // A key whose owner died: its lease ends, and the request takes it over.
    let abandoned = format!("{prefix}-abandoned");
    let claim = tower_idempotency::conformance::claim_request(
        ANONYMOUS_SCOPE,
        &abandoned,
        "order",
        Duration::from_millis(50),
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let taken = send(abandoned.clone(), "order").await;
    assert_eq!(taken.status(), StatusCode::CREATED);

    // The operator's commands for one key.
    let record = RecordKey::new(ANONYMOUS_SCOPE, placed.as_str().try_into().unwrap());
    let info = store.inspect(&record).await.unwrap().expect("the key");
    assert_eq!(info.state, RecordState::Completed);
    assert!(store.forget(&record).await.unwrap());

    // The sweeper, shard by shard on the workers: an abandoned key's row goes.
    let swept = format!("{prefix}-swept");
    let claim =
        tower_idempotency::conformance::claim_request("t", &swept, "b", Duration::from_millis(10));
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(store.sweep().await.unwrap() >= 1);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(&swept)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(left, 0, "the expired row was swept");

    // Counted at the destination: each order placed and paid once, the failing one never.
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key, count(*) FROM orders WHERE key LIKE $1 || '%' GROUP BY key ORDER BY key",
    )
    .bind(&prefix)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(abandoned.clone(), 2), (placed.clone(), 2)],
        "orders placed and paid"
    );
    assert_eq!(runs.load(SeqCst), 4, "placed, failed twice, taken over");
}

/// Fences are drawn per key, from the clock of the worker that runs the claim, and grow on every
/// take-over: a key claimed and released (its row kept, its lease ended), claimed again once its
/// shard moved to the other worker (the store's map stale: the statement forwarded), then
/// abandoned, moved back and taken over once its lease ended, never sees a fence smaller than
/// one it had; keys on either worker meanwhile neither.
async fn citus_fences_grow_per_key_across_releases_reclaims_and_a_moved_shard() {
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
async fn the_doctor_knows_a_citus_coordinator_and_how_the_table_is_distributed() {
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

/// Creates, once, `orders` (co-located with `idempotency_keys`, by key) and `ledger` (sharded by
/// its own id, not co-located: a key's fence and its ledger row may be on different workers).
async fn business_tables(admin: &PgPool) {
    sqlx::raw_sql(
        "SELECT pg_advisory_xact_lock(4242);
         CREATE TABLE IF NOT EXISTS orders (key text NOT NULL, step text NOT NULL,
                                            PRIMARY KEY (key, step));
         SELECT create_distributed_table('orders', 'key', colocate_with => 'idempotency_keys')
         WHERE NOT EXISTS (SELECT 1 FROM pg_dist_partition
                           WHERE logicalrelid = 'orders'::regclass);
         CREATE TABLE IF NOT EXISTS ledger (id text PRIMARY KEY, key text NOT NULL);
         SELECT create_distributed_table('ledger', 'id', colocate_with => 'none')
         WHERE NOT EXISTS (SELECT 1 FROM pg_dist_partition
                           WHERE logicalrelid = 'ledger'::regclass);",
    )
    .execute(admin)
    .await
    .unwrap();
}

/// A handler's transaction on the key's worker (`pool_for`): the key's order paid, in `orders`
/// (co-located), with the fence.
async fn pay_on_its_worker(store: &PostgresStore, claim: &IdempotencyClaim) {
    let mut tx = store.pool_for(claim).begin().await.unwrap();
    sqlx::query("INSERT INTO orders (key, step) VALUES ($1, 'paid')")
        .bind(claim.key().as_str())
        .execute(&mut *tx)
        .await
        .unwrap();
    claim.commit(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
}

/// A 201 answer with the body "done", as a handler's stored response.
fn answer_done() -> tower_idempotency::store::StoredResponse {
    tower_idempotency::store::StoredResponse::new(
        StatusCode::CREATED,
        axum::http::HeaderMap::new(),
        Some(axum::body::Bytes::from_static(b"done")),
        None,
    )
}

/// Commits of the two-phase protocol the coordinator has recorded and not yet cleaned up.
async fn two_phase_commits(admin: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_dist_transaction")
        .fetch_one(admin)
        .await
        .unwrap()
}

/// A handler whose business row is on another worker than its key: its transaction spans two
/// workers, and Citus commits it with two-phase commit. Still exactly once: a stale owner's transaction,
/// whose key another took over, is stopped by the fence and rolled back on both shards; the
/// owner's commits, on both. Prints what a fenced commit costs either way, side by side.
async fn citus_a_business_table_elsewhere_commits_by_two_phase_commit_still_once() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let store = PostgresStore::new(admin.clone()).on_citus();
    let lease = Duration::from_millis(100);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let fenced = async |request: &tower_idempotency::store::ClaimRequest| {
        let Ok(ClaimOutcome::Acquired { fence }) = store.claim(request).await else {
            panic!("not acquired");
        };
        let lease =
            tower_idempotency::store::Lease::new(request.record().clone(), request.owner(), fence);
        IdempotencyClaim::new(lease, Duration::from_secs(60))
    };
    // A ledger id whose shard is on the other worker than `key`'s.
    let elsewhere = async |key: &str| {
        let worker = cluster.shard_of("idempotency_keys", key).await.1;
        for n in 0.. {
            let id = format!("{key}-{n}");
            if cluster.shard_of("ledger", &id).await.1 != worker {
                return id;
            }
        }
        unreachable!()
    };
    // The business row (in `orders` with the key, or in `ledger` with the id given) and the
    // fence, in one transaction.
    let write = async |claim: &IdempotencyClaim, ledger_id: Option<&str>| {
        let key = claim.key().as_str();
        let (statement, second) = match ledger_id {
            Some(id) => ("INSERT INTO ledger (id, key) VALUES ($2, $1)", id),
            None => ("INSERT INTO orders (key, step) VALUES ($1, $2)", "paid"),
        };
        let mut tx = admin.begin().await.unwrap();
        sqlx::query(statement)
            .bind(key)
            .bind(second)
            .execute(&mut *tx)
            .await
            .unwrap();
        let outcome = claim.commit(&mut tx).await;
        if outcome.is_ok() {
            tx.commit().await.unwrap();
        }
        outcome
    };
    let request = |key: &str| {
        tower_idempotency::conformance::claim_request("t", &format!("{prefix}-{key}"), "b", lease)
    };

    // A stale owner and the one that took its key over, across two shards.
    let stale_request = request("taken");
    let stale = fenced(&stale_request).await;
    tokio::time::sleep(lease * 2).await;
    let owner = fenced(&request("taken")).await;
    let id = elsewhere(owner.key().as_str()).await;
    let before = two_phase_commits(&admin).await;
    assert!(
        write(&stale, Some(&id)).await.is_err(),
        "the stale owner fenced"
    );
    write(&owner, Some(&id)).await.unwrap();
    assert!(
        two_phase_commits(&admin).await > before,
        "the owner's commit was not two-phase"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE key = $1")
        .bind(owner.key().as_str())
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(rows, 1, "one ledger row for the key");

    // What a fenced commit costs, co-located or not, alternating; and co-located on the key's
    // worker (`pool_for`), where it commits with no coordinator.
    let mut took = [Duration::ZERO; 3];
    let commits = 100;
    for n in 0..commits {
        for (i, table) in ["orders", "ledger", "worker"].into_iter().enumerate() {
            let claim = fenced(&request(&format!("{table}-{n}"))).await;
            let started = std::time::Instant::now();
            match table {
                "ledger" => {
                    let id = elsewhere(claim.key().as_str()).await;
                    let started = std::time::Instant::now();
                    write(&claim, Some(&id)).await.unwrap();
                    took[i] += started.elapsed();
                    continue;
                }
                "worker" => pay_on_its_worker(&store, &claim).await,
                _ => write(&claim, None).await.unwrap(),
            }
            took[i] += started.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(commits);
    println!(
        "citus: a fenced commit with the business row co-located {:.0} µs, on another worker \
         (two-phase commit) {:.0} µs: {:.2}x; co-located on the key's worker (pool_for) {:.0} \
         µs: {:.2}x; {commits} of each, alternating",
        per(took[0]),
        per(took[1]),
        per(took[1]) / per(took[0]),
        per(took[2]),
        per(took[2]) / per(took[0]),
    );
}

/// The completer on a distributed table: its scan over every shard finds a key abandoned after
/// its first step (the attempt gave up with 502, its progress kept), and resumes it through the
/// layer with the kept request; the handler runs its last step once.
async fn citus_the_completer_finishes_a_key_abandoned_after_its_first_step() {
    let cluster = cluster().await;
    let pool = pool(&cluster.url()).await;
    let store = PostgresStore::new(pool.clone()).on_citus();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (pool, runs) = (pool.clone(), Arc::clone(&runs));
        move |claim: IdempotencyClaim, _: String| async move {
            let mut connection = pool.acquire().await.unwrap();
            let resumed = claim.recovery_point(&mut connection).await.unwrap();
            drop(connection);
            if resumed.is_none() {
                let mut tx = pool.begin().await.unwrap();
                claim
                    .advance(&mut tx, "placed", &serde_json::Value::Null)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                return StatusCode::BAD_GATEWAY;
            }
            runs.fetch_add(1, SeqCst);
            StatusCode::CREATED
        }
    };
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .with_kept_requests(KeptRequests::new());
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(layer.clone());
    let key = format!("{}-given-up", uuid::Uuid::new_v4().simple());
    let request = Request::post("/orders")
        .header("idempotency-key", key.as_str())
        .body(Body::from("order"))
        .unwrap();
    let given_up = app.clone().oneshot(request).await.unwrap();
    assert_eq!(given_up.status(), StatusCode::BAD_GATEWAY);

    let mut completer = layer.completer(app);
    let started = std::time::Instant::now();
    loop {
        let round = completer.run_once().await.unwrap();
        if round.finished > 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{round:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(runs.load(SeqCst), 1, "the last step ran once");
    let record = RecordKey::new(ANONYMOUS_SCOPE, key.as_str().try_into().unwrap());
    let info = store.inspect(&record).await.unwrap().unwrap();
    assert_eq!(info.state, RecordState::Completed);
}

/// Citus hashes a text distribution value with PostgreSQL's `hashtext`, which the store ports
/// (checked against the server's own on 10,000 keys by the crate's unit tests): the same on
/// 10,000 keys here, empty, ASCII and multi-byte UTF-8, short and long.
async fn citus_worker_hash_is_postgres_hashtext() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    let differing: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT repeat(md5(i::text) || 'é€🦀', i % 9) || left(i::text, i % 4) AS k
             FROM generate_series(0, 9999) i) keys
         WHERE worker_hash(k) <> hashtext(k)",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(differing, 0);
}

/// The coordinator leaves the request path: once the store has read the shard map, requests
/// for keys on live workers go on while the coordinator is stopped. Fresh keys run once each
/// (counted in a co-located business table, written with the fence in one transaction on the
/// key's worker, `pool_for`), their retries replay; the sweeper, which reads every shard
/// through the coordinator, fails until it is back. An instance started during the outage,
/// told where the workers are (`with_citus_node`), reads the map from one of them and serves
/// too: other keys once each, and the first instance's keys replayed.
async fn citus_keys_on_live_workers_are_served_while_the_coordinator_is_down() {
    let mut cluster = CitusCluster::start(2).await;
    distribute(&cluster.url()).await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let store = PostgresStore::new(admin.clone()).on_citus();
    let send = orders_app(&store);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    // A first request reads the map (in the background): the next ones follow it.
    let first = format!("{prefix}-first");
    assert_eq!(send(first.clone()).await.status(), StatusCode::CREATED);
    let worker = cluster.shard_of("idempotency_keys", &first).await.1;
    let lease = claim_request(&first, Duration::from_secs(1)).lease_with_fence(1);
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;

    cluster.coordinator.stop_server();
    let keys: Vec<String> = (0..100).map(|n| format!("{prefix}-{n}")).collect();
    let expect = async |send: &SendOrder, keys: &[String], round: &str| {
        let answers = futures_util::future::join_all(keys.iter().cloned().map(send)).await;
        for (key, answer) in keys.iter().zip(answers) {
            assert_eq!(answer.status(), StatusCode::CREATED, "{round} {key}");
            let replayed = answer.headers().get("idempotent-replayed").is_some();
            assert_eq!(replayed, round == "replayed", "{round} {key}");
        }
    };
    expect(&send, &keys, "fresh").await;
    expect(&send, &keys, "replayed").await;
    assert!(
        store.sweep().await.is_err(),
        "the sweeper needs the coordinator"
    );

    // A new instance: its pool on the coordinator (down), the workers named.
    let coordinator = PgPoolOptions::new()
        .max_connections(2)
        .connect_lazy(&cluster.url())
        .unwrap();
    let mut started = PostgresStore::new(coordinator).on_citus();
    for node in &cluster.workers {
        let options: sqlx::postgres::PgConnectOptions = node.url().parse().unwrap();
        started = started.with_citus_node("127.0.0.1", node.port, options);
    }
    let on_started = orders_app(&started);
    // The coordinator does not answer: the map is read from a worker.
    until_routed(&started, &lease, u16::try_from(worker).unwrap()).await;
    let others: Vec<String> = (0..50).map(|n| format!("{prefix}-started-{n}")).collect();
    expect(&on_started, &others, "fresh").await;
    expect(&on_started, &others, "replayed").await;
    expect(&on_started, &keys, "replayed").await;
    cluster.coordinator.start_server().await;

    // Counted at the destination: one order per key.
    let admin = pool(&cluster.url()).await;
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT key) FROM orders WHERE key LIKE $1 || '-%'",
    )
    .bind(&prefix)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!((rows, distinct), (151, 151), "one order per key");
    store.sweep().await.unwrap();
}

/// Sends a POST /orders with the key given to an app whose handler pays the order on the key's
/// worker (`pay_on_its_worker`), behind the layer on `store`.
type SendOrder = Box<
    dyn Fn(String) -> futures_util::future::BoxFuture<'static, axum::response::Response>
        + Send
        + Sync,
>;

fn orders_app(store: &PostgresStore) -> SendOrder {
    let handler = {
        let store = store.clone();
        move |claim: IdempotencyClaim, _: String| async move {
            pay_on_its_worker(&store, &claim).await;
            StatusCode::CREATED
        }
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    Box::new(move |key: String| {
        let app = app.clone();
        Box::pin(async move {
            let request = Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::from("order"))
                .unwrap();
            app.oneshot(request).await.unwrap()
        })
    })
}

/// Each node reads its own clock, so a key is taken as expired only once its expiry is past by
/// more than the skew the store allows for (`with_clock_skew`): a completed key whose retention
/// just ended still refuses another request and stays through a sweep, and is free once the
/// bound has passed too.
async fn citus_a_key_expires_only_once_past_the_clock_skew() {
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

/// `with_citus_node`: a worker the metadata names by one address is reached by the one given.
/// Pointed at a port where nothing listens, the keys on that worker fail (and nothing runs), so
/// the override is what the store used; pointed at the worker by another name, they succeed.
async fn citus_a_worker_is_reached_where_with_citus_node_says() {
    let cluster = cluster().await;
    let url = cluster.url();
    let pool = pool(&url).await;
    let worker = cluster.workers[0].port;
    let key = async |n: usize| loop {
        let key = format!("{}-{n}", uuid::Uuid::new_v4().simple());
        if cluster.shard_of("idempotency_keys", &key).await.1 == i32::from(worker) {
            return key;
        }
    };
    let options = |host: &str, port: u16| {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        options.host(host).port(port)
    };
    // The map is read in the background, on the first statement: `request`'s statements go
    // where the map routes them (to `port`) from then on.
    let settle = async |store: &PostgresStore, request: &ClaimRequest, port: u16| {
        let warm = claim_request("warm-up", Duration::from_secs(1));
        let _ = store.claim(&warm).await;
        until_routed(store, &request.lease_with_fence(1), port).await;
    };

    let nowhere = support::free_port();
    let wrong = PostgresStore::new(pool.clone()).on_citus().with_citus_node(
        "127.0.0.1",
        worker,
        options("127.0.0.1", nowhere),
    );
    let request = claim_request(&key(0).await, Duration::from_secs(1));
    settle(&wrong, &request, nowhere).await;
    assert!(
        wrong.claim(&request).await.is_err(),
        "the override was not used"
    );

    let renamed = PostgresStore::new(pool.clone()).on_citus().with_citus_node(
        "127.0.0.1",
        worker,
        options("localhost", worker),
    );
    let request = claim_request(&key(1).await, Duration::from_secs(1));
    settle(&renamed, &request, worker).await;
    assert!(matches!(
        renamed.claim(&request).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
}

/// `pool_for` called outside a Tokio runtime (a thread of the application's own) answers
/// instead of panicking: the coordinator's pool until a map is read, then the worker's, the map
/// read inside the runtime.
async fn citus_pool_for_answers_outside_a_runtime() {
    let cluster = cluster().await;
    let store = PostgresStore::new(pool(&cluster.url()).await).on_citus();
    // A lease made by hand: the store has run nothing yet, and its map is due.
    let claim = claim_request("outside", Duration::from_secs(1));
    let lease = tower_idempotency::store::Lease::new(claim.record().clone(), claim.owner(), 1);
    let outside = {
        let (store, lease) = (store.clone(), lease.clone());
        std::thread::spawn(move || store.pool_for(&lease).connect_options().get_port())
    };
    let port = outside.join().expect("pool_for panicked outside a runtime");
    let ports: Vec<u16> = std::iter::once(&cluster.coordinator)
        .chain(&cluster.workers)
        .map(|node| node.port)
        .collect();
    assert!(ports.contains(&port), "{port} is none of {ports:?}");
    // Inside the runtime the map is read, in the background, and then the key's worker answers.
    let worker = cluster.shard_of("idempotency_keys", "outside").await.1;
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;
}

/// A store built in steps (`on_citus`, then `with_max_connections`, `with_timeout`,
/// `with_max_batch`: each makes the store's routes anew) reads the shard map once, on one
/// connection to the coordinator, not once a step. Built where the runtime runs no task before
/// the builder is done (a current-thread runtime), counted at a proxy in front of the
/// coordinator: one connection, where each step's read made one (four).
async fn citus_a_store_built_in_steps_reads_the_map_once() {
    let cluster = cluster().await;
    let coordinator = std::net::SocketAddr::from(([127, 0, 0, 1], cluster.coordinator.port));
    let proxy = support::FaultProxy::start(vec![coordinator], vec![support::Fault::None]).await;
    let url = support::postgres_url(proxy.port);
    let worker = cluster.shard_of("idempotency_keys", "in-steps").await.1;
    let worker = u16::try_from(worker).unwrap();
    let built = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let pool = PgPoolOptions::new().connect_lazy(&url).unwrap();
            let store = PostgresStore::new(pool)
                .on_citus()
                .with_max_connections(4)
                .with_timeout(Duration::from_secs(5))
                .with_max_batch(8);
            let claim = claim_request("in-steps", Duration::from_secs(1));
            let lease = Lease::new(claim.record().clone(), claim.owner(), 1);
            until_routed(&store, &lease, worker).await;
        });
    });
    tokio::task::spawn_blocking(move || built.join())
        .await
        .unwrap()
        .expect("the store was not routed");
    assert_eq!(
        proxy.connections(),
        1,
        "connections to the coordinator while the store was built and its map read"
    );
}

/// Waits, up to 10 s, until the store sends `lease`'s statements to the pool at `port`: the
/// shard map is read in the background, after the store's first statement, and on a loaded
/// machine that takes longer than any fixed pause.
async fn until_routed(store: &PostgresStore, lease: &Lease, port: u16) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let routed = store.pool_for(lease).connect_options().get_port();
        if routed == port {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after 10 s, the key's pool is on {routed}, not {port}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `count` keys starting with `prefix`, all on one shard.
async fn keys_of_one_shard(admin: &PgPool, prefix: &str, count: usize) -> Vec<String> {
    let candidates: Vec<String> = (0..count * 96).map(|n| format!("{prefix}-{n}")).collect();
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT k FROM unnest($1::text[]) WITH ORDINALITY AS c(k, n)
         WHERE get_shard_id_for_distribution_column('idempotency_keys', k)
             = get_shard_id_for_distribution_column('idempotency_keys', $1[1])
         ORDER BY n LIMIT $2",
    )
    .bind(&candidates)
    .bind(count as i64)
    .fetch_all(admin)
    .await
    .unwrap();
    assert_eq!(keys.len(), count, "too few keys of one shard");
    keys
}

/// How many transactions wrote the rows of `keys` as they are now (their `xmin`s).
async fn transactions_of(admin: &PgPool, keys: &[String]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM idempotency_keys
         WHERE scope = 'tenant' AND key = ANY($1)",
    )
    .bind(keys)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Claims and completions of keys of one shard, sent at once through a store with one lane of
/// each, on sessions where any multi-shard statement is an error: they go out together, as
/// statements of that one shard (counted at the destination: the rows of 40 fresh keys were
/// written by fewer than 40 transactions, on claiming and on completing), and each gets the
/// answer it gets alone: fresh keys, two claims of one key, a completed key, one in flight,
/// another request with a completed key's key, an expired key taken over, and the completion
/// of the owner it was taken from. Renewals and releases of one shard sent at once go call by
/// call, each held.
async fn citus_claims_and_completions_of_one_shard_share_a_statement_each_with_its_own_answer() {
    use tower_idempotency::conformance::claim_request as claim_of;
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    let routed = pool(&cluster.single_shard_url()).await;
    let store = PostgresStore::new(routed)
        .on_citus()
        .with_clock_skew(Duration::ZERO)
        .with_max_connections(4);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let keys = keys_of_one_shard(&admin, &prefix, 53).await;
    let (done, busy, gone, twice, fresh) = (&keys[0], &keys[1], &keys[2], &keys[3], &keys[5..45]);
    let long = Duration::from_secs(60);
    let answer = answer_done();
    let lease = acquire(&store, &claim_request(done, long)).await;
    store.complete(&lease, &answer, long).await.unwrap();
    acquire(&store, &claim_request(busy, long)).await;
    let stale = acquire(&store, &claim_request(gone, Duration::from_millis(100))).await;
    // Until the shard map is read, statements go to the coordinator, one by one.
    let worker = cluster.shard_of("idempotency_keys", done).await.1;
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut requests = vec![
        claim_request(done, long),
        claim_request(busy, long),
        claim_of("tenant", done, "another body", long),
        claim_request(gone, long),
        claim_request(twice, long),
        claim_request(twice, long),
    ];
    requests.extend(fresh.iter().map(|key| claim_request(key, long)));
    let claims: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let store = store.clone();
            tokio::spawn(async move {
                let outcome = store.claim(&request).await.unwrap();
                (request, outcome)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for claim in claims {
        outcomes.push(claim.await.unwrap());
    }
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|(_, outcome)| support::outcome_kind(outcome))
        .collect();
    assert_eq!(
        kinds[..4],
        ["completed", "in_flight", "mismatch", "acquired"]
    );
    let mut two = [kinds[4], kinds[5]];
    two.sort();
    assert_eq!(
        two,
        ["acquired", "in_flight"],
        "one of two claims of one key"
    );
    assert!(kinds[6..].iter().all(|k| *k == "acquired"), "{kinds:?}");
    let claimed = transactions_of(&admin, fresh).await;
    assert!(
        claimed < 40,
        "40 fresh keys claimed in {claimed} transactions"
    );

    // Every acquired key completed at once, with the owner the expired key was taken from.
    let mut leases: Vec<_> = outcomes
        .iter()
        .filter_map(|(request, outcome)| match outcome {
            ClaimOutcome::Acquired { fence } => Some(request.lease_with_fence(*fence)),
            _ => None,
        })
        .collect();
    leases.push(stale);
    let completions: Vec<_> = leases
        .into_iter()
        .map(|lease| {
            let (store, answer) = (store.clone(), answer.clone());
            tokio::spawn(async move { store.complete(&lease, &answer, long).await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for completion in completions {
        answers.push(completion.await.unwrap());
    }
    let stale = answers.pop().unwrap();
    assert_eq!(stale, Ownership::Lost, "the owner the key was taken from");
    assert!(answers.iter().all(|a| *a == Ownership::Held), "{answers:?}");
    let completed = transactions_of(&admin, fresh).await;
    assert!(
        completed < 40,
        "40 keys completed in {completed} transactions"
    );
    let rows: Vec<(String, Option<i16>)> = sqlx::query_as(
        "SELECT state, status FROM idempotency_keys WHERE scope = 'tenant' AND key = ANY($1)",
    )
    .bind(&keys)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(rows.len(), 45 - 1, "a row for each key claimed");
    let completed = rows
        .iter()
        .filter(|row| **row == ("completed".into(), Some(201)));
    // The fresh ones, the one taken over, one of the two claims of one key, the first done.
    assert_eq!(completed.count(), 40 + 3);

    // Renewals and releases of one shard sent at once: each its own, held.
    let mut spare = Vec::new();
    for key in &keys[45..] {
        spare.push(acquire(&store, &claim_request(key, long)).await);
    }
    let at_once = |release: bool| {
        let (spare, store) = (spare.clone(), store.clone());
        async move {
            let calls: Vec<_> = spare
                .into_iter()
                .map(|lease| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        match release {
                            true => store.release(&lease).await.unwrap(),
                            false => store.renew(&lease, long).await.unwrap(),
                        }
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for call in calls {
                answers.push(call.await.unwrap());
            }
            answers
        }
    };
    assert_eq!(at_once(false).await, vec![Ownership::Held; 8], "renewals");
    assert_eq!(at_once(true).await, vec![Ownership::Held; 8], "releases");
}

/// The fence runs in the application's session, where the store chooses nothing about how
/// statements are planned: its function keeps one plan per session, pruned to the key's shard
/// on each call, and that plan must stay a primary-key lookup after the table grew from empty
/// (a fresh deployment). On a cluster of its own (its table starts empty), one application
/// session on the worker: 51 fences after 200,000 rows arrived make no sequential scan of the
/// shards, nor do the store's claims and completions around them.
async fn citus_fences_stay_index_lookups_after_the_table_grew_from_empty() {
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
async fn citus_renewals_answer_held_lost_and_busy_without_waiting() {
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

/// The port of the worker that holds `key`'s shard.
async fn worker_of(cluster: &CitusCluster, key: &str) -> u16 {
    let worker = cluster.shard_of("idempotency_keys", key).await.1;
    u16::try_from(worker).unwrap()
}

/// Sequential and index scans of `idempotency_keys`' shards on the node so far.
async fn shard_scans(node: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT sum(seq_scan)::int8, sum(coalesce(idx_scan, 0))::int8 FROM pg_stat_user_tables
         WHERE relname ~ '^idempotency_keys_[0-9]+$'",
    )
    .fetch_one(node)
    .await
    .unwrap()
}

const LONG: Duration = Duration::from_secs(60);
