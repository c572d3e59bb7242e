//! The payment example, run as its own process on the memory store and driven over HTTP.

mod support;

use http::{Method, StatusCode};
use support::{Proc, post_json, send};

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
