//! Recovery points and the recovery hook: progress outlives its owner, and a key committed without an answer gets the one the application rebuilds.

use super::*;

/// Recovery points: advanced in the handler's own transaction, fenced; kept when the owner
/// dies (the sweeper leaves the row); resumed only by the request the key was claimed for; and a
/// key with progress is never deleted by a release, only left for the next attempt.
pub(crate) async fn recovery_points_outlive_their_owner_and_resume_only_for_the_same_request() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let short = Duration::from_millis(200);
    let first = claim_request("k-steps", short);
    let lease = acquire(&store, &first).await;
    let claim = claim_for(lease.clone(), short);
    let mut connection = schema.pool.acquire().await.unwrap();
    assert_eq!(claim.recovery_point(&mut connection).await.unwrap(), None);
    let progress = serde_json::json!({ "payment_id": "pay_1" });
    let mut tx = schema.pool.begin().await.unwrap();
    claim
        .advance(&mut tx, "intent_recorded", &progress)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let point = claim
        .recovery_point(&mut connection)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (point.name(), point.payload()),
        ("intent_recorded", &progress)
    );

    // The owner dies: its lease runs out, and the sweeper leaves the progress alone.
    tokio::time::sleep(short * 3).await;
    store.sweep().await.unwrap();
    // Another request with the key may not take the progress over.
    let other = tower_idempotency::conformance::claim_request("tenant", "k-steps", "other", LONG);
    assert_eq!(store.claim(&other).await.unwrap(), ClaimOutcome::Mismatch);
    // The same request takes the key over and resumes.
    let retry = claim_request("k-steps", LONG);
    let resumed = acquire(&store, &retry).await;
    assert!(resumed.fence() > lease.fence());
    let resumed_claim = claim_for(resumed.clone(), LONG);
    let point = resumed_claim
        .recovery_point(&mut connection)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (point.name(), point.payload()),
        ("intent_recorded", &progress)
    );
    // The stale owner can no longer advance, nor read the key as its own.
    let mut tx = schema.pool.begin().await.unwrap();
    let stale = claim
        .advance(&mut tx, "charged", &serde_json::Value::Null)
        .await;
    assert!(
        matches!(stale, Err(FenceError::LeaseLost { .. })),
        "{stale:?}"
    );
    drop(tx);
    assert!(matches!(
        claim.recovery_point(&mut connection).await,
        Err(FenceError::LeaseLost { .. })
    ));

    // A release (the provider failed, say) ends the lease instead of deleting the progress.
    assert_eq!(store.release(&resumed).await.unwrap(), Ownership::Held);
    let again = acquire(&store, &claim_request("k-steps", LONG)).await;
    let point = claim_for(again, LONG)
        .recovery_point(&mut connection)
        .await
        .unwrap();
    assert_eq!(
        point.map(|p| p.name().to_owned()).as_deref(),
        Some("intent_recorded")
    );
    // A claim of another store (the memory store here) has no row to advance: said so.
    let elsewhere = tower_idempotency::MemoryStore::new();
    let foreign = acquire(&elsewhere, &claim_request("k-elsewhere", LONG)).await;
    let mut tx = schema.pool.begin().await.unwrap();
    let refused = claim_for(foreign, LONG)
        .advance(&mut tx, "x", &serde_json::Value::Null)
        .await;
    assert!(
        matches!(refused, Err(FenceError::NoRecord { .. })),
        "{refused:?}"
    );
    drop(tx);
    drop(connection);
    schema.drop().await;
}

/// With a recovery hook, a key committed by an owner that died before storing an answer gets
/// the answer the application rebuilds from its own rows, stored and replayed, instead of 24 h of
/// outcome-unknown; the hook runs once.
pub(crate) async fn the_recovery_hook_answers_a_key_committed_without_an_answer() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let recovered = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(100))
        .with_recovery({
            let recovered = Arc::clone(&recovered);
            move |record: RecordKey| {
                recovered.fetch_add(1, SeqCst);
                async move {
                    // The handler's business row, looked up by the key.
                    let body = format!(r#"{{"payment":"pay_for_{}"}}"#, record.key());
                    Some(
                        http::Response::builder()
                            .status(StatusCode::CREATED)
                            .header("content-type", "application/json")
                            .body(bytes::Bytes::from(body))
                            .unwrap(),
                    )
                }
            }
        });
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
        .layer(layer);

    // An earlier attempt committed with plain `commit`, then its instance died.
    committed_then_died(&store, &schema, "k-recovered").await;

    let send = || {
        app.clone().oneshot(
            Request::post("/x")
                .header("idempotency-key", "k-recovered")
                .body(Body::empty())
                .unwrap(),
        )
    };
    for _ in 0..2 {
        let response = send().await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(
            response.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
            "true"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, r#"{"payment":"pay_for_k-recovered"}"#);
    }
    assert_eq!(recovered.load(SeqCst), 1, "stored once, then replayed");
    assert_eq!(runs.load(SeqCst), 0, "the handler never ran again");
    schema.drop().await;
}

/// A recovery hook that has no answer yet (its read of the application's rows failed, say)
/// never turns the key into `outcome-unknown`, which would tell the client the payment's fate
/// can never be known: a caller who cannot wait gets a 409 saying the key is in flight, with a
/// `Retry-After`; a caller who waits, and the retry, get the answer once the hook has it.
pub(crate) async fn a_recovery_hook_without_an_answer_yet_gets_the_caller_a_retry_not_outcome_unknown()
 {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone());
    // The hook's read fails on its first two calls, then finds the payment.
    let asked = Arc::new(AtomicUsize::new(0));
    let layer = |wait: Duration| {
        let asked = Arc::clone(&asked);
        IdempotencyLayer::new(store.clone())
            .with_lease(Duration::from_millis(100))
            .with_wait(wait)
            .with_recovery(move |_: RecordKey| {
                let found = asked.fetch_add(1, SeqCst) >= 2;
                async move {
                    found.then(|| {
                        http::Response::builder()
                            .status(StatusCode::CREATED)
                            .body(bytes::Bytes::from_static(b"pay_1"))
                            .unwrap()
                    })
                }
            })
    };
    let app = |wait| {
        Router::new()
            .route("/x", post(|| async { StatusCode::OK }))
            .layer(layer(wait))
    };
    committed_then_died(&store, &schema, "k-not-yet").await;
    let send = |wait| {
        app(wait).oneshot(
            Request::post("/x")
                .header("idempotency-key", "k-not-yet")
                .body(Body::empty())
                .unwrap(),
        )
    };

    // Callers that cannot wait: in flight while the dead owner's grace runs, then still in
    // flight (not outcome-unknown) while the hook has no answer.
    for _ in 0..50 {
        let impatient = send(Duration::ZERO).await.unwrap();
        assert_eq!(impatient.status(), StatusCode::CONFLICT);
        assert!(impatient.headers().contains_key("retry-after"));
        let body = impatient.into_body().collect().await.unwrap().to_bytes();
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(problem["type"], problem::IN_FLIGHT, "{problem}");
        if asked.load(SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(asked.load(SeqCst), 1, "the hook was never asked");

    // A caller that waits is answered once the hook finds the payment (its second try).
    let patient = send(Duration::from_secs(5)).await.unwrap();
    assert_eq!(patient.status(), StatusCode::CREATED);
    assert_eq!(
        patient.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let body = patient.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "pay_1");
    assert_eq!(
        asked.load(SeqCst),
        3,
        "asked until it answered, then stored"
    );
    schema.drop().await;
}
