//! The payment route the in-process benchmarks (`cpu`, `counts`) send their requests through,
//! so that both measure the same request.

use axum::{Router, body::Body, http::StatusCode, routing::post};
use bytes::Bytes;
use http::{Request, header};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;

/// About 200 bytes, as a payment API answers.
pub const ANSWER: &str = r#"{"id":"pay_8f14e45fceea167a5a36dedd4bea2543","object":"payment","amount_cents":4900,"currency":"usd","customer":"cus_1","status":"succeeded","charge_id":"ch_c9f0f895fb98ab9159f51fd0297e236d"}"#;

/// The route, made once as `axum::serve` makes it (`with_state`): a router left unmade boxes its
/// handler and applies its layers again on every request.
pub fn app(layer: Option<IdempotencyLayer>) -> Router {
    let handler = post(|_body: Bytes| async {
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            ANSWER,
        )
    });
    let router = match layer {
        Some(layer) => Router::new().route("/payments", handler.route_layer(layer)),
        None => Router::new().route("/payments", handler),
    };
    router.with_state(())
}

/// `POST /payments` with `key` and `body`, its response read whole.
pub async fn send(app: &Router, key: String, body: &Bytes) {
    let request = Request::post("/payments")
        .header("idempotency-key", key)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.clone()))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    response.into_body().collect().await.unwrap();
}
