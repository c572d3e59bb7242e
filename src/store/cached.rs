//! Replays from process memory, in front of any store.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::time::Instant;
use uuid::Uuid;

use super::{
    BoxFuture, ClaimOutcome, ClaimRequest, Diagnosis, Lease, Ownership, RecordInfo, RecordKey,
    Store, StoreError,
};
use crate::{Fingerprint, StoredResponse};

/// Default bound on how long a cached answer is served without asking the store: 1 s.
pub const DEFAULT_CACHE_BOUND: Duration = Duration::from_secs(1);
/// Default number of answers a [`CachedStore`] keeps: 10,000.
pub const DEFAULT_CACHE_MAX_ENTRIES: usize = 10_000;
/// Default bytes of answers a [`CachedStore`] keeps: 16 MiB.
pub const DEFAULT_CACHE_MAX_BYTES: usize = 16 * 1024 * 1024;

/// Claims held by this process whose fingerprints the cache remembers at most, for their
/// completions: far more than a process holds at once.
const HELD_CLAIMS: usize = 100_000;

/// A store that answers replays from the process's memory: the answers this process stored or
/// replayed are kept for a short while, so that a retry that comes soon after (a client that
/// timed out and retries at once, a duplicate delivery) is replayed without a round trip.
///
/// A cached answer is served for at most [`with_bound`](Self::with_bound) (1 s by default)
/// after the process stored or read it, and never past its key's retention. That bound is the
/// whole staleness this adds: an answer the store no longer holds (an operator forgot the key
/// from another process, the retention ended, the store lost its data) is served for at most
/// that long, here, and only to a request with the same fingerprint; a request that differs
/// goes to the store. Forgetting a key through this store forgets it here at once. Everything
/// but the replay goes to the inner store: a fresh key, a key in flight, a request that differs,
/// and every write; a fresh key costs one lookup in a map, no round trip.
///
/// Off unless the application wraps its store: the bound is a promise the application makes
/// to its operators. At most [`DEFAULT_CACHE_MAX_ENTRIES`] answers and
/// [`DEFAULT_CACHE_MAX_BYTES`] by default, the oldest dropped first.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, store::CachedStore};
///
/// let store = CachedStore::new(MemoryStore::new()).with_bound(Duration::from_millis(500));
/// let layer = IdempotencyLayer::new(store);
/// ```
#[derive(Debug, Clone)]
pub struct CachedStore<S> {
    inner: S,
    cache: Arc<Mutex<Cache>>,
    bound: Duration,
}

#[derive(Debug, Default)]
struct Cache {
    answers: HashMap<RecordKey, Answer>,
    /// Answers in the order they were kept, oldest first, for eviction: (record, when kept).
    /// An item is stale when its record was kept again since.
    order: VecDeque<(RecordKey, Instant)>,
    /// Claims this process holds, for the fingerprint their completion is kept with.
    held: HashMap<(RecordKey, Uuid), Fingerprint>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
}

#[derive(Debug)]
struct Answer {
    fingerprint: Fingerprint,
    response: StoredResponse,
    kept: Instant,
    /// Served until then: the bound, or the end of the retention if sooner.
    until: Instant,
    /// The end of the key's retention, for the `expires_in` of a replay.
    expires: Instant,
    bytes: usize,
}

impl<S: Store> CachedStore<S> {
    /// `inner` with a cache in front, with the default bound and budget.
    pub fn new(inner: S) -> Self {
        let cache = Cache {
            max_entries: DEFAULT_CACHE_MAX_ENTRIES,
            max_bytes: DEFAULT_CACHE_MAX_BYTES,
            ..Cache::default()
        };
        Self {
            inner,
            cache: Arc::new(Mutex::new(cache)),
            bound: DEFAULT_CACHE_BOUND,
        }
    }

    /// How long an answer is served from memory at most, after this process stored or read it
    /// (1 s by default): the longest this process may replay an answer the store no longer
    /// holds. `Duration::ZERO` serves nothing from memory.
    pub fn with_bound(mut self, bound: Duration) -> Self {
        self.bound = bound;
        self
    }

    /// At most `entries` answers kept (10,000 by default), the oldest dropped first.
    pub fn with_max_entries(self, entries: usize) -> Self {
        self.lock().max_entries = entries;
        self
    }

    /// At most `bytes` of answers kept (16 MiB by default), the oldest dropped first.
    pub fn with_max_bytes(self, bytes: usize) -> Self {
        self.lock().max_bytes = bytes;
        self
    }

    /// The store behind the cache.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        // No operation leaves the cache half-updated.
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The answer kept for `request`, if it is still to be served.
    fn cached(&self, request: &ClaimRequest) -> Option<ClaimOutcome> {
        let cache = self.lock();
        let answer = cache.answers.get(request.record())?;
        let now = Instant::now();
        if now >= answer.until || answer.fingerprint != *request.fingerprint() {
            return None;
        }
        Some(ClaimOutcome::Completed {
            response: Box::new(answer.response.clone()),
            expires_in: answer.expires.saturating_duration_since(now),
        })
    }

    /// Keeps `response` for `record`, answered to requests with `fingerprint`.
    fn keep(
        &self,
        record: &RecordKey,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        expires_in: Duration,
    ) {
        if self.bound.is_zero() {
            return;
        }
        let now = Instant::now();
        let answer = Answer {
            fingerprint,
            bytes: super::memory::size_of(response),
            response: response.clone(),
            kept: now,
            until: now + self.bound.min(expires_in),
            expires: now + expires_in,
        };
        self.lock().insert(record.clone(), answer);
    }
}

impl Cache {
    fn insert(&mut self, record: RecordKey, answer: Answer) {
        if answer.bytes > self.max_bytes || self.max_entries == 0 {
            return;
        }
        self.order.push_back((record.clone(), answer.kept));
        self.bytes += answer.bytes;
        if let Some(old) = self.answers.insert(record, answer) {
            self.bytes -= old.bytes;
        }
        self.evict();
    }

    /// Drops the oldest answers while over budget, and those whose time is up from the front.
    fn evict(&mut self) {
        let now = Instant::now();
        loop {
            let over = self.answers.len() > self.max_entries || self.bytes > self.max_bytes;
            let Some((record, kept)) = self.order.front() else {
                return;
            };
            let drop = match self.answers.get(record) {
                Some(answer) if answer.kept == *kept => over || answer.until <= now,
                // Kept again since, or gone: this item is stale.
                _ => true,
            };
            if !drop {
                return;
            }
            let (record, kept) = self.order.pop_front().expect("a front item");
            if self.answers.get(&record).is_some_and(|a| a.kept == kept) {
                self.remove(&record);
            }
        }
    }

    fn remove(&mut self, record: &RecordKey) {
        if let Some(old) = self.answers.remove(record) {
            self.bytes -= old.bytes;
        }
    }
}

impl<S: Store> Store for CachedStore<S> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            if let Some(replay) = self.cached(request) {
                return Ok(replay);
            }
            let outcome = self.inner.claim(request).await?;
            match &outcome {
                ClaimOutcome::Completed {
                    response,
                    expires_in,
                } => self.keep(
                    request.record(),
                    *request.fingerprint(),
                    response,
                    *expires_in,
                ),
                ClaimOutcome::Acquired { .. } => {
                    let held = (request.record().clone(), request.owner());
                    let mut cache = self.lock();
                    // A claim never finalized here (its grant came too late to act on) stays
                    // until this clears them all: only its completion goes uncached.
                    if cache.held.len() >= HELD_CLAIMS {
                        cache.held.clear();
                    }
                    cache.held.insert(held, *request.fingerprint());
                }
                _ => {}
            }
            Ok(outcome)
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        self.inner.renew(lease, duration)
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let held = self.inner.complete(lease, response, retention).await;
            let fingerprint = match &held {
                // Finalizing again after an error keeps what it needs until it is done.
                Err(_) => None,
                Ok(_) => self.let_go(lease),
            };
            if let (Ok(Ownership::Held), Some(fingerprint)) = (&held, fingerprint) {
                self.keep(lease.record(), fingerprint, response, retention);
            }
            held
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let released = self.inner.release(lease).await;
            if matches!(released, Ok(Ownership::Held | Ownership::Lost)) {
                self.let_go(lease);
            }
            released
        })
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn tombstone_horizon(&self) -> Duration {
        self.inner.tombstone_horizon()
    }

    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        self.inner.inspect(record)
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.lock().remove(record);
        self.inner.forget(record)
    }

    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        self.inner.stuck(older_than, limit)
    }

    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        self.inner.adopt(request, response, retention)
    }

    fn detached(&self) -> Option<Arc<dyn Store>> {
        self.inner.detached()
    }

    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        self.inner.diagnose()
    }
}

impl<S: Store> CachedStore<S> {
    /// Forgets the claim `lease` held here: the fingerprint it was claimed with, if it was.
    fn let_go(&self, lease: &Lease) -> Option<Fingerprint> {
        let held = (lease.record().clone(), lease.owner());
        self.lock().held.remove(&held)
    }
}
