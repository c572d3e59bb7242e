//! What the queue-consumer examples share: the shipment each order's message asks for, written
//! once per order through `Once::run` whatever the broker redelivers, and the settings they read
//! from the environment. Each example is the broker's half: how it receives, acknowledges and
//! hands back a message.

use std::{env, time::Duration};

use sqlx::{PgConnection, PgPool, postgres::PgPoolOptions};
use tower_idempotency::{
    IdempotencyClaim,
    store::{Admin, PostgresStore},
    work::{Done, Once, Unit, WorkError},
};

/// An environment variable, or `default`.
pub fn var(name: &str, default: &str) -> String {
    env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// An environment variable in milliseconds, or `default`.
pub fn millis(name: &str, default: u64) -> Duration {
    Duration::from_millis(
        env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

/// A shipment: the order and the consumer that shipped it.
const INSERT_SHIPMENT: &str = "INSERT INTO shipments (order_id, consumer) VALUES ($1, $2)";

/// Connections of the store's own: fewer than 8, so one lane each for claims and completions,
/// and a window's deliveries share their statements.
const STORE_CONNECTIONS: usize = 4;

/// The pool's, for the shipments' transactions: a prefetch window of 10 handled at once.
const POOL_CONNECTIONS: u32 = 10;

/// Logs to standard output, at `RUST_LOG` (info by default).
pub fn log() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
}

/// How a delivery claims its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Units {
    /// In the shipment's own transaction (`Once::run_in_transaction`), the default.
    InTransaction,
    /// Under a lease renewed while it works, the shipment fenced (`Once::run`):
    /// `IDEMPOTENCY_UNITS=lease`.
    Leased,
    /// A window of deliveries in one transaction, their shipments, claims and outcomes
    /// together (`Once::run_batch_in_transaction`, through [`Shipping::ship_window`]):
    /// `IDEMPOTENCY_UNITS=batch`. A delivery shipped alone is shipped as in its transaction.
    InBatches,
}

impl Units {
    /// `IDEMPOTENCY_UNITS`: `transaction` (the default), `lease` or `batch`.
    pub fn from_env() -> Self {
        match var("IDEMPOTENCY_UNITS", "transaction").as_str() {
            "lease" => Self::Leased,
            "transaction" => Self::InTransaction,
            "batch" => Self::InBatches,
            other => panic!("IDEMPOTENCY_UNITS={other}: `transaction`, `lease` or `batch`"),
        }
    }
}

/// Where shipments are written, and how: the `shipments` table in `DATABASE_URL`, and
/// `Once` on the same Postgres.
pub struct Shipping {
    once: Once,
    pool: PgPool,
    consumer: String,
    work: Duration,
    units: Units,
}

impl Shipping {
    /// Connects to `DATABASE_URL`, runs the crate's migrations and makes the `shipments`
    /// table. `WORK_MS` of work per message; `IDEMPOTENCY_LEASE_MS` the claim's lease (in a
    /// transaction, the longest pause between its statements); `IDEMPOTENCY_UNITS` how
    /// deliveries claim ([`Units::from_env`]).
    pub async fn open(consumer: String) -> Self {
        let pool = PgPoolOptions::new()
            .max_connections(POOL_CONNECTIONS)
            .connect(&env::var("DATABASE_URL").expect("DATABASE_URL"))
            .await
            .expect("Postgres");
        let (work, lease) = (millis("WORK_MS", 0), millis("IDEMPOTENCY_LEASE_MS", 30_000));
        Self::on(pool, consumer, (work, lease), Units::from_env()).await
    }

    /// [`open`](Self::open) on `pool`: `work` per message, claims leased for `lease`, made as
    /// `units` says.
    pub async fn on(
        pool: PgPool,
        consumer: String,
        (work, lease): (Duration, Duration),
        units: Units,
    ) -> Self {
        // The connection budget: the store's 4 (a lane each for claims and completions, so that
        // a window's deliveries share their statements), its renewals' 4 and the pool's 10 for
        // the shipments' own transactions: 18 per consumer.
        let store = PostgresStore::new(pool.clone()).with_max_connections(STORE_CONNECTIONS);
        store.migrate().await.expect("migrations");
        // The start-up check: what puts a guarantee at risk logged, a store that cannot serve
        // the reason to stop.
        let diagnosis = store.diagnose().await;
        diagnosis.log();
        diagnosis
            .ready()
            .expect("the start-up check (see DATABASE_URL)");
        // Consumers starting together would race on `CREATE TABLE IF NOT EXISTS`: one at a time.
        let mut tx = pool.begin().await.expect("Postgres");
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency examples'))")
            .execute(&mut *tx)
            .await
            .expect("the advisory lock");
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS shipments (
                 order_id text NOT NULL, consumer text NOT NULL,
                 shipped_at timestamptz DEFAULT now())",
        )
        .execute(&mut *tx)
        .await
        .expect("the shipments table");
        tx.commit().await.expect("the shipments table");
        let once = Once::new(store).with_lease(lease);
        Self {
            once,
            pool,
            consumer,
            work,
            units,
        }
    }

    /// How its deliveries claim their orders.
    #[allow(dead_code)] // The RabbitMQ example's.
    pub fn units(&self) -> Units {
        self.units
    }

    /// One delivery of `order_id`'s message: the shipment, once per order, its outcome stored
    /// with it. Whether to acknowledge the message: not when it was not delivered (it failed,
    /// or another delivery still runs it), so that the broker delivers it again.
    pub async fn ship(&self, order_id: &str, payload: &[u8]) -> bool {
        let Ok(unit) = Unit::new("orders", order_id, payload) else {
            tracing::error!(%order_id, "a message without a valid order id: dropped");
            return true;
        };
        let (pool, consumer, work) = (&self.pool, &self.consumer, self.work);
        let shipped = match self.units {
            // The shipment, the claim and the outcome in one transaction: one commit, and a
            // delivery that dies or stalls past its lease commits none of them.
            Units::InTransaction | Units::InBatches => {
                let ship = async |tx: &mut PgConnection| self.shipment(tx, order_id).await;
                self.once.run_in_transaction(unit, pool, ship).await
            }
            Units::Leased => {
                let ship = |claim: IdempotencyClaim| async move {
                    tokio::time::sleep(work).await;
                    let mut tx = pool.begin().await?;
                    // The fence, with the outcome: a delivery whose claim another took over
                    // writes nothing, and a consumer killed right after this commit leaves the
                    // next delivery its outcome, not "outcome unknown".
                    let outcome = format!("shipped by {consumer}");
                    claim
                        .commit_with_outcome(&mut tx, &outcome)
                        .await
                        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
                    sqlx::query(INSERT_SHIPMENT)
                        .bind(claim.key().as_str())
                        .bind(consumer)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(outcome)
                };
                self.once.run(unit, ship).await
            }
        };
        delivered(order_id, shipped)
    }

    /// A window of deliveries at once, in one transaction: each order's shipment, once per
    /// order, its outcome stored with it (`Once::run_batch_in_transaction`). Whether to
    /// acknowledge each, as [`ship`](Self::ship) says.
    #[allow(dead_code)] // The RabbitMQ example's and the benchmark's.
    pub async fn ship_window(&self, window: &[(&str, &[u8])]) -> Vec<bool> {
        let mut acks = vec![true; window.len()];
        let (at, units): (Vec<usize>, Vec<Unit>) = (window.iter().enumerate())
            .filter_map(
                |(i, (order_id, payload))| match Unit::new("orders", order_id, payload) {
                    Ok(unit) => Some((i, unit)),
                    Err(_) => {
                        tracing::error!(%order_id, "a message without a valid order id: dropped");
                        None
                    }
                },
            )
            .unzip();
        let ship = |n: usize| {
            let order_id = window[at[n]].0;
            async move |tx: &mut PgConnection| self.shipment(tx, order_id).await
        };
        let shipped = self.once.run_batch_in_transaction(units, &self.pool, ship);
        for (n, shipped) in shipped.await.into_iter().enumerate() {
            acks[at[n]] = delivered(window[at[n]].0, shipped);
        }
        acks
    }

    /// `order_id`'s shipment in the transaction on `tx`, after the message's work: the outcome
    /// its delivery stores.
    async fn shipment(&self, tx: &mut PgConnection, order_id: &str) -> Result<String, sqlx::Error> {
        tokio::time::sleep(self.work).await;
        sqlx::query(INSERT_SHIPMENT)
            .bind(order_id)
            .bind(&self.consumer)
            .execute(&mut *tx)
            .await?;
        Ok(format!("shipped by {}", self.consumer))
    }
}

/// Whether to acknowledge `order_id`'s message, now that `Once` said what became of it: not
/// when it was not delivered (it failed, or another delivery still runs it), so that the
/// broker delivers it again.
fn delivered(order_id: &str, shipped: Result<Done<String>, WorkError<sqlx::Error>>) -> bool {
    match shipped {
        Ok(done) => {
            let outcome = &done.value;
            tracing::info!(order = %order_id, replayed = done.replayed, %outcome, "delivered");
            true
        }
        Err(
            error @ (WorkError::Mismatch | WorkError::OutcomeUnknown | WorkError::AnswerExpired),
        ) => {
            tracing::error!(order = %order_id, %error, "dropped: it will never ship again");
            true
        }
        Err(error) => {
            tracing::warn!(order = %order_id, %error, "not delivered; the broker redelivers it");
            false
        }
    }
}
