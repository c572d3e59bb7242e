//! What a webhook receiver needs of the layer: the key where the sender puts it (a JSON body's
//! field), a verifier that refuses a forged delivery before its key is claimed, and a declared
//! fingerprint that leaves out what changes between attempts.

use tower_idempotency::{JsonFields, problem::Unverified, scope};

use super::*;

/// A Stripe-like receiver: the event's `id` in the body is the key, the sender the scope, and
/// a delivery is genuine when its `x-signature` header says `good` (the real check is the
/// webhooks example's).
fn receiver(probe: &Arc<Probe>) -> Router {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_key_from_body("/id")
        .with_scope(scope::fixed("stripe"))
        .with_verifier(|parts, _| match parts.headers.get("x-signature") {
            Some(signature) if signature == "good" => Ok(()),
            Some(_) => Err(Unverified::new("no signature matches")),
            None => Err(Unverified::new("no signature").with_status(StatusCode::BAD_REQUEST)),
        });
    app(&layer, probe)
}

fn delivery(signature: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::post("/payments").header("content-type", "application/json");
    if let Some(signature) = signature {
        request = request.header("x-signature", signature);
    }
    request.body(Body::from(body.to_owned())).unwrap()
}

const EVENT: &str = r#"{"id": "evt_1", "type": "charge.refunded"}"#;

#[tokio::test]
async fn the_key_is_read_from_the_body_and_a_redelivery_is_replayed() {
    let probe = Probe::open();
    let app = receiver(&probe);
    let first = send(&app, delivery(Some("good"), EVENT)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["key"], "evt_1");
    // The sender's redelivery: the same event, a header key the layer does not read.
    let mut again = delivery(Some("good"), EVENT);
    again
        .headers_mut()
        .insert("idempotency-key", HeaderValue::from_static("other"));
    let again = send(&app, again).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn a_body_without_a_valid_key_is_refused_and_not_run() {
    let probe = Probe::open();
    let app = receiver(&probe);
    for (body, expected) in [
        (r#"{"type": "charge.refunded"}"#, problem::MISSING_KEY),
        (r#"{"id": null}"#, problem::MISSING_KEY),
        ("not json", problem::MISSING_KEY),
        (r#"{"id": {"nested": 1}}"#, problem::INVALID_KEY),
        (r#"{"id": ""}"#, problem::INVALID_KEY),
        (r#"{"id": "has space"}"#, problem::INVALID_KEY),
    ] {
        let answer = send(&app, delivery(Some("good"), body)).await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(answer.problem_type(), expected, "{body}");
    }
    // An integer id is a key too, as it is.
    let answer = send(&app, delivery(Some("good"), r#"{"id": 42}"#)).await;
    assert_eq!(answer.json()["key"], "42");
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn a_forged_delivery_first_is_refused_without_claiming_and_the_genuine_one_runs() {
    let probe = Probe::open();
    let app = receiver(&probe);
    let forged = send(&app, delivery(Some("forged"), EVENT)).await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED);
    assert_eq!(forged.problem_type(), problem::UNVERIFIED);
    assert_eq!(forged.json()["detail"], "no signature matches");
    let unsigned = send(&app, delivery(None, EVENT)).await;
    assert_eq!(unsigned.status, StatusCode::BAD_REQUEST);
    assert_eq!(unsigned.problem_type(), problem::UNVERIFIED);
    assert_eq!(probe.runs(), 0);
    // Neither claimed the key: the genuine delivery runs, at once.
    let genuine = send(&app, delivery(Some("good"), EVENT)).await;
    assert_eq!(
        (genuine.status, genuine.replayed()),
        (StatusCode::CREATED, false)
    );
    // And a forgery after it is refused, never answered with the stored response.
    let forged = send(&app, delivery(Some("forged"), EVENT)).await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED);
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn the_verifier_runs_before_a_header_key_is_claimed_too() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_key_header(http::HeaderName::from_static("webhook-id"))
        .with_key_required(true)
        .with_verifier(|_, body| match body.as_ref() {
            b"forged" => Err(Unverified::new("forged")),
            _ => Ok(()),
        });
    let app = app(&layer, &probe);
    let with_id = |body: &str| {
        let request = Request::post("/payments").header("webhook-id", "msg_1");
        request.body(Body::from(body.to_owned())).unwrap()
    };
    assert_eq!(
        send(&app, with_id("forged")).await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        send(&app, with_id("genuine")).await.status,
        StatusCode::CREATED
    );
    assert!(send(&app, with_id("genuine")).await.replayed());
    assert_eq!(probe.runs(), 1);
}

#[tokio::test]
async fn a_declared_fingerprint_leaves_out_what_changes_between_attempts() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_fingerprint_json(JsonFields::except(["/attempt", "/meta/sent_at"]));
    let app = app(&layer, &probe);
    let first = r#"{"amount": 1, "attempt": 1, "meta": {"sent_at": 10, "source": "a"}}"#;
    let retry = r#"{"meta": {"source": "a", "sent_at": 99}, "attempt": 2, "amount": 1}"#;
    assert_eq!(
        send(&app, post_payment("k-f", first)).await.status,
        StatusCode::CREATED
    );
    let answer = send(&app, post_payment("k-f", retry)).await;
    assert!(answer.replayed(), "{answer:?}");
    // A field that is declared is compared: another amount is another request.
    let other = r#"{"amount": 2, "attempt": 3, "meta": {"sent_at": 1, "source": "a"}}"#;
    let answer = send(&app, post_payment("k-f", other)).await;
    assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);

    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_fingerprint_json(JsonFields::only(["/amount"]));
    let app = super::app(&layer, &probe);
    send(&app, post_payment("k-o", r#"{"amount": 1, "note": "a"}"#)).await;
    assert!(
        send(&app, post_payment("k-o", r#"{"note": "b", "amount": 1}"#))
            .await
            .replayed()
    );
    let answer = send(&app, post_payment("k-o", r#"{"amount": 1.5}"#)).await;
    assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(probe.runs(), 2);
}
