//! The store's own connections to Postgres.

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

use sqlx::{
    Connection, PgConnection,
    postgres::{PgConnectOptions, PgDatabaseError, PgSeverity},
};
use tokio::{
    sync::{Semaphore, SemaphorePermit},
    time::Instant,
};

/// A connection that has been idle longer than this is checked before it is used again.
const STALE_AFTER: Duration = Duration::from_secs(30);

/// Connections of the store's own, apart from the application's pool.
///
/// Three reasons. sqlx's pool checks a connection with a round trip when it takes it back (and,
/// unless `test_before_acquire(false)`, when it hands it out), in a task spawned per statement.
/// Measured side by side (BENCHMARKS-LOG.md, "The store's connections"), sqlx's `PgPool` with
/// `test_before_acquire(false)` and the same session settings served 0.72-0.81x the fresh keys
/// and 0.66-0.81x the replays of these connections, at 1.3-1.7x the application CPU. A connection of our own can carry session settings that are the
/// store's business alone: `enable_seqscan = off`, and a statement timeout, so that a statement
/// the store gave up on is also abandoned by the server. And the store's statements never queue
/// behind the application's, nor the application's behind them.
///
/// Why `enable_seqscan = off`: Postgres caches a generic plan for a prepared statement after five
/// executions, and one planned while the table is empty (every fresh deployment) scans the whole
/// table, forever after. Every statement of the store has an index to use (the primary key, or
/// `expires_at` for the sweeper), so with sequential scans priced out the generic plan is the
/// index lookup whatever the table's history, and it stays cached: planning each execution
/// instead (`plan_cache_mode = force_custom_plan`) cost a third of the store's throughput.
///
/// Why `plan_cache_mode = force_generic_plan`: on a hash-partitioned table (the optional
/// migration) Postgres prices the generic plan as a scan of every partition, prefers a custom
/// plan, and so plans every execution; forced, the generic plan prunes to one partition when it
/// runs. Measured side by side (BENCHMARKS-LOG.md, "Partitioned, measured again"), the partitioned
/// table went from 0.63-0.65x the plain one's fresh keys to 0.75-1.09x with 16 partitions, and
/// to 0.92-1.13x with the migration's 4. On the plain table the generic plan is the one Postgres
/// picks anyway, from the first execution instead of the sixth.
///
/// A connection is reused only after it answered: one that failed (other than with a database
/// error, after which it is still in step) or whose statement was abandoned is closed. One that
/// idled for more than 30 s is checked with a round trip before it is lent again.
#[derive(Debug)]
pub(super) struct Connections {
    options: PgConnectOptions,
    idle: Mutex<Vec<(PgConnection, Instant)>>,
    permits: Semaphore,
}

impl Connections {
    /// Up to `max` connections made with `options`, plus the store's session settings,
    /// planning as `plans` says.
    pub(super) fn new(
        options: &PgConnectOptions,
        max: usize,
        statement_timeout: Duration,
        plans: Plans,
    ) -> Self {
        let plans = match plans {
            Plans::Generic => "force_generic_plan",
            Plans::Custom => "force_custom_plan",
        };
        let options = options.clone().options([
            ("enable_seqscan", "off".to_owned()),
            ("plan_cache_mode", plans.to_owned()),
            (
                "statement_timeout",
                statement_timeout.as_millis().max(1).to_string(),
            ),
        ]);
        Self {
            options,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(max.max(1)),
        }
    }

    /// A connection for one statement (or one short transaction): an idle one, or a new one.
    pub(super) async fn lend(&self) -> Result<Lent<'_>, sqlx::Error> {
        let permit = self
            .permits
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let (connection, reused) = match self.take_idle().await {
            Some(connection) => (connection, true),
            None => self.connect().await?,
        };
        Ok(Lent {
            connections: self,
            connection: Some(connection),
            reused,
            _permit: permit,
        })
    }

    /// A new connection. A server with no connection slot free ("too many clients", SQLSTATE
    /// 53300: other processes hold them all) is backpressure, not a failure: the connection is
    /// tried again, after a pause that doubles from 10 ms to 200 ms, until the caller's timeout
    /// ends the wait; a connection of the store's own given back meanwhile is taken instead.
    async fn connect(&self) -> Result<(PgConnection, bool), sqlx::Error> {
        let mut pause = Duration::from_millis(10);
        loop {
            match PgConnection::connect_with(&self.options).await {
                Err(error) if too_many_clients(&error) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                    if let Some(connection) = self.take_idle().await {
                        return Ok((connection, true));
                    }
                }
                connected => return connected.map(|connection| (connection, false)),
            }
        }
    }

    /// The most recently used idle connection, checked first if it idled for long.
    async fn take_idle(&self) -> Option<PgConnection> {
        let (mut connection, since) = self.lock().pop()?;
        if since.elapsed() > STALE_AFTER && connection.ping().await.is_err() {
            return None;
        }
        Some(connection)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(PgConnection, Instant)>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How the server plans the store's prepared statements (`plan_cache_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plans {
    /// Once, for every execution: one Postgres; and on Citus a fresh key's statements (the
    /// claim's insert and read, the completion), renewals and releases (flat, on one table,
    /// naming the key), which Citus then routes at execution and, on the worker that holds the
    /// shard, runs from a cached plan of the shard's. Measured with pgbench on a worker, a
    /// claim and a completion cost 1.8x the server CPU planned on every execution, a release
    /// 2.3x and a renewal (in its earlier form) 4.5x.
    Generic,
    /// On every execution, with its values in: Citus, for every other statement. Citus routes a
    /// generic plan's parameters only in its simplest statements, and refuses the others
    /// ("could not create distributed plan").
    Custom,
}

/// A connection lent for a statement. [`give_back`](Self::give_back) returns it for reuse once
/// it answered; dropped otherwise (its statement abandoned or failed), it is closed.
pub(super) struct Lent<'a> {
    connections: &'a Connections,
    connection: Option<PgConnection>,
    /// Whether it idled before: the server may have closed it meanwhile.
    reused: bool,
    _permit: SemaphorePermit<'a>,
}

impl Lent<'_> {
    /// Returns the connection for reuse, if it is still in step after `result`. `true` when the
    /// statement failed because a reused connection was gone (the server restarted, failed over
    /// or terminated it): it is worth running again on a fresh one. The other idle connections
    /// likely went the same way, and are dropped too.
    pub(super) fn give_back<T>(mut self, result: &Result<T, sqlx::Error>) -> bool {
        let in_step = match result {
            Ok(_) => true,
            Err(error) => in_step(error),
        };
        match (in_step, self.connection.take()) {
            (true, Some(connection)) => self.connections.lock().push((connection, Instant::now())),
            (false, _) if self.reused => {
                self.connections.lock().clear();
                return true;
            }
            _ => {}
        }
        false
    }
}

impl std::ops::Deref for Lent<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.connection.as_ref().expect("lent until given back")
    }
}

impl std::ops::DerefMut for Lent<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.connection.as_mut().expect("lent until given back")
    }
}

/// Whether connecting failed because the server had no connection slot free.
fn too_many_clients(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.code().as_deref() == Some("53300"))
}

/// Whether a connection is still in step with the server after this error: a database error
/// whose severity is `ERROR` (the statement failed; the session goes on) leaves it so; one that
/// ends the session (`FATAL`, `PANIC`: the server is shutting down, an administrator terminated
/// it) does not, and neither does anything else.
///
/// The severity decides, not the code: a Citus coordinator reports a worker it cannot reach as
/// `08006` (connection failure) at `ERROR`, on a session to the coordinator that goes on.
/// Taken for the store's own connection, it dropped every idle connection and made each next
/// statement, for any key, connect again: while one worker was down, keys on the others
/// answered seconds late or 503.
fn in_step(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => match error.try_downcast_ref::<PgDatabaseError>() {
            Some(error) => !matches!(error.severity(), PgSeverity::Fatal | PgSeverity::Panic),
            None => !error
                .code()
                .is_some_and(|code| code.starts_with("57P") || code.starts_with("08")),
        },
        sqlx::Error::RowNotFound => true,
        _ => false,
    }
}
