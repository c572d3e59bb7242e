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
        Admin, ClaimOutcome, ClaimRequest, FenceError, Lease, MIGRATOR, Ownership,
        PARTITION_BY_HASH, PostgresStore, RecordKey, Store,
    },
};
use uuid::Uuid;

fn main() -> std::process::ExitCode {
    use tower_idempotency::conformance::{TOMBSTONE_HORIZON, admin_cases, cases, tombstone_cases};
    let plain = || async {
        let pool = pool_in_schema(&database_url(), "tower_idempotency_conformance").await;
        let store = PostgresStore::new(pool);
        // The shared schema outlives the run: keep it from growing.
        store.sweep().await.unwrap();
        store
    };
    // In a schema of their own (their sweeper buries what it finds), by the sweeper's hand
    // too: a store that sweeps every 100 ms buries the keys past their retention while the
    // cases wait.
    let with_tombstones = || async {
        let pool = pool_in_schema(&database_url(), "tower_idempotency_tombstones").await;
        let store = PostgresStore::new(pool).with_tombstones(TOMBSTONE_HORIZON);
        store.spawn_sweeper(Duration::from_millis(100));
        store
    };
    // On a hash-partitioned `idempotency_keys`.
    let partitioned = || async {
        let pool = pool_in_schema(&database_url(), "tower_idempotency_partitioned").await;
        partition(&pool).await;
        let store = PostgresStore::new(pool);
        store.sweep().await.unwrap();
        store
    };
    let mut tests = support::conformance("postgres", &[], cases(), plain);
    tests.extend(support::conformance("postgres", &[], admin_cases(), plain));
    tests.extend(support::conformance(
        "postgres",
        &[],
        tombstone_cases(),
        with_tombstones,
    ));
    tests.extend(support::conformance(
        "partitioned",
        &[],
        cases(),
        partitioned,
    ));
    tests.extend(crate::tests![
        current:
            batches::completions_go_out_together_and_each_key_gets_its_own_answer,
            batches::claims_go_out_together_and_each_gets_its_own_answer,
            batches::renewals_go_out_together_and_each_gets_its_own_answer,
            batches::releases_go_out_together_and_each_gets_its_own_answer,
            batches::claims_within_the_batch_window_share_one_transaction,
            batches::a_full_batch_goes_before_its_window_ends,
            completer::the_completer_finishes_a_payment_nobody_retried_once_with_a_retrys_guarantees,
            completer::completers_on_four_instances_finish_each_key_once,
            completer::a_key_without_a_kept_request_is_left_alone_and_said_why,
            completer::the_completer_answers_a_key_committed_without_an_answer_with_the_recovery_hook,
            completer::a_resumed_handler_that_fails_again_is_noted_and_finished_next_round,
            completer::a_panicking_recovery_hook_fails_its_key_only,
            fence::the_fence_refuses_a_stale_owner_and_is_idempotent_for_the_current_one,
            fence::a_committed_key_whose_owner_died_never_runs_again,
            fence::a_committed_key_is_completed_whatever_the_response,
            fence::an_orphaned_key_answers_outcome_unknown_through_the_layer,
            fence::the_fences_retention_counts_from_the_commit_not_the_transactions_start,
            fence::completing_a_key_committed_with_its_answer_writes_nothing,
            outages::busy_store_connections_are_a_fast_503_and_the_application_pool_is_untouched,
            outages::terminated_connections_are_never_lent_again_and_claims_go_on,
            partitioning::a_key_lookup_on_the_partitioned_table_takes_only_fast_path_locks,
            partitioning::the_fence_the_sweeper_and_the_admin_work_on_the_partitioned_table,
            recovery::recovery_points_outlive_their_owner_and_resume_only_for_the_same_request,
            recovery::the_recovery_hook_answers_a_key_committed_without_an_answer,
            recovery::a_recovery_hook_without_an_answer_yet_gets_the_caller_a_retry_not_outcome_unknown,
            schema::the_sweeper_removes_only_expired_rows,
            schema::the_compiled_in_migrations_are_the_files_as_sqlx_reads_them,
            schema::migrations_apply_as_a_plain_sqlx_migrator_and_twice_through_the_store,
            schema::a_claim_that_settles_a_locked_row_leaves_no_transaction_open;
        multi(2):
            fence::a_stalled_handler_that_lost_its_lease_cannot_commit_a_second_payment,
            fence::an_answer_stored_with_the_fence_is_the_one_every_retry_gets,
            outages::a_database_that_is_down_means_503_and_no_execution_until_it_returns,
            outages::a_claim_the_client_gave_up_on_never_acquires_later,
            outages::a_postgres_restart_under_load_runs_nothing_twice_and_503s_end_when_it_answers,
            outages::a_postgres_failover_under_load_runs_nothing_twice_and_503s_end_when_it_answers,
            outages::a_server_out_of_connections_is_waited_for_within_the_timeout,
            schema::sweepers_in_parallel_skip_rows_others_hold,
            schema::claims_and_fences_stay_index_lookups_after_the_table_grew_from_empty;
        multi(4):
            concurrent_claims_from_two_instances_yield_one_owner_every_round;
        multi(2):
            wakeups::a_duplicate_elsewhere_is_woken_by_postgres_and_a_key_nobody_waits_for_is_never_told;
    ]);
    support::run(tests)
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

fn response(status: StatusCode) -> StoredResponse {
    StoredResponse::new(status, HeaderMap::new(), Some("body".into()), None)
}

const LONG: Duration = Duration::from_secs(60);

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
mod wakeups;
