//! Replays from process memory (`CachedStore`) in front of a Redis of the test's own: what the
//! cache saves is counted at Redis (its command statistics), and every way a cached answer
//! could go stale is tried: it is never served past the bound.

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::Duration,
};

use axum::{Router, body::Body, routing::post};
use http::{HeaderMap, Request, StatusCode};
use support::{RedisServer, call};
use tower_idempotency::{
    IdempotencyLayer,
    store::Fingerprint,
    store::StoredResponse,
    store::{
        Admin, CachedStore, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, RedisStore,
        Store,
    },
};
use uuid::Uuid;

const BOUND: Duration = Duration::from_secs(1);

/// The store contract holds through the cache: on a memory store, on Redis, and on Redis that
/// tells the cache when an answer changed. The operator's paths are the wrapped store's.
fn main() -> std::process::ExitCode {
    use tower_idempotency::conformance::{admin_cases, cases};
    let on_memory = || async { CachedStore::new(tower_idempotency::MemoryStore::new()) };
    let on_redis = || async {
        let store = RedisStore::open(&support::redis_url()).unwrap();
        CachedStore::new(store.with_prefix(format!("cache:{}:", Uuid::new_v4().simple())))
    };
    let watched = || async {
        let store = RedisStore::open(&support::redis_url())
            .unwrap()
            .with_prefix(format!("watched:{}:", Uuid::new_v4().simple()));
        CachedStore::new(store.clone()).with_watcher(store.watcher())
    };
    let mut tests = support::conformance("on_memory", &[], cases(), on_memory);
    tests.extend(support::conformance(
        "on_memory",
        &[],
        admin_cases(),
        on_memory,
    ));
    tests.extend(support::conformance("on_redis", &[], cases(), on_redis));
    tests.extend(support::conformance(
        "on_redis",
        &[],
        admin_cases(),
        on_redis,
    ));
    tests.extend(support::conformance("watched", &[], cases(), watched));
    tests.extend(crate::tests![
        current:
            replays_soon_after_cost_no_round_trip_and_fresh_keys_cost_the_same,
            only_a_lease_made_from_its_claim_has_its_answer_kept,
            an_answer_the_store_no_longer_holds_is_served_for_at_most_the_bound,
            a_key_forgotten_and_reused_by_another_request_is_the_stores_past_the_bound,
            an_answer_is_never_served_past_its_retention,
            the_cache_keeps_to_its_budget,
            watched::a_watched_answer_is_served_past_the_bound_without_a_round_trip,
            watched::a_watched_answer_goes_the_moment_redis_says_its_key_changed,
            watched::a_lost_tracking_connection_drops_what_it_watched,
            watched::a_silent_redis_stops_watched_answers_after_the_bound;
    ]);
    support::run(tests)
}

/// An app on `store` whose handler counts its runs and answers with the run's number.
fn app(store: impl Store, runs: &Arc<AtomicUsize>) -> Router {
    let runs = Arc::clone(runs);
    let handler = move || {
        let runs = Arc::clone(&runs);
        async move { (StatusCode::CREATED, runs.fetch_add(1, SeqCst).to_string()) }
    };
    Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::new(store).with_retention(Duration::from_secs(60)))
}

fn order(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/orders")
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

struct Setup {
    redis: RedisServer,
    /// The Redis store behind the cache: another process's view of the same records.
    behind: RedisStore,
    cached: CachedStore<RedisStore>,
}

async fn setup() -> Setup {
    let redis = RedisServer::start().await;
    let behind = RedisStore::open(&redis.url())
        .unwrap()
        .with_prefix(format!("cache:{}:", Uuid::new_v4().simple()));
    let cached = CachedStore::new(behind.clone()).with_bound(BOUND);
    Setup {
        redis,
        behind,
        cached,
    }
}

fn record(key: &str) -> RecordKey {
    RecordKey::new(
        tower_idempotency::scope::ANONYMOUS_SCOPE,
        key.try_into().unwrap(),
    )
}

/// A retry soon after is replayed without a round trip: Redis sees the fresh key's claim and
/// completion, and nothing for the replays; a fresh key costs what it costs without the cache.
async fn replays_soon_after_cost_no_round_trip_and_fresh_keys_cost_the_same() {
    let setup = setup().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(setup.cached.clone(), &runs);
    let first = call(&app, order("k-hot", "a")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let after_first = setup.redis.claims_and_scripts().await;
    for _ in 0..5 {
        let replay = call(&app, order("k-hot", "a")).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(
        setup.redis.claims_and_scripts().await,
        after_first,
        "replays reached Redis"
    );
    // A fresh key: the same calls as without the cache (claim, complete).
    let uncached = app_without_cache(&setup, &runs);
    let before = setup.redis.claims_and_scripts().await;
    call(&uncached, order("k-plain", "a")).await;
    let plain = setup.redis.claims_and_scripts().await - before;
    let before = setup.redis.claims_and_scripts().await;
    call(&app, order("k-fresh", "a")).await;
    assert_eq!(setup.redis.claims_and_scripts().await - before, plain);
    assert_eq!(runs.load(SeqCst), 3);
}

/// An answer is kept for the request its claim was made for, which the lease made from that
/// claim knows. A lease made without its claim (`Lease::new`) does not: its completion is not
/// kept, and a retry is the store's to answer.
async fn only_a_lease_made_from_its_claim_has_its_answer_kept() {
    let setup = setup().await;
    let body = Some("1".into());
    let response = StoredResponse::new(StatusCode::CREATED, HeaderMap::new(), body, None);
    let retention = Duration::from_secs(60);
    for (key, from_claim, round_trips) in [("k-claim", true, 0), ("k-made", false, 1)] {
        let request = || {
            let fingerprint = Fingerprint::of_payload(b"a");
            ClaimRequest::new(record(key), fingerprint, Uuid::new_v4(), retention)
        };
        let claim = request();
        let ClaimOutcome::Acquired { fence } = setup.cached.claim(&claim).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        let lease = if from_claim {
            claim.lease_with_fence(fence)
        } else {
            Lease::new(record(key), claim.owner(), fence)
        };
        let held = setup.cached.complete(&lease, &response, retention).await;
        assert_eq!(held.unwrap(), Ownership::Held);
        let before = setup.redis.claims_and_scripts().await;
        let replay = setup.cached.claim(&request()).await.unwrap();
        assert!(matches!(replay, ClaimOutcome::Completed { .. }), "{key}");
        let after = setup.redis.claims_and_scripts().await;
        assert_eq!(
            after - before,
            round_trips,
            "{key}: claims that reached Redis"
        );
    }
}

fn app_without_cache(setup: &Setup, runs: &Arc<AtomicUsize>) -> Router {
    app(setup.behind.clone(), runs)
}

/// Forgotten from another process (an operator's `admin forget`), lost by the store (flushed):
/// the cached answer is served for at most the bound, then the store decides, and the request
/// runs again. Forgotten through the cache itself, at once.
async fn an_answer_the_store_no_longer_holds_is_served_for_at_most_the_bound() {
    let setup = setup().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(setup.cached.clone(), &runs);
    for (key, lose) in [("k-forgotten", "forget"), ("k-flushed", "flush")] {
        assert_eq!(
            call(&app, order(key, "a")).await.status,
            StatusCode::CREATED
        );
        let ran = runs.load(SeqCst);
        match lose {
            "forget" => assert!(setup.behind.forget(&record(key)).await.unwrap()),
            _ => {
                let () = redis::cmd("FLUSHALL")
                    .query_async(&mut setup.redis.admin().await)
                    .await
                    .unwrap();
            }
        }
        // Within the bound, still the cached answer.
        assert!(call(&app, order(key, "a")).await.replayed());
        tokio::time::sleep(BOUND).await;
        let again = call(&app, order(key, "a")).await;
        assert!(!again.replayed(), "{key}: served past the bound");
        assert_eq!(runs.load(SeqCst), ran + 1, "{key}: the request ran again");
    }
    // Forgotten through the cache: the next request runs at once.
    let ran = runs.load(SeqCst);
    assert!(setup.cached.forget(&record("k-flushed")).await.unwrap());
    assert!(!call(&app, order("k-flushed", "a")).await.replayed());
    assert_eq!(runs.load(SeqCst), ran + 1);
}

/// A key forgotten and claimed again with another request: a request like the new one goes to
/// the store (the cache keeps answers by fingerprint) and gets the new answer at once; a request
/// like the old one may get the old answer, within the bound only.
async fn a_key_forgotten_and_reused_by_another_request_is_the_stores_past_the_bound() {
    let setup = setup().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(setup.cached.clone(), &runs);
    let old = call(&app, order("k-reused", "old")).await;
    assert!(setup.behind.forget(&record("k-reused")).await.unwrap());
    let new = call(&app, order("k-reused", "new")).await;
    assert_eq!(new.status, StatusCode::CREATED);
    assert!(!new.replayed(), "the new request ran");
    assert_ne!(new.body, old.body);
    let replay = call(&app, order("k-reused", "new")).await;
    assert_eq!(replay.body, new.body);
    tokio::time::sleep(BOUND).await;
    let like_the_old = call(&app, order("k-reused", "old")).await;
    assert_eq!(like_the_old.status, StatusCode::UNPROCESSABLE_ENTITY);
}

/// The retention ends before the bound: the answer is not served past it, watched or not.
async fn an_answer_is_never_served_past_its_retention() {
    let setup = setup().await;
    let cached = CachedStore::new(setup.behind.clone()).with_bound(Duration::from_secs(60));
    short_retention(cached, "k-short").await;
    let watched = CachedStore::new(setup.behind.clone())
        .with_bound(Duration::from_secs(60))
        .with_watcher(setup.behind.watcher());
    short_retention(watched, "k-short-watched").await;
}

/// `key` through `cached` with a retention of a second: replayed soon after, run again past it.
async fn short_retention(cached: CachedStore<RedisStore>, key: &str) {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(cached).with_retention(Duration::from_secs(1));
    let handler = {
        let runs = Arc::clone(&runs);
        move || {
            let runs = Arc::clone(&runs);
            async move { (StatusCode::CREATED, runs.fetch_add(1, SeqCst).to_string()) }
        }
    };
    let app = Router::new().route("/orders", post(handler)).layer(layer);
    call(&app, order(key, "a")).await;
    assert!(call(&app, order(key, "a")).await.replayed());
    assert!(call(&app, order(key, "a")).await.replayed());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!call(&app, order(key, "a")).await.replayed(), "{key}");
    assert_eq!(runs.load(SeqCst), 2);
}

/// The cache holds at most its budget: past it, the oldest answers go, and their retries ask
/// the store (which replays them).
async fn the_cache_keeps_to_its_budget() {
    let setup = setup().await;
    let cached = CachedStore::new(setup.behind.clone())
        .with_bound(Duration::from_secs(60))
        .with_max_entries(2);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = app(cached, &runs);
    for key in ["k-1", "k-2", "k-3"] {
        call(&app, order(key, "a")).await;
    }
    let before = setup.redis.claims_and_scripts().await;
    for key in ["k-2", "k-3"] {
        assert!(call(&app, order(key, "a")).await.replayed());
    }
    assert_eq!(
        setup.redis.claims_and_scripts().await,
        before,
        "k-2 and k-3 are cached"
    );
    assert!(call(&app, order("k-1", "a")).await.replayed());
    assert_eq!(
        setup.redis.claims_and_scripts().await,
        before + 1,
        "k-1 was evicted, and replayed by Redis"
    );
    assert_eq!(runs.load(SeqCst), 3);
}

/// With the Redis store's watcher: answers served for as long as Redis says they have not
/// changed, and dropped the moment it says they have (client tracking), never past the bound
/// after the watcher last heard from Redis.
mod watched {
    use std::time::Instant;

    use super::*;

    /// The store of `setup` behind a cache with a watcher and `bound`.
    fn watched(setup: &Setup, bound: Duration) -> CachedStore<RedisStore> {
        CachedStore::new(setup.behind.clone())
            .with_bound(bound)
            .with_watcher(setup.behind.watcher())
    }

    /// Completes `key` and retries it once, so that its answer is watched; waits until the
    /// watcher has read it (the `GET`s Redis counts reach `gets`). The first answer.
    async fn watch(setup: &Setup, app: &Router, key: &str, gets: u64) -> support::Answer {
        let first = call(app, order(key, "a")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(call(app, order(key, "a")).await.replayed());
        let deadline = Instant::now() + Duration::from_secs(5);
        while setup.redis.calls("get").await < gets {
            assert!(
                Instant::now() < deadline,
                "{key}: the watcher never read it"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        first
    }

    /// Calls `key` until the answer is no longer the cached one (`old`'s body, replayed), for
    /// up to `within`: the answer then.
    async fn until_told(
        app: &Router,
        key: &str,
        old: &support::Answer,
        within: Duration,
    ) -> support::Answer {
        let deadline = Instant::now() + within;
        loop {
            let now = call(app, order(key, "a")).await;
            if !(now.replayed() && now.body == old.body) {
                return now;
            }
            assert!(
                Instant::now() < deadline,
                "{key}: still the old answer after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A watched answer is served past the bound, without a round trip, while Redis says
    /// nothing changed.
    pub(crate) async fn a_watched_answer_is_served_past_the_bound_without_a_round_trip() {
        let setup = setup().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(watched(&setup, BOUND), &runs);
        let first = watch(&setup, &app, "k-watched", 1).await;
        tokio::time::sleep(BOUND + Duration::from_millis(300)).await;
        let before = setup.redis.claims_and_scripts().await;
        let replay = call(&app, order("k-watched", "a")).await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(
            setup.redis.claims_and_scripts().await,
            before,
            "the replay reached Redis"
        );
        assert_eq!(runs.load(SeqCst), 1);
    }

    /// Forgotten by another process, flushed, forgotten and run again by another process, past
    /// its retention: the cached answer goes the moment Redis says so, long before the bound
    /// (a minute here), and the store decides.
    pub(crate) async fn a_watched_answer_goes_the_moment_redis_says_its_key_changed() {
        let setup = setup().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(watched(&setup, Duration::from_secs(60)), &runs);
        let other = app_without_cache(&setup, &runs);
        let soon = Duration::from_secs(2);
        for (n, change) in ["forget", "flush", "rerun"].into_iter().enumerate() {
            let key = format!("k-{change}");
            let old = watch(&setup, &app, &key, n as u64 + 1).await;
            let ran = runs.load(SeqCst);
            match change {
                "forget" => assert!(setup.behind.forget(&record(&key)).await.unwrap()),
                "flush" => {
                    let () = redis::cmd("FLUSHALL")
                        .query_async(&mut setup.redis.admin().await)
                        .await
                        .unwrap();
                }
                _ => {
                    assert!(setup.behind.forget(&record(&key)).await.unwrap());
                    assert!(!call(&other, order(&key, "a")).await.replayed());
                }
            }
            let now = until_told(&app, &key, &old, soon).await;
            if change == "rerun" {
                assert!(now.replayed(), "the other process's answer, from Redis");
                assert_eq!(
                    runs.load(SeqCst),
                    ran + 1,
                    "{key}: ran once more, elsewhere"
                );
            } else {
                assert!(!now.replayed(), "{key}: ran again");
                assert_eq!(runs.load(SeqCst), ran + 1);
            }
        }
    }

    /// The watcher's connection killed: what it watched is not served again until Redis is
    /// asked, and the watcher connects again.
    pub(crate) async fn a_lost_tracking_connection_drops_what_it_watched() {
        let setup = setup().await;
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(watched(&setup, Duration::from_secs(60)), &runs);
        watch(&setup, &app, "k-lost", 1).await;
        let killed = kill_tracking_clients(&setup).await;
        assert_eq!(killed, 1, "one tracking connection");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = setup.redis.claims_and_scripts().await;
        assert!(call(&app, order("k-lost", "a")).await.replayed());
        assert_eq!(
            setup.redis.claims_and_scripts().await,
            before + 1,
            "asked Redis again"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while tracking_clients(&setup).await.is_empty() {
            assert!(
                Instant::now() < deadline,
                "the watcher did not connect again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(runs.load(SeqCst), 1);
    }

    /// Redis frozen (its connections open, nothing answering; the store's timeout longer than
    /// the bound, so the watcher's ping is still waiting): a watched answer is served for the
    /// bound after the watcher last heard from Redis, then no more.
    pub(crate) async fn a_silent_redis_stops_watched_answers_after_the_bound() {
        let mut setup = setup().await;
        let bound = Duration::from_millis(300);
        let store = setup.behind.clone().with_timeout(Duration::from_secs(2));
        let cached = CachedStore::new(store.clone())
            .with_bound(bound)
            .with_watcher(store.watcher());
        let runs = Arc::new(AtomicUsize::new(0));
        let app = app(cached, &runs);
        watch(&setup, &app, "k-silent", 1).await;
        tokio::time::sleep(bound + Duration::from_millis(100)).await;
        let before = setup.redis.claims_and_scripts().await;
        assert!(call(&app, order("k-silent", "a")).await.replayed());
        assert_eq!(
            setup.redis.claims_and_scripts().await,
            before,
            "watched, past the timer"
        );
        setup.redis.pause();
        tokio::time::sleep(bound + Duration::from_millis(150)).await;
        let late = call(&app, order("k-silent", "a")).await;
        setup.redis.resume();
        assert!(
            !late.replayed(),
            "served past the bound after Redis fell silent"
        );
        assert_eq!(
            late.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "asked the frozen Redis"
        );
        assert_eq!(runs.load(SeqCst), 1);
    }

    /// The ids of the server's clients with tracking on.
    async fn tracking_clients(setup: &Setup) -> Vec<String> {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut setup.redis.admin().await)
            .await
            .unwrap();
        list.lines()
            .filter(|line| {
                line.split(' ').any(|field| {
                    field
                        .strip_prefix("flags=")
                        .is_some_and(|f| f.contains('t'))
                })
            })
            .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
            .map(str::to_owned)
            .collect()
    }

    async fn kill_tracking_clients(setup: &Setup) -> usize {
        let ids = tracking_clients(setup).await;
        for id in &ids {
            let _: i64 = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("ID")
                .arg(id)
                .query_async(&mut setup.redis.admin().await)
                .await
                .unwrap();
        }
        ids.len()
    }
}
