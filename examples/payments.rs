//! A small payment API behind `IdempotencyLayer`.
//!
//! ```sh
//! cargo run --example payments            # serves 127.0.0.1:3000 (PORT overrides)
//! curl -si localhost:3000/payments -H 'Idempotency-Key: order-42' \
//!      -H 'content-type: application/json' \
//!      -d '{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}'
//! ```
//!
//! Send the same command again: the answer is the same payment, with `Idempotent-Replayed: true`,
//! and the mock provider charged once. Change the amount with the same key: 422.

use std::{
    collections::HashMap,
    env,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde::{Deserialize, Serialize};
use tower_idempotency::{IdempotencyClaim, IdempotencyLayer, MemoryStore};

#[derive(Debug, Deserialize)]
struct NewPayment {
    amount_cents: i64,
    currency: String,
    customer: String,
}

#[derive(Debug, Clone, Serialize)]
struct Payment {
    id: String,
    amount_cents: i64,
    currency: String,
    customer: String,
    status: &'static str,
    charge_id: String,
    idempotency_key: String,
}

/// Stands in for a payment provider: it counts charges per idempotency key, the number that
/// must never exceed one.
#[derive(Default)]
struct MockProvider {
    charges: Mutex<HashMap<String, u32>>,
}

impl MockProvider {
    fn charge(&self, key: &str, amount_cents: i64) -> String {
        let mut charges = self.charges.lock().unwrap();
        let count = charges.entry(key.to_owned()).or_default();
        *count += 1;
        if *count > 1 {
            tracing::error!(key, count = *count, "DUPLICATE CHARGE");
        }
        tracing::info!(key, amount_cents, "provider charged");
        format!("ch_{}", uuid::Uuid::new_v4().simple())
    }
}

#[derive(Default)]
struct AppState {
    payments: Mutex<HashMap<String, Payment>>,
    provider: MockProvider,
}

async fn create_payment(
    State(state): State<Arc<AppState>>,
    claim: IdempotencyClaim,
    Json(new): Json<NewPayment>,
) -> Response {
    if new.amount_cents <= 0 || new.currency.len() != 3 || new.customer.is_empty() {
        let problem = serde_json::json!({
            "title": "invalid payment",
            "detail": "amount_cents must be positive, currency a 3-letter code, customer non-empty",
        });
        return (StatusCode::BAD_REQUEST, Json(problem)).into_response();
    }
    // The key goes to the provider too, so it deduplicates on its side as well.
    let charge_id = state
        .provider
        .charge(claim.key().as_str(), new.amount_cents);
    let payment = Payment {
        id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
        amount_cents: new.amount_cents,
        currency: new.currency.to_lowercase(),
        customer: new.customer,
        status: "succeeded",
        charge_id,
        idempotency_key: claim.key().to_string(),
    };
    state
        .payments
        .lock()
        .unwrap()
        .insert(payment.id.clone(), payment.clone());
    let location = format!("/payments/{}", payment.id);
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(payment),
    )
        .into_response()
}

async fn get_payment(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.payments.lock().unwrap().get(&id) {
        Some(payment) => Json(payment.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();

    tracing::warn!(
        "no REDIS_URL / DATABASE_URL: running on the in-memory store, which protects this \
         single process only"
    );
    let layer = IdempotencyLayer::new(MemoryStore::new()).require_key(true);

    let app = Router::new()
        .route("/payments", post(create_payment))
        .route("/payments/{id}", get(get_payment))
        .layer(layer)
        .with_state(Arc::new(AppState::default()));

    let port = env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3000);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot listen on {addr}: {e}");
            std::process::exit(1)
        });
    tracing::info!("payments API listening on http://{addr}");
    axum::serve(listener, app).await.unwrap();
}
