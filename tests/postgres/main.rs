//! The Postgres store against real servers: the machine's (a schema per test) and, for tests
//! that stop it, a cluster of their own.

#[path = "../support/mod.rs"]
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
    IdempotencyClaim, IdempotencyKey, IdempotencyLayer, problem,
    store::Fingerprint,
    store::StoredResponse,
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

/// The tombstone cases, in a schema of their own (their sweeper buries what it finds), by the
/// sweeper's hand too: a store that sweeps every 100 ms buries the keys past their retention
/// while the cases wait.
mod tombstones {
    use super::*;

    tower_idempotency::store_tombstone_conformance_tests!(async {
        let pool = pool_in_schema(&database_url(), "tower_idempotency_tombstones").await;
        let store = PostgresStore::new(pool)
            .with_tombstones(tower_idempotency::conformance::TOMBSTONE_HORIZON);
        store.spawn_sweeper(Duration::from_millis(100));
        store
    });
}

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

/// The claim a handler holding `lease` receives, from a layer whose lease is `lease_duration`.
fn claim_for(lease: Lease, lease_duration: Duration) -> IdempotencyClaim {
    IdempotencyClaim::new(lease, LONG).with_lease_duration(lease_duration)
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

mod batches;
mod fence;
mod recovery;
mod completer;
mod partitioning;
mod schema;
mod outages;
