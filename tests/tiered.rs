//! Redis in front of Postgres, against real servers.

mod support;

use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};
use support::{
    RedisServer, TestSchema, acquire, claim_request, database_url, pool_in_schema, redis_url,
};
use tower_idempotency::{
    StoredResponse,
    store::{ClaimOutcome, ClaimRequest, Ownership, PostgresStore, RedisStore, Store, TieredStore},
};
use uuid::Uuid;

tower_idempotency::store_conformance_tests!(async {
    let redis = RedisStore::open(&redis_url())
        .unwrap()
        .with_prefix(format!("test:{}:", Uuid::new_v4()));
    let postgres =
        PostgresStore::new(pool_in_schema(&database_url(), "tower_idempotency_conformance").await);
    TieredStore::new(redis, postgres)
});

fn request(key: &str) -> ClaimRequest {
    claim_request(key, Duration::from_secs(30))
}

fn created() -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        HeaderMap::new(),
        Some("paid".into()),
        None,
    )
}

#[tokio::test]
async fn after_a_flush_the_authority_answers_and_redis_is_refilled() {
    let server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url()).unwrap();
    let store = TieredStore::new(redis.clone(), PostgresStore::new(schema.pool.clone()));
    let lease = acquire(&store, &request("k-flush")).await;
    assert_eq!(
        store
            .complete(&lease, &created(), Duration::from_secs(3600))
            .await
            .unwrap(),
        Ownership::Held
    );

    let mut admin = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        matches!(
            redis.claim(&request("k-flush")).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ),
        "the flush did not empty Redis"
    );
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .unwrap();

    match store.claim(&request("k-flush")).await.unwrap() {
        ClaimOutcome::Completed { response, .. } => assert_eq!(*response, created()),
        other => panic!("the authority's record was not replayed: {other:?}"),
    }
    // Written back with the authority's remaining retention: Redis alone replays it now.
    match redis.claim(&request("k-flush")).await.unwrap() {
        ClaimOutcome::Completed {
            response,
            expires_in,
        } => {
            assert_eq!(*response, created());
            assert!(
                expires_in <= Duration::from_secs(3600) && expires_in > Duration::from_secs(3500)
            );
        }
        other => panic!("not written back: {other:?}"),
    }
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_redis_costs_one_timeout_then_is_skipped() {
    let mut server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url())
        .unwrap()
        .with_timeout(Duration::from_millis(200))
        .unwrap();
    let store = TieredStore::new(redis, PostgresStore::new(schema.pool.clone()))
        .with_breaker_cooldown(Duration::from_secs(1));
    acquire(&store, &request("warm-up")).await;

    server.pause();
    let started = Instant::now();
    acquire(&store, &request("k-0")).await;
    let first = started.elapsed();
    assert!(store.front_skipped());
    let started = Instant::now();
    for i in 1..=20 {
        acquire(&store, &request(&format!("k-{i}"))).await;
    }
    let next = started.elapsed() / 20;
    assert!(
        first >= Duration::from_millis(200),
        "the first claim did not wait for Redis: {first:?}"
    );
    assert!(
        next < Duration::from_millis(100),
        "claims kept waiting on a stalled Redis: {next:?} each"
    );

    server.resume();
    // Past the cooldown one claim probes Redis, and its success closes the breaker.
    let mut probes = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        acquire(&store, &request(&format!("probe-{probes}"))).await;
        probes += 1;
        if !store.front_skipped() {
            break;
        }
        assert!(probes < 5, "Redis was never used again");
    }
    schema.drop().await;
}

#[tokio::test]
async fn postgres_failing_releases_the_redis_claim() {
    let redis = RedisStore::open(&redis_url())
        .unwrap()
        .with_prefix(format!("test:{}:", Uuid::new_v4()));
    let broken = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let store = TieredStore::new(redis.clone(), PostgresStore::new(broken));
    assert!(store.claim(&request("k-down")).await.is_err());
    assert!(
        matches!(
            redis.claim(&request("k-down")).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ),
        "Redis kept the claim of a request that did not run"
    );
}
