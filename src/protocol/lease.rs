//! Holding a claimed key: renewing its lease from a task of its own, and finalizing it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering::Relaxed},
    },
    time::Duration,
};

use tokio::{task::JoinHandle, time::Instant};

use super::Chain;
use crate::{
    Completion, StoredResponse,
    layer::Config,
    store::{Lease, Ownership, StoreError},
};

/// How soon a renewal that found the record locked (by the handler's own fence transaction)
/// tries again: the lease must be fresh as soon as that transaction ends.
const BUSY_RETRY: Duration = Duration::from_millis(20);

/// Renews a lease every third of its length from a task of its own, until dropped.
///
/// A task of its own, not a branch of the handler's: a handler that blocks its worker thread
/// (synchronous I/O, a long computation) would block its own renewals too, and lose its key while
/// it still runs. On a multi-thread runtime another worker renews; a current-thread runtime has
/// no other worker, so there a blocking handler still loses its lease.
pub(crate) struct Keeper {
    task: JoinHandle<()>,
    lost: Arc<AtomicBool>,
}

impl Keeper {
    /// Starts renewing. Yields once, so that the renewal task is running (its timer armed)
    /// before the handler starts: a task just spawned waits in its worker's LIFO slot, which no
    /// other worker steals, and a handler that blocked that worker would keep it from ever
    /// starting.
    pub(crate) async fn start(config: Arc<Config>, lease: Lease) -> Self {
        let lost = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(keep(config, lease, Arc::clone(&lost)));
        tokio::task::yield_now().await;
        Self { task, lost }
    }

    /// Whether a renewal found the key in another owner's hands.
    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Relaxed)
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep(config: Arc<Config>, lease: Lease, lost: Arc<AtomicBool>) {
    // A zero lease would make this loop spin.
    let period = (config.lease / 3).max(Duration::from_millis(1));
    let mut pause = period;
    loop {
        tokio::time::sleep(pause).await;
        pause = match config.store.renew(&lease, config.lease).await {
            Ok(Ownership::Held) => period,
            Ok(Ownership::Busy) => BUSY_RETRY.min(period),
            Ok(_) => {
                lost.store(true, Relaxed);
                config.metrics.add(|m| &m.leases_lost);
                tracing::warn!(record = %lease.record(), owner = %lease.owner(), "lease lost while the handler runs; its outcome will not be stored");
                return;
            }
            Err(error) => {
                tracing::warn!(record = %lease.record(), error = %Chain(&error), "lease renewal failed; retrying");
                period
            }
        };
    }
}

/// How a finalize ended.
pub(crate) enum Finalized {
    /// The key is completed or released (or, for a stale owner, left to its new owner).
    Done,
    /// The store kept failing: the caller may be answered, and the write retried while the key
    /// stays held.
    Failing,
}

/// Completes or releases the key, owner-checked; a committed key is completed whatever the
/// policy. A few quick attempts; a store that still fails leaves it to [`finalize_later`].
pub(crate) async fn finalize(
    config: &Config,
    lease: &Lease,
    response: &StoredResponse,
    completion: Completion,
) -> Finalized {
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=QUICK_ATTEMPTS {
        match finalize_once(config, lease, response, completion).await {
            Ok(()) => return Finalized::Done,
            Err(error) => {
                tracing::warn!(record = %lease.record(), attempt, error = %Chain(&error), "finalize failed; retrying");
            }
        }
        if attempt < QUICK_ATTEMPTS {
            tokio::time::sleep(delay).await;
            delay *= 4;
        }
    }
    Finalized::Failing
}

/// Attempts at finalizing before the caller is answered anyway.
const QUICK_ATTEMPTS: u32 = 3;

/// Keeps retrying a finalize that failed, with the key held by `keeper`, until it succeeds, the
/// lease is lost, or the layer's finalize deadline passes. The key is never freed for a second
/// execution while the write is retried: retries of it wait or get 409.
pub(crate) async fn finalize_later(
    config: &Config,
    lease: &Lease,
    response: &StoredResponse,
    completion: Completion,
    keeper: &Keeper,
) -> Finalized {
    config.metrics.add(|m| &m.finalize_errors);
    let deadline = Instant::now() + config.finalize_deadline;
    let mut delay = Duration::from_millis(250);
    while Instant::now() < deadline && !keeper.lost() {
        tokio::time::sleep(delay.min(deadline - Instant::now())).await;
        delay = (delay * 2).min(Duration::from_secs(5));
        match finalize_once(config, lease, response, completion).await {
            Ok(()) => {
                tracing::info!(record = %lease.record(), "finalized after store failures");
                return Finalized::Done;
            }
            Err(error) => {
                tracing::warn!(record = %lease.record(), error = %Chain(&error), "finalize still failing; the key stays held");
            }
        }
    }
    tracing::error!(record = %lease.record(), deadline = ?config.finalize_deadline, "gave up finalizing; the key frees itself when its lease ends");
    Finalized::Failing
}

/// One attempt: `Err` only for a store failure worth retrying.
async fn finalize_once(
    config: &Config,
    lease: &Lease,
    response: &StoredResponse,
    completion: Completion,
) -> Result<(), StoreError> {
    let store = &config.store;
    let complete = || store.complete(lease, response, config.retention);
    let ownership = match completion {
        Completion::Complete => complete().await?,
        Completion::Release => match store.release(lease).await? {
            Ownership::Committed => complete().await?,
            Ownership::Held => {
                config.metrics.add(|m| &m.releases);
                tracing::debug!(record = %lease.record(), "key released");
                return Ok(());
            }
            other => other,
        },
    };
    match ownership {
        Ownership::Held => {
            config.metrics.add(|m| &m.completions);
            tracing::debug!(record = %lease.record(), status = response.status().as_u16(), "key completed");
        }
        _ => {
            config.metrics.add(|m| &m.leases_lost);
            tracing::warn!(record = %lease.record(), owner = %lease.owner(), fence = lease.fence(), "lease lost before finalizing: nothing stored (another attempt holds the key)");
        }
    }
    Ok(())
}
