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
//! and the provider charged once. Change the amount with the same key: 422. Both answers say
//! until when the key is protected (`Idempotency-Key-Protected-Until`): its retention, or its
//! tombstone's horizon when longer.
//!
//! | variable | effect |
//! |---|---|
//! | `DATABASE_URL` | payments and idempotency keys in Postgres (migrations run at start-up) |
//! | `REDIS_URL` | Redis as the first line (in front of Postgres when both are set) |
//! | `REDIS_CLUSTER_NODES` | the same on a Redis Cluster: seed nodes `host:port,host:port,…` (instead of `REDIS_URL`) |
//! | `PROVIDER_URL` | charge through an HTTP payment provider (`POST {url}/charges`) instead of the built-in mock, through the crate's client layer |
//! | `PROVIDER_TIMEOUT_MS` | how long one call to that provider may take before it is retried (10000) |
//! | `PORT` | listening port on 127.0.0.1 (3000) |
//! | `IDEMPOTENCY_LEASE_MS` | the claim lease (30000) |
//! | `IDEMPOTENCY_WAIT_MS` | how long a duplicate waits for the first request (10000) |
//! | `IDEMPOTENCY_MAX_WAIT_MS` | the longest a duplicate that asks (`Prefer: wait=N`) waits (60000) |
//! | `IDEMPOTENCY_RETENTION_MS` | how long a completed key and its answer are kept (86400000, 24 h) |
//! | `IDEMPOTENCY_TOMBSTONE_HORIZON_MS` | how long after its payment a key is still refused (410) once its answer is gone (604800000, 7 days; 0: not at all); with Redis in front of Postgres, Postgres keeps them |
//! | `PAYMENTS_WORK_MS` | simulated work (fraud scoring) before the payment is recorded, with no transaction open (0) |
//! | `PAYMENTS_PAUSE_AFTER_INTENT_MS` | on Postgres, a pause after step 1 (the intent) commits (0) |
//! | `PAYMENTS_PAUSE_AFTER_CHARGE_MS` | on Postgres, a pause after the provider charged, before step 3 (0) |
//! | `PAYMENTS_PAUSE_AFTER_COMMIT_MS` | a pause after the payment's last transaction commits, before the answer (0) |
//! | `PAYMENTS_COMPLETER_PERIOD_MS` | on Postgres, how often the completer looks for payments abandoned mid-way (their instance died and nobody retried) and finishes them (5000; 0: no completer) |
//! | `PAYMENTS_ANSWER_WITH_FENCE` | `false`: the last step fences with `commit` alone, and a retry whose instance died after it gets the answer the recovery hook rebuilds from the payment row (true) |
//!
//! Each charge carries an idempotency key derived from the payment's (`IdempotencyClaim::derived_key`),
//! the same on every attempt and every retry of the payment, so the provider deduplicates it; the
//! HTTP provider is called through `IdempotencyClientLayer`, which retries a provider that fails,
//! times out or answers 409 with that key.
//!
//! With neither URL set, everything lives in memory: fine to try, no protection across processes.
//! `GET /metrics` serves the crate's metrics in Prometheus' text format; the admin example
//! (`examples/admin.rs`) inspects and forgets keys in the same stores.

mod answers;
mod ledger;
mod provider;
mod setup;

use std::{
    collections::HashMap,
    env,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Json, Router,
    body::Body,
    extract::{Path, State},
    http::{HeaderValue, Request, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use sqlx::{
    FromRow, PgPool, Row,
    postgres::{PgPoolOptions, PgRow},
};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer, MemoryStore,
    client::{ClientBody, IdempotencyClient, IdempotencyClientLayer},
    completer::KeptRequests,
    store::{Diagnosis, FenceError, PostgresStore, RecordKey, RedisStore, Store, TieredStore},
};

use self::{answers::*, ledger::*, provider::*, setup::*};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let prometheus = prometheus();
    let (store, ledger) = stores_from_env().await;
    check_store(store.as_ref()).await;
    let state = AppState {
        ledger,
        provider: Provider::from_env(),
        answer_with_fence: env::var("PAYMENTS_ANSWER_WITH_FENCE").map_or(true, |v| v != "false"),
        work: env_millis("PAYMENTS_WORK_MS", 0),
        pause_after_intent: env_millis("PAYMENTS_PAUSE_AFTER_INTENT_MS", 0),
        pause_after_charge: env_millis("PAYMENTS_PAUSE_AFTER_CHARGE_MS", 0),
        pause_after_commit: env_millis("PAYMENTS_PAUSE_AFTER_COMMIT_MS", 0),
    };
    let mut layer = IdempotencyLayer::from_shared_store(store)
        .with_key_required(true)
        .with_lease(env_millis("IDEMPOTENCY_LEASE_MS", 30_000))
        .with_wait(env_millis("IDEMPOTENCY_WAIT_MS", 10_000))
        .with_max_wait(env_millis("IDEMPOTENCY_MAX_WAIT_MS", 60_000))
        .with_retention(env_millis("IDEMPOTENCY_RETENTION_MS", 86_400_000))
        .with_protected_until_header(true);
    let completing = matches!(state.ledger, Ledger::Postgres(_));
    if let Ledger::Postgres(store) = &state.ledger {
        let pool = store.pool().clone();
        // A payment whose instance died mid-way, and whose client gave up, is finished by the
        // completer: it keeps the request (content type and body; never credentials) with the
        // payment's first recovery point, to resume the handler with.
        layer = layer
            .with_recovery(move |record| recover(pool.clone(), record))
            .with_kept_requests(KeptRequests::new());
    }

    // The layer guards the handler only: a 404 or a 405 never reaches it. Keys are scoped by
    // the caller's credentials (the default): two callers with different `Authorization`
    // headers never share a payment; requests without one share the anonymous scope.
    let app = Router::new()
        .route("/payments", post(create_payment).route_layer(layer.clone()))
        .route("/payments/{id}", get(get_payment))
        .with_state(Arc::new(state))
        .route("/metrics", get(move || metrics(prometheus.clone())));
    // On every instance: payments abandoned mid-way (their instance died, nobody retried) are
    // resumed about a lease plus a period after the death.
    let period = env_millis("PAYMENTS_COMPLETER_PERIOD_MS", 5_000);
    if completing && !period.is_zero() {
        layer.completer(app.clone()).with_period(period).spawn();
    }

    let port = env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3000);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| fail(&format!("cannot listen on {addr}"), e));
    tracing::info!("payments API listening on http://{addr}");
    axum::serve(listener, app).await.unwrap();
}

struct AppState {
    ledger: Ledger,
    provider: Provider,
    /// Whether the last step stores the answer with the fence (`commit_with_response`) or only
    /// fences (`commit`), leaving a key whose instance dies after it to the recovery hook.
    answer_with_fence: bool,
    work: Duration,
    pause_after_intent: Duration,
    pause_after_charge: Duration,
    pause_after_commit: Duration,
}

async fn create_payment(
    State(state): State<Arc<AppState>>,
    claim: IdempotencyClaim,
    Json(new): Json<NewPayment>,
) -> Response {
    if new.amount_cents <= 0 || new.currency.len() != 3 || new.customer.is_empty() {
        // Nothing was done: a 422 releases the key, so the corrected payment can use it.
        return problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid payment",
            "amount_cents must be positive, currency a 3-letter code, customer non-empty",
        );
    }
    let key = claim.key().as_str();
    let mut payment = Payment {
        id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
        amount_cents: new.amount_cents,
        currency: new.currency.to_lowercase(),
        customer: new.customer,
        status: "succeeded".into(),
        charge_id: String::new(),
        idempotency_key: key.to_owned(),
    };
    let response = match &state.ledger {
        Ledger::Memory(payments) => {
            // Fraud scoring, address checks…
            tokio::time::sleep(state.work).await;
            payment.charge_id = match state.provider.charge(&claim, payment.amount_cents).await {
                Ok(charge) => charge,
                Err(error) => return problem(StatusCode::BAD_GATEWAY, "provider failed", error),
            };
            payments
                .lock()
                .unwrap()
                .insert(payment.id.clone(), payment.clone());
            created(&payment)
        }
        // On Citus, the payment's transactions run on the key's worker, beside its row.
        Ledger::Postgres(store) => {
            let pool = store.pool_for(&claim);
            match record_payment(&pool, &state, &claim, &mut payment).await {
                Ok(response) => response,
                Err(response) => return response,
            }
        }
    };
    response.map(Body::from)
}

/// The 201 a new payment is answered with.
fn created(payment: &Payment) -> http::Response<Bytes> {
    let body = serde_json::to_vec(payment).expect("a payment serializes");
    http::Response::builder()
        .status(StatusCode::CREATED)
        .header(header::LOCATION, format!("/payments/{}", payment.id))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Bytes::from(body))
        .expect("a valid response")
}

/// Records the payment in steps, resuming where an earlier attempt of the same request stopped:
///
/// 1. the intent (a `pending` payment row) and the recovery point `intent_recorded`, in one
///    short transaction (a stale attempt, whose lease another took over, is stopped here by the
///    recovery point's owner check and writes nothing);
/// 2. the provider call, with no transaction open and no lock held, carrying a key derived from
///    the payment's: a retry that calls it again is deduplicated by the provider;
/// 3. the result and the answer, fenced (`commit_with_response`), in one short transaction: if
///    this instance dies once it commits, a retry on another instance gets this payment at once.
///
/// An instance killed between two steps leaves its key in flight until its lease ends; the next
/// retry, on any instance, takes it over and continues from the last recovery point.
async fn record_payment(
    pool: &PgPool,
    state: &AppState,
    claim: &IdempotencyClaim,
    payment: &mut Payment,
) -> Result<http::Response<Bytes>, Response> {
    // Fraud scoring, address checks…: before anything is recorded, with nothing held.
    tokio::time::sleep(state.work).await;
    let mut connection = pool.acquire().await.map_err(unavailable)?;
    let resumed = claim
        .recovery_point(&mut connection)
        .await
        .map_err(fence_failed)?;
    drop(connection);
    match resumed {
        Some(point) if point.name() == "intent_recorded" => {
            let id = point.payload()["payment_id"].as_str().unwrap_or_default();
            tracing::info!(payment = id, "resuming after the recorded intent");
            payment.id = id.to_owned();
        }
        _ => record_intent(pool, claim, payment).await?,
    }
    tokio::time::sleep(state.pause_after_intent).await;
    // The charge: no transaction open, nothing locked meanwhile.
    payment.charge_id = state
        .provider
        .charge(claim, payment.amount_cents)
        .await
        .map_err(|error| problem(StatusCode::BAD_GATEWAY, "provider failed", error))?;
    tokio::time::sleep(state.pause_after_charge).await;
    let response = record_result(pool, state, claim, payment).await?;
    // A pause between the commit and the answer, where a crash leaves a committed payment
    // whose response the layer has not stored yet (fault tests use it).
    tokio::time::sleep(state.pause_after_commit).await;
    Ok(response)
}

/// Step 1: the `pending` payment row and the recovery point, together.
async fn record_intent(
    pool: &PgPool,
    claim: &IdempotencyClaim,
    payment: &Payment,
) -> Result<(), Response> {
    let mut tx = pool.begin().await.map_err(unavailable)?;
    sqlx::query(
        "INSERT INTO payments (id, amount_cents, currency, customer, status, charge_id, idempotency_key)
         VALUES ($1, $2, $3, $4, 'pending', '', $5)",
    )
    .bind(&payment.id)
    .bind(payment.amount_cents)
    .bind(&payment.currency)
    .bind(&payment.customer)
    .bind(&payment.idempotency_key)
    .execute(&mut *tx)
    .await
    .map_err(unavailable)?;
    let progress = serde_json::json!({ "payment_id": payment.id });
    claim
        .advance(&mut tx, "intent_recorded", &progress)
        .await
        .map_err(fence_failed)?;
    tx.commit().await.map_err(unavailable)
}

/// Step 3: the charge on the payment row, and the answer stored with the fence.
async fn record_result(
    pool: &PgPool,
    state: &AppState,
    claim: &IdempotencyClaim,
    payment: &Payment,
) -> Result<http::Response<Bytes>, Response> {
    let mut tx = pool.begin().await.map_err(unavailable)?;
    // The key too, which routes the statement to one shard on Citus (see the payments table).
    sqlx::query(
        "UPDATE payments SET status = $2, charge_id = $3 WHERE id = $1 AND idempotency_key = $4",
    )
    .bind(&payment.id)
    .bind(&payment.status)
    .bind(&payment.charge_id)
    .bind(&payment.idempotency_key)
    .execute(&mut *tx)
    .await
    .map_err(unavailable)?;
    let response = created(payment);
    let fenced = if state.answer_with_fence {
        claim.commit_with_response(&mut tx, &response).await
    } else {
        claim.commit(&mut tx).await
    };
    fenced.map_err(fence_failed)?;
    tx.commit().await.map_err(unavailable)?;
    Ok(response)
}

/// The recovery hook: the answer of a key whose last step committed and whose instance died
/// before the answer was stored, rebuilt from the payment row the step wrote.
async fn recover(pool: PgPool, record: RecordKey) -> Option<http::Response<Bytes>> {
    let paid = sqlx::query_as::<_, Payment>(
        "SELECT * FROM payments WHERE idempotency_key = $1 AND status = 'succeeded'",
    )
    .bind(record.key().as_str())
    .fetch_optional(&pool)
    .await;
    match paid {
        Ok(paid) => paid.as_ref().map(created),
        Err(error) => {
            tracing::warn!(%error, "the recovery hook could not read the payments");
            None
        }
    }
}
