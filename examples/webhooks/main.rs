//! A webhook receiver behind `IdempotencyLayer`: every event handled once, however many times
//! and to whichever instance its sender delivers it.
//!
//! ```sh
//! cargo run --example webhooks            # serves 127.0.0.1:3001 (PORT overrides)
//! # A signed delivery, as its sender would make it (prints a curl command to send it):
//! cargo run --example webhooks -- sign stripe '{"id": "evt_1", "type": "charge.refunded"}'
//! cargo run --example webhooks -- sign standard msg_1 '{"type": "invoice.paid"}'
//! ```
//!
//! Two routes, a layer each:
//!
//! - `POST /webhooks/standard`: [Standard Webhooks](https://www.standardwebhooks.com/)
//!   deliveries (Svix, and the senders built on the spec), signed with `WEBHOOK_SECRET`, keyed
//!   by their `webhook-id` header;
//! - `POST /webhooks/stripe`: Stripe events, `Stripe-Signature` checked against
//!   `STRIPE_WEBHOOK_SECRET`, keyed by the event's `id`, which Stripe puts only in the body.
//!
//! Each layer checks the signature and the timestamp (5 minutes' tolerance) before it claims the
//! key: a forged or stale delivery gets 401 (400 without a signature), and the genuine one
//! still runs. Its scope is the sender, never a credential. A redelivery of a handled event gets
//! the stored 200 (senders stop retrying on 2xx); one that arrives while the first runs waits for
//! it; a failed handler releases the key, so the sender's next retry runs it.
//!
//! Each event handled writes one row to `webhook_effects` (`event_id`, `route`, `handled_at`),
//! fenced with `claim.commit` in the same transaction, so a stale attempt writes nothing. The
//! table has no unique constraint on `event_id`: a second run would show there.
//!
//! | variable | effect |
//! |---|---|
//! | `DATABASE_URL` | keys and `webhook_effects` in Postgres (migrations run at start-up) |
//! | `REDIS_URL` | Redis in front of Postgres (with `DATABASE_URL`), or alone |
//! | `WEBHOOK_SECRET` | the Standard Webhooks signing secret, `whsec_…` (an example secret if unset, with a warning) |
//! | `STRIPE_WEBHOOK_SECRET` | the Stripe endpoint's signing secret, `whsec_…` (the same) |
//! | `PORT` | listening port on 127.0.0.1 (3001) |
//! | `IDEMPOTENCY_LEASE_MS` | the claim lease (30000) |
//! | `WEBHOOKS_WORK_MS` | simulated work before the effect is written (0) |
//!
//! With no URL set, keys and effects live in memory: fine to try, no protection across
//! processes. `docs/webhooks.md` says how senders deliver and what each sees.

mod signatures;

use std::{
    env,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
    routing::post,
};
use http::HeaderName;
use sqlx::{PgPool, postgres::PgPoolOptions};
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer, MemoryStore, scope,
    store::{PostgresStore, RedisStore, Store, TieredStore},
};

use self::signatures::{StandardSecret, StripeSecret, now};

/// Secrets to try the receiver with, when none is set: never in production.
const EXAMPLE_STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const EXAMPLE_STRIPE_SECRET: &str = "whsec_example_not_for_production";

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let standard = secret("WEBHOOK_SECRET", EXAMPLE_STANDARD_SECRET);
    let standard = StandardSecret::parse(&standard).unwrap_or_else(|e| fail("WEBHOOK_SECRET", e));
    let stripe = StripeSecret::new(&secret("STRIPE_WEBHOOK_SECRET", EXAMPLE_STRIPE_SECRET));
    if let [_, sign, rest @ ..] = env::args().collect::<Vec<_>>().as_slice()
        && sign == "sign"
    {
        return print_signed(rest, &standard, &stripe);
    }
    let (store, effects) = stores_from_env().await;
    let lease = env_millis("IDEMPOTENCY_LEASE_MS", 30_000);
    let layer = IdempotencyLayer::from_shared_store(store).with_lease(lease);
    // Standard Webhooks: the delivery id is a header; the signature covers id, timestamp and body.
    let standard_layer = layer
        .clone()
        .with_key_header(HeaderName::from_static("webhook-id"))
        .with_key_required(true)
        .with_scope(scope::fixed("standard-webhooks"))
        .with_verifier(move |parts, body| standard.verify(&parts.headers, body, now()));
    // Stripe: the event id is only in the body; the signature covers timestamp and body.
    let stripe_layer = layer
        .with_key_from_body("/id")
        .with_scope(scope::fixed("stripe"))
        .with_verifier(move |parts, body| stripe.verify(&parts.headers, body, now()));
    let app = App {
        effects,
        work: env_millis("WEBHOOKS_WORK_MS", 0),
    };
    let app = Router::new()
        .route(
            "/webhooks/standard",
            post(|app: State<Arc<App>>, claim: IdempotencyClaim| handle(app, claim, "standard"))
                .route_layer(standard_layer),
        )
        .route(
            "/webhooks/stripe",
            post(|app: State<Arc<App>>, claim: IdempotencyClaim| handle(app, claim, "stripe"))
                .route_layer(stripe_layer),
        )
        .with_state(Arc::new(app));

    let port = env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3001);
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .unwrap_or_else(|e| fail("binding the port", e));
    tracing::info!("listening on http://{address}");
    axum::serve(listener, app)
        .await
        .unwrap_or_else(|e| fail("serving", e));
}

struct App {
    effects: Effects,
    work: Duration,
}

/// Where the effects of handled events go.
enum Effects {
    Postgres(PgPool),
    Memory(Mutex<Vec<(String, &'static str)>>),
}

/// Handles one event: the work, then its effect, fenced. Answers 200 (the sender stops
/// retrying); a failure answers 5xx, which releases the key for the sender's next retry.
async fn handle(
    State(app): State<Arc<App>>,
    claim: IdempotencyClaim,
    route: &'static str,
) -> Response {
    tokio::time::sleep(app.work).await;
    let event = claim.key().as_str().to_owned();
    let written = match &app.effects {
        Effects::Postgres(pool) => write_effect(pool, &claim, &event, route).await,
        Effects::Memory(effects) => {
            effects.lock().unwrap().push((event.clone(), route));
            Ok(())
        }
    };
    match written {
        Ok(()) => {
            tracing::info!(event, route, "handled");
            (
                StatusCode::OK,
                axum::Json(serde_json::json!({"received": true})),
            )
                .into_response()
        }
        Err(response) => response,
    }
}

/// The event's effect, in one transaction with the fence: a stale attempt (its lease lost to a
/// redelivery) stops at the fence and writes nothing.
async fn write_effect(
    pool: &PgPool,
    claim: &IdempotencyClaim,
    event: &str,
    route: &str,
) -> Result<(), Response> {
    let unavailable =
        |e: sqlx::Error| (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response();
    let mut tx = pool.begin().await.map_err(unavailable)?;
    if let Err(error) = claim.commit(&mut tx).await {
        tracing::warn!(%error, event, "stale attempt stopped by the fence");
        return Err((StatusCode::CONFLICT, error.to_string()).into_response());
    }
    sqlx::query("INSERT INTO webhook_effects (event_id, route) VALUES ($1, $2)")
        .bind(event)
        .bind(route)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
    tx.commit().await.map_err(unavailable)
}

/// The idempotency store and where effects go, from `DATABASE_URL` and `REDIS_URL`.
async fn stores_from_env() -> (Arc<dyn Store>, Effects) {
    let redis = env::var("REDIS_URL")
        .ok()
        .map(|url| RedisStore::open(&url).unwrap_or_else(|e| fail("REDIS_URL", e)));
    let Ok(url) = env::var("DATABASE_URL") else {
        let effects = Effects::Memory(Mutex::default());
        return match redis {
            Some(redis) => {
                tracing::warn!("Redis alone (best effort); effects kept in memory");
                (Arc::new(redis), effects)
            }
            None => {
                tracing::warn!("no DATABASE_URL: keys and effects in memory, this process only");
                (Arc::new(MemoryStore::new()), effects)
            }
        };
    };
    // 4 + 6 connections an instance (the effects' pool, the store's), and the listener.
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_lazy(&url)
        .unwrap_or_else(|e| fail("DATABASE_URL", e));
    let postgres = PostgresStore::new(pool.clone()).with_max_connections(6);
    postgres
        .migrate()
        .await
        .unwrap_or_else(|e| fail("migrations", e));
    create_effects_table(&pool)
        .await
        .unwrap_or_else(|e| fail("creating webhook_effects", e));
    postgres.spawn_sweeper(Duration::from_secs(60));
    let store: Arc<dyn Store> = match redis {
        Some(redis) => Arc::new(TieredStore::new(redis, postgres)),
        None => Arc::new(postgres),
    };
    (store, Effects::Postgres(pool))
}

/// `webhook_effects`, created once whichever instance starts first (an advisory lock keeps
/// two from racing): no unique constraint on `event_id`, so a second run would show.
async fn create_effects_table(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency webhooks example'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS webhook_effects (
             id bigserial PRIMARY KEY, event_id text NOT NULL, route text NOT NULL,
             handled_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// `sign stripe BODY` or `sign standard ID BODY`: a curl command that delivers `BODY` as the
/// sender would, signed now with this receiver's secret.
fn print_signed(args: &[String], standard: &StandardSecret, stripe: &StripeSecret) {
    let port = env::var("PORT").unwrap_or_else(|_| "3001".into());
    let (path, headers, body) = match args {
        [sender, body] if sender == "stripe" => {
            let signature = stripe.sign(now(), body.as_bytes());
            (
                "stripe",
                vec![format!("Stripe-Signature: {signature}")],
                body,
            )
        }
        [sender, id, body] if sender == "standard" => {
            let timestamp = now();
            let signature = standard.sign(id, timestamp, body.as_bytes());
            let headers = vec![
                format!("webhook-id: {id}"),
                format!("webhook-timestamp: {timestamp}"),
                format!("webhook-signature: {signature}"),
            ];
            ("standard", headers, body)
        }
        _ => fail("usage", "sign stripe BODY | sign standard ID BODY"),
    };
    let headers: String = headers.iter().map(|h| format!(" -H '{h}'")).collect();
    println!(
        "curl -si localhost:{port}/webhooks/{path} -H 'content-type: application/json'{headers} -d '{body}'"
    );
}

fn secret(name: &str, example: &str) -> String {
    env::var(name).unwrap_or_else(|_| {
        tracing::warn!("{name} is not set: using an example secret; never in production");
        example.to_owned()
    })
}

fn env_millis(name: &str, default: u64) -> Duration {
    let millis = env::var(name).ok().and_then(|v| v.parse().ok());
    Duration::from_millis(millis.unwrap_or(default))
}

fn fail(what: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {error}");
    std::process::exit(1)
}
