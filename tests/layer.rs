//! Behaviour of the layer through a real axum router, on the memory store.
//!
//! "Instances" here are separate routers (separate layer and service stacks) sharing one store,
//! the way separate processes share Redis and Postgres; the fleet tests with real processes and
//! real stores live in `fleet.rs`.

mod support;

use std::{
    convert::Infallible,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode},
    response::IntoResponse,
    routing::post,
};
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use support::{Answer, Faulty, StoreFault};
use tokio::sync::{Notify, Semaphore};
use tower::{Service, ServiceExt};
use tower_idempotency::{
    Completion, CompletionPolicy, IdempotencyClaim, IdempotencyLayer, MemoryStore, problem,
};

/// What the handlers share with the test.
#[derive(Default)]
struct Probe {
    runs: AtomicUsize,
    started: Notify,
    /// While closed (no permits), handlers wait here after counting their run.
    gate: Option<Semaphore>,
    fail_next: AtomicBool,
}

impl Probe {
    fn open() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn gated() -> Arc<Self> {
        Arc::new(Self {
            gate: Some(Semaphore::new(0)),
            ..Self::default()
        })
    }

    fn release_gate(&self) {
        if let Some(gate) = &self.gate {
            gate.add_permits(1000);
        }
    }

    fn runs(&self) -> usize {
        self.runs.load(SeqCst)
    }

    async fn enter(&self) -> usize {
        let run = self.runs.fetch_add(1, SeqCst) + 1;
        self.started.notify_one();
        if let Some(gate) = &self.gate {
            let _permit = gate.acquire().await.unwrap();
        }
        run
    }
}

async fn pay(
    State(probe): State<Arc<Probe>>,
    claim: IdempotencyClaim,
    body: Bytes,
) -> Response<Body> {
    let run = probe.enter().await;
    if probe.fail_next.swap(false, SeqCst) {
        panic!("the handler failed on purpose");
    }
    let mut response = (
        StatusCode::CREATED,
        [
            ("content-type", "application/json"),
            ("location", "/payments/pay_1"),
            ("set-cookie", "session=secret"),
            ("x-repeated", "one"),
        ],
        format!(
            r#"{{"run":{run},"key":"{}","fence":{},"echo":{}}}"#,
            claim.key(),
            claim.fence(),
            String::from_utf8_lossy(&body)
        ),
    )
        .into_response();
    let headers = response.headers_mut();
    headers.append("x-repeated", HeaderValue::from_static("two"));
    headers.insert(
        "date",
        HeaderValue::from_static("Sun, 29 Nov 2026 10:00:00 GMT"),
    );
    response
}

async fn status_from_body(State(probe): State<Arc<Probe>>, body: String) -> StatusCode {
    probe.enter().await;
    StatusCode::from_u16(body.trim().parse().unwrap()).unwrap()
}

async fn big(State(probe): State<Arc<Probe>>) -> Vec<u8> {
    probe.enter().await;
    vec![b'x'; 64 * 1024]
}

async fn list(State(probe): State<Arc<Probe>>) -> &'static str {
    probe.enter().await;
    "[]"
}

fn app(layer: &IdempotencyLayer, probe: &Arc<Probe>) -> Router {
    Router::new()
        .route("/payments", post(pay).patch(pay).get(list))
        .route("/other", post(pay))
        .route("/status", post(status_from_body))
        .route("/big", post(big))
        .layer(layer.clone())
        .with_state(Arc::clone(probe))
}

fn request(method: Method, uri: &str, key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::builder().method(method).uri(uri);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

fn post_payment(key: &str, body: &str) -> Request<Body> {
    request(Method::POST, "/payments", Some(key), body)
}

async fn send<S, B>(service: &S, request: Request<Body>) -> Answer
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    support::call(service, request).await
}

#[tokio::test]
async fn a_duplicate_on_another_instance_waits_for_the_first_and_gets_its_answer() {
    let store = MemoryStore::new();
    let probe = Probe::gated();
    let a = app(&IdempotencyLayer::new(store.clone()), &probe);
    let b_layer = IdempotencyLayer::new(store.clone());
    let b = app(&b_layer, &probe);

    let first = tokio::spawn({
        let a = a.clone();
        async move { send(&a, post_payment("k-1", r#"{"amount":1}"#)).await }
    });
    probe.started.notified().await;
    let duplicate = tokio::spawn({
        let b = b.clone();
        async move { send(&b, post_payment("k-1", r#"{"amount":1}"#)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!duplicate.is_finished(), "the duplicate did not wait");
    probe.release_gate();

    let first = first.await.unwrap();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(duplicate.status, StatusCode::CREATED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(probe.runs(), 1);
    assert_eq!(b_layer.counters().snapshot().waits, 1);
}

#[tokio::test]
async fn past_the_wait_a_duplicate_gets_409_with_a_retry_after_from_recent_handlers() {
    let store = MemoryStore::new();
    let probe = Probe::gated();
    let layer = IdempotencyLayer::new(store.clone()).with_wait(Duration::from_millis(100));
    let app = app(&layer, &probe);
    // Handlers have been quick lately.
    probe.release_gate();
    for i in 0..5 {
        send(&app, post_payment(&format!("quick-{i}"), "{}")).await;
    }
    let gated = Probe::gated();
    let slow = self::app(&layer, &gated);
    let first = tokio::spawn({
        let slow = slow.clone();
        async move { send(&slow, post_payment("k-409", "{}")).await }
    });
    gated.started.notified().await;

    let conflict = send(&slow, post_payment("k-409", "{}")).await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.problem_type(), problem::IN_FLIGHT);
    assert_eq!(conflict.json()["idempotency_key"], "k-409");
    // Not the 30 s left on the lease: the handlers' recent durations, in whole seconds.
    assert_eq!(conflict.headers["retry-after"], "1");

    gated.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&slow, post_payment("k-409", "{}")).await.replayed());
    assert_eq!(gated.runs(), 1);
}

#[tokio::test]
async fn a_waiting_duplicate_runs_itself_when_the_first_releases_the_key() {
    let probe = Probe::gated();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let status = || request(Method::POST, "/status", Some("k-release"), "503");
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, status()).await }
    });
    probe.started.notified().await;
    let duplicate = tokio::spawn({
        let app = app.clone();
        async move { send(&app, status()).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    probe.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!duplicate.replayed(), "a released key was replayed");
    assert_eq!(probe.runs(), 2);
}

#[tokio::test]
async fn many_simultaneous_duplicates_run_once() {
    let store = MemoryStore::new();
    let probe = Probe::open();
    let instances: Vec<_> = (0..4)
        .map(|_| app(&IdempotencyLayer::new(store.clone()), &probe))
        .collect();
    let mut tasks = Vec::new();
    for i in 0..40 {
        let instance = instances[i % 4].clone();
        tasks.push(tokio::spawn(async move {
            send(&instance, post_payment("burst", "{}")).await.status
        }));
    }
    let mut created = 0;
    for task in tasks {
        match task.await.unwrap() {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert!(created >= 1);
    assert_eq!(probe.runs(), 1, "duplicates ran the handler more than once");
}

#[tokio::test]
async fn replay_keeps_status_headers_and_body_but_not_cookies_or_date() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let first = send(&app, post_payment("k-h", "{}")).await;
    assert_eq!(
        first.headers["set-cookie"], "session=secret",
        "the first caller gets its cookie"
    );

    let replay = send(&app, post_payment("k-h", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["location"], "/payments/pay_1");
    assert_eq!(replay.headers["content-type"], "application/json");
    let repeated: Vec<_> = replay.headers.get_all("x-repeated").iter().collect();
    assert_eq!(repeated, ["one", "two"]);
    assert!(
        replay.headers.get("set-cookie").is_none(),
        "Set-Cookie was replayed"
    );
    assert!(
        replay.headers.get("date").is_none(),
        "the stored Date was replayed"
    );
    assert_eq!(replay.body, first.body);
    assert_eq!(probe.runs(), 1);
}

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

#[tokio::test]
async fn a_dropped_caller_does_not_stop_the_handler_and_the_retry_replays() {
    let probe = Probe::gated();
    let store = MemoryStore::new();
    let app = app(&IdempotencyLayer::new(store), &probe);

    let caller = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-drop", "{}")).await }
    });
    probe.started.notified().await;
    caller.abort(); // the client disconnects mid-request
    assert!(caller.await.unwrap_err().is_cancelled());
    probe.release_gate();

    let retry = eventually_replayed(&app, || post_payment("k-drop", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(probe.runs(), 1);
}

/// Retries (as a client would after 409) until the response is a replay.
async fn eventually_replayed(app: &Router, request: impl Fn() -> Request<Body>) -> Answer {
    for _ in 0..100 {
        let answer = send(app, request()).await;
        if answer.replayed() {
            return answer;
        }
        assert_eq!(
            answer.status,
            StatusCode::CONFLICT,
            "only 409 may precede the replay"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("no replay after 2 s");
}

#[tokio::test]
async fn a_panic_is_a_500_and_the_retry_runs_cleanly() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    probe.fail_next.store(true, SeqCst);
    let failed = send(&app, post_payment("k-panic", "{}")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.problem_type(), problem::HANDLER_FAILED);

    let retry = send(&app, post_payment("k-panic", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert!(send(&app, post_payment("k-panic", "{}")).await.replayed());
    assert_eq!(probe.runs(), 2);
}

/// Work that panics outside the handler (a fingerprint hook, a completion policy) is answered
/// like every other answer of the layer: through the problem hook (or as a gRPC status), with
/// its outcome on the response and in the counters.
#[tokio::test]
async fn a_panic_outside_the_handler_is_answered_like_every_other_answer() {
    let house = |problem: &problem::Problem| {
        let body = format!(r#"{{"error":"{}"}}"#, problem.type_uri());
        let mut response = problem.to_response();
        *response.body_mut() = Bytes::from(body);
        response.headers_mut().insert(
            "content-type",
            HeaderValue::from_static("application/vnd.house+json"),
        );
        response
    };
    let probe = Probe::open();
    let hook_panics = IdempotencyLayer::new(MemoryStore::new())
        .with_fingerprint_body(|_, _| panic!("the fingerprint hook failed on purpose"))
        .with_problem_response(house);
    let http_app = app(&hook_panics, &probe);
    let response = http_app
        .oneshot(post_payment("k-hook", "{}"))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        response
            .extensions()
            .get::<tower_idempotency::IdempotencyOutcome>(),
        Some(&tower_idempotency::IdempotencyOutcome::HandlerFailed)
    );
    assert_eq!(
        response.headers()["content-type"],
        "application/vnd.house+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        format!(r#"{{"error":"{}"}}"#, problem::HANDLER_FAILED)
    );
    assert_eq!(hook_panics.counters().snapshot().handler_failures, 1);
    assert_eq!(probe.runs(), 0, "the handler never ran");

    let policy_panics = IdempotencyLayer::new(MemoryStore::new()).with_completion_policy(
        CompletionPolicy::new(|_| panic!("the policy failed on purpose")),
    );
    let grpc_app = app(&policy_panics, &probe);
    let mut grpc_call = post_payment("k-policy", "{}");
    grpc_call
        .headers_mut()
        .insert("content-type", HeaderValue::from_static("application/grpc"));
    let answer = send(&grpc_app, grpc_call).await;
    assert_eq!(
        answer.status,
        StatusCode::OK,
        "gRPC statuses travel in headers"
    );
    assert_eq!(answer.headers["grpc-status"], "13", "INTERNAL: {answer:?}");
    assert_eq!(policy_panics.counters().snapshot().handler_failures, 1);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn retryable_statuses_release_the_key_and_final_ones_complete_it() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let status =
        |key: &str, code: u16| request(Method::POST, "/status", Some(key), &code.to_string());

    let released = [500, 503, 429, 409, 408, 400, 404, 405, 415, 422];
    for code in released {
        let key = format!("k-{code}");
        assert_eq!(send(&app, status(&key, code)).await.status.as_u16(), code);
        let again = send(&app, status(&key, code)).await;
        assert!(!again.replayed(), "{code} must release the key");
    }
    assert_eq!(probe.runs(), 2 * released.len());

    for code in [200, 201, 402, 410] {
        let key = format!("k-{code}");
        send(&app, status(&key, code)).await;
        let again = send(&app, status(&key, code)).await;
        assert!(again.replayed(), "{code} must be stored");
        assert_eq!(again.status.as_u16(), code);
    }
    assert_eq!(probe.runs(), 2 * released.len() + 4);
}

#[tokio::test]
async fn the_completion_policy_is_configurable() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_completion_policy(CompletionPolicy::new(|_| Completion::Complete));
    let app = app(&layer, &probe);
    let req = || request(Method::POST, "/status", Some("k-store-5xx"), "502");
    send(&app, req()).await;
    let again = send(&app, req()).await;
    assert!(again.replayed());
    assert_eq!(again.status, StatusCode::BAD_GATEWAY);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn a_response_over_the_cache_limit_reaches_its_caller_and_never_runs_again() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(1024);
    let metrics = layer.counters();
    let app = app(&layer, &probe);
    let req = || request(Method::POST, "/big", Some("k-big-response"), "");

    let first = send(&app, req()).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        first.body.len(),
        64 * 1024,
        "the first caller gets the whole body"
    );

    let retry = send(&app, req()).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.problem_type(), problem::RESPONSE_NOT_STORED);
    assert!(retry.replayed());
    assert!(retry.json()["detail"].as_str().unwrap().contains("200"));
    assert_eq!(probe.runs(), 1);
    assert_eq!(metrics.snapshot().responses_not_stored, 1);
}

/// A bare tower service whose responses end with trailers, as gRPC responses do.
#[tokio::test]
async fn trailers_are_replayed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let runs = Arc::clone(&runs);
        move |_request: Request<tower_idempotency::RequestBody<Body>>| {
            let run = runs.fetch_add(1, SeqCst) + 1;
            async move {
                let mut trailers = HeaderMap::new();
                trailers.insert("grpc-status", HeaderValue::from_static("0"));
                trailers.insert("x-run", HeaderValue::from(run));
                let frames = futures_util::stream::iter([
                    Ok::<_, Infallible>(http_body::Frame::data(Bytes::from_static(b"payload"))),
                    Ok(http_body::Frame::trailers(trailers)),
                ]);
                let mut response = Response::new(Body::new(StreamBody::new(frames)));
                response
                    .headers_mut()
                    .insert("content-type", HeaderValue::from_static("application/grpc"));
                Ok::<_, Infallible>(response)
            }
        }
    });
    let service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(service);
    let req = || {
        Request::post("/pkg.Payments/Create")
            .header("content-type", "application/grpc")
            .header("idempotency-key", "k-trailers")
            .body(Body::from("message"))
            .unwrap()
    };
    let first = send(&service, req()).await;
    let replay = send(&service, req()).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let trailers = replay.trailers.expect("the replay has trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-run"], "1");
    assert_eq!(first.trailers.unwrap(), trailers);
    assert_eq!(runs.load(SeqCst), 1);
}

#[tokio::test]
async fn a_live_handler_keeps_its_lease_past_the_lease_length() {
    let probe = Probe::gated();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_millis(300))
        .with_wait(Duration::ZERO);
    let app = app(&layer, &probe);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-slow", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        send(&app, post_payment("k-slow", "{}")).await.status,
        StatusCode::CONFLICT
    );
    probe.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(probe.runs(), 1);
    assert_eq!(layer.counters().snapshot().leases_lost, 0);
}

#[tokio::test]
async fn a_stalled_owner_loses_its_lease_and_its_finalize_changes_nothing() {
    let probe = Probe::gated();
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::FrozenRenewals,
    };
    let stalled_layer = IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(200));
    let stalled = app(&stalled_layer, &probe);
    let healthy = app(&IdempotencyLayer::new(store.inner.clone()), &Probe::open());

    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { send(&stalled, post_payment("k-stall", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The lease ran out: a retry on another instance reclaims the key and runs.
    let retry = send(&healthy, post_payment("k-stall", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());

    probe.release_gate();
    let stale = first.await.unwrap();
    // The stale owner's caller gets the key's answer (the retry's), never its own.
    assert_eq!(stale.status, StatusCode::CREATED);
    assert!(stale.replayed(), "{stale:?}");
    assert_eq!(
        stale.body, retry.body,
        "the superseded attempt answered for the key"
    );
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);

    let replay = send(&healthy, post_payment("k-stall", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.body, retry.body,
        "the stale owner overwrote the stored response"
    );
}

/// An owner whose lease is really lost counts it once: its renewal, sent when the instance
/// thawed, finds another owner, and so does its finalize; one loss, not two.
#[tokio::test]
async fn a_lease_lost_once_is_counted_once() {
    let probe = Probe::gated();
    let memory = MemoryStore::new();
    let stalled = Faulty {
        inner: memory.clone(),
        fault: StoreFault::StalledRenewals(Duration::from_millis(800)),
    };
    let stalled_layer = IdempotencyLayer::new(stalled).with_lease(Duration::from_millis(200));
    let stalled = app(&stalled_layer, &probe);
    let healthy = app(&IdempotencyLayer::new(memory), &Probe::open());
    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { send(&stalled, post_payment("k-lost-once", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = send(&healthy, post_payment("k-lost-once", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    // The stalled renewal reaches the store (and finds the retry's record), then the stale
    // owner finalizes.
    tokio::time::sleep(Duration::from_millis(700)).await;
    probe.release_gate();
    let stale = first.await.unwrap();
    assert_eq!(stale.body, retry.body);
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);
}

/// A renewal that reaches the store after this owner's own completion (the completion is
/// written, and answered late, as when a front store hangs after the authority completed) is
/// no loss: nothing is counted, and the key is this owner's answer.
#[tokio::test]
async fn a_renewal_that_meets_its_owners_own_completion_is_no_loss() {
    let probe = Probe::open();
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::SlowCompletes(Duration::from_millis(700)),
    };
    let lease = Duration::from_millis(300);
    let layer = IdempotencyLayer::new(store.clone()).with_lease(lease);
    let answer = send(&app(&layer, &probe), post_payment("k-own", "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let other = app(&IdempotencyLayer::new(store.inner.clone()), &Probe::open());
    let replay = send(&other, post_payment("k-own", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, answer.body);
    assert_eq!(probe.runs(), 1);
    let seen = layer.counters().snapshot();
    assert_eq!(seen.leases_lost, 0, "{seen:?}");
}

/// A service whose first response body fails after `good` bytes; later ones succeed.
fn failing_body_service(
    good: usize,
    attempts: Arc<AtomicUsize>,
) -> impl Service<
    Request<tower_idempotency::RequestBody<Body>>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(
        move |_request: Request<tower_idempotency::RequestBody<Body>>| {
            let attempt = attempts.fetch_add(1, SeqCst);
            async move {
                let rest: Result<_, std::io::Error> = if attempt == 0 {
                    Err(std::io::Error::other("disk gone"))
                } else {
                    Ok(http_body::Frame::data(Bytes::from_static(b"-rest")))
                };
                let frames = futures_util::stream::iter([
                    Ok(http_body::Frame::data(Bytes::from(vec![b'p'; good]))),
                    rest,
                ]);
                Ok::<_, Infallible>(Response::new(Body::new(StreamBody::new(frames))))
            }
        },
    )
}

#[tokio::test]
async fn a_body_that_fails_before_anything_was_sent_is_a_500_that_releases_the_key() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(failing_body_service(7, Arc::clone(&attempts)));
    let req = || post_payment("k-body-error", "");
    let failed = send(&service, req()).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.problem_type(), problem::HANDLER_FAILED);

    let retry = send(&service, req()).await;
    assert_eq!(retry.body, "ppppppp-rest");
    assert!(!retry.replayed());
    assert_eq!(attempts.load(SeqCst), 2);
}

#[tokio::test]
async fn a_streamed_body_that_fails_midway_reaches_the_caller_as_an_error_and_releases_the_key() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_max_response_body(16))
        .service(failing_body_service(32, Arc::clone(&attempts)));
    let req = || post_payment("k-stream-error", "");
    let response = service.clone().oneshot(req()).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the head was already sent"
    );
    assert!(
        response.into_body().collect().await.is_err(),
        "the caller must see the body fail"
    );

    let retry = eventually_not_in_flight(&service, req).await;
    assert_eq!(retry.body.len(), 32 + 5);
    assert!(!retry.replayed());
    assert_eq!(attempts.load(SeqCst), 2);
}

async fn eventually_not_in_flight<S, B>(service: &S, request: impl Fn() -> Request<Body>) -> Answer
where
    S: Service<Request<Body>, Response = Response<B>, Error = Infallible> + Clone,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    for _ in 0..100 {
        let answer = send(service, request()).await;
        if answer.status != StatusCode::CONFLICT {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("still in flight after 2 s");
}

#[tokio::test]
async fn a_service_error_is_passed_on_and_releases_the_key() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let attempts = Arc::clone(&attempts);
        move |_request: Request<tower_idempotency::RequestBody<Body>>| {
            let attempt = attempts.fetch_add(1, SeqCst);
            async move {
                if attempt == 0 {
                    Err("overloaded")
                } else {
                    Ok(Response::new(Body::from("done")))
                }
            }
        }
    });
    let mut service = tower::ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(service);
    let error = service
        .ready()
        .await
        .unwrap()
        .call(post_payment("k-err", ""))
        .await
        .unwrap_err();
    assert_eq!(error, "overloaded");

    for _ in 0..100 {
        match service
            .ready()
            .await
            .unwrap()
            .call(post_payment("k-err", ""))
            .await
        {
            Ok(response) if response.status() == StatusCode::CONFLICT => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(response) => {
                assert_eq!(
                    response.into_body().collect().await.unwrap().to_bytes(),
                    "done"
                );
                assert_eq!(attempts.load(SeqCst), 2);
                return;
            }
            Err(e) => panic!("second attempt failed: {e}"),
        }
    }
    panic!("the key was never released");
}

#[tokio::test]
async fn metrics_count_what_happened() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new());
    let app = app(&layer, &probe);
    send(&app, post_payment("k-metrics", "{}")).await;
    send(&app, post_payment("k-metrics", "{}")).await;
    send(&app, post_payment("k-metrics", "{\"other\":1}")).await;
    send(&app, post_payment("", "{}")).await;
    let counts = layer.counters().snapshot();
    assert_eq!(counts.executions, 1);
    assert_eq!(counts.completions, 1);
    assert_eq!(counts.replays, 1);
    assert_eq!(counts.mismatches, 1);
    assert_eq!(counts.bad_requests, 1);
}

#[tokio::test]
async fn the_handler_sees_its_claim() {
    let probe = Probe::open();
    let app = app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let answer = send(&app, post_payment("k-claim", "{}")).await;
    let json = answer.json();
    assert_eq!(json["key"], "k-claim");
    assert!(json["fence"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn the_completion_policy_sees_headers_that_are_not_stored() {
    // Complete only responses that say they are final; never store that marker.
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_unstored_headers([http::HeaderName::from_static("x-final")])
        .with_completion_policy(CompletionPolicy::new(|response| {
            if response.headers.contains_key("x-final") {
                Completion::Complete
            } else {
                Completion::Release
            }
        }));
    let service = tower::ServiceBuilder::new()
        .layer(layer)
        .service(tower::service_fn(
            |_request: Request<tower_idempotency::RequestBody<Body>>| async {
                let mut response = Response::new(Body::from("final answer"));
                response
                    .headers_mut()
                    .insert("x-final", HeaderValue::from_static("yes"));
                Ok::<_, Infallible>(response)
            },
        ));
    assert!(!send(&service, post_payment("k-final", "")).await.replayed());
    let replay = send(&service, post_payment("k-final", "")).await;
    assert!(replay.replayed(), "the policy did not see x-final");
    assert!(
        replay.headers.get("x-final").is_none(),
        "an unstored header was replayed"
    );
}
