//! The Redis store against real Redis servers: the machine's (under a unique prefix per test)
//! and, for tests that stop, pause or flush one, a `redis-server` of their own.

mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use axum::{Router, routing::post};
use http::{HeaderMap, StatusCode};
use support::{RedisServer, claim_request, eventually, redis_connection, redis_url};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, conformance,
    store::StoredResponse,
    store::{ClaimOutcome, ClaimRequest, Front, Ownership, RedisStore, Store, StoreError},
};
use uuid::Uuid;

fn store_on(url: &str) -> RedisStore {
    RedisStore::open(url)
        .unwrap()
        .with_prefix(format!("test:{}:", Uuid::new_v4()))
}

fn main() -> std::process::ExitCode {
    use conformance::{TOMBSTONE_HORIZON, admin_cases, cases, tombstone_cases};
    let plain = || async { store_on(&redis_url()) };
    let mut tests = support::conformance("redis", &[], cases(), plain);
    tests.extend(support::conformance("redis", &[], admin_cases(), plain));
    tests.extend(support::conformance(
        "redis",
        &[],
        tombstone_cases(),
        || async { store_on(&redis_url()).with_tombstones(TOMBSTONE_HORIZON) },
    ));
    tests.extend(crate::tests![
        current:
            tombstones::a_tombstone_costs_a_small_key,
            script_flush_between_calls_changes_nothing,
            finalizing_compares_and_sets_where_the_server_can_and_runs_scripts_where_not,
            a_claim_by_command_answers_as_claim_lua_does,
            a_claim_asked_again_by_claim_lua_keeps_its_fence_growing,
            a_restarted_redis_is_reconnected,
            a_stalled_redis_times_out_within_the_bound,
            unreadable_records_are_errors_that_name_the_record,
            stored_records_expire_with_redis_clocks,
            two_instances_on_one_redis_run_a_key_once,
            a_claim_stalled_inside_its_pipeline_past_a_lease_does_not_run,
            an_owner_asking_again_as_its_record_expires_holds_the_key_again,
            a_duplicate_elsewhere_is_woken_by_redis_and_a_key_nobody_waits_for_publishes_nothing;
    ]);
    support::run(tests)
}

mod tombstones {
    use super::*;

    /// A tombstone costs Redis a key of its own: its bytes, as `MEMORY USAGE` counts them,
    /// against the completed record's (a 200-byte answer).
    pub(crate) async fn a_tombstone_costs_a_small_key() {
        let store = store_on(&redis_url()).with_tombstones(Duration::from_secs(3600));
        let request = claim_request("order-0123456789abcdef", Duration::from_secs(30));
        let lease = support::acquire(&store, &request).await;
        let body = bytes::Bytes::from(vec![b'x'; 200]);
        let answer = StoredResponse::new(StatusCode::CREATED, HeaderMap::new(), Some(body), None);
        let completed = store
            .complete(&lease, &answer, Duration::from_secs(60))
            .await;
        assert_eq!(completed.unwrap(), Ownership::Held);
        let mut admin = redis_connection(&redis_url()).await;
        let key = store.record_key(request.record());
        let usage = async |key: String, admin: &mut redis::aio::MultiplexedConnection| -> i64 {
            redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(key)
                .query_async(admin)
                .await
                .unwrap()
        };
        let record = usage(key.clone(), &mut admin).await;
        let tombstone = usage(format!("{{{key}}} tombstone"), &mut admin).await;
        assert!(
            tombstone > 0 && tombstone < record,
            "{tombstone} against {record}"
        );
        println!(
            "Redis: a tombstone {tombstone} B, the completed record {record} B (a 200-byte answer)"
        );
    }
}

fn ok_response() -> StoredResponse {
    StoredResponse::new(StatusCode::OK, HeaderMap::new(), Some("done".into()), None)
}

async fn flush_scripts(admin: &mut redis::aio::MultiplexedConnection) {
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(admin)
        .await
        .unwrap();
}

async fn script_flush_between_calls_changes_nothing() {
    let server = RedisServer::start().await;
    let store = store_on(&server.url());
    let mut admin = server.admin().await;
    let request = claim_request("k-flush", Duration::from_secs(30));

    let ClaimOutcome::Acquired { fence } = store.claim(&request).await.unwrap() else {
        panic!("not acquired");
    };
    flush_scripts(&mut admin).await;
    let lease = request.lease_with_fence(fence);
    assert_eq!(
        store.renew(&lease, Duration::from_secs(30)).await.unwrap(),
        Ownership::Held
    );
    flush_scripts(&mut admin).await;
    assert_eq!(
        store
            .complete(&lease, &ok_response(), Duration::from_secs(60))
            .await
            .unwrap(),
        Ownership::Held
    );
    flush_scripts(&mut admin).await;
    match store.claim(&request).await.unwrap() {
        ClaimOutcome::Completed { response, .. } => assert_eq!(response, ok_response()),
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// Completion and renewal are one `SET … IFEQ` on servers that have it (Valkey 8.1 and 9.1,
/// Redis 8.4), release one `DELIFEQ` (Valkey 9.1), the scripts on servers that refuse them
/// (Redis 7.0 and 8.2): the server's own command counts say which ran, and the answers are the
/// same either way. A command that finds another record than its lease's leaves the answer to
/// the script. The store asks the server once what it has, and never tries a command it does
/// not.
async fn finalizing_compares_and_sets_where_the_server_can_and_runs_scripts_where_not() {
    let server = RedisServer::start().await;
    let store = store_on(&server.url());
    server.reset_stats().await;
    // The first finalizes find out what the server offers; the scripts get loaded.
    let warm_up = claim_request("k-warm-up", Duration::from_secs(30));
    let lease = support::acquire(&store, &warm_up).await;
    let renewed = store.renew(&lease, Duration::from_secs(30)).await.unwrap();
    assert_eq!(renewed, Ownership::Held);
    assert_eq!(store.release(&lease).await.unwrap(), Ownership::Held);
    let errors = (server.errors("set").await, server.errors("delifeq").await);
    assert_eq!(
        errors,
        (0, 0),
        "commands the server does not have were tried"
    );
    assert_eq!(server.calls("command|docs").await, 1, "asked, once");
    server.reset_stats().await;

    let mut leases = Vec::new();
    for key in ["k-cas-1", "k-cas-2"] {
        let request = claim_request(key, Duration::from_secs(30));
        let lease = support::acquire(&store, &request).await;
        let renewed = store.renew(&lease, Duration::from_secs(30)).await.unwrap();
        assert_eq!(renewed, Ownership::Held);
        let completed = store
            .complete(&lease, &ok_response(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(completed, Ownership::Held);
        match store.claim(&request).await.unwrap() {
            ClaimOutcome::Completed { response, .. } => assert_eq!(response, ok_response()),
            other => panic!("expected a replay, got {other:?}"),
        }
        leases.push(lease);
    }
    // A lease on a completed key holds nothing, whichever way it is asked.
    let stale = &leases[0];
    let renewed = store.renew(stale, Duration::from_secs(30)).await.unwrap();
    assert_eq!(renewed, Ownership::Lost);
    let response = ok_response();
    let completed = store.complete(stale, &response, Duration::from_secs(60));
    assert_eq!(completed.await.unwrap(), Ownership::Lost);
    assert_eq!(store.release(stale).await.unwrap(), Ownership::Lost);
    // A release frees the key for the next claim; the same lease released again holds nothing.
    let request = claim_request("k-cas-released", Duration::from_secs(30));
    let lease = support::acquire(&store, &request).await;
    assert_eq!(store.release(&lease).await.unwrap(), Ownership::Held);
    assert_eq!(store.release(&lease).await.unwrap(), Ownership::Lost);
    let next = claim_request("k-cas-released", Duration::from_secs(30));
    let again = support::acquire(&store, &next).await;
    assert_eq!(store.release(&lease).await.unwrap(), Ownership::Lost);
    assert_eq!(store.release(&again).await.unwrap(), Ownership::Held);

    // A script's own `redis.call`s count too: each claim is one SET (NX GET) and one PTTL,
    // pipelined, with no transaction, each scripted completion one SET inside complete.lua
    // (renew.lua's is a PEXPIRE), each scripted release that deletes one DEL inside release.lua.
    let count = async |command: &str| server.calls(command).await;
    let counts = (
        count("evalsha").await,
        count("set").await,
        count("delifeq").await,
        count("del").await,
    );
    // 4 claims that acquire and 2 replays are pipelines, whatever the server.
    assert_eq!(count("pttl").await, 6, "claims made by command");
    assert_eq!(count("exec").await, 0, "claims in a transaction");
    match (server.has_set_ifeq().await, server.has_delifeq().await) {
        // Renewals and completions are one SET each, releases one DELIFEQ each; the 2 of them
        // on the completed key and the 3 releases that lost (a command found another record,
        // or none) run their script after it, which says so.
        (true, true) => assert_eq!(counts, (2 + 3, 6 + 6, 5, 0)),
        // Releases run release.lua.
        (true, false) => assert_eq!(counts, (2 + 5, 6 + 6, 0, 2)),
        // Every finalize runs a script.
        (false, false) => assert_eq!(counts, (6 + 5, 6 + 2, 0, 2)),
        (false, true) => panic!("a server with DELIFEQ and without SET … IFEQ"),
    }
    assert_eq!(server.calls("command|docs").await, 0, "asked again");
}

/// Without tombstones the store claims with one `SET … NX GET`, a `PTTL` and a `TIME`,
/// pipelined, and so does it in front of an authority (`Front::claim_in_front`) even with
/// tombstones, less the `TIME`. Its answers are claim.lua's: granted, granted again to its
/// owner with a fence no earlier (alone, asked again in a transaction; in front, with its
/// record's fence), in flight to another owner for what is left of the lease, a mismatch to
/// another request, the answer to a retry with what is left of the retention. The record is the one
/// claim.lua writes: the script (which a store with tombstones claims with) reads it, and the
/// lease finalizes it.
async fn a_claim_by_command_answers_as_claim_lua_does() {
    let server = RedisServer::start().await;
    let plain = store_on(&server.url());
    let with_tombstones = plain.clone().with_tombstones(Duration::from_secs(3600));
    let lease = Duration::from_secs(30);
    for (key, in_front) in [("k-alone", false), ("k-front", true)] {
        let claim = async |request: &ClaimRequest| match in_front {
            false => plain.claim(request).await.unwrap(),
            true => with_tombstones.claim_in_front(request).await.unwrap(),
        };
        let request = claim_request(key, lease);
        server.reset_stats().await;
        let ClaimOutcome::Acquired { fence } = claim(&request).await else {
            panic!("{key}: not acquired");
        };
        match claim(&request).await {
            ClaimOutcome::Acquired { fence: again } => assert!(again >= fence, "an earlier fence"),
            other => panic!("{key}: the owner asked again got {other:?}"),
        }
        match claim(&claim_request(key, lease)).await {
            ClaimOutcome::InFlight { retry_after } => {
                assert!(retry_after <= lease && retry_after > lease - Duration::from_secs(5));
            }
            other => panic!("{key}: another owner got {other:?}"),
        }
        let other_body = conformance::claim_request("tenant", key, "another body", lease);
        assert_eq!(claim(&other_body).await, ClaimOutcome::Mismatch);
        assert_eq!(server.calls("evalsha").await, 0, "{key}: a script claimed");
        // Four pipelines, one PTTL each, and alone the owner's claim asked again once more in
        // a transaction.
        let calls = (server.calls("pttl").await, server.calls("exec").await);
        let again = u64::from(!in_front);
        assert_eq!(calls, (4 + again, again), "{key}: claims by command");

        let retention = Duration::from_secs(3600);
        let held = request.lease_with_fence(fence);
        let response = ok_response();
        let completed = plain.complete(&held, &response, retention);
        assert_eq!(completed.await.unwrap(), Ownership::Held);
        server.reset_stats().await;
        for by_script in [false, true] {
            let replay = match by_script {
                false => claim(&request).await,
                true => with_tombstones.claim(&request).await.unwrap(),
            };
            let ClaimOutcome::Completed {
                response,
                expires_in,
            } = replay
            else {
                panic!("{key}: expected a replay, got {replay:?}");
            };
            assert_eq!(response, ok_response());
            assert!(expires_in <= retention && expires_in > retention - Duration::from_secs(5));
        }
        // claim.lua reads the time left with a PTTL of its own.
        let calls = (server.calls("pttl").await, server.calls("evalsha").await);
        assert_eq!(calls, (1 + 1, 1), "{key}: one replay each way");
        assert_eq!(
            server.calls("exec").await,
            0,
            "{key}: a replay in a transaction"
        );
    }
}

/// A claim asked again by its owner may run claim.lua where the first ran the pipeline (on a
/// cluster, the key's slot moved in between): granted again, its fence is the server's clock
/// of that moment as the pipeline's would be, no earlier than the first grant's, and not the
/// first claim's record name (this machine's clock, read before it was sent).
async fn a_claim_asked_again_by_claim_lua_keeps_its_fence_growing() {
    let server = RedisServer::start().await;
    let plain = store_on(&server.url());
    // The same records, claimed by claim.lua (it reads the tombstone there).
    let by_script = plain.clone().with_tombstones(Duration::from_secs(3600));
    let request = claim_request("k-asked-again", Duration::from_secs(30));
    let ClaimOutcome::Acquired { fence } = plain.claim(&request).await.unwrap() else {
        panic!("not acquired");
    };
    server.reset_stats().await;
    let again = by_script.claim(&request).await.unwrap();
    assert_eq!(server.calls("evalsha").await, 1, "claim.lua claimed");
    let ClaimOutcome::Acquired { fence: again } = again else {
        panic!("the owner asked again got {again:?}");
    };
    assert!(again >= fence, "granted again with {again}, below {fence}");
    // The lease of the second answer finalizes the record the first claim wrote.
    let response = ok_response();
    let held = request.lease_with_fence(again);
    let completed = plain.complete(&held, &response, Duration::from_secs(60));
    assert_eq!(completed.await.unwrap(), Ownership::Held);
}

async fn a_restarted_redis_is_reconnected() {
    let mut server = RedisServer::start().await;
    let store = store_on(&server.url());
    assert!(matches!(
        store
            .claim(&claim_request("k-before", Duration::from_secs(30)))
            .await,
        Ok(ClaimOutcome::Acquired { .. })
    ));

    server.stop();
    let down = store
        .claim(&claim_request("k-down", Duration::from_secs(30)))
        .await;
    assert!(down.is_err(), "a stopped Redis answered {down:?}");

    server.restart().await;
    let after = claim_request("k-after", Duration::from_secs(30));
    let outcome = eventually(Duration::from_secs(15), "reconnecting", || {
        store.claim(&after)
    })
    .await;
    // The restarted server is empty: the claim is new.
    assert!(matches!(outcome, ClaimOutcome::Acquired { .. }));
}

async fn a_stalled_redis_times_out_within_the_bound() {
    let mut server = RedisServer::start().await;
    let timeout = Duration::from_millis(200);
    let store = store_on(&server.url()).with_timeout(timeout);
    let request = claim_request("k-stall", Duration::from_secs(30));
    let ClaimOutcome::Acquired { fence } = store.claim(&request).await.unwrap() else {
        panic!("not acquired");
    };

    server.pause();
    for _ in 0..3 {
        let started = Instant::now();
        let result = store
            .claim(&claim_request("k-stalled", Duration::from_secs(30)))
            .await;
        let took = started.elapsed();
        assert!(
            matches!(result, Err(StoreError::Timeout { .. })),
            "expected a timeout, got {result:?}"
        );
        assert!(
            took < timeout + Duration::from_millis(300),
            "the timeout took {took:?}"
        );
    }

    server.resume();
    let lease = request.lease_with_fence(fence);
    let response = ok_response();
    let ownership = eventually(Duration::from_secs(10), "answering after a resume", || {
        store.complete(&lease, &response, Duration::from_secs(60))
    })
    .await;
    assert_eq!(ownership, Ownership::Held);
}

async fn unreadable_records_are_errors_that_name_the_record() {
    let url = redis_url();
    let store = store_on(&url);
    let mut admin = redis_connection(&url).await;
    let request = claim_request("k-corrupt", Duration::from_secs(30));
    let key = store.record_key(request.record());
    let fingerprint = &request.fingerprint().as_bytes()[..];

    // Records as the scripts write them: layout, state, fingerprint, owner, fence, response.
    let record = |layout: u8, state: u8, response: &[u8]| {
        let mut record = vec![layout, state];
        record.extend_from_slice(fingerprint);
        record.extend_from_slice(&[7; 16]);
        record.extend_from_slice(b"1795968561227110");
        record.extend_from_slice(response);
        record
    };
    let cases = [
        ("response", record(2, b'c', b"not a record")),
        ("state", record(2, b'x', b"")),
        ("version", record(1, b'i', b"")),
        ("length", b"short".to_vec()),
    ];
    for (what, value) in cases {
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(value)
            .query_async(&mut admin)
            .await
            .unwrap();

        match store.claim(&request).await {
            Err(error @ StoreError::Corrupt { .. }) => {
                let StoreError::Corrupt { record, .. } = &error else {
                    unreachable!()
                };
                assert_eq!(record.key().as_str(), "k-corrupt", "{what}");
                // Displayed, the key is a pseudonym: error messages end up in logs.
                let message = error.to_string();
                assert!(message.contains("key #"), "{what}: {message}");
                assert!(!message.contains("k-corrupt"), "{what}: {message}");
                let source = std::error::Error::source(&error).unwrap().to_string();
                assert!(!source.is_empty(), "{what}: no cause");
            }
            other => panic!("{what}: expected a corrupt-record error, got {other:?}"),
        }
    }
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
}

async fn stored_records_expire_with_redis_clocks() {
    let url = redis_url();
    let store = store_on(&url);
    let mut admin = redis_connection(&url).await;
    let request = claim_request("k-ttl", Duration::from_millis(5_000));
    let key = store.record_key(request.record());
    let ClaimOutcome::Acquired { fence } = store.claim(&request).await.unwrap() else {
        panic!("not acquired");
    };
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!((4_000..=5_000).contains(&pttl), "in-flight PTTL {pttl}");

    store
        .complete(
            &request.lease_with_fence(fence),
            &ok_response(),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        (3_590_000..=3_600_000).contains(&pttl),
        "completed PTTL {pttl}"
    );
}

async fn two_instances_on_one_redis_run_a_key_once() {
    let runs = Arc::new(AtomicUsize::new(0));
    let prefix = format!("test:{}:", Uuid::new_v4());
    let instance = || {
        let runs = Arc::clone(&runs);
        let store = RedisStore::open(&redis_url())
            .unwrap()
            .with_prefix(prefix.clone());
        Router::new()
            .route(
                "/pay",
                post(move || async move {
                    runs.fetch_add(1, SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    (StatusCode::CREATED, "paid")
                }),
            )
            .layer(IdempotencyLayer::new(store))
    };
    let instances = [instance(), instance()];
    let send = |i: usize| {
        let app = instances[i % 2].clone();
        async move {
            let request = http::Request::post("/pay")
                .header("idempotency-key", "k-fleet")
                .body(axum::body::Body::empty())
                .unwrap();
            let response = app.oneshot(request).await.unwrap();
            (
                response.status(),
                response
                    .headers()
                    .contains_key(tower_idempotency::headers::IDEMPOTENT_REPLAYED),
            )
        }
    };
    // The duplicates wait for the first and get its answer.
    let answers = futures_util::future::join_all((0..8).map(send)).await;
    assert!(
        answers.iter().all(|(s, _)| *s == StatusCode::CREATED),
        "{answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|(_, replayed)| !replayed).count(),
        1,
        "{answers:?}"
    );
    assert_eq!(runs.load(SeqCst), 1);
}

/// Pays on `app` with `key`: the status, whether the answer was a replay, and the body.
async fn pay(app: Router, key: &'static str) -> (StatusCode, bool, String) {
    let request = http::Request::post("/pay")
        .header("idempotency-key", key)
        .body(axum::body::Body::empty())
        .unwrap();
    let answer = support::call(&app, request).await;
    let body = String::from_utf8(answer.body.to_vec()).unwrap();
    (answer.status, answer.replayed(), body)
}

/// A claim without a script is three commands, pipelined: the `SET` that writes the record,
/// then the `PTTL` and the `TIME` that give its time left and its fence. A server that stalls
/// between them for longer than a lease lets a second instance take the key in between, with
/// a fence from an earlier clock: the first instance's grant comes late, is renewed before
/// anything runs under it, is found in the second's hands, and its request gets the second's
/// answer. The payment runs once.
async fn a_claim_stalled_inside_its_pipeline_past_a_lease_does_not_run() {
    let server = RedisServer::start().await;
    let holder = support::CommandHolder::start(server.port).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let prefix = format!("test:{}:", Uuid::new_v4());
    let lease = Duration::from_millis(600);
    let instance = |url: String, name: &'static str| {
        let runs = Arc::clone(&runs);
        let store = RedisStore::open(&url)
            .unwrap()
            .with_prefix(prefix.clone())
            // Longer than the stall: the claim is answered, late.
            .with_timeout(Duration::from_secs(10));
        Router::new()
            .route(
                "/pay",
                post(move || async move {
                    runs.fetch_add(1, SeqCst);
                    (StatusCode::CREATED, name)
                }),
            )
            .layer(IdempotencyLayer::new(store).with_lease(lease))
    };
    let stalled = instance(holder.url(), "paid on the stalled instance");
    let healthy = instance(server.url(), "paid on the healthy instance");
    // The stalled instance's connection is open, and it knows what the server offers.
    assert_eq!(pay(stalled.clone(), "k-warm").await.0, StatusCode::CREATED);
    runs.store(0, SeqCst);

    let held = holder.hold("PTTL", lease * 4);
    let first = tokio::spawn(pay(stalled, "k-stalled"));
    held.await;
    // The first claim's record is written: the second instance comes once its lease is over.
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let second = pay(healthy, "k-stalled").await;
    let paid = "paid on the healthy instance".to_owned();
    assert_eq!(second, (StatusCode::CREATED, false, paid.clone()));
    assert!(!first.is_finished(), "the stalled claim was answered early");
    assert_eq!(first.await.unwrap(), (StatusCode::CREATED, true, paid));
    assert_eq!(runs.load(SeqCst), 1, "the payment ran more than once");
}

/// A claim asked again by its owner (its first answer lost) finds the owner's record, with what
/// is left of the lease: if that runs out before the pipeline's `PTTL`, the record is gone when
/// the grant is given. The claim is asked once more in a transaction, which writes the record
/// afresh: the key is the owner's again for a whole lease, and nobody else's, and every lease of
/// the owner's holds it, also one that names the first record.
async fn an_owner_asking_again_as_its_record_expires_holds_the_key_again() {
    let server = RedisServer::start().await;
    let holder = support::CommandHolder::start(server.port).await;
    let prefix = format!("test:{}:", Uuid::new_v4());
    let open = |url: String| {
        RedisStore::open(&url)
            .unwrap()
            .with_prefix(prefix.clone())
            .with_timeout(Duration::from_secs(10))
    };
    let (stalled, direct) = (open(holder.url()), open(server.url()));
    let lease = Duration::from_secs(1);
    let request = claim_request("k-again", lease);
    support::acquire(&stalled, &request).await;

    // A lease made from the request as it was after the first grant: it names the first record.
    let first = request.clone();

    // Asked again with a little of the lease left, and held past it after the `SET`.
    tokio::time::sleep(lease - Duration::from_millis(200)).await;
    let held = holder.hold("PTTL", Duration::from_millis(800));
    let again = tokio::spawn({
        let stalled = stalled.clone();
        async move { (stalled.claim(&request).await.unwrap(), request) }
    });
    held.await;
    let (ClaimOutcome::Acquired { fence }, request) = again.await.unwrap() else {
        panic!("the owner asked again was not granted");
    };
    let other = direct
        .claim(&claim_request("k-again", lease))
        .await
        .unwrap();
    assert!(
        matches!(other, ClaimOutcome::InFlight { .. }),
        "another owner got {other:?} from a key granted again"
    );
    // The owner's leases hold the record written again, whichever record they name, on every
    // server: a lease naming the first is renewed (the script decides where `SET … IFEQ` finds
    // another record), the one naming the second completes it.
    let renewed = direct.renew(&first.lease_with_fence(fence), lease).await;
    assert_eq!(
        renewed.unwrap(),
        Ownership::Held,
        "the first record's lease"
    );
    let (held, response) = (request.lease_with_fence(fence), ok_response());
    let completed = direct.complete(&held, &response, Duration::from_secs(60));
    assert_eq!(completed.await.unwrap(), Ownership::Held);
}

/// A duplicate on another instance (another store object, with a listener of its own) is woken
/// the moment the first completes, without polling: the completion of the key it waits for
/// publishes once, and one of a key nobody waits for never. Its listener killed while it waits,
/// it listens again (and claims once more meanwhile), and is answered all the same.
async fn a_duplicate_elsewhere_is_woken_by_redis_and_a_key_nobody_waits_for_publishes_nothing() {
    let server = RedisServer::start().await;
    let prefix = format!("test:{}:", Uuid::new_v4());
    let store = || {
        RedisStore::open(&server.url())
            .unwrap()
            .with_prefix(prefix.clone())
    };
    let alone = Router::new().route(
        "/pay",
        post(|| async { (StatusCode::CREATED, "paid") })
            .route_layer(IdempotencyLayer::new(store())),
    );
    assert_eq!(pay(alone, "k-alone").await.0, StatusCode::CREATED);
    assert_eq!(
        server.calls("publish").await,
        0,
        "a key nobody waits for published"
    );

    let woken = support::duplicate_elsewhere((store(), store()), "k-waited", async || {}).await;
    woken.assert_woken(1, "k-waited");
    assert_eq!(
        server.calls("publish").await,
        1,
        "the waited key's end, told once"
    );

    let killed = support::duplicate_elsewhere((store(), store()), "k-killed", async || {
        let killed = kill_subscribers(&server).await;
        assert!(killed >= 1, "no listener to kill");
        // Listening again takes a reconnection.
        tokio::time::sleep(Duration::from_millis(500)).await;
    })
    .await;
    // Woken when its listener was lost (it claimed, and marked, again), then by the word.
    killed.assert_woken(2, "k-killed");
}

/// Kills the server's clients that are subscribed to a channel (`CLIENT KILL ID`): how many.
async fn kill_subscribers(server: &RedisServer) -> usize {
    let subscribed = server.subscribers().await;
    let mut admin = server.admin().await;
    for (id, _) in &subscribed {
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    subscribed.len()
}
