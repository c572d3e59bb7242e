//! Retries and duplicates of one request: they wait for the first, get its answer or a 409 that says when to come back, and run once.

use super::*;

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

/// A bare tower service whose responses end with trailers, as gRPC responses do.
#[tokio::test]
async fn trailers_are_replayed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let runs = Arc::clone(&runs);
        move |_request: Request<tower_idempotency::body::RequestBody<Body>>| {
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

/// A duplicate may ask to wait longer than the layer's wait (`Prefer: wait=N`, RFC 7240) and
/// follows a long first request to its answer instead of getting 409; one without the header
/// gets today's 409; one asking for more than the layer's maximum waits that maximum; `wait=0`
/// answers at once. The layer's answers say what it honored (`Preference-Applied`).
#[tokio::test]
async fn a_duplicate_that_prefers_to_wait_follows_the_first_to_its_answer() {
    let store = MemoryStore::new();
    let layer = IdempotencyLayer::new(store.clone())
        .with_wait(Duration::from_millis(100))
        .with_max_wait(Duration::from_secs(3));
    let gated = Probe::gated();
    let app = app(&layer, &gated);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-prefer", "{}")).await }
    });
    gated.started.notified().await;
    let preferring = |wait: &str| {
        let mut request = post_payment("k-prefer", "{}");
        let value = http::HeaderValue::try_from(format!("respond-async, wait={wait}")).unwrap();
        request.headers_mut().insert("prefer", value);
        request
    };

    // Without the header, and with wait=0: 409 at once.
    let plain = send(&app, post_payment("k-prefer", "{}")).await;
    assert_eq!(plain.status, StatusCode::CONFLICT);
    assert!(plain.headers.get("preference-applied").is_none());
    let at_once = send(&app, preferring("0")).await;
    assert_eq!(at_once.status, StatusCode::CONFLICT);
    assert_eq!(at_once.headers["preference-applied"], "wait=0");

    // wait=30, bounded by the layer's 3 s: it waits, and gets the answer when the first ends.
    let patient = tokio::spawn({
        let (app, request) = (app.clone(), preferring("30"));
        async move { send(&app, request).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !patient.is_finished(),
        "the preferring duplicate did not wait"
    );
    gated.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    let patient = patient.await.unwrap();
    assert_eq!(patient.status, StatusCode::CREATED);
    assert!(patient.replayed());
    assert_eq!(patient.headers["preference-applied"], "wait=3");
    assert_eq!(gated.runs(), 1);
}

/// Past the layer's maximum, a preferring duplicate gets 409 like any other, with what was
/// honored.
#[tokio::test]
async fn a_preference_longer_than_the_maximum_waits_the_maximum() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_wait(Duration::ZERO)
        .with_max_wait(Duration::from_secs(1));
    let gated = Probe::gated();
    let app = app(&layer, &gated);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-max", "{}")).await }
    });
    gated.started.notified().await;
    let mut request = post_payment("k-max", "{}");
    request
        .headers_mut()
        .insert("prefer", http::HeaderValue::from_static("wait=600"));
    let started = std::time::Instant::now();
    let bounded = send(&app, request).await;
    let waited = started.elapsed();
    assert_eq!(bounded.status, StatusCode::CONFLICT);
    assert_eq!(bounded.headers["preference-applied"], "wait=1");
    assert!(
        waited >= Duration::from_secs(1),
        "answered after {waited:?}"
    );
    gated.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

/// The application adjusts replays before they leave (a header of this exchange); the stored
/// response is not changed by it, and the replay marker stays.
#[tokio::test]
async fn replays_pass_through_the_applications_hook() {
    let layer = IdempotencyLayer::new(MemoryStore::new()).with_replayed_response(|parts| {
        parts
            .headers
            .insert("x-replay", http::HeaderValue::from_static("1"));
        parts
            .headers
            .remove(tower_idempotency::headers::IDEMPOTENT_REPLAYED);
    });
    let probe = Probe::gated();
    probe.release_gate();
    let app = app(&layer, &probe);
    let first = send(&app, post_payment("k-hook", "{}")).await;
    assert!(first.headers.get("x-replay").is_none());
    for _ in 0..2 {
        let replay = send(&app, post_payment("k-hook", "{}")).await;
        assert!(replay.replayed());
        assert_eq!(replay.headers.get_all("x-replay").iter().count(), 1);
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(probe.runs(), 1);
}
