//! A real tonic client against a real tonic server with the layer: the same guarantees as HTTP,
//! spoken in gRPC statuses.

mod support;

#[path = "../examples/grpc/payments_proto.rs"]
mod payments_proto;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst},
    },
    time::Duration,
};

use payments_proto::{CreatePaymentRequest, Payment, Payments, PaymentsClient, PaymentsServer};
use support::{TestSchema, redis_url};
use tokio::sync::{Notify, Semaphore};
use tonic::{Code, Request, Response, Status, transport::Channel};
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer, MemoryStore,
    store::{PostgresStore, RedisStore, TieredStore},
};
use uuid::Uuid;

/// A handler the tests steer: it counts its runs, can be held at a gate, and can fail its next
/// run with UNAVAILABLE.
#[derive(Clone, Default)]
struct Probe {
    runs: Arc<AtomicUsize>,
    started: Arc<Notify>,
    gate: Option<Arc<Semaphore>>,
    unavailable_next: Arc<AtomicBool>,
}

impl Payments for Probe {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        let run = self.runs.fetch_add(1, SeqCst) + 1;
        self.started.notify_one();
        if let Some(gate) = &self.gate {
            let _permit = gate.acquire().await.unwrap();
        }
        if self.unavailable_next.swap(false, SeqCst) {
            return Err(Status::unavailable("provider down, try again"));
        }
        let claim = request
            .extensions()
            .get::<IdempotencyClaim>()
            .cloned()
            .unwrap();
        let new = request.into_inner();
        if new.amount_cents <= 0 {
            return Err(Status::invalid_argument("amount_cents must be positive"));
        }
        if new.amount_cents > 1_000_000 {
            return Err(Status::failed_precondition(format!(
                "over the account's limit (run {run})"
            )));
        }
        Ok(Response::new(Payment {
            id: format!("pay_{run}"),
            amount_cents: new.amount_cents,
            currency: new.currency,
            customer: new.customer,
            charge_id: format!("ch_{run}"),
            idempotency_key: claim.key().to_string(),
        }))
    }
}

/// Serves `probe` behind `layer` on a free port; returns a connected client.
async fn serve(layer: IdempotencyLayer, probe: &Probe) -> PaymentsClient<Channel> {
    PaymentsClient::connect(serve_at(layer, probe).await)
        .await
        .unwrap()
}

/// Serves `probe` behind `layer` on a free port; returns its URL.
async fn serve_at(layer: IdempotencyLayer, probe: &Probe) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = tonic::transport::Server::builder()
        .layer(layer)
        .add_service(PaymentsServer::new(probe.clone()));
    tokio::spawn(server.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    url
}

fn create(key: &str, amount_cents: i64) -> Request<CreatePaymentRequest> {
    let mut request = Request::new(CreatePaymentRequest {
        amount_cents,
        currency: "usd".into(),
        customer: "cus_1".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", key.parse().unwrap());
    request
}

/// Metadata (headers and trailers, which tonic merges for unary calls) a replay must repeat.
fn comparable(response: &Response<Payment>) -> Vec<(String, String)> {
    let mut pairs: Vec<_> = response
        .metadata()
        .clone()
        .into_headers()
        .iter()
        .filter(|(name, _)| {
            *name != "date" && *name != tower_idempotency::headers::IDEMPOTENT_REPLAYED
        })
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    pairs.sort();
    pairs
}

fn replayed(response: &Response<Payment>) -> bool {
    response
        .metadata()
        .get(tower_idempotency::headers::IDEMPOTENT_REPLAYED.as_str())
        .is_some_and(|v| v == "true")
}

/// The whole contract, on whatever store `layer` uses.
async fn behaves_like_http(layer: IdempotencyLayer) {
    let probe = Probe::default();
    let mut client = serve(layer.clone(), &probe).await;

    // First call, then the replay: same message, same metadata and trailers.
    let first = client.create_payment(create("g-1", 4900)).await.unwrap();
    let again = client.create_payment(create("g-1", 4900)).await.unwrap();
    assert!(!replayed(&first));
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(comparable(&again), comparable(&first));
    assert!(
        comparable(&first)
            .iter()
            .any(|(name, value)| name == "grpc-status" && value == "0"),
        "the trailers were not compared: {:?}",
        comparable(&first)
    );
    assert_eq!(first.get_ref().idempotency_key, "g-1");
    assert_eq!(probe.runs.load(SeqCst), 1);

    // The same key with another message: a status clients do not retry.
    let changed = client
        .create_payment(create("g-1", 5000))
        .await
        .unwrap_err();
    assert_eq!(changed.code(), Code::FailedPrecondition, "{changed:?}");

    // UNAVAILABLE leaves the key free: the retry runs the handler again.
    probe.unavailable_next.store(true, SeqCst);
    let unavailable = client.create_payment(create("g-2", 100)).await.unwrap_err();
    assert_eq!(unavailable.code(), Code::Unavailable);
    let retried = client.create_payment(create("g-2", 100)).await.unwrap();
    assert!(!replayed(&retried));
    assert_eq!(probe.runs.load(SeqCst), 3);

    // A deterministic error is the call's final word: stored and replayed.
    let refused = client
        .create_payment(create("g-3", 2_000_000))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let refused_again = client
        .create_payment(create("g-3", 2_000_000))
        .await
        .unwrap_err();
    assert_eq!(refused_again.code(), Code::FailedPrecondition);
    assert_eq!(refused_again.message(), refused.message());
    assert_eq!(probe.runs.load(SeqCst), 4);

    // INVALID_ARGUMENT says nothing was executed: the key is released, and the corrected call
    // with the same key runs.
    let invalid = client.create_payment(create("g-5", -1)).await.unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    let corrected = client.create_payment(create("g-5", 100)).await.unwrap();
    assert!(!replayed(&corrected));
    assert_eq!(probe.runs.load(SeqCst), 6);

    // Keys that are bad, or missing where required: INVALID_ARGUMENT, nothing runs.
    let bad = client
        .create_payment(create("has space", 100))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    let unkeyed = client
        .create_payment(Request::new(CreatePaymentRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(unkeyed.code(), Code::InvalidArgument);
    assert_eq!(probe.runs.load(SeqCst), 6);

    // A concurrent call while the first runs waits for its answer; past the wait, a status
    // clients retry, with a pushback hint.
    let gated = Probe {
        gate: Some(Arc::new(Semaphore::new(0))),
        ..Probe::default()
    };
    let mut gated_client = serve(layer.clone().with_wait(Duration::ZERO), &gated).await;
    let mut waiting_client = serve(layer, &gated).await;
    let first = tokio::spawn({
        let mut client = gated_client.clone();
        async move { client.create_payment(create("g-4", 700)).await }
    });
    gated.started.notified().await;
    let busy = gated_client
        .create_payment(create("g-4", 700))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
    let pushback: u64 = busy
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback > 0);
    let waiting =
        tokio::spawn(async move { waiting_client.create_payment(create("g-4", 700)).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    gated.gate.as_ref().unwrap().add_permits(1);
    let first = first.await.unwrap().unwrap();
    let waited = waiting.await.unwrap().unwrap();
    assert!(replayed(&waited));
    assert_eq!(waited.get_ref(), first.get_ref());
    let replay = gated_client
        .create_payment(create("g-4", 700))
        .await
        .unwrap();
    assert!(replayed(&replay));
    assert_eq!(replay.get_ref(), first.get_ref());
    assert_eq!(gated.runs.load(SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_on_the_memory_store() {
    behaves_like_http(IdempotencyLayer::new(MemoryStore::new()).with_key_required(true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_on_redis_in_front_of_postgres() {
    let schema = TestSchema::new().await;
    let redis = RedisStore::open(&redis_url())
        .unwrap()
        .with_prefix(format!("test:{}:", Uuid::new_v4()));
    let store = TieredStore::new(redis, PostgresStore::new(schema.pool.clone()));
    behaves_like_http(
        IdempotencyLayer::new(store)
            .with_key_required(true)
            .with_lease(Duration::from_secs(10)),
    )
    .await;
    schema.drop().await;
}

#[tokio::test]
async fn the_grpc_example_charges_once() {
    let app = support::Proc::example("grpc_payments", &[]).await;
    let mut client = PaymentsClient::connect(format!("http://127.0.0.1:{}", app.port))
        .await
        .unwrap();
    let first = client.create_payment(create("ex-1", 4900)).await.unwrap();
    let replay = client.create_payment(create("ex-1", 4900)).await.unwrap();
    assert!(replayed(&replay));
    assert_eq!(replay.get_ref(), first.get_ref());
    assert!(first.get_ref().id.starts_with("pay_"));
    let changed = client.create_payment(create("ex-1", 1)).await.unwrap_err();
    assert_eq!(changed.code(), Code::FailedPrecondition);
    let unkeyed = client
        .create_payment(Request::new(CreatePaymentRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(unkeyed.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn the_grpc_example_honours_its_lease_and_wait_settings() {
    let pushback_with = |env: Vec<(&'static str, String)>| async move {
        let mut env = env;
        env.extend([
            ("IDEMPOTENCY_WAIT_MS", "0".to_owned()),
            ("PAYMENTS_WORK_MS", "1500".to_owned()),
        ]);
        let app = support::Proc::example("grpc_payments", &env).await;
        let url = format!("http://127.0.0.1:{}", app.port);
        let mut client = PaymentsClient::connect(url).await.unwrap();
        let first = tokio::spawn({
            let mut client = client.clone();
            async move { client.create_payment(create("lease-1", 100)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let busy = client
            .create_payment(create("lease-1", 100))
            .await
            .unwrap_err();
        assert_eq!(busy.code(), Code::Aborted, "{busy:?}");
        first.await.unwrap().unwrap();
        busy.metadata()
            .get("grpc-retry-pushback-ms")
            .unwrap()
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    // The pushback never exceeds what is left of the lease: 400 ms here, 30 s by default.
    let short = pushback_with(vec![("IDEMPOTENCY_LEASE_MS", "400".to_owned())]).await;
    let default = pushback_with(Vec::new()).await;
    assert!(short <= 400, "pushback {short} ms past a 400 ms lease");
    assert!(default > 400, "pushback {default} ms");
}

/// A tonic client behind the client layer: one key per logical call on every attempt, and the
/// statuses that mean "try again" retried: UNAVAILABLE (the key was released, the call runs
/// again) and ABORTED with pushback (the first call is in flight: the retry gets its answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tonic_client_through_the_client_layer_retries_what_grpc_says_to_retry() {
    use tower::ServiceBuilder;
    use tower_idempotency::client::{ClientOutcome, IdempotencyClientLayer};

    let probe = Probe {
        gate: Some(Arc::new(Semaphore::new(0))),
        ..Probe::default()
    };
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_wait(Duration::ZERO);
    let url = serve_at(layer, &probe).await;
    let channel = Channel::from_shared(url).unwrap().connect().await.unwrap();
    let retrying = ServiceBuilder::new()
        .layer(
            IdempotencyClientLayer::new()
                .with_max_attempts(20)
                .with_backoff(Duration::from_millis(20), Duration::from_millis(100)),
        )
        .map_request(|request: http::Request<_>| request.map(tonic::body::Body::new))
        .service(channel.clone());
    let mut client = PaymentsClient::new(retrying);
    let outcome =
        |response: &Response<Payment>| *response.extensions().get::<ClientOutcome>().unwrap();
    let gate = probe.gate.clone().unwrap();

    // UNAVAILABLE: the layer released the key; the retry runs, and its payment is the answer.
    probe.unavailable_next.store(true, SeqCst);
    gate.add_permits(2);
    let request = Request::new(CreatePaymentRequest {
        amount_cents: 4900,
        currency: "usd".into(),
        customer: "cus_1".into(),
    });
    let paid = client.create_payment(request).await.unwrap();
    assert_eq!(outcome(&paid).attempts, 2);
    assert_eq!(
        probe.runs.load(SeqCst),
        2,
        "UNAVAILABLE released the key: it ran again"
    );
    let minted = paid.get_ref().idempotency_key.clone();
    assert_eq!(minted.len(), 36, "a key the client minted: {minted}");

    // ABORTED with pushback: the first call holds the key; the retry gets its answer. The
    // handlers gave their permits back: close the gate again.
    gate.acquire_many(2).await.unwrap().forget();
    let mut plain = PaymentsClient::new(channel);
    let first = tokio::spawn(async move { plain.create_payment(create("g-retry", 4900)).await });
    while probe.runs.load(SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let opener = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        gate.add_permits(1);
    });
    let second = client
        .create_payment(create("g-retry", 4900))
        .await
        .unwrap();
    let first = first.await.unwrap().unwrap();
    opener.await.unwrap();
    assert!(replayed(&second));
    assert_eq!(second.get_ref(), first.get_ref());
    assert!(outcome(&second).attempts >= 2, "{:?}", outcome(&second));
    assert!(outcome(&second).replayed);
    assert_eq!(probe.runs.load(SeqCst), 3, "the in-flight call ran once");
}

/// A gRPC status sent in the trailers of a full answer (headers, then trailers saying
/// UNAVAILABLE: what a proxy or another server may send instead of a trailers-only answer) is
/// read before the client decides: retried with the same key, and the retry's answer returned.
/// It reached the caller as a failed call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_status_in_the_trailers_of_a_full_answer_is_retried() {
    use http_body_util::BodyExt;
    use tower::{Service, ServiceBuilder, ServiceExt};
    use tower_idempotency::client::{ClientOutcome, IdempotencyClientLayer};

    let probe = Probe::default();
    let url = serve_at(IdempotencyLayer::new(MemoryStore::new()), &probe).await;
    let channel = Channel::from_shared(url).unwrap().connect().await.unwrap();
    let refuse_next = Arc::new(AtomicBool::new(true));
    let first_refused = tower::service_fn(move |request: http::Request<tonic::body::Body>| {
        let (mut channel, refuse_next) = (channel.clone(), Arc::clone(&refuse_next));
        async move {
            if refuse_next.swap(false, SeqCst) {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", "14".parse().unwrap());
                trailers.insert("grpc-message", "overloaded".parse().unwrap());
                let body = http_body_util::Empty::<bytes::Bytes>::new()
                    .with_trailers(async move { Some(Ok(trailers)) });
                let response = http::Response::builder()
                    .header("content-type", "application/grpc")
                    .body(tonic::body::Body::new(body))
                    .unwrap();
                return Ok(response);
            }
            channel.ready().await?.call(request).await
        }
    });
    let retrying = ServiceBuilder::new()
        .layer(
            IdempotencyClientLayer::new()
                .with_backoff(Duration::from_millis(20), Duration::from_millis(100)),
        )
        .map_request(|request: http::Request<_>| request.map(tonic::body::Body::new))
        .service(first_refused);
    let mut client = PaymentsClient::new(retrying);
    let paid = client
        .create_payment(create("g-trailers", 4900))
        .await
        .unwrap();
    let outcome = *paid.extensions().get::<ClientOutcome>().unwrap();
    assert_eq!(outcome.attempts, 2, "the trailers' UNAVAILABLE was retried");
    assert_eq!(probe.runs.load(SeqCst), 1);
    assert_eq!(paid.get_ref().idempotency_key, "g-trailers");
}
