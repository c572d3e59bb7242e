//! Where payments are kept: their rows (in Postgres, or in memory without a database), and
//! `GET /payments/{id}`.

use super::*;

#[derive(Debug, Deserialize)]
pub(crate) struct NewPayment {
    pub(crate) amount_cents: i64,
    pub(crate) currency: String,
    pub(crate) customer: String,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Payment {
    pub(crate) id: String,
    pub(crate) amount_cents: i64,
    pub(crate) currency: String,
    pub(crate) customer: String,
    pub(crate) status: String,
    pub(crate) charge_id: String,
    pub(crate) idempotency_key: String,
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

/// Where payments are kept: in memory, or in Postgres beside the keys (the store's pool, and on
/// Citus each key's worker: `PostgresStore::pool_for`).
pub(crate) enum Ledger {
    Memory(Mutex<HashMap<String, Payment>>),
    Postgres(PostgresStore),
}

pub(crate) async fn get_payment(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Response {
    let found = match &state.ledger {
        Ledger::Memory(payments) => payments.lock().unwrap().get(&id).cloned(),
        Ledger::Postgres(store) => {
            match sqlx::query_as::<_, Payment>("SELECT * FROM payments WHERE id = $1")
                .bind(&id)
                .fetch_optional(store.pool())
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
///
/// On a Citus coordinator (`citus`), `idempotency_keys` is distributed by key and `payments` by
/// `idempotency_key`, co-located with it: a payment's rows and its key are on one shard, so each
/// step's transaction (a payment statement and the fence) runs on one worker, without two-phase
/// commit. Citus wants the distribution column in every unique constraint: the primary key is
/// then `(idempotency_key, id)`.
pub(crate) async fn create_payments_table(pool: &PgPool, citus: bool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency payments example'))")
        .execute(&mut *tx)
        .await?;
    let primary_key = if citus { "idempotency_key, id" } else { "id" };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS payments (
             id text NOT NULL, amount_cents bigint NOT NULL, currency text NOT NULL,
             customer text NOT NULL, status text NOT NULL, charge_id text NOT NULL,
             idempotency_key text NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY ({primary_key}))"
    )))
    .execute(&mut *tx)
    .await?;
    if citus {
        sqlx::raw_sql(tower_idempotency::store::DISTRIBUTE_ON_CITUS)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "SELECT create_distributed_table('payments', 'idempotency_key',
                                             colocate_with => 'idempotency_keys')
             WHERE NOT EXISTS (SELECT 1 FROM pg_dist_partition
                               WHERE logicalrelid = 'payments'::regclass)",
        )
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await
}
