//! What the layer refuses before the handler runs: another request with the key (422), bad keys (400), bodies over the limit (413); and what it lets through untouched.

use super::*;

#[tokio::test]
async fn same_key_with_a_different_request_is_422() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    assert_eq!(
        send(&app, post_payment("k-m", r#"{"amount":1}"#))
            .await
            .status,
        StatusCode::CREATED
    );

    for changed in [
        post_payment("k-m", r#"{"amount":2}"#),
        request(Method::POST, "/other", Some("k-m"), r#"{"amount":1}"#),
        request(
            Method::POST,
            "/payments?dry_run=1",
            Some("k-m"),
            r#"{"amount":1}"#,
        ),
        request(Method::PATCH, "/payments", Some("k-m"), r#"{"amount":1}"#),
    ] {
        let answer = send(&app, changed).await;
        assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(answer.problem_type(), problem::KEY_MISMATCH);
    }
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn a_different_request_is_422_while_the_first_is_in_flight() {
    let probe = Probe::gated();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-mf", "1")).await }
    });
    probe.started.notified().await;
    assert_eq!(
        send(&app, post_payment("k-mf", "2")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    probe.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

#[tokio::test]
async fn bad_keys_are_400_and_never_reach_the_handler() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let too_long = "k".repeat(256);
    for bad in [
        "",
        "\"\"",
        too_long.as_str(),
        "has space",
        "\"unterminated",
        "\"a\"b",
        "tab\there",
    ] {
        let mut req = post_payment("placeholder", "{}");
        req.headers_mut()
            .insert("idempotency-key", HeaderValue::from_str(bad).unwrap());
        let answer = send(&app, req).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "key {bad:?}");
        assert_eq!(answer.problem_type(), problem::INVALID_KEY);
    }
    let mut opaque = post_payment("placeholder", "{}");
    opaque.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_bytes(b"caf\xe9").unwrap(),
    );
    assert_eq!(send(&app, opaque).await.status, StatusCode::BAD_REQUEST);

    let mut repeated = post_payment("k-r", "{}");
    repeated
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static("k-r"));
    let answer = send(&app, repeated).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert!(
        answer.json()["detail"]
            .as_str()
            .unwrap()
            .contains("repeated")
    );
    assert_eq!(probe.runs(), 0);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    send(&app, post_payment("\"k-q\"", "{}")).await;
    assert!(send(&app, post_payment("k-q", "{}")).await.replayed());
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn missing_key_passes_through_unless_required() {
    let probe = Probe::open();
    let optional = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let unkeyed = || request(Method::POST, "/payments", None, "{}");
    // The extractor refuses: IdempotencyClaim is not optional in `pay`.
    assert_eq!(
        send(&optional, unkeyed()).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );

    let required = app(
        &IdempotencyLayer::new(MemoryStore::new()).with_key_required(true),
        &probe,
    );
    let answer = send(&required, unkeyed()).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem_type(), problem::MISSING_KEY);
    assert_eq!(probe.runs(), 0);
}

#[tokio::test]
async fn unguarded_methods_pass_through_untouched() {
    let probe = Probe::open();
    let all_defaults = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    for _ in 0..2 {
        let answer = send(
            &all_defaults,
            request(Method::GET, "/payments", Some("k-get"), ""),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert!(!answer.replayed());
    }
    assert_eq!(probe.runs(), 2);

    let patch_only = app(
        &IdempotencyLayer::new(MemoryStore::new()).with_methods([Method::PATCH]),
        &probe,
    );
    for _ in 0..2 {
        let answer = send(
            &patch_only,
            request(Method::POST, "/status", Some("k-post"), "200"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::OK);
        assert!(!answer.replayed());
    }
    assert_eq!(
        probe.runs(),
        4,
        "POST is not guarded when only PATCH is configured"
    );
}

#[tokio::test]
async fn bodies_over_the_limit_are_413() {
    let probe = Probe::open();
    let app = app(
        &IdempotencyLayer::new(MemoryStore::new()).with_max_request_body(16),
        &probe,
    );
    let answer = send(&app, post_payment("k-big", &"x".repeat(17))).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(answer.problem_type(), problem::BODY_TOO_LARGE);

    // A streamed body without a declared length is cut off at the limit too.
    let chunks =
        futures_util::stream::iter((0..8).map(|_| {
            Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"0123456789")))
        }));
    let streamed = Request::post("/payments")
        .header("idempotency-key", "k-stream")
        .body(Body::new(StreamBody::new(chunks)))
        .unwrap();
    assert_eq!(
        send(&app, streamed).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    assert_eq!(probe.runs(), 0);

    assert_eq!(
        send(&app, post_payment("k-ok", &"x".repeat(16)))
            .await
            .status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn scopes_are_independent() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(|parts| {
        parts
            .headers
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let app = app(&layer, &probe);
    let tenant = |tenant: &str, body: &str| {
        let mut req = post_payment("shared", body);
        req.headers_mut()
            .insert("x-tenant", HeaderValue::from_str(tenant).unwrap());
        req
    };
    let a = send(&app, tenant("a", r#""from a""#)).await;
    let b = send(&app, tenant("b", r#""from b""#)).await;
    assert!(!a.replayed() && !b.replayed());
    assert_eq!(probe.runs(), 2);

    let replay_a = send(&app, tenant("a", r#""from a""#)).await;
    let replay_b = send(&app, tenant("b", r#""from b""#)).await;
    assert_eq!(replay_a.json()["echo"], "from a");
    assert_eq!(replay_b.json()["echo"], "from b");
    assert_eq!(probe.runs(), 2);
}
