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

/// Where payments are kept.
pub(crate) enum Ledger {
    Memory(Mutex<HashMap<String, Payment>>),
    Postgres(PgPool),
}

pub(crate) async fn get_payment(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Response {
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
pub(crate) async fn create_payments_table(pool: &PgPool) -> Result<(), sqlx::Error> {
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
