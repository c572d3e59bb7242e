//! The handler fence: a stale owner never commits, a committed key is never run again, and the answer stored with the fence is the one every retry gets.

use super::*;

pub(crate) async fn the_fence_refuses_a_stale_owner_and_is_idempotent_for_the_current_one() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let stale = claim_request("k-fence", Duration::from_millis(200));
    let stale_lease = acquire(&store, &stale).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let current = claim_request("k-fence", LONG);
    let current_lease = acquire(&store, &current).await;
    assert!(current_lease.fence() > stale_lease.fence());

    let claim_of = |lease: &Lease| claim_for(lease.clone(), LONG);
    let mut tx = schema.pool.begin().await.unwrap();
    match claim_of(&stale_lease).commit(&mut tx).await {
        Err(FenceError::LeaseLost { record, fence }) => {
            assert_eq!(record.key().as_str(), "k-fence");
            assert_eq!(fence, stale_lease.fence());
        }
        other => panic!("a stale owner's fence must fail, got {other:?}"),
    }
    drop(tx);

    let mut tx = schema.pool.begin().await.unwrap();
    claim_of(&current_lease).commit(&mut tx).await.unwrap();
    claim_of(&current_lease).commit(&mut tx).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        store.release(&current_lease).await.unwrap(),
        Ownership::Committed
    );
    assert_eq!(store.release(&stale_lease).await.unwrap(), Ownership::Lost);
    assert_eq!(
        store
            .complete(&current_lease, &response(StatusCode::OK), LONG)
            .await
            .unwrap(),
        Ownership::Held
    );
    schema.drop().await;
}

pub(crate) async fn a_committed_key_whose_owner_died_never_runs_again() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let request = claim_request("k-orphan", Duration::from_millis(200));
    let lease = acquire(&store, &request).await;
    let mut tx = schema.pool.begin().await.unwrap();
    claim_for(lease.clone(), request.lease())
        .commit(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // The owner "dies": no renewal, no completion. Its lease runs out, the commit stands. The
    // first claim after that gives the owner half a lease to show it is alive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    match store.claim(&request).await.unwrap() {
        ClaimOutcome::InFlight { retry_after } => {
            assert_eq!(retry_after, request.lease() / 2)
        }
        other => panic!("a lapsed owner was declared dead without a grace: {other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.claim(&request).await.unwrap(), ClaimOutcome::Orphaned);
    assert_eq!(
        store.claim(&claim_request("k-orphan", LONG)).await.unwrap(),
        ClaimOutcome::Orphaned
    );
    schema.drop().await;
}

/// A payment API over Postgres whose handler writes its row through the fence; the first attempt
/// stalls (until the test lets it go) after its insert and before its fence.
struct Payments {
    pool: PgPool,
    attempts: AtomicUsize,
    stalled: Notify,
    unstall: Semaphore,
}

async fn create_payment(State(app): State<Arc<Payments>>, claim: IdempotencyClaim) -> Response {
    let attempt = app.attempts.fetch_add(1, SeqCst) as i32 + 1;
    let mut tx = app.pool.begin().await.unwrap();
    sqlx::query("INSERT INTO payments (key, attempt) VALUES ($1, $2)")
        .bind(claim.key().as_str())
        .bind(attempt)
        .execute(&mut *tx)
        .await
        .unwrap();
    if attempt == 1 {
        app.stalled.notify_one();
        let _permit = app.unstall.acquire().await.unwrap();
    }
    match claim.commit(&mut tx).await {
        Ok(()) => {
            tx.commit().await.unwrap();
            (StatusCode::CREATED, format!("attempt {attempt}")).into_response()
        }
        // `tx` is dropped: the insert rolls back.
        Err(FenceError::LeaseLost { .. }) => (StatusCode::CONFLICT, "lost the key").into_response(),
        Err(error) => panic!("{error}"),
    }
}

fn payments_app(layer: IdempotencyLayer, app: &Arc<Payments>) -> Router {
    Router::new()
        .route("/payments", post(create_payment))
        .layer(layer)
        .with_state(Arc::clone(app))
}

async fn post_payment(app: &Router, key: &str) -> (StatusCode, HeaderMap, String) {
    let request = Request::post("/payments")
        .header("idempotency-key", key)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (
        parts.status,
        parts.headers,
        String::from_utf8_lossy(&body).into_owned(),
    )
}

pub(crate) async fn a_stalled_handler_that_lost_its_lease_cannot_commit_a_second_payment() {
    let schema = TestSchema::new().await;
    sqlx::query("CREATE TABLE payments (key text NOT NULL, attempt int NOT NULL)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let store = PostgresStore::new(schema.pool.clone());
    let state = Arc::new(Payments {
        pool: schema.pool.clone(),
        attempts: AtomicUsize::new(0),
        stalled: Notify::new(),
        unstall: Semaphore::new(0),
    });
    let stalled_layer = IdempotencyLayer::new(Faulty {
        inner: store.clone(),
        fault: StoreFault::FrozenRenewals,
    })
    .with_lease(Duration::from_millis(300));
    let stalled = payments_app(stalled_layer.clone(), &state);
    let healthy = payments_app(IdempotencyLayer::new(store.clone()), &state);

    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { post_payment(&stalled, "pay-once").await }
    });
    state.stalled.notified().await;
    tokio::time::sleep(Duration::from_millis(700)).await;

    // The lease ran out while the first attempt stalled: the retry reclaims and commits.
    let (status, _, body) = post_payment(&healthy, "pay-once").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));

    state.unstall.add_permits(1);
    // The stale attempt's fence failed (its handler answered "lost the key"), and its caller
    // got the key's real answer instead of that.
    let (status, headers, body) = first.await.unwrap();
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));
    assert_eq!(
        headers[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );

    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT key, attempt FROM payments")
        .fetch_all(&schema.pool)
        .await
        .unwrap();
    assert_eq!(
        rows,
        [("pay-once".to_owned(), 2)],
        "exactly one business commit"
    );
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);

    let (status, headers, body) = post_payment(&healthy, "pay-once").await;
    assert_eq!((status, body.as_str()), (StatusCode::CREATED, "attempt 2"));
    assert_eq!(
        headers[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    assert_eq!(state.attempts.load(SeqCst), 2);
    schema.drop().await;
}

pub(crate) async fn a_committed_key_is_completed_whatever_the_response() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/refunds",
            post({
                let (pool, runs) = (schema.pool.clone(), Arc::clone(&runs));
                move |claim: IdempotencyClaim| async move {
                    runs.fetch_add(1, SeqCst);
                    let mut tx = pool.begin().await.unwrap();
                    claim.commit(&mut tx).await.unwrap();
                    tx.commit().await.unwrap();
                    // A 503 would normally release the key; after the commit it must not.
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        )
        .layer(IdempotencyLayer::new(store));
    let send = || async {
        let request = Request::post("/refunds")
            .header("idempotency-key", "refund-1")
            .body(Body::empty())
            .unwrap();
        app.clone().oneshot(request).await.unwrap()
    };
    assert_eq!(send().await.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = send().await;
    assert_eq!(retry.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        retry.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    assert_eq!(runs.load(SeqCst), 1);
    schema.drop().await;
}

pub(crate) async fn an_orphaned_key_answers_outcome_unknown_through_the_layer() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/x",
            post({
                let runs = Arc::clone(&runs);
                move || async move {
                    runs.fetch_add(1, SeqCst);
                    StatusCode::OK
                }
            }),
        )
        .layer(IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(100)));

    // An earlier attempt of this request claimed and committed, then its instance died.
    committed_then_died(&store, &schema, "k-dead").await;

    let request = Request::post("/x")
        .header("idempotency-key", "k-dead")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert!(response.headers().get("retry-after").is_none());
    let body: serde_json::Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["type"], problem::OUTCOME_UNKNOWN);
    assert_eq!(runs.load(SeqCst), 0);
    schema.drop().await;
}

/// One key, one stored answer: a response stored with the fence that varies on a request
/// header (`Vary`) is stored as the layer stores it, with the request's value of that header, so
/// a retry that meets it (here before the handler even returned) is replayed, not refused 406;
/// and the layer's completion keeps it.
pub(crate) async fn an_answer_stored_with_the_fence_is_the_one_every_retry_gets() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let pool = schema.pool.clone();
    let handler = move |claim: IdempotencyClaim| {
        let pool = pool.clone();
        async move {
            let response = http::Response::builder()
                .status(StatusCode::CREATED)
                .header("vary", "accept-language")
                .header("content-language", "fr")
                .body(bytes::Bytes::from_static(b"paiement"))
                .unwrap();
            let mut tx = pool.begin().await.unwrap();
            claim
                .commit_with_response(&mut tx, &response)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            // The answer is stored; the handler is still busy.
            tokio::time::sleep(Duration::from_millis(400)).await;
            response.map(Body::from)
        }
    };
    let app = Router::new()
        .route("/pay", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    let request = || {
        Request::post("/pay")
            .header("idempotency-key", "k-vary")
            .header("accept-language", "fr")
            .body(Body::empty())
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(request()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let early = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        early.status(),
        StatusCode::CREATED,
        "the answer stored with the fence"
    );
    assert_eq!(
        early.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let late = app.clone().oneshot(request()).await.unwrap();
    assert_eq!(late.status(), StatusCode::CREATED);
    let body = late.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "paiement");
    schema.drop().await;
}

/// The fence's retention counts from the fence, not from the start of the handler's
/// transaction: a key fenced at the end of a long transaction (1.5 s of work here) and never
/// completed (its instance died) keeps its answer for the whole retention after the commit.
pub(crate) async fn the_fences_retention_counts_from_the_commit_not_the_transactions_start() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let request = claim_request("long-transaction", Duration::from_secs(3));
    let lease = acquire(&store, &request).await;
    let retention = Duration::from_secs(10);
    let mut tx = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_sleep(1.5)")
        .execute(&mut *tx)
        .await
        .unwrap();
    IdempotencyClaim::new(lease, retention)
        .commit(&mut tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let info = store
        .inspect(request.record())
        .await
        .unwrap()
        .expect("the committed record");
    assert!(
        info.expires_in > retention - Duration::from_millis(500),
        "expires in {:?} of a {retention:?} retention: counted from the transaction's start",
        info.expires_in
    );
    schema.drop().await;
}

/// A key committed with its answer is complete already: its completion is answered held
/// without a write (the row's version, its `xmin`, is the one the fence wrote), `inspect` calls
/// it completed, and a retry gets the answer stored with the fence. A stale owner's completion
/// of it is still lost. Before, the completion wrote the row a second time.
pub(crate) async fn completing_a_key_committed_with_its_answer_writes_nothing() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let stale = acquire(&store, &claim_request("k", Duration::from_millis(100))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let request = claim_request("k", LONG);
    let lease = acquire(&store, &request).await;
    let mut tx = schema.pool.begin().await.unwrap();
    let created = http::Response::builder()
        .status(StatusCode::CREATED)
        .body(bytes::Bytes::from_static(b"created"))
        .unwrap();
    claim_for(lease.clone(), LONG)
        .commit_with_response(&mut tx, &created)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let version = async || -> String {
        sqlx::query_scalar("SELECT xmin::text FROM idempotency_keys WHERE key = 'k'")
            .fetch_one(&schema.pool)
            .await
            .unwrap()
    };
    let fenced = version().await;

    let ok = response(StatusCode::OK);
    assert_eq!(
        store.complete(&lease, &ok, LONG).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.complete(&stale, &ok, LONG).await.unwrap(),
        Ownership::Lost
    );
    assert_eq!(
        version().await,
        fenced,
        "the completion wrote the row again"
    );
    let info = store.inspect(request.record()).await.unwrap().unwrap();
    assert_eq!(info.state, tower_idempotency::store::RecordState::Completed);
    assert_eq!(info.status, Some(StatusCode::CREATED));
    match store.claim(&claim_request("k", LONG)).await.unwrap() {
        ClaimOutcome::Completed { response, .. } => assert_eq!(response.status(), 201),
        other => panic!("a retry got {other:?}"),
    }
    schema.drop().await;
}
