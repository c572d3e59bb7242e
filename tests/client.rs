//! The client layer against the crate's own server layer: two instances sharing a Postgres
//! store, with faults between client and server (connections dropped after the request reached
//! the server, attempts that time out before the handler ends, 503s and 502s). Counted where
//! it happens: the handler's effects per key, and the requests that reached the servers.

mod support;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{Request, State},
    http::StatusCode,
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use support::{Fault, FaultProxy, TestSchema};
use tower::{ServiceBuilder, ServiceExt, retry::budget::TpsBudget};
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer,
    client::{ClientBody, ClientOutcome, IdempotencyClient, IdempotencyClientLayer},
    store::PostgresStore,
};

/// What happened at the servers: the handler's effects per key, and every request that
/// arrived (key, when), before the idempotency layer.
#[derive(Clone, Default)]
struct Seen {
    effects: Arc<Mutex<HashMap<String, u32>>>,
    arrivals: Arc<Mutex<Vec<(String, Instant)>>>,
}

impl Seen {
    fn effects(&self, key: &str) -> u32 {
        self.effects.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    fn arrivals(&self, key: &str) -> Vec<Instant> {
        let arrivals = self.arrivals.lock().unwrap();
        arrivals
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, at)| *at)
            .collect()
    }

    fn all_arrivals(&self) -> usize {
        self.arrivals.lock().unwrap().len()
    }
}

#[derive(Clone)]
struct App {
    seen: Seen,
    work: Duration,
}

async fn pay(State(app): State<App>, claim: IdempotencyClaim, body: Bytes) -> Response {
    tokio::time::sleep(app.work).await;
    let key = claim.key().as_str().to_owned();
    let run = {
        let mut effects = app.seen.effects.lock().unwrap();
        let run = effects.entry(key.clone()).or_default();
        *run += 1;
        *run
    };
    let body = format!(
        r#"{{"key":"{key}","run":{run},"echo":{}}}"#,
        String::from_utf8_lossy(&body)
    );
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

/// Counts every request at the door, and answers a canned status where the test says so.
async fn door(
    State((seen, canned)): State<(Seen, Canned)>,
    request: Request,
    next: Next,
) -> Response {
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let first = seen.arrivals(&key).is_empty();
    seen.arrivals.lock().unwrap().push((key, Instant::now()));
    match canned.answer(first) {
        Some(response) => response,
        None => next.run(request).await,
    }
}

/// A status the door answers instead of the app.
#[derive(Clone, Copy)]
enum Canned {
    Nothing,
    /// 503 with `Retry-After: 1` to the first request of each key.
    FirstUnavailable,
    /// This status to every request.
    Always(StatusCode),
    /// 429 to the first request of each key, with a `Retry-After` HTTP date this far ahead.
    FirstTooManyUntil(Duration),
}

impl Canned {
    fn answer(self, first: bool) -> Option<Response> {
        match self {
            Canned::Nothing => None,
            Canned::FirstUnavailable if first => {
                Some((StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")]).into_response())
            }
            Canned::FirstUnavailable => None,
            Canned::Always(status) => Some(status.into_response()),
            Canned::FirstTooManyUntil(ahead) if first => {
                let until = httpdate::fmt_http_date(std::time::SystemTime::now() + ahead);
                Some((StatusCode::TOO_MANY_REQUESTS, [("retry-after", until)]).into_response())
            }
            Canned::FirstTooManyUntil(_) => None,
        }
    }
}

/// Two instances of the app, each its own router and layer, sharing one Postgres store.
async fn fleet(schema: &TestSchema, work: Duration, canned: Canned) -> (Seen, Vec<SocketAddr>) {
    fleet_with(schema, work, canned, |layer| layer).await
}

/// [`fleet`], its layers configured by `configure` beyond the tests' own.
async fn fleet_with(
    schema: &TestSchema,
    work: Duration,
    canned: Canned,
    configure: fn(IdempotencyLayer) -> IdempotencyLayer,
) -> (Seen, Vec<SocketAddr>) {
    let seen = Seen::default();
    let mut addrs = Vec::new();
    for _ in 0..2 {
        let layer = IdempotencyLayer::new(PostgresStore::new(schema.pool.clone()))
            .with_wait(Duration::from_millis(300));
        let layer = configure(layer);
        let app = App {
            seen: seen.clone(),
            work,
        };
        let router = Router::new()
            .route("/payments", post(pay).route_layer(layer))
            .with_state(app)
            .layer(middleware::from_fn_with_state((seen.clone(), canned), door));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    }
    (seen, addrs)
}

type Http = Client<HttpConnector, ClientBody<Full<Bytes>>>;

/// A real HTTP client, one connection per attempt (so that each attempt meets the proxy's next
/// fault), behind the client layer.
fn client(layer: IdempotencyClientLayer) -> IdempotencyClient<Http> {
    let http = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    ServiceBuilder::new().layer(layer).service(http)
}

/// The client's answer: status, body, what the call took.
struct Called {
    status: StatusCode,
    body: serde_json::Value,
    outcome: ClientOutcome,
}

/// A payment request to `url`'s `/payments`, with `key` when given.
fn payment(url: &str, key: Option<&str>, body: &str) -> http::Request<Full<Bytes>> {
    let mut request =
        http::Request::post(format!("{url}/payments")).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

async fn post_payment(
    client: &IdempotencyClient<Http>,
    url: &str,
    key: Option<&str>,
    body: &str,
) -> Called {
    let response = client
        .clone()
        .oneshot(payment(url, key, body))
        .await
        .unwrap();
    let outcome = *response.extensions().get::<ClientOutcome>().unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    Called {
        status,
        body,
        outcome,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_lost_after_the_server_got_the_request_are_retried_and_run_once() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::from_millis(50), Canned::Nothing).await;
    // Every other connection is cut: after the request, or after the server answered.
    let plan = vec![
        Fault::DropAfterRequest,
        Fault::None,
        Fault::DropAnswer,
        Fault::None,
    ];
    let proxy = FaultProxy::start(addrs, plan).await;
    let client = client(
        IdempotencyClientLayer::new()
            .with_backoff(Duration::from_millis(20), Duration::from_millis(100)),
    );

    let calls = 10;
    for n in 0..calls {
        let called = post_payment(&client, &proxy.url, None, &format!(r#"{{"n":{n}}}"#)).await;
        assert_eq!(called.status, StatusCode::CREATED, "{}", called.body);
        let key = called.body["key"].as_str().unwrap().to_owned();
        assert_eq!(called.body["echo"]["n"], n, "the retry sent the same body");
        assert_eq!(called.body["run"], 1);
        assert_eq!(
            seen.effects(&key),
            1,
            "{key} ran {} times",
            seen.effects(&key)
        );
        assert_eq!(
            called.outcome.attempts, 2,
            "one lost attempt, then the answer"
        );
        assert!(
            called.outcome.replayed,
            "the second attempt got the first's answer"
        );
        assert_eq!(
            seen.arrivals(&key).len(),
            2,
            "both attempts carried the same key"
        );
    }
    println!(
        "{calls} calls through a proxy that cut every other connection: {} connections, every call ran once",
        proxy.connections()
    );
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_that_time_out_before_the_handler_ends_get_its_answer() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::from_millis(600), Canned::Nothing).await;
    let client = client(
        IdempotencyClientLayer::new()
            .with_attempt_timeout(Duration::from_millis(200))
            .with_max_attempts(10)
            .with_backoff(Duration::from_millis(20), Duration::from_millis(100)),
    );
    let url = format!("http://{}", addrs[0]);
    let called = post_payment(&client, &url, None, "{}").await;
    assert_eq!(called.status, StatusCode::CREATED, "{}", called.body);
    let key = called.body["key"].as_str().unwrap();
    assert_eq!(seen.effects(key), 1);
    assert!(called.outcome.attempts >= 2, "{:?}", called.outcome);
    assert!(called.outcome.replayed);
    println!(
        "a 600 ms handler, 200 ms attempts: answered after {} attempts, run once",
        called.outcome.attempts
    );
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_with_retry_after_is_retried_no_sooner_than_it_says() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::ZERO, Canned::FirstUnavailable).await;
    let client = client(IdempotencyClientLayer::new());
    let url = format!("http://{}", addrs[0]);
    let called = post_payment(&client, &url, Some("k-503"), "{}").await;
    assert_eq!(called.status, StatusCode::CREATED);
    assert_eq!(called.outcome.attempts, 2);
    let arrivals = seen.arrivals("k-503");
    let waited = arrivals[1] - arrivals[0];
    assert!(
        waited >= Duration::from_secs(1),
        "retried after {waited:?}, Retry-After said 1 s"
    );
    assert!(waited < Duration::from_millis(2500), "{waited:?}");
    assert_eq!(seen.effects("k-503"), 1);
    println!("Retry-After: 1 honoured: retried after {waited:?}");
    schema.drop().await;
}

/// A `Retry-After` given as an HTTP date (2 s ahead of the server's `Date`) is honoured: the 429
/// is retried no sooner than the date. It was ignored: a 429 without a number of seconds was
/// final, and the caller got it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_an_http_date_is_retried_no_sooner_than_the_date() {
    let schema = TestSchema::new().await;
    let canned = Canned::FirstTooManyUntil(Duration::from_secs(2));
    let (seen, addrs) = fleet(&schema, Duration::ZERO, canned).await;
    let client = client(IdempotencyClientLayer::new());
    let url = format!("http://{}", addrs[0]);
    let called = post_payment(&client, &url, Some("k-429-date"), "{}").await;
    assert_eq!(called.status, StatusCode::CREATED, "{}", called.body);
    assert_eq!(called.outcome.attempts, 2);
    let arrivals = seen.arrivals("k-429-date");
    let waited = arrivals[1] - arrivals[0];
    // Dates have whole seconds: 2 s ahead is 1 to 2 s after the server's `Date`, itself up
    // to a second behind.
    assert!(waited >= Duration::from_secs(1), "retried after {waited:?}");
    assert!(waited < Duration::from_millis(3500), "{waited:?}");
    assert_eq!(seen.effects("k-429-date"), 1);
    println!("Retry-After as an HTTP date honoured: retried after {waited:?}");
    schema.drop().await;
}

/// A call whose every attempt lost its answer (the server ran it, the connection dropped)
/// ends in an error that carries its key; the caller retries the same logical call with that
/// key later and gets the first run's answer: one effect. Without the key, the retry was a new
/// call, and the payment ran twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_gave_up_carries_its_key_and_a_retry_with_it_runs_nothing_twice() {
    use tower_idempotency::client::{CallError, ClientError};
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::ZERO, Canned::Nothing).await;
    let proxy = FaultProxy::start(addrs.clone(), vec![Fault::DropAnswer]).await;
    let client = client(
        IdempotencyClientLayer::new()
            .with_max_attempts(3)
            .with_backoff(Duration::from_millis(10), Duration::from_millis(20)),
    );
    let request = payment(&proxy.url, None, "{}");
    let error = client.clone().oneshot(request).await.unwrap_err();
    let gave_up = error.downcast_ref::<CallError>().expect("a CallError");
    assert_eq!(gave_up.attempts(), 3);
    let key = gave_up.key().to_owned();
    assert!(
        gave_up.to_string().contains(&key),
        "the message names the key: {gave_up}"
    );
    let source = std::error::Error::source(gave_up).expect("the last attempt's error");
    assert!(source.downcast_ref::<ClientError>().is_none(), "{source}");
    assert_eq!(
        seen.arrivals(&key).len(),
        3,
        "every attempt carried the key"
    );
    assert_eq!(seen.effects(&key), 1);

    // The same logical call, later, on a healthy path: the first run's answer.
    let url = format!("http://{}", addrs[1]);
    let again = post_payment(&client, &url, Some(&key), "{}").await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    assert!(again.outcome.replayed);
    assert_eq!(again.body["run"], 1);
    assert_eq!(seen.effects(&key), 1, "one payment for the logical call");
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_mismatch_is_final_and_never_retried() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::ZERO, Canned::Nothing).await;
    let client = client(IdempotencyClientLayer::new());
    let url = format!("http://{}", addrs[0]);
    assert_eq!(
        post_payment(&client, &url, Some("k-422"), r#"{"a":1}"#)
            .await
            .status,
        StatusCode::CREATED
    );
    let mismatch = post_payment(&client, &url, Some("k-422"), r#"{"a":2}"#).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(mismatch.outcome.attempts, 1);
    assert_eq!(seen.arrivals("k-422").len(), 2, "one request per call");
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_answers_back_off_with_full_jitter_up_to_the_attempt_cap() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(
        &schema,
        Duration::ZERO,
        Canned::Always(StatusCode::BAD_GATEWAY),
    )
    .await;
    let (base, cap) = (Duration::from_millis(40), Duration::from_millis(160));
    let client = client(
        IdempotencyClientLayer::new()
            .with_max_attempts(5)
            .with_backoff(base, cap),
    );
    let url = format!("http://{}", addrs[0]);
    let mut pauses = Vec::new();
    for n in 0..6 {
        let key = format!("k-502-{n}");
        let called = post_payment(&client, &url, Some(&key), "{}").await;
        assert_eq!(
            called.status,
            StatusCode::BAD_GATEWAY,
            "the last answer as it was"
        );
        assert_eq!(called.outcome.attempts, 5);
        let arrivals = seen.arrivals(&key);
        assert_eq!(arrivals.len(), 5, "attempts are capped");
        for (retry, pair) in arrivals.windows(2).enumerate() {
            let pause = pair[1] - pair[0];
            let ceiling = (base * 2u32.pow(retry as u32)).min(cap);
            // Full jitter: anywhere from zero to the ceiling (plus the round trip).
            assert!(
                pause <= ceiling + Duration::from_millis(60),
                "retry {retry}: {pause:?} over {ceiling:?}"
            );
            pauses.push(pause);
        }
    }
    let (shortest, longest) = (pauses.iter().min().unwrap(), pauses.iter().max().unwrap());
    assert!(
        *longest - *shortest > Duration::from_millis(20),
        "no jitter: {pauses:?}"
    );
    println!("backoff pauses from {shortest:?} to {longest:?}, ceilings 40/80/160/160 ms");
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_budget_stops_a_retry_storm() {
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(
        &schema,
        Duration::ZERO,
        Canned::Always(StatusCode::SERVICE_UNAVAILABLE),
    )
    .await;
    let url = format!("http://{}", addrs[0]);
    let calls = 40;
    let storm = |layer: IdempotencyClientLayer| {
        let client = client(
            layer
                .with_max_attempts(4)
                .with_backoff(Duration::from_millis(1), Duration::from_millis(2)),
        );
        let url = url.clone();
        async move {
            for n in 0..calls {
                post_payment(&client, &url, Some(&format!("storm-{n}")), "{}").await;
            }
        }
    };
    // A generous budget: every call makes its 4 attempts.
    let unbounded = Arc::new(TpsBudget::new(Duration::from_secs(1), 1000, 1000.0));
    storm(IdempotencyClientLayer::new().with_budget(unbounded)).await;
    let without = seen.all_arrivals();
    assert_eq!(without, calls * 4);
    // 10 % of the calls, and 1 a second: about 5 retries for the 40 calls.
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(1), 1, 0.1));
    storm(IdempotencyClientLayer::new().with_budget(budget)).await;
    let with = seen.all_arrivals() - without;
    assert!(
        with <= calls + calls / 10 + 3,
        "{with} requests for {calls} calls"
    );
    assert!(with > calls, "the budget allows some retries: {with}");
    println!(
        "a fleet answering 503: {without} requests for {calls} calls without a budget, {with} with one"
    );
    schema.drop().await;
}

/// A dead-letter retry, resumed once its key's answer is gone: the bug idempotency exists to
/// kill, and the protection the server says on its answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_resumed_past_the_servers_protection_is_refused_instead_of_run_twice() {
    use tower_idempotency::client::{CallError, CallStarted, ProtectionEnded};
    let schema = TestSchema::new().await;
    let retention = Duration::from_secs(3);
    let (seen, addrs) = fleet_with(&schema, Duration::ZERO, Canned::Nothing, |layer| {
        layer
            .with_retention(Duration::from_secs(3))
            .with_protected_until_header(true)
    })
    .await;
    let proxy = FaultProxy::start(addrs.clone(), vec![Fault::DropAnswer]).await;
    let quick = || {
        IdempotencyClientLayer::new()
            .with_max_attempts(2)
            .with_backoff(Duration::from_millis(10), Duration::from_millis(20))
    };
    let client = client(quick());

    // The call ran, and its caller never heard: it keeps the key and the start for later.
    let request = payment(&proxy.url, None, "{}");
    let error = client.clone().oneshot(request).await.unwrap_err();
    let gave_up = error.downcast_ref::<CallError>().expect("a CallError");
    let (key, started) = (gave_up.key().to_owned(), gave_up.started());
    assert_eq!(seen.effects(&key), 1);

    // Another call teaches the client how long the server protects a key.
    let url = format!("http://{}", addrs[0]);
    let teacher = post_payment(&client, &url, None, "{}").await;
    assert_eq!(teacher.status, StatusCode::CREATED);
    let resume = |client: &IdempotencyClient<Http>| {
        let mut request = payment(&url, Some(&key), "{}");
        request.extensions_mut().insert(CallStarted(started));
        client.clone().oneshot(request)
    };

    // Resumed while the key is protected: the first run's answer.
    let answer = resume(&client).await.unwrap();
    assert!(answer.extensions().get::<ClientOutcome>().unwrap().replayed);
    assert_eq!(seen.effects(&key), 1);

    // Resumed past it: not sent.
    tokio::time::sleep(retention + Duration::from_millis(500)).await;
    let arrived = seen.arrivals(&key).len();
    let error = resume(&client).await.unwrap_err();
    let ended = error
        .downcast_ref::<ProtectionEnded>()
        .expect("ProtectionEnded");
    assert_eq!((ended.key(), ended.attempts()), (key.as_str(), 0));
    assert!(ended.protection() < retention, "{:?}", ended.protection());
    assert_eq!(seen.arrivals(&key).len(), arrived, "nothing sent");
    assert_eq!(seen.effects(&key), 1, "one payment for the logical call");

    // What it spared: a client that never learned the protection sends it, and it runs again.
    let naive = resume(&self::client(quick())).await.unwrap();
    assert_eq!(naive.status(), StatusCode::CREATED);
    assert_eq!(
        seen.effects(&key),
        2,
        "the second payment of a naive client"
    );
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_where_the_keys_protection_ends() {
    use tower_idempotency::client::ProtectionEnded;
    let schema = TestSchema::new().await;
    let (seen, addrs) = fleet(&schema, Duration::ZERO, Canned::Nothing).await;
    let proxy = FaultProxy::start(addrs, vec![Fault::DropAnswer]).await;
    // A server known to keep keys 300 ms; retries every 100 to 200 ms, up to 20 attempts.
    let client = client(
        IdempotencyClientLayer::new()
            .with_max_attempts(20)
            .with_backoff(Duration::from_millis(100), Duration::from_millis(200))
            .with_key_protection(Duration::from_millis(300)),
    );
    let request = payment(&proxy.url, None, "{}");
    let started = Instant::now();
    let error = client.clone().oneshot(request).await.unwrap_err();
    let ended = error
        .downcast_ref::<ProtectionEnded>()
        .expect("ProtectionEnded");
    assert!((1..20).contains(&ended.attempts()), "{}", ended.attempts());
    assert!(
        std::error::Error::source(ended).is_some(),
        "the last attempt's error"
    );
    let arrivals = seen.arrivals(ended.key());
    assert_eq!(arrivals.len() as u32, ended.attempts());
    // No attempt starts past the protection (an attempt started just before it arrives a
    // moment later).
    let last = arrivals.last().unwrap().duration_since(started);
    assert!(last < Duration::from_millis(400), "{last:?}");
    assert_eq!(seen.effects(ended.key()), 1);
    schema.drop().await;
}
