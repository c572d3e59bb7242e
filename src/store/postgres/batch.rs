//! Claims and completions in batches: those that arrive while earlier ones are on their way to
//! the server go out together, as one set-based statement (arrays and `unnest`), one round trip
//! and one commit for all of them.
//!
//! A call is queued, and sent by a *lane*: a task that takes what is queued (up to
//! [`with_max_batch`](PostgresStore::with_max_batch), 64 by default) and sends it, until the
//! queue is empty. A call that finds a lane free starts one at once, so an idle store sends it
//! alone, with no wait; only when every lane is busy does a call wait, and then it goes out with
//! the others that queued meanwhile. Claims and completions have lanes of their own.
//!
//! Each key's answer is its own, and the one the call sent alone gets. A claim is one statement
//! whether it carries one claim or many (`claim.rs`). A completion the batch completed is held;
//! one whose row another transaction holds locked is skipped by the batch (`SKIP LOCKED`, so that
//! one lock never holds up the others) and completed on its own, waiting for the lock as a
//! single completion does; one this owner no longer holds is lost. A batch that fails (a
//! connection lost, say) is sent again call by call.

use std::sync::{
    Arc, Mutex, PoisonError,
    atomic::{AtomicUsize, Ordering::SeqCst},
};

use sqlx::Row;
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{PostgresStore, backend, held_if_one, sql::*};
use crate::store::{BoxFuture, Ownership, StoreError};

/// One completion, as the statements bind it, and where its answer goes.
pub(super) struct Completion {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) owner: Uuid,
    pub(super) status: i16,
    pub(super) response: Vec<u8>,
    pub(super) retention_ms: f64,
    pub(super) answer: oneshot::Sender<Result<Ownership, StoreError>>,
}

/// Calls of one kind waiting for a lane, and the lanes running.
#[derive(Debug)]
pub(super) struct Batches<T> {
    queue: Mutex<Vec<T>>,
    lanes: AtomicUsize,
    max_lanes: usize,
    max_batch: usize,
}

/// How a lane sends one batch of `T`.
pub(super) type SendBatch<T> = for<'a> fn(&'a PostgresStore, Vec<T>) -> BoxFuture<'a, ()>;

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Batches<T> {
    /// Lanes for a store of `connections` connections, batches of at most `max_batch`: a
    /// quarter of the connections for each kind (claims, completions), so that the store's other
    /// statements (settling a claim, releases, the sweeper) always find connections free.
    pub(super) fn new(connections: usize, max_batch: usize) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::default(),
            lanes: AtomicUsize::new(0),
            max_lanes: (connections / 4).max(1),
            max_batch: max_batch.max(1),
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
        self.queue().push(item);
        if self.take_lane() {
            let (store, batches) = (store.clone(), Arc::clone(self));
            tokio::spawn(async move { batches.lane(&store, send).await });
        }
    }

    /// Sends what is queued until the queue is empty, then gives the lane up. An item queued
    /// by a caller that found no lane free, after this lane saw the queue empty, is seen on the
    /// check after the lane is given up. A lane that panics gives its lane up too (its batch's
    /// callers get an error), so the store never runs out of lanes.
    async fn lane(&self, store: &PostgresStore, send: SendBatch<T>) {
        let mut lane = Lane(self);
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
    /// Queues `completion` for a lane.
    pub(super) fn enqueue_completion(&self, completion: Completion) {
        let send: SendBatch<Completion> = |store, batch| Box::pin(store.send(batch));
        self.completions.push(self, completion, send);
    }

    /// One batch: alone as the single statement, together as the set-based one.
    async fn send(&self, mut batch: Vec<Completion>) {
        if batch.len() == 1 {
            let completion = batch.pop().expect("one completion");
            let answer = self.complete_one(&completion).await;
            let _ = completion.answer.send(answer);
            return;
        }
        tracing::debug!(completions = batch.len(), "completions sent together");
        match self.complete_many(&batch).await {
            Ok(verdicts) => {
                for (completion, verdict) in batch.into_iter().zip(verdicts) {
                    let answer = match verdict {
                        Verdict::Completed => Ok(Ownership::Held),
                        Verdict::Lost => Ok(Ownership::Lost),
                        Verdict::Locked => self.complete_one(&completion).await,
                    };
                    let _ = completion.answer.send(answer);
                }
            }
            Err(_) => {
                // Each on its own, so that whatever failed the batch fails only its own key.
                for completion in batch {
                    let answer = self.complete_one(&completion).await;
                    let _ = completion.answer.send(answer);
                }
            }
        }
    }

    /// The single completion, as the store sent every completion before batches.
    async fn complete_one(&self, completion: &Completion) -> Result<Ownership, StoreError> {
        let updated = self
            .on_connection(async |connection| {
                sqlx::query(COMPLETE)
                    .bind(&completion.scope)
                    .bind(&completion.key)
                    .bind(completion.owner)
                    .bind(completion.status)
                    .bind(&completion.response[..])
                    .bind(completion.retention_ms)
                    .execute(connection)
                    .await
            })
            .await?;
        Ok(held_if_one(updated.rows_affected()))
    }

    /// The set-based completion: a verdict per completion, in order.
    async fn complete_many(&self, batch: &[Completion]) -> Result<Vec<Verdict>, StoreError> {
        let scopes: Vec<&str> = batch.iter().map(|c| c.scope.as_str()).collect();
        let keys: Vec<&str> = batch.iter().map(|c| c.key.as_str()).collect();
        let owners: Vec<Uuid> = batch.iter().map(|c| c.owner).collect();
        let statuses: Vec<i16> = batch.iter().map(|c| c.status).collect();
        let responses: Vec<&[u8]> = batch.iter().map(|c| &c.response[..]).collect();
        let retentions: Vec<f64> = batch.iter().map(|c| c.retention_ms).collect();
        let rows = self
            .on_connection(async |connection| {
                sqlx::query(COMPLETE_MANY)
                    .bind(&scopes)
                    .bind(&keys)
                    .bind(&owners)
                    .bind(&statuses)
                    .bind(&responses)
                    .bind(&retentions)
                    .fetch_all(connection)
                    .await
            })
            .await?;
        let mut verdicts = vec![Verdict::Lost; batch.len()];
        for row in rows {
            let n: i64 = row.try_get("n").map_err(backend)?;
            let completed: bool = row.try_get("completed").map_err(backend)?;
            let owned: bool = row.try_get("owned").map_err(backend)?;
            let slot = usize::try_from(n - 1)
                .ok()
                .and_then(|i| verdicts.get_mut(i))
                .ok_or_else(|| backend(sqlx::Error::RowNotFound))?;
            *slot = match (completed, owned) {
                (true, _) => Verdict::Completed,
                (false, true) => Verdict::Locked,
                (false, false) => Verdict::Lost,
            };
        }
        Ok(verdicts)
    }
}

/// What the set-based statement did with one completion.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    Completed,
    /// Held by this owner, but its row was locked by another transaction: skipped.
    Locked,
    Lost,
}
