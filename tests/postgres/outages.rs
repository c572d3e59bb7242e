//! Postgres down, busy, restarted and failed over under load: 503s while it is away, nothing run twice, service back when it answers.

use super::*;

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

pub(crate) async fn a_database_that_is_down_means_503_and_no_execution_until_it_returns() {
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
        replay.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true",
        "the completed key was lost"
    );
    assert_eq!(runs.load(SeqCst), 2);
}

pub(crate) async fn busy_store_connections_are_a_fast_503_and_the_application_pool_is_untouched() {
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

pub(crate) async fn a_claim_the_client_gave_up_on_never_acquires_later() {
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

/// Postgres terminates the store's connections (as a restart or a failover does) and answers
/// again at once: the next claims all succeed. A connection that failed with "terminating
/// connection due to administrator command" was taken back as still usable (a database error),
/// failed again with EOF, and most of the next new keys got 503.
pub(crate) async fn terminated_connections_are_never_lent_again_and_claims_go_on() {
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
pub(crate) async fn a_postgres_restart_under_load_runs_nothing_twice_and_503s_end_when_it_answers()
{
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
pub(crate) async fn a_postgres_failover_under_load_runs_nothing_twice_and_503s_end_when_it_answers()
{
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

/// A server with every connection slot taken by other processes ("too many clients") is
/// backpressure: a claim waits for a slot, within the store's timeout, and acquires once one is
/// free. It failed at once with "sorry, too many clients already", answered 503.
pub(crate) async fn a_server_out_of_connections_is_waited_for_within_the_timeout() {
    use sqlx::Connection;
    let mut cluster = PgCluster::start().await;
    let mut admin = sqlx::PgConnection::connect(&cluster.url()).await.unwrap();
    for setting in [
        "ALTER SYSTEM SET max_connections = 6",
        "ALTER SYSTEM SET superuser_reserved_connections = 0",
    ] {
        sqlx::query(setting).execute(&mut admin).await.unwrap();
    }
    drop(admin);
    cluster.restart_server().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&cluster.url())
        .await
        .unwrap();
    let store = PostgresStore::new(pool)
        .with_timeout(Duration::from_secs(5))
        .with_max_connections(2);
    store.migrate().await.unwrap();
    // Every other slot taken, as by other instances of the application.
    let mut others = Vec::new();
    while let Ok(connection) = sqlx::PgConnection::connect(&cluster.url()).await {
        others.push(connection);
    }
    assert!(!others.is_empty(), "the server took every connection");
    let claim = tokio::spawn({
        let store = store.clone();
        async move {
            let started = Instant::now();
            let outcome = store.claim(&claim_request("k-crowded", LONG)).await;
            (outcome, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!claim.is_finished(), "the claim did not wait for a slot");
    drop(others.pop());
    let (outcome, waited) = claim.await.unwrap();
    assert!(
        matches!(outcome, Ok(ClaimOutcome::Acquired { .. })),
        "{outcome:?}"
    );
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    drop(others);
}
