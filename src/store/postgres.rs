//! The Postgres store: the source of truth, a row per key behind a primary key.

use std::{future::Future, time::Duration};

use bytes::Bytes;
use sqlx::{PgConnection, PgPool, Row, migrate::Migrator, postgres::PgRow};
use tokio::task::JoinHandle;

use super::{
    BoxFuture, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, Store, StoreError,
};
use crate::StoredResponse;

/// The crate's schema migrations (`migrations/` in the crate): the `idempotency_keys` table and
/// the `idempotency_fence` sequence.
///
/// Three ways to apply them:
/// - [`PostgresStore::migrate`], which records them in a table of their own,
///   `_tower_idempotency_migrations`, so they never get in the way of the application's;
/// - `MIGRATOR.run(&pool)`, recorded in sqlx's `_sqlx_migrations` (an application running its own
///   migrator on the same database then needs `set_ignore_missing(true)`);
/// - copying the files into the application's `migrations/` and running `sqlx migrate run`.
///
/// The objects are created unqualified, in the first schema of the `search_path`; the store and
/// the handlers' transactions find them through the same `search_path`.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The default bound on one Postgres operation (acquiring a connection included).
pub const DEFAULT_POSTGRES_TIMEOUT: Duration = Duration::from_secs(5);

/// Rows the sweeper deletes per statement, by default.
pub const DEFAULT_SWEEP_BATCH: i64 = 500;

const STORE: &str = "postgres";

/// A store on Postgres: the source of truth.
///
/// One row per (scope, key), primary key on both; a claim is one atomic `INSERT … ON CONFLICT DO
/// UPDATE … WHERE expired` statement, never a read followed by a write. The same statement
/// answers from a live row it sees without writing, so replays and 409s cost the database no
/// write. Complete, release and renew are `UPDATE`/`DELETE … WHERE owner = $owner`. Every time
/// is the database's `now()`.
/// Fences come from a sequence, so they grow across reclaims and releases alike.
///
/// Handlers fence their business write with [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit)
/// inside their own transaction: once committed, the key can be neither released nor reclaimed,
/// only completed, so a handler that lost its lease during a stall cannot commit a second time.
///
/// Expired rows are deleted by [`sweep`](Self::sweep), which every instance may run at once
/// ([`spawn_sweeper`](Self::spawn_sweeper)). An unreachable database, or an exhausted pool,
/// is an error within [`with_timeout`](Self::with_timeout)'s bound (5 s by default), which the
/// layer answers with 503 without running the handler. Give the pool an `acquire_timeout` below
/// that bound.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    timeout: Duration,
    sweep_batch: i64,
}

const CLAIM: &str = r"
WITH live AS (
    SELECT * FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND expires_at > now()
),
claimed AS (
    INSERT INTO idempotency_keys AS k
        (scope, key, fingerprint, state, owner, fence, lease_until, expires_at)
    SELECT $1, $2, $3, 'in_flight', $4, nextval('idempotency_fence'),
           now() + $5::float8 * interval '1 millisecond',
           now() + $5::float8 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT 1 FROM live)
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = excluded.fingerprint, state = 'in_flight', owner = excluded.owner,
        fence = excluded.fence, lease_until = excluded.lease_until,
        expires_at = excluded.expires_at, status = NULL, response = NULL,
        created_at = now(), updated_at = now()
    WHERE k.expires_at <= now()
    RETURNING k.fence
)
SELECT true AS acquired, fence, NULL::text AS state, true AS same_request,
       NULL::bytea AS response, NULL::int8 AS remaining_ms, NULL::int8 AS expires_ms
FROM claimed
UNION ALL
SELECT false, fence, state, fingerprint = $3,
       CASE WHEN fingerprint = $3 THEN response END,
       ceil(extract(epoch FROM lease_until - now()) * 1000)::int8,
       ceil(extract(epoch FROM expires_at - now()) * 1000)::int8
FROM live
";

const RENEW: &str = r"
UPDATE idempotency_keys
SET lease_until = now() + $4::float8 * interval '1 millisecond',
    expires_at = CASE WHEN state = 'in_flight'
                      THEN now() + $4::float8 * interval '1 millisecond'
                      ELSE greatest(expires_at, now() + $4::float8 * interval '1 millisecond') END,
    updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

const COMPLETE: &str = r"
UPDATE idempotency_keys
SET state = 'completed', status = $4, response = $5, lease_until = now(),
    expires_at = now() + $6::float8 * interval '1 millisecond', updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

const RELEASE: &str = r"
WITH released AS (
    DELETE FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'in_flight'
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM released) AS released,
       EXISTS (SELECT 1 FROM idempotency_keys
               WHERE scope = $1 AND key = $2 AND owner = $3 AND state = 'committed') AS committed
";

/// The fence: run by the handler inside its own transaction.
const COMMIT: &str = r"
UPDATE idempotency_keys
SET state = 'committed',
    expires_at = greatest(expires_at, now() + $4::float8 * interval '1 millisecond'),
    updated_at = now()
WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
";

const SWEEP: &str = r"
WITH doomed AS (
    SELECT scope, key FROM idempotency_keys
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
DELETE FROM idempotency_keys k
USING doomed
WHERE k.scope = doomed.scope AND k.key = doomed.key
";

/// Claims race only when a competing claim commits between two statements; after this many
/// rounds the key is reported in flight.
const CLAIM_ROUNDS: usize = 4;

impl PostgresStore {
    /// A store on `pool`. Run the migrations first ([`migrate`](Self::migrate)).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            timeout: DEFAULT_POSTGRES_TIMEOUT,
            sweep_batch: DEFAULT_SWEEP_BATCH,
        }
    }

    /// The bound on each operation; past it the operation fails with [`StoreError::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many rows one sweep statement deletes (500 by default): small batches keep locks and
    /// WAL bursts short.
    pub fn with_sweep_batch(mut self, rows: i64) -> Self {
        self.sweep_batch = rows.max(1);
        self
    }

    /// The pool, for the handlers' own transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies [`MIGRATOR`], tracked in `_tower_idempotency_migrations` (apart from the
    /// application's own `_sqlx_migrations`).
    pub async fn migrate(&self) -> Result<(), sqlx::migrate::MigrateError> {
        let mut migrator = Migrator::with_migrations(MIGRATOR.iter().cloned().collect());
        // A table of our own from the first run on: never renamed, so nothing to lose.
        migrator.dangerous_set_table_name("_tower_idempotency_migrations");
        migrator.run(&self.pool).await
    }

    /// Deletes every expired row, a batch per statement, and returns how many. Batches skip rows
    /// another sweeper (or a claim) holds, so sweepers on every instance never wait on each other.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let deleted = self
                .bounded(
                    sqlx::query(SWEEP)
                        .bind(self.sweep_batch)
                        .execute(&self.pool),
                )
                .await?
                .rows_affected();
            total += deleted;
            if deleted < self.sweep_batch as u64 {
                return Ok(total);
            }
        }
    }

    /// Runs [`sweep`](Self::sweep) every `period` in a background task, logging failures, until
    /// the handle is aborted. Safe to run on every instance.
    pub fn spawn_sweeper(&self, period: Duration) -> JoinHandle<()> {
        let store = self.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match store.sweep().await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::debug!(deleted, "swept expired idempotency keys"),
                    Err(error) => tracing::warn!(error = %error, "idempotency sweep failed"),
                }
            }
        })
    }

    async fn bounded<T>(
        &self,
        operation: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, operation).await {
            Ok(result) => result.map_err(backend),
            Err(_elapsed) => Err(StoreError::Timeout {
                store: STORE,
                after: self.timeout,
            }),
        }
    }

    async fn claim_once(&self, request: &ClaimRequest) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let row = self
            .bounded(
                sqlx::query(CLAIM)
                    .bind(record.scope())
                    .bind(record.key().as_str())
                    .bind(&request.fingerprint().as_bytes()[..])
                    .bind(request.owner())
                    .bind(millis(request.lease()))
                    .fetch_optional(&self.pool),
            )
            .await?;
        let Some(row) = row else {
            // A competing claim committed after this statement's snapshot: look again.
            return Ok(None);
        };
        read_claim(&row)
            .map(Some)
            .map_err(|source| StoreError::Corrupt {
                store: STORE,
                record: record.clone(),
                source,
            })
    }
}

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            for _ in 0..CLAIM_ROUNDS {
                if let Some(outcome) = self.claim_once(request).await? {
                    return Ok(outcome);
                }
            }
            Ok(ClaimOutcome::InFlight {
                retry_after: Duration::from_secs(1),
            })
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let record = lease.record();
            let updated = self
                .bounded(
                    sqlx::query(RENEW)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .bind(millis(duration))
                        .execute(&self.pool),
                )
                .await?;
            Ok(held_if_one(updated.rows_affected()))
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let record = lease.record();
            let updated = self
                .bounded(
                    sqlx::query(COMPLETE)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .bind(response.status().as_u16() as i16)
                        .bind(&response.encode()[..])
                        .bind(millis(retention))
                        .execute(&self.pool),
                )
                .await?;
            Ok(held_if_one(updated.rows_affected()))
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let record = lease.record();
            let row = self
                .bounded(
                    sqlx::query(RELEASE)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .fetch_one(&self.pool),
                )
                .await?;
            let released: bool = row.try_get("released").map_err(backend)?;
            let committed: bool = row.try_get("committed").map_err(backend)?;
            Ok(match (released, committed) {
                (true, _) => Ownership::Held,
                (false, true) => Ownership::Committed,
                (false, false) => Ownership::Lost,
            })
        })
    }
}

/// Moves the key from in flight to committed inside the caller's transaction, if `lease`'s owner
/// still holds it. See [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit).
pub(crate) async fn commit(
    connection: &mut PgConnection,
    lease: &Lease,
    retention: Duration,
) -> Result<(), FenceError> {
    let record = lease.record();
    let updated = sqlx::query(COMMIT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(millis(retention))
        .execute(connection)
        .await
        .map_err(|source| FenceError::Database {
            record: record.clone(),
            source,
        })?
        .rows_affected();
    if updated == 1 {
        Ok(())
    } else {
        Err(FenceError::LeaseLost {
            record: record.clone(),
            fence: lease.fence(),
        })
    }
}

/// The fence refused a handler's commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The request no longer owns its key: its lease expired and another attempt reclaimed it
    /// (or the key finished). Roll the transaction back: the other attempt is the one that counts.
    #[error("the claim on {record} (fence {fence}) was lost to another attempt; roll back")]
    LeaseLost {
        /// The record whose claim was lost.
        record: RecordKey,
        /// The fence this request was granted.
        fence: u64,
    },
    /// The fence statement itself failed (the transaction is likely aborted).
    #[error("could not fence {record}")]
    Database {
        /// The record involved.
        record: RecordKey,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
}

/// An owner-checked statement touches the row if, and only if, the owner still holds it.
fn held_if_one(rows: u64) -> Ownership {
    if rows == 1 {
        Ownership::Held
    } else {
        Ownership::Lost
    }
}

fn backend(error: sqlx::Error) -> StoreError {
    StoreError::Backend {
        store: STORE,
        source: error.into(),
    }
}

/// Postgres intervals take fractional milliseconds; ours are whole.
fn millis(duration: Duration) -> f64 {
    duration.as_millis() as f64
}

/// Reads the row of the claim statement.
fn read_claim(row: &PgRow) -> Result<ClaimOutcome, super::BoxError> {
    if row.try_get::<bool, _>("acquired")? {
        let fence: i64 = row.try_get("fence")?;
        return Ok(ClaimOutcome::Acquired {
            fence: u64::try_from(fence)?,
        });
    }
    if !row.try_get::<bool, _>("same_request")? {
        return Ok(ClaimOutcome::Mismatch);
    }
    let millis = |column| -> Result<Duration, sqlx::Error> {
        let millis: Option<i64> = row.try_get(column)?;
        Ok(Duration::from_millis(
            u64::try_from(millis.unwrap_or(0)).unwrap_or(0),
        ))
    };
    let remaining = millis("remaining_ms")?;
    let state: String = row.try_get("state")?;
    Ok(match state.as_str() {
        "completed" => {
            let response: Vec<u8> = row
                .try_get::<Option<Vec<u8>>, _>("response")?
                .ok_or("completed row without a response")?;
            ClaimOutcome::Completed {
                response: Box::new(StoredResponse::decode(Bytes::from(response))?),
                expires_in: millis("expires_ms")?,
            }
        }
        "in_flight" => ClaimOutcome::InFlight {
            retry_after: remaining,
        },
        // Committed: while its owner lives it renews the lease; a lapsed lease means the
        // owner died between its commit and storing a response.
        "committed" if remaining > Duration::ZERO => ClaimOutcome::InFlight {
            retry_after: remaining,
        },
        "committed" => ClaimOutcome::Orphaned,
        other => return Err(format!("unknown state {other:?}").into()),
    })
}
