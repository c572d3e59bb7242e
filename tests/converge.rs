//! Every retry converges to the real answer: through the layer on real Postgres, with handlers
//! that block their worker, stores that refuse to finalize, and fences held open for longer
//! than the lease. Side effects are counted where they happen (a counter the handler bumps, rows
//! in a table), never from what the layer says.

mod support;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst},
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
use support::{Answer, Faulty, StoreFault, TestSchema, call};
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer, problem,
    store::{MemoryStore, PostgresStore},
};

fn main() -> std::process::ExitCode {
    support::run(crate::tests![
        multi(2):
            a_handler_that_blocks_its_worker_past_the_lease_keeps_its_key,
            a_store_that_cannot_finalize_keeps_the_key_until_it_can,
            a_store_slow_to_answer_renewals_keeps_the_key,
            a_live_owner_holding_its_fence_past_the_lease_is_never_reported_dead,
            a_handler_that_blocks_the_only_thread_of_its_runtime_keeps_its_key,
            a_handler_that_blocks_the_only_thread_of_its_runtime_keeps_its_key_behind_redis,
            a_claim_granted_while_the_runtime_is_blocked_never_runs_on_postgres,
            a_claim_granted_while_the_runtime_is_blocked_never_runs_behind_redis,
            a_claim_granted_while_the_runtime_is_blocked_never_runs_in_memory,
            a_fleet_blocking_its_runtimes_runs_each_key_once_on_postgres,
            a_fleet_blocking_its_runtimes_runs_each_key_once_behind_redis,
            a_claim_whose_reply_was_lost_is_served_at_once,
            a_claim_that_timed_out_after_the_store_took_it_is_released;
    ])
}

fn post_key(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap()
}

/// Side effects per key, counted by the handler itself.
#[derive(Clone, Default)]
struct Effects(Arc<Mutex<HashMap<String, u32>>>);

impl Effects {
    fn add(&self, key: &str) -> u32 {
        let mut effects = self.0.lock().unwrap();
        let count = effects.entry(key.to_owned()).or_default();
        *count += 1;
        *count
    }

    fn of(&self, key: &str) -> u32 {
        self.0.lock().unwrap().get(key).copied().unwrap_or_default()
    }
}

async fn a_handler_that_blocks_its_worker_past_the_lease_keeps_its_key() {
    let schema = TestSchema::new().await;
    // Renewed every 100 ms: a renewal task that kept its own worker loses the key only if it
    // is starved for 300 ms, which a loaded CI machine did to a 150 ms lease.
    let lease = Duration::from_millis(300);
    let effects = Effects::default();
    // Synchronous work that holds the worker thread: no await for 800 ms.
    let layer = IdempotencyLayer::new(PostgresStore::new(schema.pool.clone())).with_lease(lease);
    let app = blocking_app(&layer, &effects, Duration::from_millis(800));

    let keys = 20;
    let mut second_runs = 0;
    for i in 0..keys {
        let key = format!("blocking-{i}");
        let first = tokio::spawn({
            let (app, key) = (app.clone(), key.clone());
            async move { call(&app, post_key(&key)).await }
        });
        // Past the lease while the first handler still blocks its worker.
        tokio::time::sleep(lease + Duration::from_millis(100)).await;
        let retry = call(&app, post_key(&key)).await;
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        second_runs += effects.of(&key) - 1;
    }
    println!(
        "blocking handler (800 ms, lease 300 ms, 2 workers): {keys} keys, second executions of \
         an unfenced side effect {second_runs}"
    );
    assert_eq!(second_runs, 0);
    schema.drop().await;
}

async fn a_store_that_cannot_finalize_keeps_the_key_until_it_can() {
    let schema = TestSchema::new().await;
    let failing = Arc::new(AtomicBool::new(true));
    let store = Faulty {
        inner: PostgresStore::new(schema.pool.clone()),
        fault: StoreFault::FailingCompletes(Arc::clone(&failing)),
    };
    // Renewed every 100 ms: the key is lost only if the renewals stall for a whole 300 ms. A
    // 200 ms lease once ran out on a loaded CI machine (a retry ran the handler again).
    let lease = Duration::from_millis(300);
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store)
        .with_lease(lease)
        .with_wait(Duration::ZERO);
    let app = counting_app(&layer, &effects, Duration::ZERO);

    let first = call(&app, post_key("k-finalize")).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the caller gets its answer"
    );
    // Two leases and more with the store refusing to complete: retries never run it again.
    let started = Instant::now();
    let mut conflicts = 0;
    while started.elapsed() < 2 * lease + Duration::from_millis(200) {
        let retry = call(&app, post_key("k-finalize")).await;
        let seen = layer.counters().snapshot();
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?} {seen:?}");
        conflicts += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    failing.store(false, SeqCst);
    let replay = eventually_replayed(&app, "k-finalize").await;
    assert_eq!(replay.body, first.body);
    println!(
        "complete failing for {:?} (lease {lease:?}): {conflicts} retries answered 409, \
         executions {}, then completed",
        started.elapsed(),
        effects.of("k-finalize")
    );
    assert_eq!(effects.of("k-finalize"), 1);
    assert_eq!(layer.counters().snapshot().finalize_errors, 1);
    schema.drop().await;
}

async fn a_store_slow_to_answer_renewals_keeps_the_key() {
    // Each renewal answers 1.2 s after the store renewed, 0.8 of the lease. Renewals counted
    // from the late answers would be 1.13 leases apart (200 ms without a lease, each time);
    // counted from when each started, the next one follows the answer at once, 300 ms early.
    let lease = Duration::from_millis(1500);
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::LateRenewals(Duration::from_millis(1200)),
    };
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store)
        .with_lease(lease)
        .with_wait(Duration::ZERO);
    let app = counting_app(&layer, &effects, Duration::from_secs(4));

    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app, post_key("k-slow")).await }
    });
    let started = Instant::now();
    let mut conflicts = 0;
    while started.elapsed() < Duration::from_millis(3800) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let retry = call(&app, post_key("k-slow")).await;
        let seen = layer.counters().snapshot();
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?} {seen:?}");
        conflicts += 1;
    }
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = eventually_replayed(&app, "k-slow").await;
    assert_eq!(replay.body, first.body);
    println!(
        "renewals answering 1.2 s late (lease {lease:?}), handler 4 s: {conflicts} retries \
         answered 409, executions {}",
        effects.of("k-slow")
    );
    assert_eq!(effects.of("k-slow"), 1);
    assert_eq!(layer.counters().snapshot().leases_lost, 0);
}

/// The payments route behind `layer`: after `work`, the handler counts an effect for its key
/// and answers with the count.
fn counting_app(layer: &IdempotencyLayer, effects: &Effects, work: Duration) -> Router {
    let handler = move |State(effects): State<Effects>, claim: IdempotencyClaim| async move {
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        let count = effects.add(claim.key().as_str());
        (StatusCode::CREATED, format!("effect {count}"))
    };
    Router::new()
        .route("/payments", post(handler))
        .layer(layer.clone())
        .with_state(effects.clone())
}

/// The payments route behind `layer`, whose handler blocks its thread for `block` (synchronous
/// work: no await), then counts an effect for its key and answers with the count.
fn blocking_app(layer: &IdempotencyLayer, effects: &Effects, block: Duration) -> Router {
    let handler = move |State(effects): State<Effects>, claim: IdempotencyClaim| async move {
        std::thread::sleep(block);
        let count = effects.add(claim.key().as_str());
        (StatusCode::CREATED, format!("effect {count}"))
    };
    Router::new()
        .route("/payments", post(handler))
        .layer(layer.clone())
        .with_state(effects.clone())
}

async fn eventually_replayed(app: &Router, key: &str) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = call(app, post_key(key)).await;
        if answer.replayed() {
            return answer;
        }
        assert_eq!(answer.status, StatusCode::CONFLICT, "{answer:?}");
        assert!(Instant::now() < deadline, "never replayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A payment handler in the example's order: the fence first, then slow work inside the
/// transaction (longer than the lease), then a pause after the commit before the answer.
#[derive(Clone)]
struct Slow {
    pool: sqlx::PgPool,
    runs: Arc<AtomicUsize>,
    work: Duration,
    pause_after_commit: Duration,
}

async fn slow_payment(State(app): State<Slow>, claim: IdempotencyClaim) -> Response {
    let run = app.runs.fetch_add(1, SeqCst) + 1;
    let mut tx = app.pool.begin().await.unwrap();
    claim.commit(&mut tx).await.unwrap();
    tokio::time::sleep(app.work).await;
    sqlx::query("INSERT INTO payments (key, run) VALUES ($1, $2)")
        .bind(claim.key().as_str())
        .bind(run as i32)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    tokio::time::sleep(app.pause_after_commit).await;
    (StatusCode::CREATED, format!("payment {run}")).into_response()
}

async fn a_live_owner_holding_its_fence_past_the_lease_is_never_reported_dead() {
    let schema = TestSchema::new().await;
    sqlx::query("CREATE TABLE payments (key text NOT NULL, run int NOT NULL)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let state = Slow {
        pool: schema.pool.clone(),
        runs: Arc::default(),
        work: Duration::from_secs(2),
        pause_after_commit: Duration::from_millis(300),
    };
    let lease = Duration::from_millis(500);
    let instance = |wait: Duration| {
        Router::new()
            .route("/payments", post(slow_payment))
            .layer(
                IdempotencyLayer::new(PostgresStore::new(schema.pool.clone()))
                    .with_lease(lease)
                    .with_wait(wait),
            )
            .with_state(state.clone())
    };
    let owner = instance(Duration::ZERO);
    let impatient = instance(Duration::ZERO);
    let patient = instance(Duration::from_secs(10));

    let first = tokio::spawn({
        let owner = owner.clone();
        async move { call(&owner, post_key("k-slow-fence")).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = tokio::spawn({
        let patient = patient.clone();
        async move { call(&patient, post_key("k-slow-fence")).await }
    });
    // Duplicates every 50 ms on another instance, until one is the replay.
    let mut answers: HashMap<String, usize> = HashMap::new();
    let replay = loop {
        let answer = call(&impatient, post_key("k-slow-fence")).await;
        if answer.replayed() {
            break answer;
        }
        let kind = answer.problem_type();
        *answers.entry(kind).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let first = first.await.unwrap();
    let waited = waiting.await.unwrap();
    println!(
        "fence first, 2 s of work in the transaction (lease {lease:?}), 300 ms pause after \
         commit: duplicates answered {answers:?} before the replay"
    );
    assert_eq!(
        answers.get(problem::OUTCOME_UNKNOWN),
        None,
        "a live owner was reported dead: {answers:?}"
    );
    assert!(answers[problem::IN_FLIGHT] > 10, "{answers:?}");
    assert_eq!(first.body, "payment 1");
    assert_eq!(replay.body, "payment 1");
    assert!(waited.replayed());
    assert_eq!(waited.body, "payment 1");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
    assert_eq!(state.runs.load(SeqCst), 1);
    schema.drop().await;
}

/// A handler that blocks the only thread of its runtime (a current-thread runtime, where the
/// renewals used to run too) for longer than the lease keeps its key: a retry on another
/// instance waits for its answer instead of running it a second time.
async fn a_handler_that_blocks_the_only_thread_of_its_runtime_keeps_its_key() {
    let schema = TestSchema::new().await;
    let postgres = PostgresStore::new(schema.pool.clone());
    blocks_the_only_thread("Postgres", move || Arc::new(postgres.clone())).await;
    schema.drop().await;
}

async fn a_handler_that_blocks_the_only_thread_of_its_runtime_keeps_its_key_behind_redis() {
    let schema = TestSchema::new().await;
    let redis = support::RedisServer::start().await;
    let (postgres, url) = (PostgresStore::new(schema.pool.clone()), redis.url());
    blocks_the_only_thread("Redis in front of Postgres", move || {
        let redis = tower_idempotency::store::RedisStore::open(&url).unwrap();
        Arc::new(tower_idempotency::store::TieredStore::new(
            redis,
            postgres.clone(),
        ))
    })
    .await;
    schema.drop().await;
}

/// Instance A on a current-thread runtime of its own, whose handler blocks that thread for 2 s;
/// instance B retries each key past A's lease. Counts the second executions.
async fn blocks_the_only_thread(
    stores: &str,
    store: impl Fn() -> Arc<dyn tower_idempotency::store::Store>,
) {
    let lease = Duration::from_millis(800);
    let effects = Effects::default();
    // Synchronous work that holds the runtime's only thread for 2 s.
    let app = |effects: Effects| {
        let layer = IdempotencyLayer::from_shared_store(store()).with_lease(lease);
        blocking_app(&layer, &effects, Duration::from_secs(2))
    };
    // Instance A: a current-thread runtime of its own, serving over TCP.
    let url = serve_on_a_runtime_of_its_own(app(effects.clone()), Flavor::CurrentThread);
    // Instance B: on this runtime, a layer of its own on the same store.
    let instance_b = app(effects.clone());
    let keys = 3;
    let mut second_runs = 0;
    for i in 0..keys {
        let key = format!("only-thread-{i}-{}", uuid::Uuid::new_v4().simple());
        // The retry comes past the lease while A's only thread is blocked.
        let (first, retry) = first_then_retry(&url, &instance_b, &key, lease).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        second_runs += effects.of(&key) - 1;
    }
    println!(
        "{stores}: a handler blocking its runtime's only thread for 2 s (lease 800 ms): {keys} \
         keys, second executions {second_runs}"
    );
    assert_eq!(second_runs, 0);
}

/// Sends `key` to instance A at `url`, then, 400 ms past `lease`, to `instance_b`: A's answer
/// and B's.
async fn first_then_retry(
    url: &str,
    instance_b: &Router,
    key: &str,
    lease: Duration,
) -> (Answer, Answer) {
    let first = tokio::spawn({
        let (url, key) = (url.to_owned(), key.to_owned());
        async move {
            let headers = [("idempotency-key", key.as_str())];
            support::send(http::Method::POST, &url, &headers, "").await
        }
    });
    tokio::time::sleep(lease + Duration::from_millis(400)).await;
    let retry = call(instance_b, post_key(key)).await;
    (first.await.unwrap().unwrap(), retry)
}

/// A store of its own for each instance that calls it, on `schema`: Postgres alone, or behind
/// the Redis at `redis`. Connections made on one instance's runtime would stall with it, which
/// is no instance's fate in a fleet.
fn stores<'a>(
    schema: &'a TestSchema,
    redis: Option<&'a str>,
) -> impl Fn() -> Arc<dyn tower_idempotency::store::Store> + 'a {
    move || {
        let postgres = PostgresStore::new(schema.pool.clone());
        match redis {
            None => Arc::new(postgres),
            Some(url) => {
                let redis = tower_idempotency::store::RedisStore::open(url).unwrap();
                Arc::new(tower_idempotency::store::TieredStore::new(redis, postgres))
            }
        }
    }
}

/// The runtime an instance runs on.
#[derive(Debug, Clone, Copy)]
enum Flavor {
    CurrentThread,
    MultiThread,
}

/// Serves `app` over TCP from a thread with a runtime of its own (an instance the test's
/// runtime cannot help or hinder): the URL of its payments route.
fn serve_on_a_runtime_of_its_own(app: Router, flavor: Flavor) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}/payments", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let runtime = match flavor {
            Flavor::CurrentThread => tokio::runtime::Builder::new_current_thread(),
            Flavor::MultiThread => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(2);
                builder
            }
        }
        .enable_all()
        .build()
        .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    url
}

/// The store grants instance A a key while A's runtime is blocked (2 s, lease 800 ms), so A
/// sees the grant only after its lease ran out; instance B retries the key meanwhile and runs
/// it. A must not act on its lapsed grant: the handler's effect happens once, and A's caller
/// gets the key's answer (B's). Before grants were checked at the start of the work, A ran the
/// handler a second time on every key. `store` makes each instance a store of its own.
async fn a_grant_seen_after_its_lease(
    stores: &str,
    store: impl Fn() -> Arc<dyn tower_idempotency::store::Store>,
    flavor: Flavor,
) {
    let lease = Duration::from_millis(800);
    let effects = Effects::default();
    let armed = Arc::new(AtomicBool::new(false));
    let blocked = Faulty {
        inner: store(),
        fault: StoreFault::BlockedAfterGrant {
            armed: Arc::clone(&armed),
            pause: Duration::from_secs(2),
        },
    };
    let layer_a = IdempotencyLayer::new(blocked).with_lease(lease);
    let url =
        serve_on_a_runtime_of_its_own(counting_app(&layer_a, &effects, Duration::ZERO), flavor);
    let layer_b = IdempotencyLayer::from_shared_store(store()).with_lease(lease);
    let instance_b = counting_app(&layer_b, &effects, Duration::ZERO);
    let keys = 3;
    let mut second_runs = 0;
    for i in 0..keys {
        let key = format!("lapsed-{i}-{}", uuid::Uuid::new_v4().simple());
        armed.store(true, SeqCst);
        // The retry comes past A's lease while A's runtime is still blocked on the grant.
        let (first, retry) = first_then_retry(&url, &instance_b, &key, lease).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert_eq!(first.body, retry.body, "A's caller gets the key's answer");
        second_runs += effects.of(&key) - 1;
    }
    let lapsed = layer_a.counters().snapshot().grants_lapsed;
    println!(
        "{stores}, {flavor:?}: a claim granted while the runtime was blocked 2 s (lease 800 ms): \
         {keys} keys, second executions {second_runs}, grants given up {lapsed}"
    );
    assert_eq!(second_runs, 0);
    assert_eq!(lapsed, keys as u64);
    assert_eq!(layer_a.counters().snapshot().leases_lost, 0, "no work ran");
}

async fn a_claim_granted_while_the_runtime_is_blocked_never_runs_on_postgres() {
    let schema = TestSchema::new().await;
    for flavor in [Flavor::CurrentThread, Flavor::MultiThread] {
        a_grant_seen_after_its_lease("Postgres", stores(&schema, None), flavor).await;
    }
    schema.drop().await;
}

async fn a_claim_granted_while_the_runtime_is_blocked_never_runs_behind_redis() {
    let schema = TestSchema::new().await;
    let redis = support::RedisServer::start().await;
    let (url, name) = (redis.url(), "Redis in front of Postgres");
    for flavor in [Flavor::CurrentThread, Flavor::MultiThread] {
        a_grant_seen_after_its_lease(name, stores(&schema, Some(&url)), flavor).await;
    }
    schema.drop().await;
}

async fn a_claim_granted_while_the_runtime_is_blocked_never_runs_in_memory() {
    let memory = MemoryStore::new();
    for flavor in [Flavor::CurrentThread, Flavor::MultiThread] {
        let store = || Arc::new(memory.clone()) as Arc<dyn tower_idempotency::store::Store>;
        a_grant_seen_after_its_lease("memory", store, flavor).await;
    }
}

/// The run that found lapsed grants, on two instances: handlers that block their runtime's
/// only thread for 2 s (lease 800 ms), and every key sent to both instances at once. Claims
/// answered while an instance's thread is blocked reach it after their lease ran out; none
/// may run then if the other instance took the key. Every key runs once.
async fn a_fleet_blocking_its_runtimes(
    stores: &str,
    store: impl Fn() -> Arc<dyn tower_idempotency::store::Store>,
) {
    let lease = Duration::from_millis(800);
    let effects = Effects::default();
    let layers: Vec<_> = (0..2)
        .map(|_| {
            IdempotencyLayer::from_shared_store(store())
                .with_lease(lease)
                .with_wait(Duration::from_secs(60))
        })
        .collect();
    let urls: Vec<_> = layers
        .iter()
        .map(|layer| {
            let app = blocking_app(layer, &effects, Duration::from_secs(2));
            serve_on_a_runtime_of_its_own(app, Flavor::CurrentThread)
        })
        .collect();
    let keys: Vec<_> = (0..6)
        .map(|i| format!("blocked-fleet-{i}-{}", uuid::Uuid::new_v4().simple()))
        .collect();
    let mut calls = Vec::new();
    for key in &keys {
        for url in &urls {
            let (url, key) = (url.clone(), key.clone());
            calls.push(tokio::spawn(
                async move { until_answered(&url, &key).await },
            ));
        }
    }
    let mut refused = 0;
    for call in calls {
        let (answer, retries) = call.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        refused += retries;
    }
    let second_runs: u32 = keys.iter().map(|key| effects.of(key) - 1).sum();
    let lapsed: u64 = layers
        .iter()
        .map(|layer| layer.counters().snapshot().grants_lapsed)
        .sum();
    println!(
        "{stores}: 2 instances whose handlers block their only thread 2 s (lease 800 ms), {} \
         keys sent to both at once: second executions {second_runs}, grants given up {lapsed}, \
         answers retried (503 or 409) {refused}",
        keys.len()
    );
    assert_eq!(second_runs, 0);
}

/// Sends `key` to `url` as a client would, again after the `Retry-After` of a 503 (a claim
/// that timed out on a blocked runtime) or a 409 (in flight), for up to a minute: the answer,
/// and how many times it was sent again.
async fn until_answered(url: &str, key: &str) -> (Answer, u32) {
    let headers = [("idempotency-key", key)];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut retries = 0;
    loop {
        let answer = support::send(http::Method::POST, url, &headers, "")
            .await
            .unwrap();
        let again = [StatusCode::SERVICE_UNAVAILABLE, StatusCode::CONFLICT];
        if !again.contains(&answer.status) || Instant::now() > deadline {
            return (answer, retries);
        }
        let after = answer.headers.get("retry-after");
        let after = after
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .unwrap_or(1);
        tokio::time::sleep(Duration::from_secs(after)).await;
        retries += 1;
    }
}

async fn a_fleet_blocking_its_runtimes_runs_each_key_once_on_postgres() {
    let schema = TestSchema::new().await;
    a_fleet_blocking_its_runtimes("Postgres", stores(&schema, None)).await;
    schema.drop().await;
}

async fn a_fleet_blocking_its_runtimes_runs_each_key_once_behind_redis() {
    let schema = TestSchema::new().await;
    let redis = support::RedisServer::start().await;
    let url = redis.url();
    let store = stores(&schema, Some(&url));
    a_fleet_blocking_its_runtimes("Redis in front of Postgres", store).await;
    schema.drop().await;
}

/// A claim the store applied whose reply was lost in transit (a proxy between the layer and
/// the store lets the claim through, drops the reply and closes the connection) does not lock
/// its own caller out: the layer asks the store again as the same owner, which hands the claim
/// over, or releases it, so the first request runs, or its retry does at once. It was a 503 and
/// then 409 "still being processed" on every retry for the whole lease, though nothing ran, on
/// Redis alone, Postgres alone and Redis in front of Postgres. Counted where it happens: the
/// handler ran once per key, and a reply was really cut.
async fn a_claim_whose_reply_was_lost_is_served_at_once() {
    use redis::{ConnectionAddr, IntoConnectionInfo};
    use support::{ReplyCutter, redis_url};
    use tower_idempotency::store::{RedisStore, Store, TieredStore};

    let schema = TestSchema::new().await;
    // The servers REDIS_URL and DATABASE_URL name, reached through the proxy with their
    // credentials, database and (for Postgres) the test's schema.
    let redis_info = redis_url().into_connection_info().unwrap();
    let ConnectionAddr::Tcp(redis_host, redis_port) = redis_info.addr().clone() else {
        panic!("REDIS_URL is not a TCP address: {redis_info:?}");
    };
    let postgres = (*schema.pool.connect_options()).clone();
    let prefix = format!("test:{}:", uuid::Uuid::new_v4());
    for setup in ["redis", "postgres", "redis-in-front-of-postgres"] {
        let cutter = match setup {
            "redis" => ReplyCutter::start(&redis_host, redis_port).await,
            _ => ReplyCutter::start(postgres.get_host(), postgres.get_port()).await,
        };
        let redis = || {
            let info = match setup {
                "redis" => redis_info
                    .clone()
                    .set_addr(ConnectionAddr::Tcp("127.0.0.1".into(), cutter.port)),
                _ => redis_info.clone(),
            };
            let client = redis::Client::open(info).unwrap();
            RedisStore::new(client).with_prefix(format!("{prefix}{setup}:"))
        };
        let through = async || {
            let options = postgres.clone().host("127.0.0.1").port(cutter.port);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .connect_with(options)
                .await
                .unwrap();
            PostgresStore::new(pool)
        };
        let store: std::sync::Arc<dyn Store> = match setup {
            "redis" => std::sync::Arc::new(redis()),
            "postgres" => std::sync::Arc::new(through().await),
            _ => std::sync::Arc::new(TieredStore::new(redis(), through().await)),
        };
        let effects = Effects::default();
        let layer = IdempotencyLayer::new(store).with_wait(Duration::from_secs(2));
        let app = counting_app(&layer, &effects, Duration::ZERO);
        // The store's connections are open before the cut.
        let warm = format!("{setup}-warm");
        let warmed = call(&app, post_key(&warm)).await;
        assert_eq!(warmed.status, StatusCode::CREATED, "{setup}: {warmed:?}");

        let key = format!("{setup}-lost");
        cutter.arm();
        let first = call(&app, post_key(&key)).await;
        assert_eq!(cutter.cut(), 1, "{setup}: no reply was cut");
        let first_status = first.status;
        let answer = match first_status {
            StatusCode::SERVICE_UNAVAILABLE => call(&app, post_key(&key)).await,
            _ => first,
        };
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{setup}: first {first_status}, then {answer:?}"
        );
        assert_eq!(effects.of(&key), 1, "{setup}: runs of the key");
        println!("{setup}: a claim's reply cut: the first request {first_status}, served");
    }
    schema.drop().await;
}

/// A claim the store applied though its caller was told it timed out: the layer answers 503
/// and releases the claim (owner-checked, in the background), so the retry runs at once
/// instead of waiting out the lease of a claim nobody acts on. It was 409 "still being
/// processed" until the lease ended. Counted at the handler: the key ran once.
async fn a_claim_that_timed_out_after_the_store_took_it_is_released() {
    let armed = Arc::new(AtomicBool::new(true));
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::TimedOutAfterApplying(armed.clone()),
    };
    let effects = Effects::default();
    let layer = IdempotencyLayer::new(store).with_wait(Duration::from_secs(2));
    let app = counting_app(&layer, &effects, Duration::ZERO);
    let first = call(&app, post_key("k-timed-out")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE, "{first:?}");
    assert!(
        !armed.load(SeqCst),
        "the claim was not the one that timed out"
    );
    let retry = call(&app, post_key("k-timed-out")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert_eq!(effects.of("k-timed-out"), 1);
}
