//! Behaviour of the layer through a real axum router, on the memory store.
//!
//! "Instances" here are separate routers (separate layer and service stacks) sharing one store,
//! the way separate processes share Redis and Postgres; the fleet tests with real processes and
//! real stores live in `fleet.rs`.

#[path = "../support/mod.rs"]
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
    IdempotencyClaim, IdempotencyLayer, MemoryStore, policy::Completion, policy::CompletionPolicy,
    problem,
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

mod duplicates;
mod refusals;
mod completion;
mod leases;
mod protection;
mod webhooks;
