//! What is stored and what releases the key: the completion policy, responses over the cache limit, panics, failing bodies and service errors.

use super::*;

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

/// A service whose first response body fails after `good` bytes; later ones succeed.
fn failing_body_service(
    good: usize,
    attempts: Arc<AtomicUsize>,
) -> impl Service<
    Request<tower_idempotency::body::RequestBody<Body>>,
    Response = Response<Body>,
    Error = Infallible,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(
        move |_request: Request<tower_idempotency::body::RequestBody<Body>>| {
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

#[tokio::test]
async fn a_service_error_is_passed_on_and_releases_the_key() {
    let attempts = Arc::new(AtomicUsize::new(0));
    let service = tower::service_fn({
        let attempts = Arc::clone(&attempts);
        move |_request: Request<tower_idempotency::body::RequestBody<Body>>| {
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
            |_request: Request<tower_idempotency::body::RequestBody<Body>>| async {
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
