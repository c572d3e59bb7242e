//! The payment example, run as its own process on the memory store and driven over HTTP.

mod support;

use http::{Method, StatusCode};
use support::{Proc, TestSchema, database_url, post_json, send, url_in_schema};

const PAYMENT: &str = r#"{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}"#;

#[tokio::test]
async fn payments_example_creates_replays_and_refuses() {
    let app = Proc::example("payments", &[]).await;
    let url = app.url("/payments");

    let created = post_json(&url, "order-42", PAYMENT).await.unwrap();
    assert_eq!(created.status, StatusCode::CREATED);
    let payment = created.json();
    let id = payment["id"].as_str().unwrap().to_owned();
    assert_eq!(payment["amount_cents"], 4900);
    assert_eq!(payment["customer"], "cus_1");
    assert_eq!(created.headers["location"], format!("/payments/{id}"));

    let replay = post_json(&url, "order-42", PAYMENT).await.unwrap();
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.json()["id"], id.as_str());

    let fetched = send(Method::GET, &app.url(&format!("/payments/{id}")), &[], "")
        .await
        .unwrap();
    assert_eq!(fetched.status, StatusCode::OK);
    assert_eq!(fetched.json(), payment);

    let changed = post_json(&url, "order-42", &PAYMENT.replace("4900", "5000"))
        .await
        .unwrap();
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);

    let unkeyed = send(
        Method::POST,
        &url,
        &[("content-type", "application/json")],
        PAYMENT,
    )
    .await
    .unwrap();
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);

    let missing = send(Method::GET, &app.url("/payments/pay_nope"), &[], "")
        .await
        .unwrap();
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

/// Payment rows the example wrote for `key`: counted where they are, in Postgres.
async fn rows(schema: &TestSchema, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(&schema.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn payments_example_lets_a_corrected_request_run_and_keeps_callers_apart() {
    let schema = TestSchema::new().await;
    let app = Proc::example(
        "payments",
        &[("DATABASE_URL", url_in_schema(&database_url(), &schema.name))],
    )
    .await;
    let json = ("content-type", "application/json");

    // A mistyped path (404), a method the route does not serve (405), no content type (415),
    // an invalid payment (422): nothing ran, and the corrected request with the same key runs.
    let key = ("idempotency-key", "order-fixed");
    let typo = send(Method::POST, &app.url("/paymnts"), &[key, json], PAYMENT).await;
    assert_eq!(typo.unwrap().status, StatusCode::NOT_FOUND);
    let wrong = send(
        Method::POST,
        &app.url("/payments/p1"),
        &[key, json],
        PAYMENT,
    )
    .await;
    assert_eq!(wrong.unwrap().status, StatusCode::METHOD_NOT_ALLOWED);
    let untyped = send(Method::POST, &app.url("/payments"), &[key], PAYMENT).await;
    assert_eq!(untyped.unwrap().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let invalid = PAYMENT.replace("4900", "-1");
    let refused = send(Method::POST, &app.url("/payments"), &[key, json], &invalid).await;
    assert_eq!(refused.unwrap().status, StatusCode::UNPROCESSABLE_ENTITY);
    let corrected = post_json(&app.url("/payments"), "order-fixed", PAYMENT)
        .await
        .unwrap();
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert!(!corrected.replayed());
    let retry = post_json(&app.url("/payments"), "order-fixed", PAYMENT)
        .await
        .unwrap();
    assert!(retry.replayed());
    assert_eq!(rows(&schema, "order-fixed").await, 1);

    // Two callers with different credentials, the same key and body: two payments.
    let as_caller = |token: &'static str| {
        let url = app.url("/payments");
        async move {
            let authorization = format!("Bearer {token}");
            send(
                Method::POST,
                &url,
                &[
                    ("idempotency-key", "order-shared"),
                    json,
                    ("authorization", &authorization),
                ],
                PAYMENT,
            )
            .await
            .unwrap()
        }
    };
    let alice = as_caller("alice").await;
    let bob = as_caller("bob").await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.json()["id"], bob.json()["id"]);
    assert_eq!(as_caller("alice").await.json()["id"], alice.json()["id"]);
    assert_eq!(rows(&schema, "order-shared").await, 2);
    drop(app);
    schema.drop().await;
}

#[tokio::test]
async fn hyper_example_runs_an_order_once() {
    let app = Proc::example("hyper_server", &[]).await;
    let url = app.url("/orders");
    let order = |key: &'static str, body: &'static str| {
        let url = url.clone();
        async move {
            send(Method::POST, &url, &[("idempotency-key", key)], body)
                .await
                .unwrap()
        }
    };

    let first = order("order-1", "two coffees").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["location"], "/orders/1");
    assert_eq!(first.body, "order 1: two coffees (key order-1)\n");

    let replay = order("order-1", "two coffees").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["location"], "/orders/1");

    assert_eq!(
        order("order-1", "three coffees").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let second = order("order-2", "a tea").await;
    assert_eq!(second.body, "order 2: a tea (key order-2)\n");
    let unkeyed = send(Method::POST, &url, &[], "x").await.unwrap();
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);
}
