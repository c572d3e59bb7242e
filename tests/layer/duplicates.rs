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
