//! The layer inside real axum apps, next to tower-http layers and an authentication layer: who
//! shares a record, what "the same request" is, and which order of layers is safe. Every case
//! counts the handler's runs, the number that must match what the client was promised.

mod support;

use std::{
    convert::Infallible,
    io::Write,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    body::Body,
    extract::{Request as AxumRequest, State},
    http::{HeaderValue, Method, Request, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use bytes::Bytes;
use http_body_util::StreamBody;
use support::{Answer, call};
use tower::ServiceBuilder;
use tower_http::{
    compression::CompressionLayer,
    cors::{AllowOrigin, CorsLayer},
    limit::RequestBodyLimitLayer,
    request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer},
    timeout::TimeoutLayer,
};
use tower_idempotency::{IdempotencyLayer, MemoryStore, problem};

/// Counts runs and echoes what the handler saw.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn get(&self) -> usize {
        self.0.load(SeqCst)
    }
}

/// The tenant an authentication layer found.
#[derive(Clone)]
struct Tenant(String);

/// A tiny authentication layer: `Authorization: Bearer <tenant>`, else 401.
async fn authenticate(mut request: AxumRequest, next: Next) -> Response {
    let tenant = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match tenant {
        Some(tenant) => {
            request.extensions_mut().insert(Tenant(tenant));
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

async fn pay(State(runs): State<Runs>, body: Bytes) -> Response {
    let run = runs.0.fetch_add(1, SeqCst) + 1;
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        format!(
            r#"{{"run":{run},"echo":{:?},"padding":"{}"}}"#,
            String::from_utf8_lossy(&body),
            "x".repeat(200)
        ),
    )
        .into_response()
}

async fn pay_as_tenant(
    State(runs): State<Runs>,
    tenant: Option<axum::Extension<Tenant>>,
) -> Response {
    let run = runs.0.fetch_add(1, SeqCst) + 1;
    let tenant = tenant.map_or_else(|| "none".to_owned(), |t| t.0.0.clone());
    (StatusCode::CREATED, format!("payment {run} for {tenant}")).into_response()
}

#[derive(serde::Deserialize)]
struct NewPayment {
    amount_cents: i64,
}

async fn pay_json(State(runs): State<Runs>, Json(new): Json<NewPayment>) -> Response {
    let run = runs.0.fetch_add(1, SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("payment {run} of {}", new.amount_cents),
    )
        .into_response()
}

fn post_with(uri: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut request = Request::post(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

fn tenant_scope(parts: &http::request::Parts) -> Option<String> {
    parts.extensions.get::<Tenant>().map(|t| t.0.clone())
}

#[tokio::test]
async fn an_authentication_layer_inside_never_lets_tenants_share_a_record() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_scope(tenant_scope);
    let runs = Runs::default();
    // Wrong order: authentication runs after the scope was read.
    let inside = Router::new()
        .route("/payments", post(pay_as_tenant))
        .layer(middleware::from_fn(authenticate))
        .layer(layer.clone())
        .with_state(runs.clone());
    let as_tenant = |tenant: &str| {
        post_with(
            "/payments",
            &[
                ("idempotency-key", "shared-key"),
                ("authorization", &format!("Bearer {tenant}")),
            ],
            "{}",
        )
    };
    for tenant in ["a", "b"] {
        let answer = call(&inside, as_tenant(tenant)).await;
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(answer.problem_type(), problem::NO_SCOPE);
        assert!(!answer.replayed());
    }
    assert_eq!(
        runs.get(),
        0,
        "a request without a scope reached the handler"
    );

    // Right order: authentication outside; each tenant has its own record.
    let outside = Router::new()
        .route("/payments", post(pay_as_tenant))
        .layer(layer)
        .layer(middleware::from_fn(authenticate))
        .with_state(runs.clone());
    let a = call(&outside, as_tenant("a")).await;
    let b = call(&outside, as_tenant("b")).await;
    assert_eq!(a.body, "payment 1 for a");
    assert_eq!(b.body, "payment 2 for b");
    assert!(!b.replayed(), "tenant b was given tenant a's response");
    let a_again = call(&outside, as_tenant("a")).await;
    assert!(a_again.replayed());
    assert_eq!(a_again.body, a.body);
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn callers_with_different_credentials_never_share_a_record_by_default() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let send = |authorization: Option<&str>| {
        let mut headers = vec![("idempotency-key", "k-cred")];
        if let Some(value) = authorization {
            headers.push(("authorization", value));
        }
        call(&app, post_with("/payments", &headers, "same body"))
    };
    let alice = send(Some("Bearer alice")).await;
    let bob = send(Some("Bearer bob")).await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_eq!(runs.get(), 2, "two callers shared one record");
    assert!(send(Some("Bearer alice")).await.replayed());
    assert_eq!(send(Some("Bearer bob")).await.json()["run"], 2);

    // Requests without credentials share the anonymous scope, as before.
    let anonymous = send(None).await;
    assert!(!anonymous.replayed());
    assert!(send(None).await.replayed());
    assert_eq!(runs.get(), 3);
}

#[tokio::test]
async fn router_and_extractor_rejections_release_the_key() {
    let runs = Runs::default();
    // The layer on the whole router, so that it sees 404s and 405s too.
    let app = Router::new()
        .route("/payments", post(pay_json))
        .route("/payments/{id}", get(|| async { "a payment" }))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let json = [("content-type", "application/json")];
    let body = r#"{"amount_cents": 100}"#;
    let keyed = |key: &'static str, extra: &[(&'static str, &'static str)]| {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        headers
    };

    // 404: a mistyped path.
    let typo = call(&app, post_with("/paymnts", &keyed("k-404", &json), body)).await;
    assert_eq!(typo.status, StatusCode::NOT_FOUND);
    // 405: a method the route does not serve.
    let wrong = call(
        &app,
        post_with("/payments/p1", &keyed("k-405", &json), body),
    )
    .await;
    assert_eq!(wrong.status, StatusCode::METHOD_NOT_ALLOWED);
    // 415: no content type for the JSON extractor.
    let untyped = call(&app, post_with("/payments", &keyed("k-415", &[]), body)).await;
    assert_eq!(untyped.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // 400 and 422: malformed JSON, and JSON of the wrong shape.
    let broken = call(&app, post_with("/payments", &keyed("k-400", &json), "{")).await;
    assert_eq!(broken.status, StatusCode::BAD_REQUEST);
    let shapeless = call(&app, post_with("/payments", &keyed("k-422", &json), "{}")).await;
    assert_eq!(shapeless.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.get(), 0);

    // The corrected request, with the same key, runs once; its retry is replayed.
    for key in ["k-404", "k-405", "k-415", "k-400", "k-422"] {
        let corrected = call(&app, post_with("/payments", &keyed(key, &json), body)).await;
        assert_eq!(
            corrected.status,
            StatusCode::CREATED,
            "{key}: {corrected:?}"
        );
        assert!(!corrected.replayed(), "{key}");
        let retry = call(&app, post_with("/payments", &keyed(key, &json), body)).await;
        assert!(retry.replayed(), "{key}");
    }
    assert_eq!(runs.get(), 5);
}

#[tokio::test]
async fn content_type_is_part_of_the_request() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let send = |content_type: &'static str| {
        post_with(
            "/payments",
            &[("idempotency-key", "k-ct"), ("content-type", content_type)],
            "a=1",
        )
    };
    call(&app, send("application/x-www-form-urlencoded")).await;
    let other = call(&app, send("text/plain")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem_type(), problem::KEY_MISMATCH);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn nested_routers_fingerprint_the_path_the_client_sent() {
    let runs = Runs::default();
    let store = MemoryStore::new();
    let api = || {
        Router::new()
            .route("/payments", post(pay))
            .layer(IdempotencyLayer::new(store.clone()))
    };
    let app = Router::new()
        .nest("/v1", api())
        .nest("/v2", api())
        .with_state(runs.clone());
    let send = |uri: &str| post_with(uri, &[("idempotency-key", "k-nested")], "{}");
    let v1 = call(&app, send("/v1/payments")).await;
    assert_eq!(v1.status, StatusCode::CREATED);
    let v2 = call(&app, send("/v2/payments")).await;
    assert_eq!(
        v2.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "/v2 was answered with /v1's record: {v2:?}"
    );
    assert!(call(&app, send("/v1/payments")).await.replayed());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_fingerprint_hook_decides_what_of_the_body_counts() {
    let runs = Runs::default();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint_body(|_, body| {
        match serde_json::from_slice::<serde_json::Value>(body) {
            Ok(mut json) => {
                json.as_object_mut().map(|o| o.remove("sent_at"));
                Bytes::from(json.to_string())
            }
            Err(_) => body.clone(),
        }
    });
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .with_state(runs.clone());
    let send = |body: &str| post_with("/payments", &[("idempotency-key", "k-hook")], body);
    let first = call(&app, send(r#"{"amount":1,"currency":"eur","sent_at":1}"#)).await;
    let reordered = call(
        &app,
        send(r#"{ "currency": "eur", "amount": 1, "sent_at": 2 }"#),
    )
    .await;
    assert!(reordered.replayed(), "{reordered:?}");
    assert_eq!(reordered.body, first.body, "the handler saw the first body");
    let changed = call(&app, send(r#"{"amount":2,"currency":"eur","sent_at":3}"#)).await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_problem_hook_renders_the_house_envelope_and_keeps_retry_after() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_key_required(true)
        .with_problem_response(|problem| {
            let body = serde_json::json!({
                "error": { "code": problem.type_uri(), "message": problem.detail() }
            });
            let mut response = problem.to_response();
            *response.body_mut() = Bytes::from(body.to_string());
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static("application/json"));
            response
        });
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .with_state(runs.clone());
    let missing = call(&app, post_with("/payments", &[], "{}")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.headers["content-type"], "application/json");
    assert_eq!(missing.json()["error"]["code"], problem::MISSING_KEY);
    let bad = call(
        &app,
        post_with("/payments", &[("idempotency-key", "a b")], "{}"),
    )
    .await;
    assert_eq!(bad.json()["error"]["code"], problem::INVALID_KEY);
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn a_legacy_header_name_carries_the_key() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_key_header(http::HeaderName::from_static("x-idempotency-key"))
                .with_key_required(true),
        )
        .with_state(runs.clone());
    let legacy = || post_with("/payments", &[("x-idempotency-key", "k-legacy")], "{}");
    call(&app, legacy()).await;
    assert!(call(&app, legacy()).await.replayed());
    let standard = call(
        &app,
        post_with("/payments", &[("idempotency-key", "k")], "{}"),
    )
    .await;
    assert_eq!(standard.problem_type(), problem::MISSING_KEY);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn structured_field_parameters_are_ignored_and_lists_refused() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let with_key = |key: &str| post_with("/payments", &[("idempotency-key", key)], "{}");
    let first = call(&app, with_key(r#""abc";x=1"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for same in ["abc", r#""abc""#, "abc;x=1", r#""abc";v=2"#] {
        assert!(call(&app, with_key(same)).await.replayed(), "{same}");
    }
    // What a proxy makes of two headers: refused, never taken as one key.
    let joined = call(&app, with_key("k1,k2")).await;
    assert_eq!(joined.status, StatusCode::BAD_REQUEST);
    assert_eq!(joined.problem_type(), problem::INVALID_KEY);
    assert_eq!(runs.get(), 1);
}

/// A client that accepts gzip, and one that does not.
fn negotiating(accept_encoding: Option<&str>, origin: &str) -> Request<Body> {
    let mut headers = vec![("idempotency-key", "k-negotiated"), ("origin", origin)];
    if let Some(value) = accept_encoding {
        headers.push(("accept-encoding", value));
    }
    post_with("/payments", &headers, "{}")
}

#[tokio::test]
async fn compression_inside_never_replays_gzip_to_a_client_that_did_not_ask() {
    let runs = Runs::default();
    let inside = Router::new()
        .route("/payments", post(pay))
        .layer(CompressionLayer::new())
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let first = call(&inside, negotiating(Some("gzip"), "https://a.example")).await;
    assert_eq!(first.headers["content-encoding"], "gzip");
    let plain = call(&inside, negotiating(None, "https://a.example")).await;
    assert_ne!(
        plain.headers.get("content-encoding").map(|v| v.as_bytes()),
        Some(&b"gzip"[..]),
        "a client that never asked for gzip was given gzip"
    );
    assert_eq!(plain.status, StatusCode::NOT_ACCEPTABLE);
    assert_eq!(plain.problem_type(), problem::REPLAY_NOT_ACCEPTABLE);
    let same = call(&inside, negotiating(Some("gzip"), "https://a.example")).await;
    assert!(same.replayed());
    assert_eq!(same.body, first.body);
    assert_eq!(runs.get(), 1);

    // Outside, compression negotiates every answer, replays included.
    let outside = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(CompressionLayer::new())
        .with_state(runs.clone());
    let gzip = call(&outside, negotiating(Some("gzip"), "https://a.example")).await;
    assert_eq!(gzip.headers["content-encoding"], "gzip");
    let plain = call(&outside, negotiating(None, "https://a.example")).await;
    assert!(plain.replayed());
    assert!(plain.headers.get("content-encoding").is_none());
    assert_eq!(plain.json()["run"], 2);
}

fn cors() -> CorsLayer {
    CorsLayer::new()
        .allow_origin(AllowOrigin::mirror_request())
        .allow_methods([Method::POST])
}

#[tokio::test]
async fn cors_inside_never_replays_one_origin_to_another_and_outside_answers_every_origin() {
    let runs = Runs::default();
    let inside = Router::new()
        .route("/payments", post(pay))
        .layer(cors())
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let a = call(&inside, negotiating(None, "https://a.example")).await;
    assert_eq!(
        a.headers["access-control-allow-origin"],
        "https://a.example"
    );
    let b = call(&inside, negotiating(None, "https://b.example")).await;
    assert_ne!(
        b.headers
            .get("access-control-allow-origin")
            .map(|v| v.as_bytes()),
        Some(&b"https://a.example"[..]),
        "origin b was given origin a's CORS answer"
    );
    assert_eq!(b.status, StatusCode::NOT_ACCEPTABLE);
    assert!(
        call(&inside, negotiating(None, "https://a.example"))
            .await
            .replayed()
    );

    // Outside: replays and the layer's own answers carry the caller's origin.
    let store = MemoryStore::new();
    let gated = Arc::new(tokio::sync::Semaphore::new(0));
    let outside = Router::new()
        .route(
            "/payments",
            post({
                let gated = Arc::clone(&gated);
                move |State(runs): State<Runs>| async move {
                    runs.0.fetch_add(1, SeqCst);
                    let _permit = gated.acquire().await.unwrap();
                    (StatusCode::CREATED, "paid")
                }
            }),
        )
        .layer(IdempotencyLayer::new(store).with_wait(Duration::ZERO))
        .layer(cors())
        .with_state(runs.clone());
    let first = tokio::spawn({
        let outside = outside.clone();
        async move { call(&outside, negotiating(None, "https://a.example")).await }
    });
    while runs.get() < 2 {
        tokio::task::yield_now().await;
    }
    let busy = call(&outside, negotiating(None, "https://b.example")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        busy.headers["access-control-allow-origin"],
        "https://b.example"
    );
    gated.add_permits(1);
    first.await.unwrap();
    let replay = call(&outside, negotiating(None, "https://b.example")).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.headers["access-control-allow-origin"],
        "https://b.example"
    );
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn request_ids_belong_to_their_own_exchange() {
    let runs = Runs::default();
    let inside = Router::new()
        .route("/payments", post(pay))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    let send = || post_with("/payments", &[("idempotency-key", "k-rid")], "{}");
    let first = call(&inside, send()).await;
    let first_id = first.headers["x-request-id"].clone();
    let replay = call(&inside, send()).await;
    assert!(replay.replayed());
    assert_ne!(
        replay.headers.get("x-request-id"),
        Some(&first_id),
        "the replay carried the first exchange's request id"
    );

    let outside = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .with_state(runs.clone());
    let first = call(&outside, send()).await;
    let replay = call(&outside, send()).await;
    assert!(replay.replayed());
    assert!(replay.headers.contains_key("x-request-id"));
    assert_ne!(
        replay.headers["x-request-id"],
        first.headers["x-request-id"]
    );
    assert_eq!(runs.get(), 2);
}

/// Captures what the crate logs, for the tests that check a warning.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

async fn slow(State(runs): State<Runs>) -> (StatusCode, String) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let run = runs.0.fetch_add(1, SeqCst) + 1;
    (StatusCode::CREATED, format!("done {run}"))
}

#[tokio::test]
async fn a_timeout_outside_never_restarts_the_handler_and_one_inside_is_flagged() {
    let runs = Runs::default();
    let timeout =
        || TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_millis(100));
    let outside = Router::new()
        .route("/payments", post(slow))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(timeout())
        .with_state(runs.clone());
    let send = || post_with("/payments", &[("idempotency-key", "k-timeout")], "{}");
    let timed_out = call(&outside, send()).await;
    assert_eq!(timed_out.status, StatusCode::REQUEST_TIMEOUT);
    // The handler goes on after the timeout answered; the retry gets its answer.
    let deadline = Instant::now() + Duration::from_secs(5);
    let replay = loop {
        let answer = call(&outside, send()).await;
        if answer.replayed() {
            break answer;
        }
        assert!(Instant::now() < deadline, "no replay: {answer:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(replay.body, "done 1");
    assert_eq!(runs.get(), 1);

    // Inside, the timeout cancels the handler: the layer says so.
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .with_max_level(tracing::Level::WARN)
        .finish();
    support::scoped_subscribers_hear_every_callsite();
    let _guard = tracing::subscriber::set_default(subscriber);
    let inside = Router::new()
        .route("/payments", post(slow))
        .layer(timeout())
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .with_state(runs.clone());
    assert_eq!(
        call(&inside, send()).await.status,
        StatusCode::REQUEST_TIMEOUT
    );
    assert!(
        captured.text().contains("install it outside"),
        "no warning: {}",
        captured.text()
    );
}

/// A body that sends `first` and then `rest` chunks of 1 KiB without declaring its length.
fn chunked(chunks: usize) -> Body {
    let frames = futures_util::stream::iter(
        (0..chunks)
            .map(|_| Ok::<_, Infallible>(http_body::Frame::data(Bytes::from(vec![b'x'; 1024])))),
    );
    Body::new(StreamBody::new(frames))
}

#[tokio::test]
async fn a_body_limit_outside_is_a_413_whichever_limit_tripped() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .layer(RequestBodyLimitLayer::new(4096))
        .with_state(runs.clone());
    let request = Request::post("/payments")
        .header("idempotency-key", "k-limit")
        .body(chunked(8))
        .unwrap();
    let answer = call(&app, request).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE, "{answer:?}");
    assert_eq!(answer.problem_type(), problem::BODY_TOO_LARGE);
    let detail = answer.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        !detail.contains("1048576"),
        "named the wrong limit: {detail}"
    );

    // The same in a plain tower stack, without axum's error wrapping.
    let service = ServiceBuilder::new()
        .layer(RequestBodyLimitLayer::new(4096))
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(tower::service_fn(
            |_: Request<tower_idempotency::body::RequestBody<_>>| async {
                Ok::<_, Infallible>(http::Response::new(Body::from("ran")))
            },
        ));
    let request = Request::post("/")
        .header("idempotency-key", "k-limit")
        .body(chunked(8))
        .unwrap();
    let answer: Answer = call(&service, request).await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    let detail = answer.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        !detail.contains("1048576"),
        "named the wrong limit: {detail}"
    );
    assert_eq!(runs.get(), 0);
}

#[tokio::test]
async fn route_layer_on_the_handler_keeps_404s_and_405s_away_from_the_store() {
    let runs = Runs::default();
    let store = MemoryStore::new();
    let app = Router::new()
        .route(
            "/payments",
            post(pay).route_layer(IdempotencyLayer::new(store.clone())),
        )
        .route("/payments/{id}", get(|| async { "a payment" }))
        .with_state(runs.clone());
    let keyed = |uri: &str| post_with(uri, &[("idempotency-key", "k-route")], "{}");
    assert_eq!(
        call(&app, keyed("/nowhere")).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&app, keyed("/payments/p1")).await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
    let put = Request::put("/payments")
        .header("idempotency-key", "k-route")
        .body(Body::empty())
        .unwrap();
    assert_eq!(call(&app, put).await.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(store.is_empty(), "a 404 or 405 reached the store");
    assert_eq!(
        call(&app, keyed("/payments")).await.status,
        StatusCode::CREATED
    );
    assert_eq!(store.len(), 1);
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_stalled_body_is_a_408_within_the_time_limit() {
    let runs = Runs::default();
    let app = Router::new()
        .route("/payments", post(pay))
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_request_body_timeout(Duration::from_millis(200)),
        )
        .with_state(runs.clone());
    let stalled = futures_util::StreamExt::chain(
        futures_util::stream::iter([Ok::<_, Infallible>(http_body::Frame::data(
            Bytes::from_static(b"{\"amount\":"),
        ))]),
        futures_util::stream::pending(),
    );
    let request = Request::post("/payments")
        .header("idempotency-key", "k-stalled")
        .body(Body::new(StreamBody::new(stalled)))
        .unwrap();
    let started = Instant::now();
    let answer = call(&app, request).await;
    assert_eq!(answer.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(answer.problem_type(), problem::BODY_TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(runs.get(), 0);
}
