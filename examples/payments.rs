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
//! and the provider charged once. Change the amount with the same key: 422.
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
//! | `PAYMENTS_WORK_MS` | simulated work (fraud scoring) before the payment is recorded, with no transaction open (0) |
//! | `PAYMENTS_PAUSE_AFTER_INTENT_MS` | on Postgres, a pause after step 1 (the intent) commits (0) |
//! | `PAYMENTS_PAUSE_AFTER_CHARGE_MS` | on Postgres, a pause after the provider charged, before step 3 (0) |
//! | `PAYMENTS_PAUSE_AFTER_COMMIT_MS` | a pause after the payment's last transaction commits, before the answer (0) |
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
    store::{FenceError, PostgresStore, RecordKey, RedisStore, Store, TieredStore},
};

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
    status: String,
    charge_id: String,
    idempotency_key: String,
}

// Written out rather than derived: the crate builds sqlx without its `macros` feature.
impl FromRow<'_, PgRow> for Payment {
    fn from_row(row: &PgRow) -> sqlx::Result<Self> {
        Ok(Self {
            id: row.try_get("id")?,
            amount_cents: row.try_get("amount_cents")?,
            currency: row.try_get("currency")?,
            customer: row.try_get("customer")?,
            status: row.try_get("status")?,
            charge_id: row.try_get("charge_id")?,
            idempotency_key: row.try_get("idempotency_key")?,
        })
    }
}

/// Where payments are kept.
enum Ledger {
    Memory(Mutex<HashMap<String, Payment>>),
    Postgres(PgPool),
}

/// The payment provider. A key derived from the payment's goes with every charge, so a real
/// provider deduplicates on its side too; the mock counts charges per key, a number that must
/// stay at one.
enum Provider {
    Mock(Mutex<HashMap<String, u32>>),
    Http {
        url: String,
        client: Box<ProviderClient>,
    },
}

/// An HTTP client that retries the provider safely: the same key on every attempt.
type ProviderClient = IdempotencyClient<Client<HttpConnector, ClientBody<Full<Bytes>>>>;

impl Provider {
    /// Charges for the payment `claim` guards: once, whatever the retries.
    async fn charge(&self, claim: &IdempotencyClaim, amount_cents: i64) -> Result<String, String> {
        let key = claim.derived_key("charge");
        match self {
            Provider::Mock(charges) => {
                let mut charges = charges.lock().unwrap();
                let count = charges.entry(key.to_string()).or_default();
                *count += 1;
                if *count > 1 {
                    tracing::error!(%key, count = *count, "DUPLICATE CHARGE");
                }
                Ok(format!("ch_{}", uuid::Uuid::new_v4().simple()))
            }
            Provider::Http { url, client } => {
                let body = serde_json::json!({
                    "amount_cents": amount_cents,
                    "reference": claim.key().as_str(),
                });
                let request = Request::post(format!("{url}/charges"))
                    .header("idempotency-key", key.as_str())
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .map_err(|e| e.to_string())?;
                let response = client
                    .clone()
                    .oneshot(request)
                    .await
                    .map_err(|e| e.to_string())?;
                if !response.status().is_success() {
                    return Err(format!("provider answered {}", response.status()));
                }
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?;
                let charge: serde_json::Value =
                    serde_json::from_slice(&body.to_bytes()).map_err(|e| e.to_string())?;
                charge["id"]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| "provider answered without a charge id".into())
            }
        }
    }
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

fn problem(status: StatusCode, title: &str, detail: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({ "title": title, "status": status.as_u16(), "detail": detail.to_string() });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
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
        Ledger::Postgres(pool) => match record_payment(pool, &state, &claim, &mut payment).await {
            Ok(response) => response,
            Err(response) => return response,
        },
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
    sqlx::query("UPDATE payments SET status = $2, charge_id = $3 WHERE id = $1")
        .bind(&payment.id)
        .bind(&payment.status)
        .bind(&payment.charge_id)
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

fn unavailable(error: sqlx::Error) -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "database unavailable",
        error,
    )
}

/// A fence or recovery point refused: a stale attempt, stopped before it wrote anything.
fn fence_failed(error: FenceError) -> Response {
    match error {
        error @ FenceError::LeaseLost { .. } => {
            tracing::warn!(%error, "stale attempt stopped by the fence");
            problem(StatusCode::CONFLICT, "claim lost", error)
        }
        error => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database unavailable",
            error,
        ),
    }
}

async fn get_payment(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let found = match &state.ledger {
        Ledger::Memory(payments) => payments.lock().unwrap().get(&id).cloned(),
        Ledger::Postgres(pool) => {
            match sqlx::query_as::<_, Payment>("SELECT * FROM payments WHERE id = $1")
                .bind(&id)
                .fetch_optional(pool)
                .await
            {
                Ok(found) => found,
                Err(error) => {
                    return problem(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "database unavailable",
                        error,
                    );
                }
            }
        }
    };
    match found {
        Some(payment) => Json(payment).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// The example's own table. Instances starting together would race on `CREATE TABLE IF NOT
/// EXISTS`; an advisory lock lets one at a time in.
async fn create_payments_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency payments example'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS payments (
             id text PRIMARY KEY, amount_cents bigint NOT NULL, currency text NOT NULL,
             customer text NOT NULL, status text NOT NULL, charge_id text NOT NULL,
             idempotency_key text NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

fn env_millis(name: &str, default: u64) -> Duration {
    Duration::from_millis(
        env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

fn fail(what: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {error}");
    std::process::exit(1)
}

/// The crate's metrics (and any other recorded through the `metrics` facade), for Prometheus.
async fn metrics(prometheus: PrometheusHandle) -> impl IntoResponse {
    prometheus.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        prometheus.render(),
    )
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    // Latencies as histograms with the crate's buckets, so a fleet's quantiles add up.
    let prometheus = tower_idempotency::telemetry::HISTOGRAMS
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
            builder.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
        })
        .and_then(PrometheusBuilder::install_recorder)
        .unwrap_or_else(|e| fail("installing the metrics recorder", e));

    let postgres = match env::var("DATABASE_URL") {
        Ok(url) => {
            let pool = PgPoolOptions::new()
                .max_connections(16)
                .acquire_timeout(Duration::from_secs(2))
                .connect_lazy(&url)
                .unwrap_or_else(|e| fail("DATABASE_URL", e));
            let store = PostgresStore::new(pool.clone()).with_timeout(Duration::from_secs(3));
            store
                .migrate()
                .await
                .unwrap_or_else(|e| fail("migrations", e));
            create_payments_table(&pool)
                .await
                .unwrap_or_else(|e| fail("creating the payments table", e));
            store.spawn_sweeper(Duration::from_secs(60));
            Some(store)
        }
        Err(_) => None,
    };
    let redis = match (env::var("REDIS_CLUSTER_NODES"), env::var("REDIS_URL")) {
        (Ok(nodes), _) => {
            let seeds = nodes
                .split(',')
                .map(|node| format!("redis://{}", node.trim()));
            let store = RedisStore::cluster(seeds);
            Some(store.unwrap_or_else(|e| fail("REDIS_CLUSTER_NODES", e)))
        }
        (_, Ok(url)) => Some(RedisStore::open(&url).unwrap_or_else(|e| fail("REDIS_URL", e))),
        _ => None,
    };
    let (store, ledger): (Arc<dyn Store>, _) = match (redis, postgres) {
        (Some(redis), Some(postgres)) => {
            tracing::info!("idempotency: Redis in front of Postgres");
            let pool = postgres.pool().clone();
            (
                Arc::new(TieredStore::new(redis, postgres)),
                Ledger::Postgres(pool),
            )
        }
        (None, Some(postgres)) => {
            tracing::info!("idempotency: Postgres");
            let pool = postgres.pool().clone();
            (Arc::new(postgres), Ledger::Postgres(pool))
        }
        (Some(redis), None) => {
            tracing::warn!("idempotency: Redis alone (best effort); payments kept in memory");
            (Arc::new(redis), Ledger::Memory(Mutex::default()))
        }
        (None, None) => {
            tracing::warn!(
                "no REDIS_URL / DATABASE_URL: running on the in-memory store, which protects this \
                 single process only"
            );
            (
                Arc::new(MemoryStore::new()),
                Ledger::Memory(Mutex::default()),
            )
        }
    };
    let provider = match env::var("PROVIDER_URL") {
        Ok(url) => Provider::Http {
            url,
            client: Box::new(
                ServiceBuilder::new()
                    .layer(
                        IdempotencyClientLayer::new()
                            .with_attempt_timeout(env_millis("PROVIDER_TIMEOUT_MS", 10_000)),
                    )
                    .service(Client::builder(TokioExecutor::new()).build_http()),
            ),
        },
        Err(_) => Provider::Mock(Mutex::default()),
    };
    let state = AppState {
        ledger,
        provider,
        answer_with_fence: env::var("PAYMENTS_ANSWER_WITH_FENCE").map_or(true, |v| v != "false"),
        work: env_millis("PAYMENTS_WORK_MS", 0),
        pause_after_intent: env_millis("PAYMENTS_PAUSE_AFTER_INTENT_MS", 0),
        pause_after_charge: env_millis("PAYMENTS_PAUSE_AFTER_CHARGE_MS", 0),
        pause_after_commit: env_millis("PAYMENTS_PAUSE_AFTER_COMMIT_MS", 0),
    };
    let mut layer = IdempotencyLayer::from_shared_store(store)
        .with_key_required(true)
        .with_lease(env_millis("IDEMPOTENCY_LEASE_MS", 30_000))
        .with_wait(env_millis("IDEMPOTENCY_WAIT_MS", 10_000));
    if let Ledger::Postgres(pool) = &state.ledger {
        let pool = pool.clone();
        layer = layer.with_recovery(move |record| recover(pool.clone(), record));
    }

    // The layer guards the handler only: a 404 or a 405 never reaches it. Keys are scoped by
    // the caller's credentials (the default): two callers with different `Authorization`
    // headers never share a payment; requests without one share the anonymous scope.
    let app = Router::new()
        .route("/payments", post(create_payment).route_layer(layer))
        .route("/payments/{id}", get(get_payment))
        .with_state(Arc::new(state))
        .route("/metrics", get(move || metrics(prometheus.clone())));

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
