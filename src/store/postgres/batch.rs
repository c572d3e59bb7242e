//! Claims, completions, releases and renewals in batches: those that arrive while earlier ones
//! are on their way to the server go out together, as one set-based statement (arrays and
//! `unnest`), one round trip and one commit for all of them.
//!
//! A call is queued, and sent by a *lane*: a task that takes what is queued (up to
//! [`with_max_batch`](PostgresStore::with_max_batch), 64 by default) and sends it, until the
//! queue is empty. A call that finds a lane free starts one at once, so an idle store sends it
//! alone, with no wait; only when every lane is busy does a call wait, and then it goes out with
//! the others that queued meanwhile. With a batch window
//! ([`with_batch_window`](PostgresStore::with_batch_window)) a lane that starts waits that long
//! first, or until a full batch is queued. Each kind of call has lanes of its own.
//!
//! Each key's answer is its own, and the one the call sent alone gets. Every batch, of one call
//! or many, is one set-based statement. A claim's is `claim.rs`'s. A renewal never waits on a
//! row lock: a locked row is busy, as it always was. A completion or a release the batch wrote
//! is held; one whose row another transaction holds locked is skipped by the batch (`SKIP
//! LOCKED`, so that one lock never holds up the others) and sent alone, as the single statement
//! that waits for the lock, on a task of its own while the lane goes on; one this owner no
//! longer holds is lost. A batch of many that fails (a connection lost, say) is sent again call
//! by call.

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicUsize, Ordering::SeqCst},
};

use futures_util::future::join_all;
use sqlx::{Row, postgres::PgRow};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{PostgresStore, STORE, backend, connections::Plans, held_if_one, sql::*};
use crate::store::{BoxFuture, Ownership, StoreError};

/// An owner-checked write of one key (a completion, a release, a renewal) waiting for a lane,
/// and where its answer goes.
pub(super) struct Queued<T> {
    pub(super) call: T,
    answer: oneshot::Sender<Result<Ownership, StoreError>>,
}

/// An owner-checked write of one key that goes out alone or with others of its kind.
pub(super) trait Write: Send + Sync + Sized + 'static {
    /// What a batch of them is called in the store's debug events.
    const KIND: &'static str;

    /// Alone: waits for the row's lock when another transaction holds it (a write the batch
    /// skipped for its lock, or one of a batch that failed).
    fn one<'a>(&'a self, store: &'a PostgresStore) -> BoxFuture<'a, Result<Ownership, StoreError>>;

    /// Together: an answer per write, in order, or `None` for one whose row another transaction
    /// held locked (skipped, to be sent alone).
    fn many<'a>(
        store: &'a PostgresStore,
        batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>>;

    /// The key it writes: (scope, key).
    fn key(&self) -> (&str, &str);

    /// On Citus, how many writes of one shard it takes before one statement for them all
    /// costs less than each alone; `usize::MAX` for a kind that always goes alone there.
    const TOGETHER_ON_A_SHARD: usize = usize::MAX;

    /// On Citus, together: writes of one shard (and equal in [`kin`](Self::kin)), no two of
    /// one key, as one statement Citus sends to that shard alone. An answer per write, in
    /// order.
    fn many_on_shard<'a>(
        _store: &'a PostgresStore,
        _batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>> {
        // Never called for a kind that goes alone; were it, each write would go alone.
        let alone = StoreError::backend(STORE, "no statement for many writes of this kind");
        Box::pin(std::future::ready(Err(alone)))
    }

    /// What, besides the shard, writes must share to go out together on Citus.
    fn kin(&self) -> u64 {
        0
    }
}

/// One completion, as the statements bind it.
#[derive(Debug)]
pub(super) struct Completion {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) owner: Uuid,
    pub(super) status: i16,
    pub(super) response: Vec<u8>,
    pub(super) retention_ms: f64,
}

/// One release.
#[derive(Debug)]
pub(super) struct Release {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) owner: Uuid,
}

/// One renewal, for `lease_ms` from now.
#[derive(Debug)]
pub(super) struct Renewal {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) owner: Uuid,
    pub(super) lease_ms: f64,
}

/// Calls of one kind waiting for a lane, and the lanes running.
#[derive(Debug)]
pub(super) struct Batches<T> {
    queue: Mutex<Vec<T>>,
    lanes: AtomicUsize,
    max_lanes: usize,
    max_batch: usize,
    /// How long a lane that starts waits for more calls before it sends
    /// ([`with_batch_window`](PostgresStore::with_batch_window)).
    window: std::time::Duration,
    /// Told when the queue holds a full batch: a lane waiting out its window sends at once.
    full: tokio::sync::Notify,
}

/// How a lane sends one batch of `T`.
pub(super) type SendBatch<T> = for<'a> fn(&'a PostgresStore, Vec<T>) -> BoxFuture<'a, ()>;

impl<T: Write> Queued<T> {
    /// Sends the write alone (waiting for its row's lock, if another transaction holds it),
    /// and its answer to its caller.
    async fn alone(self, store: &PostgresStore) {
        let answer = self.call.one(store).await;
        let _ = self.answer.send(answer);
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Queued<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.call.fmt(f)
    }
}

impl<T: Send + 'static> Batches<T> {
    /// At most `lanes` lanes (at least one), batches of at most `max_batch`, a lane that
    /// starts waiting `window` for more calls before it sends.
    pub(super) fn new(lanes: usize, max_batch: usize, window: std::time::Duration) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            lanes: AtomicUsize::new(0),
            max_lanes: lanes.max(1),
            max_batch: max_batch.max(1),
            window,
            full: tokio::sync::Notify::new(),
        })
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Vec<T>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A lane, if one is free.
    fn take_lane(&self) -> bool {
        self.lanes
            .fetch_update(SeqCst, SeqCst, |lanes| {
                (lanes < self.max_lanes).then_some(lanes + 1)
            })
            .is_ok()
    }

    /// What is queued, oldest first, up to a batch.
    fn take(&self) -> Vec<T> {
        let mut queue = self.queue();
        let upto = queue.len().min(self.max_batch);
        queue.drain(..upto).collect()
    }

    /// Queues `item` and makes sure a lane of `store` will send it with `send`.
    pub(super) fn push(self: &Arc<Self>, store: &PostgresStore, item: T, send: SendBatch<T>) {
        let queued = {
            let mut queue = self.queue();
            queue.push(item);
            queue.len()
        };
        if queued >= self.max_batch {
            self.full.notify_waiters();
        }
        if self.take_lane() {
            let (store, batches) = (store.clone(), Arc::clone(self));
            tokio::spawn(async move { batches.lane(&store, send).await });
        }
    }

    /// The batch window: until it is over or a full batch is queued, whichever comes first.
    async fn wait_for_a_batch(&self) {
        if self.window.is_zero() {
            return;
        }
        let full = self.full.notified();
        tokio::pin!(full);
        // Told from here on: a batch that fills after the check below is not missed.
        full.as_mut().enable();
        if self.queue().len() < self.max_batch {
            let _ = tokio::time::timeout(self.window, full).await;
        }
    }

    /// Sends what is queued until the queue is empty, then gives the lane up. An item queued
    /// by a caller that found no lane free, after this lane saw the queue empty, is seen on the
    /// check after the lane is given up. A lane that panics gives its lane up too (its batch's
    /// callers get an error), so the store never runs out of lanes.
    async fn lane(&self, store: &PostgresStore, send: SendBatch<T>) {
        let mut lane = Lane(self);
        self.wait_for_a_batch().await;
        loop {
            let batch = self.take();
            if batch.is_empty() {
                drop(lane);
                if self.queue().is_empty() || !self.take_lane() {
                    return;
                }
                lane = Lane(self);
                continue;
            }
            send(store, batch).await;
        }
    }
}

/// A lane taken: given up when dropped.
struct Lane<'a, T>(&'a Batches<T>);

impl<T> Drop for Lane<'_, T> {
    fn drop(&mut self) {
        self.0.lanes.fetch_sub(1, SeqCst);
    }
}

impl PostgresStore {
    /// Sends `call` through the lanes of `batches`: its answer, within the store's timeout.
    pub(super) async fn batched<T: Write>(
        &self,
        batches: &Arc<Batches<Queued<T>>>,
        call: T,
    ) -> Result<Ownership, StoreError> {
        let (answer, answered) = oneshot::channel();
        let send: SendBatch<Queued<T>> = |store, batch| Box::pin(store.send(batch));
        batches.push(self, Queued { call, answer }, send);
        // The bound covers the wait for a lane too; a write the caller gave up on may still be
        // sent, owner-checked, as a single one whose answer was lost could be.
        match tokio::time::timeout(self.timeout, answered).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(StoreError::backend(
                STORE,
                "its batch was dropped unanswered",
            )),
            Err(_) => Err(self.timed_out()),
        }
    }

    /// One batch, of one write or many, as the set-based statement. A write whose row another
    /// transaction held is sent alone on a task of its own, so that it waits for the lock while
    /// the lane goes on. A batch of many that fails is sent again write by write, so that
    /// whatever failed it fails only its own key.
    async fn send<T: Write>(&self, batch: Vec<Queued<T>>) {
        if self.distributed {
            return self.send_by_shard(batch).await;
        }
        if batch.len() > 1 {
            tracing::debug!(writes = batch.len(), "{} sent together", T::KIND);
        }
        match T::many(self, &batch).await {
            Ok(answers) => {
                for (queued, answer) in batch.into_iter().zip(answers) {
                    match answer {
                        Some(answer) => {
                            let _ = queued.answer.send(Ok(answer));
                        }
                        None => {
                            let store = self.clone();
                            tokio::spawn(async move { queued.alone(&store).await });
                        }
                    }
                }
            }
            Err(error) if batch.len() == 1 => {
                let queued = batch.into_iter().next().expect("one write");
                let _ = queued.answer.send(Err(error));
            }
            Err(_) => self.send_each(batch).await,
        }
    }

    /// Each write of `batch` alone, one after the other.
    async fn send_each<T: Write>(&self, batch: Vec<Queued<T>>) {
        for queued in batch {
            queued.alone(self).await;
        }
    }

    /// A batch on Citus, every group of it at once ([`by_shard`](Self::by_shard)): a group large
    /// enough to pay for it as one statement sent to its shard ([`Write::many_on_shard`]), the
    /// others write by write, each on a connection of its own. A group whose statement fails is
    /// sent again write by write.
    async fn send_by_shard<T: Write>(&self, batch: Vec<Queued<T>>) {
        let groups = self.by_shard(batch, usize::MAX, |queued| {
            let (scope, key) = queued.call.key();
            (scope, key, queued.call.kin())
        });
        join_all(groups.into_iter().map(|group| self.send_shard_group(group))).await;
    }

    /// One group of [`send_by_shard`](Self::send_by_shard). A key written twice (by two owners,
    /// or in two scopes) is written alone the second time: a statement's keys are all different.
    async fn send_shard_group<T: Write>(&self, group: Vec<Queued<T>>) {
        let mut firsts: Vec<Queued<T>> = Vec::with_capacity(group.len());
        let mut again = Vec::new();
        for queued in group {
            let key = queued.call.key().1;
            match firsts.iter().any(|first| first.call.key().1 == key) {
                true => again.push(queued),
                false => firsts.push(queued),
            }
        }
        let again = join_all(again.into_iter().map(|queued| queued.alone(self)));
        let firsts = async {
            if firsts.len() >= T::TOGETHER_ON_A_SHARD {
                tracing::debug!(writes = firsts.len(), "{} sent together", T::KIND);
                if let Ok(answers) = T::many_on_shard(self, &firsts).await {
                    for (queued, answer) in firsts.into_iter().zip(answers) {
                        let answer = answer.unwrap_or(Ownership::Lost);
                        let _ = queued.answer.send(Ok(answer));
                    }
                    return;
                }
            }
            join_all(firsts.into_iter().map(|queued| queued.alone(self))).await;
        };
        tokio::join!(firsts, again);
    }

    /// The rows of a set-based completion or release: [`rows`](Self::rows), and the keys it
    /// ended that a duplicate waits for told ([`tell`](PostgresStore::tell)).
    async fn rows_told<'q, T: Write>(
        &self,
        (key, batch): (Option<(&str, &str)>, &[Queued<T>]),
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        verdict: impl Fn(&PgRow) -> Result<Option<Ownership>, sqlx::Error>,
    ) -> Result<Vec<Option<Ownership>>, StoreError> {
        let waited = std::sync::Mutex::new(Vec::new());
        let answers = self
            .rows(key, query, batch.len(), |row| {
                if row.try_get::<bool, _>("waited")? {
                    let n: i64 = row.try_get("n")?;
                    waited.lock().unwrap_or_else(|e| e.into_inner()).push(n);
                }
                verdict(row)
            })
            .await?;
        let waited = waited.into_inner().unwrap_or_else(|e| e.into_inner());
        if !waited.is_empty() {
            let ended = waited.iter().filter_map(|n| {
                let queued = batch.get(usize::try_from(*n - 1).ok()?)?;
                Some(queued.call.key())
            });
            self.tell(ended).await;
        }
        Ok(answers)
    }

    /// The rows of a set-based write: for each, by its ordinal `n` (from 1), what `verdict`
    /// reads of it; `None` for a write that has no row.
    async fn rows<'q>(
        &self,
        key: Option<(&str, &str)>,
        query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
        writes: usize,
        verdict: impl Fn(&PgRow) -> Result<Option<Ownership>, sqlx::Error>,
    ) -> Result<Vec<Option<Ownership>>, StoreError> {
        let statement =
            async |connection: &mut sqlx::PgConnection| query.fetch_all(connection).await;
        let rows = match key {
            Some(key) => self.on_key(key, statement).await?,
            None => self.on_connection(statement).await?,
        };
        let mut answers = vec![Some(Ownership::Lost); writes];
        for row in rows {
            let n: i64 = row.try_get("n").map_err(backend)?;
            let slot = usize::try_from(n - 1)
                .ok()
                .and_then(|i| answers.get_mut(i))
                .ok_or_else(|| backend(sqlx::Error::RowNotFound))?;
            *slot = verdict(&row).map_err(backend)?;
        }
        Ok(answers)
    }
}

impl Write for Completion {
    const KIND: &'static str = "completions";

    /// Measured with pgbench on a worker (Citus 13.0.5), server CPU a completion: alone about
    /// 280 µs; together about 290 µs each for 4, 40 to 70 for 16. Planning a statement Citus
    /// cannot take on its fast path costs a fixed 500 µs or so.
    const TOGETHER_ON_A_SHARD: usize = 4;

    fn key(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }

    /// The retention: [`COMPLETE_ON_SHARD`] binds one for all (Citus refuses an `UPDATE` that
    /// adds a column to `now()`).
    fn kin(&self) -> u64 {
        self.retention_ms.to_bits()
    }

    fn many_on_shard<'a>(
        store: &'a PostgresStore,
        batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>> {
        let calls = calls(batch);
        let keys = column(&calls, |c| c.key.as_str());
        let query = sqlx::query(COMPLETE_ON_SHARD)
            .bind(column(&calls, |c| c.scope.as_str()))
            .bind(keys)
            .bind(column(&calls, |c| c.owner))
            .bind(column(&calls, |c| c.status))
            .bind(column(&calls, |c| &c.response[..]))
            .bind(calls[0].retention_ms);
        let key = calls[0].key();
        Box::pin(store.rows_told((Some(key), batch), query, |_| Ok(Some(Ownership::Held))))
    }

    fn one<'a>(&'a self, store: &'a PostgresStore) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let key = (self.scope.as_str(), self.key.as_str());
            let completed: Option<bool> = store
                .on_key_planned(key, Plans::Generic, async |connection| {
                    sqlx::query_scalar(COMPLETE)
                        .bind(&self.scope)
                        .bind(&self.key)
                        .bind(self.owner)
                        .bind(self.status)
                        .bind(&self.response[..])
                        .bind(self.retention_ms)
                        .fetch_optional(connection)
                        .await
                })
                .await?;
            if completed == Some(true) {
                store.tell([key]).await;
            }
            Ok(held_if_one(u64::from(completed.is_some())))
        })
    }

    fn many<'a>(
        store: &'a PostgresStore,
        batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>> {
        let calls = calls(batch);
        let query = sqlx::query(COMPLETE_MANY)
            .bind(column(&calls, |c| c.scope.as_str()))
            .bind(column(&calls, |c| c.key.as_str()))
            .bind(column(&calls, |c| c.owner))
            .bind(column(&calls, |c| c.status))
            .bind(column(&calls, |c| &c.response[..]))
            .bind(column(&calls, |c| c.retention_ms));
        Box::pin(store.rows_told((None, batch), query, |row| {
            Ok(match (row.try_get("completed")?, row.try_get("owned")?) {
                (true, _) => Some(Ownership::Held),
                (false, true) => None,
                (false, false) => Some(Ownership::Lost),
            })
        }))
    }
}

impl Write for Release {
    fn key(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }

    const KIND: &'static str = "releases";

    /// [`RELEASE`]; on Citus, [`END_LEASE`] (the row stays, for the next claim's fence to grow
    /// from), then [`COMMITTED`] when it found no row of this owner in flight: flat statements,
    /// planned once.
    fn one<'a>(&'a self, store: &'a PostgresStore) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let key = (self.scope.as_str(), self.key.as_str());
            let bound = |sql| {
                let query = sqlx::query(sql).bind(&self.scope).bind(&self.key);
                query.bind(self.owner)
            };
            let (released, committed, waited): (bool, bool, bool) = store
                .on_key_planned(key, Plans::Generic, async |connection| {
                    if !store.distributed {
                        let row = bound(RELEASE).fetch_one(connection).await?;
                        let released = (row.try_get("released")?, row.try_get("committed")?);
                        return Ok((released.0, released.1, row.try_get("waited")?));
                    }
                    let ended = bound(END_LEASE).fetch_optional(&mut *connection).await?;
                    if let Some(ended) = ended {
                        return Ok((true, false, ended.try_get("waited")?));
                    }
                    let committed = bound(COMMITTED).fetch_optional(connection).await?;
                    Ok((false, committed.is_some(), false))
                })
                .await?;
            if waited {
                store.tell([key]).await;
            }
            Ok(match (released, committed) {
                (true, _) => Ownership::Held,
                (false, true) => Ownership::Committed,
                (false, false) => Ownership::Lost,
            })
        })
    }

    fn many<'a>(
        store: &'a PostgresStore,
        batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>> {
        let calls = calls(batch);
        let query = sqlx::query(RELEASE_MANY)
            .bind(column(&calls, |c| c.scope.as_str()))
            .bind(column(&calls, |c| c.key.as_str()))
            .bind(column(&calls, |c| c.owner));
        Box::pin(store.rows_told((None, batch), query, |row| {
            let flags = (
                row.try_get("released")?,
                row.try_get("committed")?,
                row.try_get("owned")?,
            );
            Ok(match flags {
                (true, _, _) => Some(Ownership::Held),
                (false, true, _) => Some(Ownership::Committed),
                (false, false, true) => None,
                (false, false, false) => Some(Ownership::Lost),
            })
        }))
    }
}

impl Write for Renewal {
    fn key(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }

    const KIND: &'static str = "renewals";

    /// [`RENEW`]: it never waits on a row lock either. On Citus, [`RENEW_FLAT`] (see
    /// [`renew_flat`](Self::renew_flat)).
    fn one<'a>(&'a self, store: &'a PostgresStore) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            if store.distributed {
                return self.renew_flat(store).await;
            }
            let query = sqlx::query(RENEW)
                .bind(&self.scope)
                .bind(&self.key)
                .bind(self.owner)
                .bind(self.lease_ms);
            let answer = store
                .rows(Some((&self.scope, &self.key)), query, 1, renewal_verdict)
                .await?
                .pop();
            Ok(answer.flatten().unwrap_or(Ownership::Lost))
        })
    }

    fn many<'a>(
        store: &'a PostgresStore,
        batch: &'a [Queued<Self>],
    ) -> BoxFuture<'a, Result<Vec<Option<Ownership>>, StoreError>> {
        let query = renew_many(&calls(batch));
        Box::pin(store.rows(None, query, batch.len(), renewal_verdict))
    }
}

impl Renewal {
    /// A renewal on Citus: [`RENEW_FLAT`] in a transaction that waits at most [`LOCK_WAIT`] for
    /// the row; a row held longer (by the handler's transaction, after the fence) answers busy
    /// if it is still this owner's ([`OWNED`]), as [`RENEW`] answers a row it skips.
    async fn renew_flat(&self, store: &PostgresStore) -> Result<Ownership, StoreError> {
        let key = (self.scope.as_str(), self.key.as_str());
        let bound = |sql| {
            let query = sqlx::query(sql).bind(&self.scope).bind(&self.key);
            query.bind(self.owner)
        };
        store
            .on_key_planned(key, Plans::Generic, async |connection| {
                let mut renewal = sqlx::Connection::begin(&mut *connection).await?;
                sqlx::query(LOCK_WAIT).execute(&mut *renewal).await?;
                let renew = bound(RENEW_FLAT).bind(self.lease_ms);
                match renew.execute(&mut *renewal).await {
                    Ok(renewed) => {
                        renewal.commit().await?;
                        Ok(held_if_one(renewed.rows_affected()))
                    }
                    Err(error) if is_lock_timeout(&error) => {
                        renewal.rollback().await?;
                        let owned = bound(OWNED).fetch_optional(connection).await?;
                        Ok(match owned {
                            Some(_) => Ownership::Busy,
                            None => Ownership::Lost,
                        })
                    }
                    Err(error) => Err(error),
                }
            })
            .await
    }
}

/// Postgres's `lock_not_available`: a lock not had within `lock_timeout`.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    let code = error.as_database_error().and_then(|e| e.code());
    code.as_deref() == Some("55P03")
}

/// [`RENEW_MANY`] with `renewals` bound.
fn renew_many<'q>(
    renewals: &[&'q Renewal],
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(RENEW_MANY)
        .bind(column(renewals, |r| r.scope.as_str()))
        .bind(column(renewals, |r| r.key.as_str()))
        .bind(column(renewals, |r| r.owner))
        .bind(column(renewals, |r| r.lease_ms))
}

/// The calls of a batch, in order.
fn calls<T>(batch: &[Queued<T>]) -> Vec<&T> {
    batch.iter().map(|queued| &queued.call).collect()
}

/// One column of a set-based statement: `value` of each call, in order.
fn column<'a, T, U>(calls: &[&'a T], value: impl Fn(&'a T) -> U) -> Vec<U> {
    calls.iter().map(|call| value(call)).collect()
}

/// A renewal renewed is held; one whose row another transaction held locked is busy (tried
/// again soon by the layer); one this owner no longer holds is lost.
fn renewal_verdict(row: &PgRow) -> Result<Option<Ownership>, sqlx::Error> {
    Ok(Some(
        match (row.try_get("renewed")?, row.try_get("owned")?) {
            (true, _) => Ownership::Held,
            (false, true) => Ownership::Busy,
            (false, false) => Ownership::Lost,
        },
    ))
}
