//! The Postgres store on Citus (a coordinator and two workers the tests start themselves,
//! `idempotency_keys` distributed by key): the conformance suite, every statement of a request's
//! path routed to one shard, and fences that grow per key across a shard moved between workers.
//! Citus must be installed in the machine's PostgreSQL (docs/testing.md#citus); where it is
//! not, every test here is reported as not run. The fleet on Citus is in `tests/fleet/citus.rs`.

#[path = "../support/mod.rs"]
mod support;

mod batches;
mod fences;
mod routing;
mod transactions;

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
        Admin, ClaimOutcome, ClaimRequest, DISTRIBUTE_ON_CITUS, Lease, MIGRATOR, Ownership,
        PostgresStore, RecordKey, RecordState, Severity, Store,
    },
};

/// One cluster for the conformance suite and the routing test, started by the first test that
/// needs it and stopped when the test process exits.
static CLUSTER: OnceCell<CitusCluster> = OnceCell::const_new();

pub(crate) async fn cluster() -> &'static CitusCluster {
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
pub(crate) async fn distribute(url: &str) {
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

pub(crate) async fn pool(url: &str) -> PgPool {
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
    use tower_idempotency::conformance::{admin_cases, cases};
    // One machine, one clock: no skew to allow for, and keys expire when the cases expect.
    let on_citus = || async {
        PostgresStore::new(pool(&cluster().await.url()).await)
            .on_citus()
            .with_clock_skew(Duration::ZERO)
    };
    let mut tests = support::conformance("citus", needs, cases(), on_citus);
    tests.extend(support::conformance(
        "citus",
        needs,
        admin_cases(),
        on_citus,
    ));
    tests.extend(crate::tests![needs;
        routing::citus_routes_every_statement_of_a_requests_path_to_one_shard,
        routing::citus_worker_hash_is_postgres_hashtext,
        routing::citus_a_worker_is_reached_where_with_citus_node_says,
        routing::citus_pool_for_answers_outside_a_runtime,
        routing::citus_a_store_built_in_steps_reads_the_map_once,
        routing::citus_keys_on_live_workers_are_served_while_the_coordinator_is_down,
        fences::citus_fences_grow_per_key_across_releases_reclaims_and_a_moved_shard,
        fences::citus_a_key_expires_only_once_past_the_clock_skew,
        fences::citus_renewals_answer_held_lost_and_busy_without_waiting,
        fences::citus_fences_stay_index_lookups_after_the_table_grew_from_empty,
        fences::the_doctor_knows_a_citus_coordinator_and_how_the_table_is_distributed,
        transactions::citus_a_business_table_elsewhere_commits_by_two_phase_commit_still_once,
        transactions::citus_the_completer_finishes_a_key_abandoned_after_its_first_step,
        batches::citus_claims_and_completions_of_one_shard_share_a_statement_each_with_its_own_answer,
    ]);
    support::run(tests)
}

/// Creates, once, `orders` (co-located with `idempotency_keys`, by key) and `ledger` (sharded by
/// its own id, not co-located: a key's fence and its ledger row may be on different workers).
pub(crate) async fn business_tables(admin: &PgPool) {
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
pub(crate) async fn pay_on_its_worker(store: &PostgresStore, claim: &IdempotencyClaim) {
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
pub(crate) fn answer_done() -> tower_idempotency::store::StoredResponse {
    tower_idempotency::store::StoredResponse::new(
        StatusCode::CREATED,
        axum::http::HeaderMap::new(),
        Some(axum::body::Bytes::from_static(b"done")),
        None,
    )
}

/// Waits, up to 10 s, until the store sends `lease`'s statements to the pool at `port`: the
/// shard map is read in the background, after the store's first statement, and on a loaded
/// machine that takes longer than any fixed pause.
pub(crate) async fn until_routed(store: &PostgresStore, lease: &Lease, port: u16) {
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

/// The port of the worker that holds `key`'s shard.
pub(crate) async fn worker_of(cluster: &CitusCluster, key: &str) -> u16 {
    let worker = cluster.shard_of("idempotency_keys", key).await.1;
    u16::try_from(worker).unwrap()
}

const LONG: Duration = Duration::from_secs(60);
