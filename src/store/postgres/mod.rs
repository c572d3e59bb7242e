//! The Postgres store: the source of truth, a row per key behind a primary key.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use bytes::Bytes;
use sqlx::{PgConnection, PgPool, Row, migrate::Migrator};
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
/// One row per (scope, key), primary key on both. A claim is one statement in the common case:
/// it inserts the key when there is no row (`INSERT … ON CONFLICT DO NOTHING`, never a read
/// followed by a write) or answers from the row it finds without writing, so replays and 409s
/// cost the database no write. A row that needs more is settled in a short transaction under
/// its row lock (`FOR UPDATE SKIP LOCKED`): an expired row is taken over; a row another
/// transaction holds (a handler's open fence, typically) is in flight, its holder alive; a
/// committed key whose lease lapsed gets half a lease of grace for its owner to renew before it
/// is reported orphaned. Complete, release and renew are conditional on the owner, and a renewal
/// never waits on a row lock. Every time is the database's.
///
/// Fences come from a sequence, so they grow across reclaims and releases alike. Handlers fence
/// their business write with [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit) (or
/// `commit_with_response`, which stores the answer too) inside their own transaction: once
/// committed, the key can be neither released nor reclaimed, only completed, so a handler that
/// lost its lease during a stall cannot commit a second time.
///
/// Expired rows are deleted by [`sweep`](Self::sweep), which every instance may run at once
/// ([`spawn_sweeper`](Self::spawn_sweeper)). An unreachable database, or an exhausted pool,
/// is an error within [`with_timeout`](Self::with_timeout)'s bound (5 s by default), which the
/// layer answers with 503 without running the handler; a claim also checks that bound on the
/// server's clock before it inserts, so one the client gave up on never acquires later. Give the
/// pool an `acquire_timeout` below that bound.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    timeout: Duration,
    sweep_batch: i64,
}

/// The claim's common path, one round trip: insert the key if there is no row, or say what the
/// row there is. Rows that need more (an expired row to take over, a committed key whose lease
/// lapsed) are settled by [`PostgresStore::settle`] under a row lock.
///
/// $1 scope, $2 key, $3 fingerprint, $4 owner, $5 lease (ms), $6 what is left of the caller's
/// time (ms): the insert happens only within it, measured on the server's clock from the start
/// of the statement's transaction (`now()`, taken before any lock wait; `statement_timestamp()`
/// would be the time the server got round to reading the message), so a claim the caller gave
/// up on (say it waited on a lock) never acquires later.
const CLAIM: &str = r"
WITH cur AS (
    SELECT state, fingerprint = $3 AS same, response, suspect,
           lease_until > now() AS leased, expires_at > now() AS live,
           ceil(extract(epoch FROM lease_until - now()) * 1000)::int8 AS lease_ms,
           ceil(extract(epoch FROM expires_at - now()) * 1000)::int8 AS expires_ms
    FROM idempotency_keys
    WHERE scope = $1 AND key = $2
),
claimed AS (
    INSERT INTO idempotency_keys
        (scope, key, fingerprint, state, owner, fence, lease_until, expires_at)
    SELECT $1, $2, $3, 'in_flight', $4, nextval('idempotency_fence'),
           now() + $5::float8 * interval '1 millisecond',
           now() + $5::float8 * interval '1 millisecond'
    WHERE NOT EXISTS (SELECT 1 FROM cur)
      AND clock_timestamp() < now() + $6::float8 * interval '1 millisecond'
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING fence
)
SELECT 'acquired' AS verdict, fence, NULL::bytea AS response,
       NULL::int8 AS lease_ms, NULL::int8 AS expires_ms
FROM claimed
UNION ALL
SELECT CASE
           WHEN NOT live THEN 'expired'
           WHEN NOT same THEN 'mismatch'
           WHEN state = 'completed' OR response IS NOT NULL THEN 'completed'
           WHEN leased THEN 'in_flight'
           WHEN suspect THEN 'orphaned'
           ELSE 'lapsed'
       END,
       NULL, CASE WHEN same THEN response END, lease_ms, expires_ms
FROM cur
";

/// Locks a row that needs settling, unless another transaction holds it.
const LOCK: &str = r"
SELECT fingerprint = $3 AS same, state, response IS NOT NULL AS answered, suspect,
       lease_until > now() AS leased, expires_at > now() AS live
FROM idempotency_keys
WHERE scope = $1 AND key = $2
FOR UPDATE SKIP LOCKED
";

/// Whether the row still needs settling, seen without a lock: then a transaction holds it.
const UNSETTLED: &str = r"
SELECT EXISTS (
    SELECT 1 FROM idempotency_keys
    WHERE scope = $1 AND key = $2
      AND (expires_at <= now()
           OR (state = 'committed' AND response IS NULL AND lease_until <= now()))
)
";

/// Takes over an expired row, as a fresh claim would have created it.
const TAKE_OVER: &str = r"
UPDATE idempotency_keys
SET fingerprint = $3, state = 'in_flight', owner = $4, fence = nextval('idempotency_fence'),
    lease_until = now() + $5::float8 * interval '1 millisecond',
    expires_at = now() + $5::float8 * interval '1 millisecond',
    status = NULL, response = NULL, suspect = false, created_at = now(), updated_at = now()
WHERE scope = $1 AND key = $2
RETURNING fence
";

/// Gives the owner of a committed key whose lease lapsed a grace to show it is alive.
const SUSPECT: &str = r"
UPDATE idempotency_keys
SET suspect = true, lease_until = now() + $3::float8 * interval '1 millisecond'
WHERE scope = $1 AND key = $2
";

/// Renews without waiting on a row lock: a locked row answers `renewed = false, owned = true`.
const RENEW: &str = r"
WITH target AS (
    SELECT scope, key FROM idempotency_keys
    WHERE scope = $1 AND key = $2 AND owner = $3 AND state IN ('in_flight', 'committed')
    FOR NO KEY UPDATE SKIP LOCKED
),
renewed AS (
    UPDATE idempotency_keys k
    SET lease_until = now() + $4::float8 * interval '1 millisecond',
        expires_at = CASE WHEN k.state = 'in_flight'
                          THEN now() + $4::float8 * interval '1 millisecond'
                          ELSE greatest(k.expires_at, now() + $4::float8 * interval '1 millisecond')
                     END,
        suspect = false, updated_at = now()
    FROM target
    WHERE k.scope = target.scope AND k.key = target.key
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM renewed) AS renewed,
       EXISTS (SELECT 1 FROM idempotency_keys
               WHERE scope = $1 AND key = $2 AND owner = $3
                 AND state IN ('in_flight', 'committed')) AS owned
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

/// The fence: run by the handler inside its own transaction. The lease restarts from the
/// statement's own clock, and the response, when the handler gives one, is stored with it.
const COMMIT: &str = r"
UPDATE idempotency_keys
SET state = 'committed',
    lease_until = clock_timestamp() + $5::float8 * interval '1 millisecond', suspect = false,
    expires_at = greatest(expires_at, now() + $4::float8 * interval '1 millisecond'),
    status = coalesce($6, status), response = coalesce($7, response),
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

/// What a claim that meets a row locked by another transaction answers: the holder is alive
/// (a fence transaction, another claim, a renewal), and done soon.
const LOCKED_RETRY: Duration = Duration::from_millis(100);

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
            Err(_elapsed) => Err(self.timed_out()),
        }
    }

    fn timed_out(&self) -> StoreError {
        StoreError::Timeout {
            store: STORE,
            after: self.timeout,
        }
    }

    /// One round of a claim: `None` when a competing claim committed between snapshots and the
    /// row must be read again.
    async fn claim_once(
        &self,
        request: &ClaimRequest,
        started: Instant,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let left = self
            .timeout
            .checked_sub(started.elapsed())
            .ok_or_else(|| self.timed_out())?;
        let row = sqlx::query(CLAIM)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .bind(request.owner())
            .bind(millis(request.lease()))
            .bind(millis(left))
            .fetch_optional(&self.pool)
            .await
            .map_err(backend)?;
        let Some(row) = row else {
            // A competing claim committed after this statement's snapshot (or the statement ran
            // past the caller's time and inserted nothing): look again.
            return Ok(None);
        };
        let corrupt = |source| StoreError::Corrupt {
            store: STORE,
            record: record.clone(),
            source,
        };
        let verdict: String = row.try_get("verdict").map_err(backend)?;
        let millis = |column| -> Result<Duration, StoreError> {
            let millis: Option<i64> = row.try_get(column).map_err(backend)?;
            Ok(Duration::from_millis(
                u64::try_from(millis.unwrap_or(0)).unwrap_or(0),
            ))
        };
        Ok(Some(match verdict.as_str() {
            "acquired" => {
                let fence: i64 = row.try_get("fence").map_err(backend)?;
                ClaimOutcome::Acquired {
                    fence: u64::try_from(fence).map_err(|e| corrupt(e.into()))?,
                }
            }
            "mismatch" => ClaimOutcome::Mismatch,
            "completed" => {
                let response: Option<Vec<u8>> = row.try_get("response").map_err(backend)?;
                let response =
                    response.ok_or_else(|| corrupt("completed row without a response".into()))?;
                ClaimOutcome::Completed {
                    response: Box::new(
                        StoredResponse::decode(Bytes::from(response))
                            .map_err(|e| corrupt(e.into()))?,
                    ),
                    expires_in: millis("expires_ms")?,
                }
            }
            "in_flight" => ClaimOutcome::InFlight {
                retry_after: millis("lease_ms")?,
            },
            "orphaned" => ClaimOutcome::Orphaned,
            "expired" | "lapsed" => return self.settle(request).await,
            other => return Err(corrupt(format!("unknown claim verdict {other:?}").into())),
        }))
    }

    /// Settles a row the common path could not, under its row lock: takes over an expired row,
    /// or gives the owner of a committed key whose lease lapsed a grace of half a lease to
    /// renew. A row another transaction holds is in flight: its holder is alive. `None` when
    /// the row changed meanwhile and must be read again.
    async fn settle(&self, request: &ClaimRequest) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let mut tx = self.pool.begin().await.map_err(backend)?;
        let locked = sqlx::query(LOCK)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .fetch_optional(&mut *tx)
            .await
            .map_err(backend)?;
        let Some(row) = locked else {
            let unsettled: bool = sqlx::query_scalar(UNSETTLED)
                .bind(record.scope())
                .bind(record.key().as_str())
                .fetch_one(&mut *tx)
                .await
                .map_err(backend)?;
            return Ok(unsettled.then_some(ClaimOutcome::InFlight {
                retry_after: LOCKED_RETRY,
            }));
        };
        let flag = |column| row.try_get::<bool, _>(column).map_err(backend);
        let state: String = row.try_get("state").map_err(backend)?;
        let outcome = if !flag("live")? {
            let fence: i64 = sqlx::query_scalar(TAKE_OVER)
                .bind(record.scope())
                .bind(record.key().as_str())
                .bind(&request.fingerprint().as_bytes()[..])
                .bind(request.owner())
                .bind(millis(request.lease()))
                .fetch_one(&mut *tx)
                .await
                .map_err(backend)?;
            ClaimOutcome::Acquired {
                fence: u64::try_from(fence).unwrap_or_default(),
            }
        } else if state == "committed"
            && flag("same")?
            && !flag("answered")?
            && !flag("leased")?
            && !flag("suspect")?
        {
            let grace = request.lease() / 2;
            sqlx::query(SUSPECT)
                .bind(record.scope())
                .bind(record.key().as_str())
                .bind(millis(grace))
                .execute(&mut *tx)
                .await
                .map_err(backend)?;
            ClaimOutcome::InFlight { retry_after: grace }
        } else {
            return Ok(None);
        };
        tx.commit().await.map_err(backend)?;
        Ok(Some(outcome))
    }
}

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let started = Instant::now();
            let rounds = async {
                for _ in 0..CLAIM_ROUNDS {
                    if let Some(outcome) = self.claim_once(request, started).await? {
                        return Ok(outcome);
                    }
                }
                Ok(ClaimOutcome::InFlight {
                    retry_after: LOCKED_RETRY,
                })
            };
            match tokio::time::timeout(self.timeout, rounds).await {
                Ok(outcome) => outcome,
                Err(_elapsed) => Err(self.timed_out()),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let record = lease.record();
            let row = self
                .bounded(
                    sqlx::query(RENEW)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .bind(millis(duration))
                        .fetch_one(&self.pool),
                )
                .await?;
            let renewed: bool = row.try_get("renewed").map_err(backend)?;
            let owned: bool = row.try_get("owned").map_err(backend)?;
            Ok(match (renewed, owned) {
                (true, _) => Ownership::Held,
                (false, true) => Ownership::Busy,
                (false, false) => Ownership::Lost,
            })
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
/// still holds it, storing `response` with it when given. See
/// [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit).
pub(crate) async fn commit(
    connection: &mut PgConnection,
    lease: &Lease,
    times: (Duration, Duration),
    response: Option<&StoredResponse>,
) -> Result<(), FenceError> {
    let (retention, lease_duration) = times;
    let record = lease.record();
    let updated = sqlx::query(COMMIT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(millis(retention))
        .bind(millis(lease_duration))
        .bind(response.map(|r| r.status().as_u16() as i16))
        .bind(response.map(|r| r.encode().to_vec()))
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
