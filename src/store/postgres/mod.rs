//! The Postgres store: the source of truth, a row per key behind a primary key.

mod admin;
mod batch;
mod claim;
mod connections;
mod diagnose;
pub(crate) mod fence;
mod migrations;
mod shards;
mod sql;
pub(crate) mod unit;
mod wakes;

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use sqlx::{PgConnection, PgPool, postgres::PgConnectOptions};
use tokio::task::JoinHandle;

use self::{
    batch::{Batches, Completion, Queued, Release, Renewal},
    connections::{Connections, Plans},
    shards::Routes,
    sql::*,
};
pub use self::{
    fence::{FenceError, RecoveryPoint},
    migrations::{DISTRIBUTE_ON_CITUS, MIGRATOR, PARTITION_BY_HASH},
};
use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership},
    contract::{BoxFuture, Offers, Store},
    error::StoreError,
};
use crate::response::StoredResponse;

/// The default bound on one Postgres operation (acquiring a connection included).
pub const DEFAULT_POSTGRES_TIMEOUT: Duration = Duration::from_secs(5);

/// The default number of connections the store opens for its own statements.
pub const DEFAULT_POSTGRES_CONNECTIONS: usize = 16;

/// Claims, or completions, one statement carries at most, by default.
pub const DEFAULT_POSTGRES_BATCH: usize = 64;

/// The bound on the skew between Citus nodes' clocks, by default
/// ([`PostgresStore::with_clock_skew`]).
pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_secs(1);

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
/// Fences come from a sequence, so they grow across reclaims and releases alike (on Citus, from
/// the clock of the node that runs the claim, per key: see [`on_citus`](Self::on_citus)). Handlers fence
/// their business write with [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit) (or
/// `commit_with_response`, which stores the answer too) inside their own transaction: once
/// committed, the key can be neither released nor reclaimed, only completed, so a handler that
/// lost its lease during a stall cannot commit a second time.
///
/// Past one primary, the table can be distributed on Citus, sharded by key: see
/// [`on_citus`](Self::on_citus).
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
    max_batch: usize,
    /// How long a lane that starts waits for more calls ([`with_batch_window`](Self::with_batch_window)).
    batch_window: Duration,
    /// How long after its completion a key is kept as a tombstone (zero: not at all).
    horizon: Duration,
    /// On a distributed table ([`on_citus`](Self::on_citus)): statements routed to one shard.
    distributed: bool,
    /// On Citus: where each key's statements go ([`on_citus`](Self::on_citus)).
    routes: Option<Arc<Routes>>,
    /// On Citus: connect options for nodes the metadata names by an address the application
    /// cannot use ([`with_citus_node`](Self::with_citus_node)).
    citus_nodes: Arc<[(shards::Address, PgConnectOptions)]>,
    /// On Citus: the bound on the clocks' skew between nodes, when set
    /// ([`with_clock_skew`](Self::with_clock_skew)).
    clock_skew: Option<Duration>,
    /// Calls waiting for a lane, shared by the store's clones.
    lanes: Lanes,
    /// The keys this process's waiters listen for, and the listener, shared by the store's
    /// clones.
    listening: wakes::Listening,
}

/// The store's lanes (`batch.rs`), by kind of call.
#[derive(Debug, Clone)]
struct Lanes {
    claims: Arc<Batches<claim::Queued>>,
    completions: Arc<Batches<Queued<Completion>>>,
    releases: Arc<Batches<Queued<Release>>>,
    renewals: Arc<Batches<Queued<Renewal>>>,
}

impl Lanes {
    /// Lanes for a store of `connections` connections, batches of at most `max_batch`: an
    /// eighth of the connections each for claims and completions, which every request sends
    /// (two each of the default 16). Fewer lanes make larger batches under load, so fewer
    /// statements, round trips and commits per key: in consecutive runs of the load bench
    /// (BENCHMARKS-LOG.md, "Two lanes"), two lanes each served fresh keys at 51-54 µs of application
    /// CPU and 114 µs of Postgres CPU a request, four at 71-82 and 164; one lane was no faster,
    /// with a longer tail. One lane each for releases and renewals, whose batches are rarer.
    /// With batches of one, a lane is a statement: every kind may use every connection, as
    /// before batches, and there is no window to wait.
    fn new(connections: usize, max_batch: usize, window: Duration) -> Self {
        let (busy, rare, window) = if max_batch > 1 {
            (connections / 8, 1, window)
        } else {
            (connections, connections, Duration::ZERO)
        };
        Self {
            claims: Batches::new(busy, max_batch, window),
            completions: Batches::new(busy, max_batch, window),
            releases: Batches::new(rare, max_batch, window),
            renewals: Batches::new(rare, max_batch, window),
        }
    }
}

/// The connections of a store detached for renewals ([`Store::detached`]): renewals are short,
/// and one per held lease every third of a lease.
const RENEWAL_CONNECTIONS: usize = 4;

/// Claims race only when a competing claim commits between two statements; after this many
/// rounds the key is reported in flight.
const CLAIM_ROUNDS: usize = 4;

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
            Plans::Generic,
        );
        Self {
            pool,
            connections: Arc::new(connections),
            max_connections: DEFAULT_POSTGRES_CONNECTIONS,
            timeout: DEFAULT_POSTGRES_TIMEOUT,
            sweep_batch: DEFAULT_SWEEP_BATCH,
            max_batch: DEFAULT_POSTGRES_BATCH,
            batch_window: Duration::ZERO,
            horizon: Duration::ZERO,
            distributed: false,
            routes: None,
            citus_nodes: Arc::from([]),
            clock_skew: None,
            lanes: Lanes::new(
                DEFAULT_POSTGRES_CONNECTIONS,
                DEFAULT_POSTGRES_BATCH,
                Duration::ZERO,
            ),
            listening: wakes::Listening::default(),
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
        self.connections = Arc::new(self.connect(self.max_connections));
        self.routes = self.routes(self.max_connections);
        self.lanes = Lanes::new(self.max_connections, self.max_batch, self.batch_window);
    }

    /// Up to `max` connections of the store's own to the pool's server (the coordinator, on
    /// Citus).
    fn connect(&self, max: usize) -> Connections {
        let options = self.pool.connect_options();
        let plans = match self.distributed {
            true => Plans::Custom,
            false => Plans::Generic,
        };
        Connections::new(&options, max, self.timeout, plans)
    }

    /// On Citus, routes with up to `max` connections of the store's own to each node, their
    /// shard map read at once (in the background, inside a Tokio runtime): a store built before
    /// its first requests routes them all. Read on the first statement instead, under load the
    /// map took seconds to arrive, every statement meanwhile through the coordinator.
    fn routes(&self, max: usize) -> Option<Arc<Routes>> {
        self.distributed.then(|| {
            let options = (*self.pool.connect_options()).clone();
            let overrides = self.citus_nodes.clone();
            let routes = Arc::new(Routes::new(options, max, self.timeout, overrides));
            routes.read_when_due(&self.connections);
            routes
        })
    }

    /// How many claims, completions, releases or renewals one statement carries at most (64 by
    /// default). Those that arrive while the store's lanes for them (an eighth of its
    /// connections each for claims and completions, one each for releases and renewals) are all
    /// sending go out together, one round trip and one commit for all of them; one that finds a
    /// lane free goes out at once, alone. `1` sends each on its own statement, up to one per
    /// connection at once, as the store did before batches. On Citus, a batch goes out as a
    /// statement per shard ([`on_citus`](Self::on_citus)).
    pub fn with_max_batch(mut self, calls: usize) -> Self {
        self.max_batch = calls.max(1);
        self.reconnect();
        self
    }

    /// How long a lane that starts (no call of its kind was on its way) waits for more calls
    /// to join its batch before it sends; zero by default: it sends at once.
    ///
    /// A store that is not busy sends most calls alone, each a commit of its own, and on a
    /// durable Postgres a commit is most of what a key costs it. A window trades latency on
    /// each claim and completion (at least a millisecond: Tokio's timer) for fewer commits.
    /// Measured with the load bench on one machine (`BENCHMARKS.md`, "A batch window on
    /// Postgres"): at 4,000 fresh keys a second, a 1 ms window cut Postgres's CPU a key from
    /// 230–239 µs to 101–145 (0.29–0.31 commits a key instead of 0.72–1.04) and added 0.5–1.7 ms
    /// to the median latency; at full load (64 clients, each waiting for its answer) it served
    /// 0.95–1.25x the keys at 51–57 µs of Postgres CPU a key instead of 86–102. Set it where
    /// Postgres's CPU is what runs out; leave it at zero where every millisecond counts.
    /// A lane sends as soon as a full batch ([`with_max_batch`](Self::with_max_batch)) is
    /// queued; with batches of one the window does nothing. The wait counts against each call's
    /// [`timeout`](Self::with_timeout): keep the window far below it.
    pub fn with_batch_window(mut self, window: Duration) -> Self {
        self.batch_window = window;
        self.reconnect();
        self
    }

    /// For `idempotency_keys` distributed on Citus
    /// ([`DISTRIBUTE_ON_CITUS`](super::DISTRIBUTE_ON_CITUS)): connect the pool to the
    /// coordinator, and each of a request's statements goes straight to the worker that holds
    /// the key's shard.
    ///
    /// The store reads the shard map from Citus's metadata (from the coordinator, or from a
    /// worker while the coordinator is down: every node has it; a store that has read no map yet
    /// asks the workers named with [`with_citus_node`](Self::with_citus_node)), hashes each key as Citus does,
    /// and keeps connections of its own to each worker (up to
    /// [`with_max_connections`](Self::with_max_connections) per worker, made on first use, with
    /// the pool's connect options at the worker's address, or [`with_citus_node`](Self::with_citus_node)'s).
    /// A worker runs the statement on its own shard, with no coordinator in the way: no second
    /// planning, no extra round trip. Statements always name the distributed table, so one sent
    /// on a stale map (a shard just moved) is forwarded by the worker, never written to an old
    /// copy. The map is read when the store is built (in the background, inside a Tokio
    /// runtime), again every 10 s and soon after a statement fails on a route; until the first
    /// is read, statements go to the coordinator. While the coordinator is down,
    /// requests whose keys are on live workers go on; the sweeper, [`stuck`](super::Admin::stuck) and
    /// the completer's scan, which read every shard, wait for it.
    ///
    /// Every statement is one Citus routes to one shard. Batches ([`with_max_batch`](Self::with_max_batch))
    /// are split by shard: the claims of one shard go out as one insert (up to 16 rows), the
    /// completions of one shard, four or more, as one update, each group to its worker and
    /// every group at once; a claim alone is the one statement Citus plans once and caches
    /// (fresh keys), and releases and renewals go alone, as flat statements Citus plans once (a
    /// renewal waits at most 10 ms for a row another transaction holds, then answers busy, as
    /// on one Postgres it answers at once). A claim that finds a row reads it
    /// (one more statement, for a duplicate). The fewer shards a worker holds, the larger the
    /// groups under load: the sizing guide gives a shard count. [`sweep`](Self::sweep) runs
    /// shard by shard on the workers. The handler's transaction belongs on the key's worker
    /// too: take it from [`pool_for`](Self::pool_for).
    ///
    /// Fences are drawn per key, on the node that runs the claim, from its clock (in
    /// microseconds), and grow by at least one on every take-over: there is no sequence for the
    /// workers to share. So the nodes' clocks matter, within a bound the store is told
    /// ([`with_clock_skew`](Self::with_clock_skew), 1 s by default): a released key keeps its
    /// row (its lease ended) so that the next claim's fence grows from it, and a key is taken as
    /// expired, by a claim or by the sweeper, only once its expiry is past by more than the
    /// bound. Fences grow across releases, take-overs and shard moves as long as leases are
    /// longer than twice the bound (the layer's default lease, 30 s, is).
    ///
    /// One promise is weaker than on one Postgres: the server cannot check the caller's time
    /// before the insert, so a claim its caller gave up on may still insert, and the key then
    /// answers in flight until the lease ends. It never runs twice.
    pub fn on_citus(mut self) -> Self {
        self.distributed = true;
        self.reconnect();
        self
    }

    /// On Citus: connect to the node the metadata names `host`:`port` (`pg_dist_node`) with
    /// `options` instead of the pool's options at that address: a worker behind another
    /// address, or with other credentials.
    ///
    /// A node named here is also where the store reads the shard map when the coordinator does
    /// not answer and it has read no map yet: an instance started while the coordinator is
    /// down serves the keys of the live workers it was told of. Name each worker (with its own
    /// address in `options` when it needs no other) for instances to start without the
    /// coordinator; until a map is read their statements go to the coordinator and fail.
    pub fn with_citus_node(mut self, host: &str, port: u16, options: PgConnectOptions) -> Self {
        let mut nodes = self.citus_nodes.to_vec();
        nodes.retain(|((h, p), _)| (h.as_str(), *p) != (host, port));
        nodes.push(((host.to_owned(), port), options));
        self.citus_nodes = nodes.into();
        self.reconnect();
        self
    }

    /// On Citus: the bound on how far apart the nodes' clocks are (1 s by default). Each node
    /// reads its own clock for leases, expiries and fences; after a shard moves, or through a
    /// stale route, a key's row is read on another node's clock than wrote it. Keep it above
    /// the skew your nodes' time synchronisation guarantees, and leases above twice it.
    pub fn with_clock_skew(mut self, bound: Duration) -> Self {
        self.clock_skew = Some(bound);
        self
    }

    /// The skew the store's expiry checks allow for: none on one Postgres, whose clock is one.
    fn skew(&self) -> Duration {
        match self.distributed {
            true => self.clock_skew.unwrap_or(DEFAULT_CLOCK_SKEW),
            false => Duration::ZERO,
        }
    }

    /// The pool for a handler's transaction with `claim` (an
    /// [`IdempotencyClaim`](crate::IdempotencyClaim), or its [`Lease`]): its business write,
    /// and the fence ([`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit)). On one Postgres, the
    /// store's pool. On Citus ([`on_citus`](Self::on_citus)), a pool on the worker that holds the
    /// key's shard (made on first use with the store's pool's options, so up to its
    /// `max_connections` per worker), where the fence and a business table distributed by the
    /// same value and co-located commit locally, with no distributed transaction; the store's
    /// pool (the coordinator) until the shard map is read.
    ///
    /// ```no_run
    /// # async fn handler(store: tower_idempotency::store::PostgresStore,
    /// #     claim: tower_idempotency::IdempotencyClaim) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = store.pool_for(&claim).begin().await?;
    /// sqlx::query("INSERT INTO payments (key, amount) VALUES ($1, $2)")
    ///     .bind(claim.key().as_str())
    ///     .bind(4900)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// claim.commit(&mut tx).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub fn pool_for(&self, claim: &impl AsRef<Lease>) -> PgPool {
        let record = claim.as_ref().record();
        let Some(routes) = &self.routes else {
            return self.pool.clone();
        };
        match routes.address(&self.connections, record.scope(), record.key().as_str()) {
            Some(address) => routes.pool(&self.pool, &address),
            None => self.pool.clone(),
        }
    }

    /// The store's connections to the node that holds the shard of `key` (scope, key),
    /// planning as `plans` says; `None` for the pool's server (one Postgres, or Citus's
    /// coordinator while there is no map).
    fn route(&self, key: (&str, &str), plans: Plans) -> Option<Arc<Connections>> {
        self.routes.as_ref()?.route(&self.connections, key, plans)
    }

    /// Keeps a completed key as a tombstone once its answer's retention ends, until `horizon`
    /// after its completion (off by default): a late retry of the same request is then
    /// [`ClaimOutcome::AnswerExpired`] (the layer answers 410 and never runs it), another
    /// request with the key still a mismatch; past the horizon the key is free. The sweeper
    /// buries a completed row past its retention (drops its answer, keeps its fingerprint,
    /// status and completion time) and deletes it at the horizon; a claim that meets one the
    /// sweeper has not reached yet answers the same. On Citus too: each shard's sweep buries its
    /// own.
    ///
    /// ```
    /// # fn store(pool: sqlx::PgPool) {
    /// use std::time::Duration;
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// // Answers replayed for the layer's retention (24 h by default); keys refused for 30 days.
    /// let store = PostgresStore::new(pool).with_tombstones(Duration::from_secs(30 * 24 * 3600));
    /// # }
    /// ```
    pub fn with_tombstones(mut self, horizon: Duration) -> Self {
        self.horizon = horizon;
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
        let mut migrator =
            sqlx::migrate::Migrator::with_migrations(MIGRATOR.iter().cloned().collect());
        // A table of our own from the first run on: never renamed, so nothing to lose.
        migrator.dangerous_set_table_name("_tower_idempotency_migrations");
        migrator.run(&self.pool).await
    }

    /// Deletes every expired row, a batch per statement, and returns how many. Batches skip rows
    /// another sweeper (or a claim) holds, so sweepers on every instance never wait on each other.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        if self.distributed {
            return self.sweep_shards().await;
        }
        let mut total = 0;
        loop {
            let (buried, deleted): (i64, i64) = self
                .on_connection(async |connection| {
                    sqlx::query_as(SWEEP)
                        .bind(self.sweep_batch)
                        .bind(millis(self.horizon))
                        .fetch_one(connection)
                        .await
                })
                .await?;
            let (buried, deleted) = (buried as u64, deleted as u64);
            total += deleted;
            crate::telemetry::count_n("idempotency_swept_rows_total", deleted);
            if buried + deleted < self.sweep_batch as u64 {
                return Ok(total);
            }
        }
    }

    /// [`sweep`](Self::sweep) on a distributed table: a batch per shard per statement, each on
    /// its worker, until no shard had a full batch. A shard that failed (its worker down) fails
    /// the sweep once the others are swept.
    async fn sweep_shards(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let shards: Vec<(bool, String)> = self
                .on_connection(async |connection| {
                    sqlx::query_as(SWEEP_SHARDS)
                        .bind(self.sweep_batch)
                        .bind(millis(self.horizon))
                        .bind(millis(self.skew()))
                        .fetch_all(connection)
                        .await
                })
                .await?;
            let mut full = false;
            let mut failed = None;
            for (success, result) in shards {
                let deleted = result.strip_prefix("DELETE ").and_then(|n| n.parse().ok());
                match (success, deleted) {
                    (true, Some(deleted)) => {
                        total += deleted;
                        crate::telemetry::count_n("idempotency_swept_rows_total", deleted);
                        full |= deleted >= self.sweep_batch as u64;
                    }
                    _ => failed = Some(result),
                }
            }
            if let Some(result) = failed {
                let message = format!("a shard's sweep failed: {result}");
                return Err(StoreError::backend(STORE, message));
            }
            if !full {
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
        self.bounded(Self::on(&self.connections, statement)).await
    }

    /// [`on_connection`](Self::on_connection) for a statement about the key (`scope`, `key`):
    /// on Citus, on the worker that holds its shard (the map is read again soon when it fails
    /// there).
    async fn on_key<T>(
        &self,
        key: (&str, &str),
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        self.on_key_planned(key, Plans::Custom, statement).await
    }

    /// [`on_key`](Self::on_key), for a statement of a fresh key's path on Citus: planned once
    /// (see [`Plans::Generic`]).
    async fn on_key_planned<T>(
        &self,
        key: (&str, &str),
        plans: Plans,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, StoreError> {
        let Some(connections) = self.route(key, plans) else {
            return self.on_connection(statement).await;
        };
        let result = self.bounded(Self::on(&connections, statement)).await;
        if result.is_err() {
            self.suspect_route();
        }
        result
    }

    /// Runs `statement` on one of `connections`; the connection goes back unless the statement
    /// left it out of step.
    async fn on<T>(
        connections: &Connections,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let mut connection = connections.lend().await?;
        let result = statement(&mut connection).await;
        connection.give_back(&result);
        result
    }

    /// On Citus, `items` in groups that may share a statement ([`Routes::by_shard`]); without
    /// routes, each alone.
    fn by_shard<Q>(
        &self,
        items: Vec<Q>,
        max: usize,
        key: impl Fn(&Q) -> (&str, &str, u64),
    ) -> Vec<Vec<Q>> {
        match &self.routes {
            Some(routes) => routes.by_shard(items, max, key),
            None => items.into_iter().map(|item| vec![item]).collect(),
        }
    }

    /// A statement failed on a route: on Citus, the shard map is read again soon.
    fn suspect_route(&self) {
        if let Some(routes) = &self.routes {
            routes.suspect();
        }
    }

    /// The connections for a statement about `key` (scope, key): on Citus, the worker's that
    /// holds its shard, planning as `plans` says.
    fn connections_for(&self, key: (&str, &str), plans: Plans) -> Arc<Connections> {
        self.route(key, plans)
            .unwrap_or_else(|| self.connections.clone())
    }

    /// Runs `operation` under the timeout; the server's statement timeout is a timeout too.
    async fn bounded<T>(
        &self,
        operation: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        super::error::bounded(STORE, self.timeout, operation, |e| self.failed(e)).await
    }

    /// [`failed`](Self::failed), for a statement on a route: on Citus, the shard map is read
    /// again soon.
    fn failed_on_route(&self, error: sqlx::Error) -> StoreError {
        self.suspect_route();
        self.failed(error)
    }

    fn timed_out(&self) -> StoreError {
        StoreError::timeout(STORE, self.timeout)
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

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let started = Instant::now();
            let rounds = async {
                for _ in 0..CLAIM_ROUNDS {
                    match self.claim_round(request, started).await? {
                        claim::Round::Outcome(outcome) => return Ok(outcome),
                        claim::Round::Settle => {
                            if let Some(outcome) = self.settle(request).await? {
                                return Ok(outcome);
                            }
                        }
                        claim::Round::Again => {}
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
        let record = lease.record();
        let renewal = Renewal {
            scope: record.scope().to_owned(),
            key: record.key().as_str().to_owned(),
            owner: lease.owner(),
            lease_ms: millis(duration),
        };
        Box::pin(self.batched(&self.lanes.renewals, renewal))
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let record = lease.record();
        let completion = Completion {
            scope: record.scope().to_owned(),
            key: record.key().as_str().to_owned(),
            owner: lease.owner(),
            status: response.status().as_u16() as i16,
            response: response.encode().to_vec(),
            retention_ms: millis(retention),
        };
        Box::pin(self.batched(&self.lanes.completions, completion))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let record = lease.record();
        let release = Release {
            scope: record.scope().to_owned(),
            key: record.key().as_str().to_owned(),
            owner: lease.owner(),
        };
        Box::pin(self.batched(&self.lanes.releases, release))
    }

    fn tombstone_horizon(&self) -> Duration {
        self.horizon
    }

    fn kind(&self) -> &'static str {
        "postgres"
    }

    /// Connections of its own (at most 4, made on first use, to each worker on Citus), on the
    /// same pool options.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        Some(Arc::new(Self {
            connections: Arc::new(self.connect(RENEWAL_CONNECTIONS)),
            routes: (self.routes.as_ref())
                .map(|routes| Arc::new(routes.detached(RENEWAL_CONNECTIONS))),
            max_connections: RENEWAL_CONNECTIONS,
            lanes: Lanes::new(RENEWAL_CONNECTIONS, self.max_batch, self.batch_window),
            ..self.clone()
        }))
    }

    fn offers(&self) -> Offers<'_> {
        Offers::none()
            .with_admin(self)
            .with_recovery(self)
            .with_wakes(self)
    }
}

/// An owner-checked statement touches the row if, and only if, the owner still holds it.
fn held_if_one(rows: u64) -> Ownership {
    if rows == 1 {
        Ownership::Held
    } else {
        Ownership::Lost
    }
}

/// A driver's `error` as the store's.
pub(crate) fn backend(error: sqlx::Error) -> StoreError {
    StoreError::backend(STORE, error)
}

/// Postgres intervals take fractional milliseconds; ours are whole.
fn millis(duration: Duration) -> f64 {
    duration.as_millis() as f64
}
