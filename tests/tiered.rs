//! Redis in front of Postgres, against real servers.

mod support;

use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};
use support::{
    RedisServer, TestSchema, acquire, claim_request, database_url, pool_in_schema, redis_url,
};
use tower_idempotency::{
    store::StoredResponse,
    store::{
        CachedStore, ClaimOutcome, ClaimRequest, Front, Ownership, PostgresStore, RedisStore,
        Store, TieredStore,
    },
};
use uuid::Uuid;

fn main() -> std::process::ExitCode {
    use tower_idempotency::conformance::{TOMBSTONE_HORIZON, admin_cases, cases, tombstone_cases};
    let tiered = || async {
        let redis = RedisStore::open(&redis_url())
            .unwrap()
            .with_prefix(format!("test:{}:", Uuid::new_v4()));
        let pool = pool_in_schema(&database_url(), "tower_idempotency_conformance").await;
        TieredStore::new(redis, PostgresStore::new(pool))
    };
    // Redis in front keeps no tombstones: the authority answers a key past its retention.
    let with_tombstones = || async {
        let redis = RedisStore::open(&redis_url())
            .unwrap()
            .with_prefix(format!("test:{}:", Uuid::new_v4()));
        let pool = pool_in_schema(&database_url(), "tower_idempotency_tombstones").await;
        let postgres = PostgresStore::new(pool).with_tombstones(TOMBSTONE_HORIZON);
        TieredStore::new(redis, postgres)
    };
    let mut tests = support::conformance("tiered", &[], cases(), tiered);
    tests.extend(support::conformance("tiered", &[], admin_cases(), tiered));
    tests.extend(support::conformance(
        "tiered",
        &[],
        tombstone_cases(),
        with_tombstones,
    ));
    tests.extend(crate::tests![
        current:
            the_front_claims_by_command_and_completes_by_compare_and_set_where_it_can,
            a_cached_front_claims_by_command_too,
            after_a_flush_the_authority_answers_and_redis_is_refilled,
            postgres_failing_releases_the_redis_claim,
            a_stale_front_record_of_another_request_does_not_refuse_this_one;
        multi(2):
            a_stalled_redis_costs_one_timeout_then_is_skipped,
            a_claim_that_reaches_a_frozen_redis_late_never_hides_a_completed_key,
            completed_keys_replay_from_redis_while_postgres_is_down_breaker_or_not;
    ]);
    support::run(tests)
}

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

/// Claims `key` afresh on `store` and completes it with [`created`], held.
async fn claim_and_complete(store: &impl Store, key: &str) {
    let (lease, response) = (acquire(store, &request(key)).await, created());
    let completed = store.complete(&lease, &response, Duration::from_secs(3600));
    assert_eq!(completed.await.unwrap(), Ownership::Held);
}

/// Behind Postgres, Redis claims with one pipelined `SET … NX GET`, no script, and
/// completes the record it wrote by compare-and-set where it can: the fence it wrote travels
/// in the lease beside the authority's (which the handler sees), so the front holds the answer
/// after one `SET`, and still after a script where the server has no `SET … IFEQ`.
async fn the_front_claims_by_command_and_completes_by_compare_and_set_where_it_can() {
    let server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url()).unwrap();
    let store = TieredStore::new(redis.clone(), PostgresStore::new(schema.pool.clone()));
    let complete = async |key: &str| claim_and_complete(&store, key).await;
    complete("k-warm-up").await;
    server.reset_stats().await;

    for key in ["k-cas-1", "k-cas-2", "k-cas-3"] {
        complete(key).await;
        match redis.claim_in_front(&request(key)).await.unwrap() {
            ClaimOutcome::Completed { response, .. } => assert_eq!(response, created()),
            other => panic!("the front does not hold the answer: {other:?}"),
        }
    }
    // Each claim and each replay is one SET and one PTTL, pipelined, with no transaction; a
    // completion is one SET, its own or inside complete.lua: the scripts run say which.
    let count = async |command: &str| server.calls(command).await;
    let counts = (
        count("evalsha").await,
        count("set").await,
        count("pttl").await,
        count("exec").await,
    );
    let completions_scripted = if server.has_set_ifeq().await { 0 } else { 3 };
    assert_eq!(counts, (completions_scripted, 3 + 3 + 3, 3 + 3, 0));
}

/// A replay cache around the front (`TieredStore::new(CachedStore::new(redis), postgres)`)
/// keeps the front's claim without a script: each fresh key's claim is one `SET` and one
/// `PTTL`, pipelined, as with Redis alone in front.
async fn a_cached_front_claims_by_command_too() {
    let server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url()).unwrap();
    let front = CachedStore::new(redis.clone());
    let store = TieredStore::new(front, PostgresStore::new(schema.pool.clone()));
    let complete = async |key: &str| claim_and_complete(&store, key).await;
    complete("k-warm-up").await;
    server.reset_stats().await;

    for key in ["k-cached-1", "k-cached-2", "k-cached-3"] {
        complete(key).await;
    }
    // Scripts run only for completions, and only where the server has no `SET … IFEQ`.
    let completions_scripted = if server.has_set_ifeq().await { 0 } else { 3 };
    let counts = (server.calls("evalsha").await, server.calls("pttl").await);
    assert_eq!(counts, (completions_scripted, 3));
    assert_eq!(server.calls("exec").await, 0, "claims in a transaction");
}

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

    let mut admin = server.admin().await;
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
        ClaimOutcome::Completed { response, .. } => assert_eq!(response, created()),
        other => panic!("the authority's record was not replayed: {other:?}"),
    }
    // Written back with the authority's remaining retention: Redis alone replays it now.
    match redis.claim(&request("k-flush")).await.unwrap() {
        ClaimOutcome::Completed {
            response,
            expires_in,
        } => {
            assert_eq!(response, created());
            assert!(
                expires_in <= Duration::from_secs(3600) && expires_in > Duration::from_secs(3500)
            );
        }
        other => panic!("not written back: {other:?}"),
    }
    schema.drop().await;
}

async fn a_stalled_redis_costs_one_timeout_then_is_skipped() {
    let mut server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url())
        .unwrap()
        .with_timeout(Duration::from_millis(200));
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

async fn a_claim_that_reaches_a_frozen_redis_late_never_hides_a_completed_key() {
    let mut server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url())
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let store = TieredStore::new(redis.clone(), PostgresStore::new(schema.pool.clone()))
        .with_breaker_cooldown(Duration::from_millis(100));
    let lease = acquire(&store, &request("k-late")).await;
    store
        .complete(&lease, &created(), Duration::from_secs(3600))
        .await
        .unwrap();
    let mut admin = server.admin().await;
    let () = redis::cmd("FLUSHALL")
        .query_async(&mut admin)
        .await
        .unwrap();

    // Redis freezes with a claim of the key queued in it: the claim times out, and Postgres
    // answers with the replay.
    server.pause();
    let late = request("k-late");
    assert!(matches!(
        store.claim(&late).await.unwrap(),
        ClaimOutcome::Completed { .. }
    ));
    server.resume();
    // The queued script runs once Redis thaws: Redis now holds an in-flight claim of a key
    // Postgres has completed, which nobody will ever finish.
    let key = redis.record_key(late.record());
    let state = support::eventually(Duration::from_secs(5), "the late claim", || {
        let mut admin = admin.clone();
        let key = key.clone();
        async move {
            // The record's second byte is its state.
            let record: Option<Vec<u8>> = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut admin)
                .await
                .map_err(|e| e.to_string())?;
            record
                .and_then(|r| r.get(1).map(|&state| char::from(state).to_string()))
                .ok_or_else(|| "no record yet".to_owned())
        }
    })
    .await;
    assert_eq!(
        state, "i",
        "nothing was tested: the late claim left no record"
    );

    // Every retry is still the replay, never "in flight".
    tokio::time::sleep(Duration::from_millis(150)).await;
    let mut in_flight = 0;
    for _ in 0..20 {
        match store.claim(&request("k-late")).await.unwrap() {
            ClaimOutcome::Completed { response, .. } => assert_eq!(response, created()),
            ClaimOutcome::InFlight { .. } => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    println!(
        "frozen Redis with a queued claim: 20 retries of a completed key, {in_flight} in flight"
    );
    assert_eq!(in_flight, 0);
    schema.drop().await;
}

async fn completed_keys_replay_from_redis_while_postgres_is_down_breaker_or_not() {
    let mut server = RedisServer::start().await;
    let mut cluster = support::PgCluster::start().await;
    let pool = pool_in_schema(&cluster.url(), "public").await;
    let redis = RedisStore::open(&server.url())
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let store = TieredStore::new(
        redis.clone(),
        PostgresStore::new(pool).with_timeout(Duration::from_secs(1)),
    );
    let lease = acquire(&store, &request("k-done")).await;
    store
        .complete(&lease, &created(), Duration::from_secs(3600))
        .await
        .unwrap();

    // A Redis timeout opens the breaker (5 s by default)...
    server.pause();
    let other = acquire(&store, &request("k-other")).await;
    server.resume();
    assert!(store.front_skipped(), "the breaker did not open");
    store.release(&other).await.unwrap();
    // ...and Postgres goes down within it.
    cluster.stop_server();
    assert!(store.front_skipped());
    match store.claim(&request("k-done")).await {
        Ok(ClaimOutcome::Completed { response, .. }) => assert_eq!(response, created()),
        other => panic!("a completed key was not replayed from Redis: {other:?}"),
    }
    // An unknown key cannot run without Postgres, and Redis keeps no claim of it.
    assert!(store.claim(&request("k-new")).await.is_err());
    assert!(matches!(
        redis.claim(&request("k-new")).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
}

/// A record left in Redis by an attempt whose release failed, for another request with the key:
/// the front's "mismatch" is confirmed with Postgres, which has no row, so the request runs
/// (it was refused 422 for up to a lease).
async fn a_stale_front_record_of_another_request_does_not_refuse_this_one() {
    let server = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&server.url()).unwrap();
    let store = TieredStore::new(redis.clone(), PostgresStore::new(schema.pool.clone()));
    // The stale record: another request's claim, in Redis only.
    let other = tower_idempotency::conformance::claim_request(
        "tenant",
        "k-stale",
        "other",
        Duration::from_secs(30),
    );
    acquire(&redis, &other).await;
    let outcome = store.claim(&request("k-stale")).await.unwrap();
    assert!(
        matches!(outcome, ClaimOutcome::Acquired { .. }),
        "{outcome:?}"
    );
    // A real mismatch is still one: Postgres says so.
    let lease = acquire(&store, &request("k-real")).await;
    assert_eq!(
        store
            .complete(&lease, &created(), Duration::from_secs(60))
            .await
            .unwrap(),
        Ownership::Held
    );
    let reused = tower_idempotency::conformance::claim_request(
        "tenant",
        "k-real",
        "other",
        Duration::from_secs(30),
    );
    assert_eq!(store.claim(&reused).await.unwrap(), ClaimOutcome::Mismatch);
    schema.drop().await;
}
