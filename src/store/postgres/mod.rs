//! The Postgres store: the source of truth, a row per key behind a primary key.

mod connections;
mod diagnose;
mod sql;

use std::{
    future::Future,
    sync::{Arc, LazyLock},
    time::{Duration, Instant},
};

use bytes::Bytes;
use sqlx::{
    Connection, PgConnection, PgPool, Row,
    migrate::{Migration, MigrationType, Migrator},
    postgres::PgRow,
};
use tokio::task::JoinHandle;

use self::{connections::Connections, sql::*};
use super::{
    BoxError, BoxFuture, ClaimOutcome, ClaimRequest, Diagnosis, Lease, Ownership, RecordInfo,
    RecordKey, RecordState, Store, StoreError,
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
///
/// The set is built on first use from the files compiled into the crate (without sqlx's
/// `macros` feature), with the versions, descriptions and checksums `sqlx::migrate!` and
/// `sqlx migrate run` give the same files; it dereferences to a [`Migrator`].
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                let no_tx = sql.starts_with("-- no-transaction");
                let sql = sqlx::SqlSafeStr::into_sql_str(sql);
                Migration::new(
                    version,
                    description.into(),
                    MigrationType::Simple,
                    sql,
                    no_tx,
                )
            })
            .collect(),
    )
});

/// The files of `migrations/`: version, description (the file name's rest, `_` read as a
/// space), SQL. A test checks this list against what sqlx resolves from the directory.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        20261129000000,
        "idempotency keys",
        include_str!("../../../migrations/20261129000000_idempotency_keys.sql"),
    ),
    (
        20261129000001,
        "commit with response",
        include_str!("../../../migrations/20261129000001_commit_with_response.sql"),
    ),
    (
        20261129000002,
        "fence function",
        include_str!("../../../migrations/20261129000002_fence_function.sql"),
    ),
    (
        20261201000000,
        "recovery points",
        include_str!("../../../migrations/20261201000000_recovery_points.sql"),
    ),
    (
        20261201000001,
        "fence retention from the fence",
        include_str!("../../../migrations/20261201000001_fence_retention_from_the_fence.sql"),
    ),
];

/// The optional migration that hash-partitions `idempotency_keys` on (scope, key), 4 ways:
/// `migrations/optional/partition_by_hash.sql`, which says when to use it. Not part of
/// [`MIGRATOR`]: run it once after it (`sqlx::raw_sql(PARTITION_BY_HASH).execute(&pool)`), or
/// copy the file into your migrations. Every statement of the store works on either table;
/// applied to a partitioned table, it changes nothing.
pub const PARTITION_BY_HASH: &str =
    include_str!("../../../migrations/optional/partition_by_hash.sql");

/// The default bound on one Postgres operation (acquiring a connection included).
pub const DEFAULT_POSTGRES_TIMEOUT: Duration = Duration::from_secs(5);

/// The default number of connections the store opens for its own statements.
pub const DEFAULT_POSTGRES_CONNECTIONS: usize = 16;

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
///
/// The store's statements run on connections of its own (up to 16,
/// [`with_max_connections`](Self::with_max_connections)), made with the pool's connect options:
/// sqlx's pool would add a health-check round trip before and after every statement, and the
/// store's connections carry settings of their own (`enable_seqscan = off`, so that no cached
/// generic plan made on an empty table ever scans the grown one; and a statement timeout equal to
/// the store's bound). The pool serves the handlers' transactions and the migrations. Budget for both in
/// the server's `max_connections`.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pool: PgPool,
    connections: Arc<Connections>,
    max_connections: usize,
    timeout: Duration,
    sweep_batch: i64,
}

/// The connections of a store detached for renewals ([`Store::detached`]): renewals are short,
/// and one per held lease every third of a lease.
const RENEWAL_CONNECTIONS: usize = 4;

/// Claims race only when a competing claim commits between two statements; after this many
/// rounds the key is reported in flight.
const CLAIM_ROUNDS: usize = 4;

/// Taken off a claim's time left before it is sent: the claim must not insert after its caller
/// gave up, however long the message took to reach the server.
const SEND_MARGIN: Duration = Duration::from_millis(5);

/// What a claim that meets a row locked by another transaction answers: the holder is alive
/// (a fence transaction, another claim, a renewal), and done soon.
const LOCKED_RETRY: Duration = Duration::from_millis(100);

impl PostgresStore {
    /// A store on `pool`. Run the migrations first ([`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::{sqlx::postgres::PgPoolOptions, store::PostgresStore};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPoolOptions::new()
    ///     .acquire_timeout(Duration::from_secs(2))
    ///     .connect("postgres://127.0.0.1/app")
    ///     .await?;
    /// let store = PostgresStore::new(pool).with_timeout(Duration::from_secs(3));
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn new(pool: PgPool) -> Self {
        crate::telemetry::register_postgres_metrics();
        let connections = Connections::new(
            &pool.connect_options(),
            DEFAULT_POSTGRES_CONNECTIONS,
            DEFAULT_POSTGRES_TIMEOUT,
        );
        Self {
            pool,
            connections: Arc::new(connections),
            max_connections: DEFAULT_POSTGRES_CONNECTIONS,
            timeout: DEFAULT_POSTGRES_TIMEOUT,
            sweep_batch: DEFAULT_SWEEP_BATCH,
        }
    }

    /// The bound on each operation; past it the operation fails with [`StoreError::Timeout`].
    /// The server holds the store's statements to it too (`statement_timeout`).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.reconnect();
        self
    }

    /// How many connections the store opens for its own statements (16 by default), apart from
    /// the pool's.
    pub fn with_max_connections(mut self, connections: usize) -> Self {
        self.max_connections = connections;
        self.reconnect();
        self
    }

    fn reconnect(&mut self) {
        let options = self.pool.connect_options();
        self.connections = Arc::new(Connections::new(
            &options,
            self.max_connections,
            self.timeout,
        ));
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
                .on_connection(async |connection| {
                    sqlx::query(SWEEP)
                        .bind(self.sweep_batch)
                        .execute(connection)
                        .await
                })
                .await?
                .rows_affected();
            total += deleted;
            crate::telemetry::count_n("idempotency_swept_rows_total", deleted);
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
                    Err(error) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "idempotency sweep failed"
                    ),
                }
            }
        })
    }

    /// Runs one statement on a connection of the store's own, under the timeout (getting the
    /// connection included); the connection goes back unless the statement left it out of step.
    ///
    /// A statement that fails because its connection was gone (the server restarted, failed
    /// over or terminated it) fails; the connections that idled with it are dropped, so the
    /// caller's retry (the layer retries renewals and finalizes) gets a fresh one. Claims,
    /// which a client waits on, retry at once ([`claim_once`](Self::claim_once)).
    async fn on_connection<T>(
        &self,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        self.bounded(async {
            let mut connection = self.connections.lend().await?;
            let result = statement(&mut connection).await;
            connection.give_back(&result);
            result
        })
        .await
    }

    /// Runs `operation` under the timeout; the server's statement timeout is a timeout too.
    async fn bounded<T>(
        &self,
        operation: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        super::bounded(STORE, self.timeout, operation, |e| self.failed(e)).await
    }

    fn timed_out(&self) -> StoreError {
        StoreError::timeout(STORE, self.timeout)
    }

    /// One round of a claim: `None` when a competing claim committed between snapshots and the
    /// row must be read again.
    async fn claim_once(
        &self,
        request: &ClaimRequest,
        started: Instant,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let mut connection = self.connections.lend().await.map_err(backend)?;
        // What is left of the caller's time once a connection is in hand, less a margin for the
        // message's way to the server: the server inserts only within it.
        let left = self
            .timeout
            .checked_sub(started.elapsed() + SEND_MARGIN)
            .ok_or_else(|| self.timed_out())?;
        let row = sqlx::query(CLAIM)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .bind(request.owner())
            .bind(millis(request.lease()))
            .bind(millis(left))
            .fetch_optional(&mut *connection)
            .await;
        if connection.give_back(&row) {
            // The connection was gone: another round, on a fresh one.
            return Ok(None);
        }
        let row = row.map_err(|e| self.failed(e))?;
        let Some(row) = row else {
            // A competing claim committed after this statement's snapshot (or the statement ran
            // past the caller's time and inserted nothing): look again.
            return Ok(None);
        };
        match read_claim(&row, record)? {
            Some(outcome) => Ok(Some(outcome)),
            None => self.settle(request).await,
        }
    }

    /// Settles a row the common path could not, under its row lock: takes over an expired row,
    /// or gives the owner of a committed key whose lease lapsed a grace of half a lease to
    /// renew. A row another transaction holds is in flight: its holder is alive. `None` when
    /// the row changed meanwhile and must be read again.
    async fn settle(&self, request: &ClaimRequest) -> Result<Option<ClaimOutcome>, StoreError> {
        let mut connection = self.connections.lend().await.map_err(backend)?;
        let settled = settle(&mut connection, request).await;
        if connection.give_back(&settled) {
            return Ok(None);
        }
        settled.map_err(|e| self.failed(e))
    }

    /// A failure of one of the store's statements: the server's statement timeout is a timeout.
    fn failed(&self, error: sqlx::Error) -> StoreError {
        let cancelled = error
            .as_database_error()
            .and_then(|e| e.code())
            .is_some_and(|code| code == "57014");
        if cancelled {
            self.timed_out()
        } else {
            backend(error)
        }
    }
}

/// What a row of [`CLAIM`] says: the outcome, or `None` for a row the claim must settle under
/// its lock (expired, or committed with its lease lapsed).
fn read_claim(row: &PgRow, record: &RecordKey) -> Result<Option<ClaimOutcome>, StoreError> {
    let corrupt = |source: BoxError| StoreError::corrupt(STORE, record, source);
    let verdict: String = row.try_get("verdict").map_err(backend)?;
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
            let response =
                StoredResponse::decode(Bytes::from(response)).map_err(|e| corrupt(e.into()))?;
            ClaimOutcome::Completed {
                response: Box::new(response),
                expires_in: column_millis(row, "expires_ms")?,
            }
        }
        "in_flight" => ClaimOutcome::InFlight {
            retry_after: column_millis(row, "lease_ms")?,
        },
        "orphaned" => ClaimOutcome::Orphaned,
        "expired" | "lapsed" => return Ok(None),
        other => return Err(corrupt(format!("unknown claim verdict {other:?}").into())),
    }))
}

/// A column of milliseconds (`NULL` and negative as zero) as a duration.
fn column_millis(row: &PgRow, column: &str) -> Result<Duration, StoreError> {
    let millis: Option<i64> = row.try_get(column).map_err(backend)?;
    Ok(Duration::from_millis(
        u64::try_from(millis.unwrap_or(0)).unwrap_or(0),
    ))
}

/// See [`PostgresStore::settle`]: in a transaction of its own on `connection`, which ends
/// before the connection goes back, whatever the row said: a transaction left open would keep
/// its row lock (and the key in flight) on an idle connection until its next use.
async fn settle(
    connection: &mut PgConnection,
    request: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let mut tx = connection.begin().await?;
    let outcome = settle_in(&mut tx, request).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// The statements of [`settle`], in its transaction.
async fn settle_in(
    tx: &mut PgConnection,
    request: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let record = request.record();
    let locked = sqlx::query(LOCK)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(&request.fingerprint().as_bytes()[..])
        .fetch_optional(&mut *tx)
        .await?;
    let Some(row) = locked else {
        let unsettled: bool = sqlx::query_scalar(UNSETTLED)
            .bind(record.scope())
            .bind(record.key().as_str())
            .fetch_one(&mut *tx)
            .await?;
        return Ok(unsettled.then_some(ClaimOutcome::InFlight {
            retry_after: LOCKED_RETRY,
        }));
    };
    let flag = |column| row.try_get::<bool, _>(column);
    let state: String = row.try_get("state")?;
    if !flag("live")? && flag("resumable")? && !flag("same")? && state == "in_flight" {
        // Progress made for another request: not this one's to take over.
        return Ok(Some(ClaimOutcome::Mismatch));
    }
    if !flag("live")? {
        let fence: i64 = sqlx::query_scalar(TAKE_OVER)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .bind(request.owner())
            .bind(millis(request.lease()))
            .fetch_one(&mut *tx)
            .await?;
        let fence = u64::try_from(fence).unwrap_or_default();
        return Ok(Some(ClaimOutcome::Acquired { fence }));
    }
    let lapsed = state == "committed"
        && flag("same")?
        && !flag("answered")?
        && !flag("leased")?
        && !flag("suspect")?;
    if !lapsed {
        return Ok(None);
    }
    let grace = request.lease() / 2;
    sqlx::query(SUSPECT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(millis(grace))
        .execute(&mut *tx)
        .await?;
    Ok(Some(ClaimOutcome::InFlight { retry_after: grace }))
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
                .on_connection(async |connection| {
                    sqlx::query(RENEW)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .bind(millis(duration))
                        .fetch_one(connection)
                        .await
                })
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
            let encoded = response.encode();
            let updated = self
                .on_connection(async |connection| {
                    sqlx::query(COMPLETE)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .bind(response.status().as_u16() as i16)
                        .bind(&encoded[..])
                        .bind(millis(retention))
                        .execute(connection)
                        .await
                })
                .await?;
            Ok(held_if_one(updated.rows_affected()))
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let record = lease.record();
            let row = self
                .on_connection(async |connection| {
                    sqlx::query(RELEASE)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(lease.owner())
                        .fetch_one(connection)
                        .await
                })
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

    fn kind(&self) -> &'static str {
        "postgres"
    }

    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let record = request.record();
            let adopted = self
                .on_connection(async |connection| {
                    sqlx::query(ADOPT)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .bind(&request.fingerprint().as_bytes()[..])
                        .bind(response.status().as_u16() as i16)
                        .bind(response.encode().to_vec())
                        .bind(millis(retention))
                        .execute(connection)
                        .await
                })
                .await?;
            Ok(adopted.rows_affected() == 1)
        })
    }

    /// Connections of its own (at most 4, made on first use), on the same pool options.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        let options = self.pool.connect_options();
        let connections = Connections::new(&options, RENEWAL_CONNECTIONS, self.timeout);
        Some(Arc::new(Self {
            connections: Arc::new(connections),
            max_connections: RENEWAL_CONNECTIONS,
            ..self.clone()
        }))
    }

    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        Box::pin(self.diagnosis())
    }

    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        Box::pin(async move {
            let row = self
                .on_connection(async |connection| {
                    sqlx::query(INSPECT)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .fetch_optional(connection)
                        .await
                })
                .await?;
            row.map(|row| read_info(&row)).transpose()
        })
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let deleted = self
                .on_connection(async |connection| {
                    sqlx::query(FORGET)
                        .bind(record.scope())
                        .bind(record.key().as_str())
                        .execute(connection)
                        .await
                })
                .await?;
            Ok(deleted.rows_affected() > 0)
        })
    }

    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        Box::pin(async move {
            let rows = self
                .on_connection(async |connection| {
                    sqlx::query(STUCK)
                        .bind(millis(older_than))
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                        .fetch_all(connection)
                        .await
                })
                .await?;
            rows.iter().map(read_info).collect()
        })
    }
}

/// An operator's view of a row of [`INSPECT`] or [`STUCK`].
fn read_info(row: &PgRow) -> Result<RecordInfo, StoreError> {
    let scope: String = row.try_get("scope").map_err(backend)?;
    let key: String = row.try_get("key").map_err(backend)?;
    let key =
        crate::IdempotencyKey::try_from(key.as_str()).map_err(|e| StoreError::backend(STORE, e))?;
    let record = RecordKey::new(scope, key);
    let state = match row.try_get::<String, _>("state").map_err(backend)?.as_str() {
        "in_flight" => RecordState::InFlight,
        "committed" => RecordState::Committed,
        "completed" => RecordState::Completed,
        other => {
            let unknown = format!("unknown state {other:?}");
            return Err(StoreError::corrupt(STORE, &record, unknown));
        }
    };
    let millis = |column| column_millis(row, column);
    let fence: i64 = row.try_get("fence").map_err(backend)?;
    let status: Option<i16> = row.try_get("status").map_err(backend)?;
    Ok(RecordInfo {
        state,
        fence: u64::try_from(fence).unwrap_or_default(),
        owner: row.try_get("owner").map_err(backend)?,
        lease_left: (state != RecordState::Completed)
            .then(|| millis("lease_ms"))
            .transpose()?,
        age: Some(millis("age_ms")?),
        expires_in: millis("expires_ms")?,
        status: status.and_then(|s| http::StatusCode::from_u16(s as u16).ok()),
        record,
    })
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
    let committed: bool = sqlx::query_scalar(COMMIT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(millis(retention))
        .bind(millis(lease_duration))
        .bind(response.map(|r| r.status().as_u16() as i16))
        .bind(response.map(|r| r.encode().to_vec()))
        .fetch_one(connection)
        .await
        .map_err(|source| FenceError::Database {
            record: record.clone(),
            source,
        })?;
    fenced(committed, lease)
}

/// How far a multi-step handler got with its key: the point its last finished step recorded,
/// and what it left for the next ([`IdempotencyClaim::advance`](crate::IdempotencyClaim::advance)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryPoint {
    name: String,
    payload: serde_json::Value,
}

impl RecoveryPoint {
    /// The point's name, as the handler gave it (`"intent_recorded"`, say).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the step left for the next (`null` when it left nothing).
    pub fn payload(&self) -> &serde_json::Value {
        &self.payload
    }
}

/// Moves the key's recovery point to `point`, with `payload`, inside the caller's transaction, if
/// `lease`'s owner still holds it in flight. See
/// [`IdempotencyClaim::advance`](crate::IdempotencyClaim::advance).
pub(crate) async fn advance(
    connection: &mut PgConnection,
    lease: &Lease,
    times: (Duration, Duration),
    point: &str,
    payload: &serde_json::Value,
) -> Result<(), FenceError> {
    let (retention, lease_duration) = times;
    let record = lease.record();
    let advanced: bool = sqlx::query_scalar(ADVANCE)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(point)
        .bind(payload.to_string())
        .bind(millis(retention))
        .bind(millis(lease_duration))
        .fetch_one(&mut *connection)
        .await
        .map_err(|source| FenceError::Database {
            record: record.clone(),
            source,
        })?;
    if advanced {
        return Ok(());
    }
    Err(refused(connection, lease).await)
}

/// The key's recovery point, if `lease`'s owner holds it. See
/// [`IdempotencyClaim::recovery_point`](crate::IdempotencyClaim::recovery_point).
pub(crate) async fn recovery_point(
    connection: &mut PgConnection,
    lease: &Lease,
) -> Result<Option<RecoveryPoint>, FenceError> {
    let record = lease.record();
    let failed = |source| FenceError::Database {
        record: record.clone(),
        source,
    };
    let row = sqlx::query(RECOVERY)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .fetch_optional(&mut *connection)
        .await
        .map_err(failed)?;
    let Some(row) = row else {
        return Err(refused(connection, lease).await);
    };
    let name: Option<String> = row.try_get("recovery_point").map_err(failed)?;
    let payload: Option<String> = row.try_get("payload").map_err(failed)?;
    let payload = match payload {
        Some(text) => {
            serde_json::from_str(&text).map_err(|e| failed(sqlx::Error::Decode(e.into())))?
        }
        None => serde_json::Value::Null,
    };
    Ok(name.map(|name| RecoveryPoint { name, payload }))
}

/// Why an owner-checked statement found no row of `lease`'s owner: another attempt holds the
/// key, or there is no row for it at all (the layer's store is not Postgres, or the key went).
async fn refused(connection: &mut PgConnection, lease: &Lease) -> FenceError {
    let record = lease.record();
    let exists: Result<bool, _> = sqlx::query_scalar(RECORD_EXISTS)
        .bind(record.scope())
        .bind(record.key().as_str())
        .fetch_one(connection)
        .await;
    match exists {
        Ok(false) => FenceError::NoRecord {
            record: record.clone(),
        },
        Ok(true) | Err(_) => FenceError::LeaseLost {
            record: record.clone(),
            fence: lease.fence(),
        },
    }
}

/// `Ok` if the owner-checked statement found the owner, else the fence's refusal.
fn fenced(held: bool, lease: &Lease) -> Result<(), FenceError> {
    if held {
        Ok(())
    } else {
        Err(FenceError::LeaseLost {
            record: lease.record().clone(),
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
    /// There is no record of the key in `idempotency_keys` (on this connection's
    /// `search_path`): the layer's store is not Postgres (recovery points need it, alone or
    /// behind Redis), or the key was released meanwhile.
    #[error(
        "no idempotency_keys row for {record} on this connection: is the layer's store Postgres \
         (alone or behind Redis), with its table on this transaction's search_path?"
    )]
    NoRecord {
        /// The record involved.
        record: RecordKey,
    },
    /// The outcome given to [`IdempotencyClaim::commit_with_outcome`] could not be
    /// serialized: nothing was written.
    ///
    /// [`IdempotencyClaim::commit_with_outcome`]: crate::IdempotencyClaim::commit_with_outcome
    #[error("the outcome of {record} could not be serialized")]
    Outcome {
        /// The record involved.
        record: RecordKey,
        /// What serde said.
        #[source]
        source: serde_json::Error,
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
    StoreError::backend(STORE, error)
}

/// Postgres intervals take fractional milliseconds; ours are whole.
fn millis(duration: Duration) -> f64 {
    duration.as_millis() as f64
}
