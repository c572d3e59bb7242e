//! The completer: a key abandoned mid-way (its attempt gave up with progress recorded, or
//! committed without an answer) and retried by nobody is finished by the fleet, once, with the
//! guarantees of a retry. Counted in the business table and at the (mock) provider.

use std::collections::HashMap;

use axum::routing::get;
use bytes::Bytes;
use tower_idempotency::completer::KeptRequests;

use super::*;

/// A two-step payment handler: step 1 records the intent and a recovery point; the provider
/// is called with no transaction open; step 3 records the charge and the answer, fenced. The
/// provider fails the first call for each key (the attempt then gives up with 502, its progress
/// kept, as an instance that dies between the steps leaves it), and counts its charges.
#[derive(Clone)]
struct Payments {
    pool: PgPool,
    /// Charges per key, at the provider.
    charges: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    /// Provider calls that failed, per key: the first `failures` of each key fail.
    failed: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    failures: usize,
    /// A pause before the provider, on resumed attempts.
    pause: Duration,
}

impl Payments {
    async fn new(schema: &TestSchema, pause: Duration) -> Self {
        sqlx::query(
            "CREATE TABLE payments (id text PRIMARY KEY, key text UNIQUE NOT NULL, \
             status text NOT NULL, body text NOT NULL)",
        )
        .execute(&schema.pool)
        .await
        .unwrap();
        Self {
            pool: schema.pool.clone(),
            charges: Arc::default(),
            failed: Arc::default(),
            failures: 1,
            pause,
        }
    }

    fn charges(&self) -> HashMap<String, usize> {
        self.charges.lock().unwrap().clone()
    }

    /// Payment rows by status.
    async fn rows(&self, status: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE status = $1")
            .bind(status)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

async fn pay(State(app): State<Payments>, claim: IdempotencyClaim, body: Bytes) -> Response {
    let key = claim.key().as_str().to_owned();
    let mut connection = app.pool.acquire().await.unwrap();
    let resumed = claim.recovery_point(&mut connection).await.unwrap();
    drop(connection);
    let id = match &resumed {
        Some(point) => point.payload()["id"].as_str().unwrap().to_owned(),
        None => {
            let id = format!("pay_{}", Uuid::new_v4().simple());
            let mut tx = app.pool.begin().await.unwrap();
            sqlx::query(
                "INSERT INTO payments (id, key, status, body) VALUES ($1, $2, 'pending', $3)",
            )
            .bind(&id)
            .bind(&key)
            .bind(String::from_utf8_lossy(&body).into_owned())
            .execute(&mut *tx)
            .await
            .unwrap();
            let progress = serde_json::json!({ "id": id });
            claim
                .advance(&mut tx, "intent_recorded", &progress)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            id
        }
    };
    let failed = *app
        .failed
        .lock()
        .unwrap()
        .entry(key.clone())
        .and_modify(|n| *n += 1)
        .or_insert(1);
    if failed <= app.failures {
        return (StatusCode::BAD_GATEWAY, "the provider timed out").into_response();
    }
    if resumed.is_some() {
        tokio::time::sleep(app.pause).await;
    }
    *app.charges.lock().unwrap().entry(key).or_default() += 1;
    let answer = serde_json::json!({ "id": id, "request": String::from_utf8_lossy(&body) });
    let response = http::Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .body(Bytes::from(answer.to_string()))
        .unwrap();
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("UPDATE payments SET status = 'succeeded' WHERE id = $1")
        .bind(&id)
        .execute(&mut *tx)
        .await
        .unwrap();
    claim
        .commit_with_response(&mut tx, &response)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    response.map(Body::from)
}

/// An instance of the payment API: its layer (requests kept for the completer) and router.
fn instance(store: &PostgresStore, app: &Payments) -> (IdempotencyLayer, Router) {
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .with_kept_requests(KeptRequests::new());
    let router = Router::new()
        .route("/pay", post(pay).route_layer(layer.clone()))
        .route("/health", get(|| async { "ok" }))
        .with_state(app.clone());
    (layer, router)
}

fn payment(key: &str, credentials: &str, body: &'static str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .header("authorization", credentials)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap()
}

/// A payment whose attempt gave up after its first step, and that nobody retries, is resumed
/// by the completer: charged once, its row `succeeded`, the handler given the original body
/// under the original scope (the caller's credentials were not kept; the scope came with the
/// key). A retry arriving while the completer runs it waits and gets that same answer, and so
/// does a later one. Before the completer, the payment stayed `pending`.
pub(crate) async fn the_completer_finishes_a_payment_nobody_retried_once_with_a_retrys_guarantees()
{
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let app = Payments::new(&schema, Duration::from_millis(500)).await;
    let (layer, router) = instance(&store, &app);
    const BODY: &str = r#"{"amount_cents":4900}"#;

    let first = router
        .clone()
        .oneshot(payment("k-1", "Bearer alice", BODY))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        (app.rows("pending").await, app.rows("succeeded").await),
        (1, 0)
    );

    let mut completer = layer.completer(router.clone());
    let running = tokio::spawn(async move { completer.run_once().await });
    // A retry arrives while the completer's attempt runs (it pauses 500 ms before charging).
    tokio::time::sleep(Duration::from_millis(150)).await;
    let retry = router
        .clone()
        .oneshot(payment("k-1", "Bearer alice", BODY))
        .await
        .unwrap();
    let round = running.await.unwrap().unwrap();
    assert_eq!(
        (round.found, round.finished, round.failed),
        (1, 1, 0),
        "{round:?}"
    );

    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(
        retry.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let retried: serde_json::Value =
        serde_json::from_slice(&retry.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(
        retried["request"], BODY,
        "the completer resumed with the original body"
    );
    let id: String = sqlx::query_scalar("SELECT id FROM payments WHERE key = 'k-1'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(retried["id"], id.as_str());
    assert_eq!(
        (app.rows("pending").await, app.rows("succeeded").await),
        (0, 1)
    );
    assert_eq!(app.charges()["k-1"], 1);

    // A later retry is replayed; nothing is left for the completer.
    let later = router
        .clone()
        .oneshot(payment("k-1", "Bearer alice", BODY))
        .await
        .unwrap();
    assert_eq!(
        later.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let round = layer.completer(router).run_once().await.unwrap();
    assert_eq!(round.found, 0, "{round:?}");
    assert_eq!(app.charges()["k-1"], 1);
    schema.drop().await;
}

/// Four instances, each with its completer, all running at once over 12 abandoned payments:
/// every payment is finished, and charged once.
pub(crate) async fn completers_on_four_instances_finish_each_key_once() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let app = Payments::new(&schema, Duration::from_millis(50)).await;
    let instances: Vec<_> = (0..4).map(|_| instance(&store, &app)).collect();
    for n in 0..12 {
        let router = instances[n % 4].1.clone();
        let given_up = router
            .oneshot(payment(
                &format!("k-{n}"),
                "Bearer bob",
                r#"{"amount_cents":100}"#,
            ))
            .await
            .unwrap();
        assert_eq!(given_up.status(), StatusCode::BAD_GATEWAY);
    }
    assert_eq!(app.rows("pending").await, 12);

    let started = Instant::now();
    while app.rows("succeeded").await < 12 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "not all finished"
        );
        let rounds = instances.iter().map(|(layer, router)| {
            let mut completer = layer.completer(router.clone());
            async move { completer.run_once().await.unwrap() }
        });
        futures_util::future::join_all(rounds).await;
    }
    let charges = app.charges();
    assert_eq!(charges.len(), 12);
    assert!(charges.values().all(|&n| n == 1), "{charges:?}");
    assert_eq!(app.rows("pending").await, 0);
    schema.drop().await;
}

/// A route that keeps no requests cannot be resumed: the completer leaves the key alone (the
/// handler never runs again) and says why on it, in the admin listing.
pub(crate) async fn a_key_without_a_kept_request_is_left_alone_and_said_why() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let app = Payments::new(&schema, Duration::ZERO).await;
    let layer = IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(300));
    let router = Router::new()
        .route("/pay", post(pay).route_layer(layer.clone()))
        .with_state(app.clone());
    let given_up = router
        .clone()
        .oneshot(payment("k-unkept", "Bearer c", "{}"))
        .await
        .unwrap();
    assert_eq!(given_up.status(), StatusCode::BAD_GATEWAY);

    let round = layer.completer(router).run_once().await.unwrap();
    assert_eq!(
        (round.found, round.finished, round.failed),
        (1, 0, 1),
        "{round:?}"
    );
    assert!(app.charges().is_empty(), "the handler ran again");
    let stuck = store.stuck(Duration::ZERO, 10).await.unwrap();
    let why = stuck[0].unfinished.as_deref().unwrap_or_default();
    assert!(why.contains("no request kept"), "{why:?}");
    // The doctor counts it among the keys noted unfinished.
    let diagnosis = store.diagnose().await;
    let line = diagnosis
        .findings
        .iter()
        .find(|f| f.check == "completer")
        .unwrap();
    assert_eq!(
        line.severity,
        tower_idempotency::store::Severity::Warning,
        "{line:?}"
    );
    assert!(line.message.contains("1 noted unfinished"), "{line:?}");
    assert!(
        !line.message.contains("  "),
        "a message with a run of spaces: {line:?}"
    );
    schema.drop().await;
}

/// A key committed without an answer (plain `commit`, then its instance died) is answered by
/// the recovery hook from the completer, with nobody retrying: stored once, then replayed to a
/// later retry without asking the hook again.
pub(crate) async fn the_completer_answers_a_key_committed_without_an_answer_with_the_recovery_hook()
{
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let asked = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(100))
        .with_recovery({
            let asked = Arc::clone(&asked);
            move |_: RecordKey| {
                asked.fetch_add(1, SeqCst);
                async { Some(http::Response::new(Bytes::from_static(b"pay_rebuilt"))) }
            }
        });
    let router = Router::new()
        .route("/x", post(|| async { StatusCode::IM_A_TEAPOT }))
        .layer(layer.clone());
    committed_then_died(&store, &schema, "k-committed").await;

    let mut completer = layer.completer(router.clone());
    let started = Instant::now();
    loop {
        let round = completer.run_once().await.unwrap();
        if round.finished == 1 {
            break;
        }
        // The dead owner's grace (half a lease) runs first.
        assert_eq!((round.found, round.busy), (1, 1), "{round:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(asked.load(SeqCst), 1);
    let retry = router
        .oneshot(
            Request::post("/x")
                .header("idempotency-key", "k-committed")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        retry.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let body = retry.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "pay_rebuilt");
    assert_eq!(asked.load(SeqCst), 1, "stored once, then replayed");
    schema.drop().await;
}

/// A resumed handler that fails again (its provider still down) leaves the key unfinished: the
/// round says so, the key says why, and the next round finishes it, charged once.
pub(crate) async fn a_resumed_handler_that_fails_again_is_noted_and_finished_next_round() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let mut app = Payments::new(&schema, Duration::ZERO).await;
    app.failures = 2;
    let (layer, router) = instance(&store, &app);
    let given_up = router
        .clone()
        .oneshot(payment("k-again", "Bearer d", "{}"))
        .await
        .unwrap();
    assert_eq!(given_up.status(), StatusCode::BAD_GATEWAY);

    let mut completer = layer.completer(router);
    let round = completer.run_once().await.unwrap();
    assert_eq!(
        (round.found, round.finished, round.failed),
        (1, 0, 1),
        "{round:?}"
    );
    let stuck = store.stuck(Duration::ZERO, 10).await.unwrap();
    let why = stuck[0].unfinished.as_deref().unwrap_or_default();
    assert!(why.contains("502") && why.contains("in_flight"), "{why:?}");
    let round = completer.run_once().await.unwrap();
    assert_eq!(
        (round.found, round.finished, round.failed),
        (1, 1, 0),
        "{round:?}"
    );
    assert_eq!(app.charges()["k-again"], 1);
    assert_eq!(app.rows("succeeded").await, 1);
    schema.drop().await;
}

/// A recovery hook that panics fails its key only: the same round finishes the other key, the
/// failed one says why, and the completer goes on to its next round.
pub(crate) async fn a_panicking_recovery_hook_fails_its_key_only() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(100))
        .with_recovery(|record: RecordKey| async move {
            assert_ne!(
                record.key().as_str(),
                "k-panics",
                "the hook panics on this key"
            );
            Some(http::Response::new(Bytes::from_static(b"rebuilt")))
        });
    let router = Router::new()
        .route("/x", post(|| async { StatusCode::OK }))
        .layer(layer.clone());
    committed_then_died(&store, &schema, "k-panics").await;
    committed_then_died(&store, &schema, "k-answers").await;

    let mut completer = layer.completer(router);
    let started = Instant::now();
    let round = loop {
        let round = completer.run_once().await.unwrap();
        if round.busy == 0 {
            break round;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "{round:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        (round.found, round.finished, round.failed),
        (2, 1, 1),
        "{round:?}"
    );
    let stuck = store.stuck(Duration::ZERO, 10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].record.key().as_str(), "k-panics");
    let why = stuck[0].unfinished.as_deref().unwrap_or_default();
    assert!(why.contains("panic"), "{why:?}");
    // The next round tries it again.
    let round = completer.run_once().await.unwrap();
    assert_eq!((round.found, round.failed), (1, 1), "{round:?}");
    schema.drop().await;
}
