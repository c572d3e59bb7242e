//! The payment API over gRPC (tonic), behind the same `IdempotencyLayer`, added with one line.
//!
//! ```sh
//! cargo run --example grpc_payments          # serves 127.0.0.1:50051 (PORT overrides)
//! grpcurl -plaintext -proto proto/payments.proto -H 'idempotency-key: order-1' \
//!   -d '{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}' \
//!   127.0.0.1:50051 payments.v1.Payments/CreatePayment
//! ```
//!
//! Clients send the key as `idempotency-key` metadata. A retry gets the same `Payment` back with
//! `idempotent-replayed: true` metadata; a retry while the first call runs waits for it and gets
//! its answer (past `IDEMPOTENCY_WAIT_MS`, ABORTED with `grpc-retry-pushback-ms`); the same key
//! with another message gets FAILED_PRECONDITION; a call refused as INVALID_ARGUMENT, or that
//! ends UNAVAILABLE (and the like), leaves the key free for a corrected or clean retry.
//!
//! It runs on the in-memory store; see `payments.rs` for Redis and Postgres. As there,
//! `IDEMPOTENCY_LEASE_MS` sets the claim lease (30000), `IDEMPOTENCY_WAIT_MS` how long a duplicate
//! waits for the first call (10000), and `PAYMENTS_WORK_MS` simulated work per payment (0).

#[path = "grpc/payments_proto.rs"]
mod payments_proto;

use std::{
    collections::HashMap,
    env,
    net::{Ipv4Addr, SocketAddr},
    sync::Mutex,
    time::Duration,
};

use payments_proto::{CreatePaymentRequest, Payment, Payments, PaymentsServer};
use tonic::{Request, Response, Status};
use tower_idempotency::{IdempotencyClaim, IdempotencyLayer, MemoryStore};

/// Payments, and the charges the mock provider made per key (never more than one).
#[derive(Default)]
struct Ledger {
    payments: Mutex<HashMap<String, Payment>>,
    charges: Mutex<HashMap<String, u32>>,
    work: Duration,
}

impl Payments for Ledger {
    async fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        // The layer put the claim in the request extensions; tonic carries them over.
        let claim = request
            .extensions()
            .get::<IdempotencyClaim>()
            .cloned()
            .ok_or_else(|| Status::invalid_argument("idempotency-key metadata is required"))?;
        let new = request.into_inner();
        if new.amount_cents <= 0 || new.currency.len() != 3 || new.customer.is_empty() {
            // Refused before acting: the default policy releases the key, so the corrected
            // request runs with the same key.
            return Err(Status::invalid_argument(
                "amount_cents must be positive, currency a 3-letter code, customer non-empty",
            ));
        }
        tokio::time::sleep(self.work).await;
        let key = claim.key().to_string();
        *self.charges.lock().unwrap().entry(key.clone()).or_default() += 1;
        let payment = Payment {
            id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
            amount_cents: new.amount_cents,
            currency: new.currency.to_lowercase(),
            customer: new.customer,
            charge_id: format!("ch_{}", uuid::Uuid::new_v4().simple()),
            idempotency_key: key,
        };
        self.payments
            .lock()
            .unwrap()
            .insert(payment.id.clone(), payment.clone());
        Ok(Response::new(payment))
    }
}

fn env_millis(name: &str, default: Duration) -> Duration {
    env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(default, Duration::from_millis)
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let port = env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(50051);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    tracing::warn!("running on the in-memory store, which protects this single process only");
    tracing::info!("gRPC payments listening on {addr}");

    let ledger = Ledger {
        work: env_millis("PAYMENTS_WORK_MS", Duration::ZERO),
        ..Ledger::default()
    };
    tonic::transport::Server::builder()
        .layer(
            IdempotencyLayer::new(MemoryStore::new())
                .with_key_required(true)
                .with_lease(env_millis(
                    "IDEMPOTENCY_LEASE_MS",
                    IdempotencyLayer::DEFAULT_LEASE,
                ))
                .with_wait(env_millis(
                    "IDEMPOTENCY_WAIT_MS",
                    IdempotencyLayer::DEFAULT_WAIT,
                )),
        )
        .add_service(PaymentsServer::new(ledger))
        .serve(addr)
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot serve on {addr}: {e}");
            std::process::exit(1)
        });
}
