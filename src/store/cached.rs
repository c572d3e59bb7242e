//! Replays from process memory, in front of any store.

use std::{
    collections::{HashMap, VecDeque},
    fmt,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::time::Instant;

use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    contract::{BoxFuture, Front, Store},
    error::StoreError,
};
use crate::{fingerprint::Fingerprint, response::StoredResponse};

/// Default bound on how long a cached answer is served without asking the store: 1 s.
pub const DEFAULT_CACHE_BOUND: Duration = Duration::from_secs(1);
/// Default number of answers a [`CachedStore`] keeps: 10,000.
pub const DEFAULT_CACHE_MAX_ENTRIES: usize = 10_000;
/// Default bytes of answers a [`CachedStore`] keeps: 16 MiB.
pub const DEFAULT_CACHE_MAX_BYTES: usize = 16 * 1024 * 1024;

/// A store that answers replays from the process's memory: the answers this process stored or
/// replayed are kept for a short while, so that a retry that comes soon after (a client that
/// timed out and retries at once, a duplicate delivery) is replayed without a round trip.
///
/// A cached answer is served for at most [`with_bound`](Self::with_bound) (1 s by default)
/// after the process stored or read it, and never past its key's retention. That bound is the
/// whole staleness this adds: an answer the store no longer holds (an operator forgot the key
/// from another process, the retention ended, the store lost its data) is served for at most
/// that long, here, and only to a request with the same fingerprint; a request that differs
/// goes to the store. [`forget`](Self::forget) forgets a key here at once and in the store;
/// the operator's paths ([`Store::offers`]) are the inner store's. Everything but the replay goes to the inner store: a fresh key, a key in flight, a request that differs,
/// and every write; a fresh key costs one lookup in a map, no round trip.
///
/// Off unless the application wraps its store: the bound is a promise the application makes
/// to its operators. At most [`DEFAULT_CACHE_MAX_ENTRIES`] answers and
/// [`DEFAULT_CACHE_MAX_BYTES`] by default, the oldest dropped first.
///
/// # Told by the store instead of a timer
///
/// With a [`Watcher`] ([`with_watcher`](Self::with_watcher); Redis has one,
/// [`RedisStore::watcher`](super::RedisStore::watcher)), an answer a retry asked for again is
/// watched: once the store has said it will tell of any change to the key, and the key still
/// held that answer, the answer is served until its retention ends rather than for the bound,
/// and dropped the moment the store says the key changed (forgotten, expired, evicted, flushed).
/// The bound still holds: a watched answer is served only while the watcher has heard from the
/// store within the bound, everything the store told it before included, so a lost connection
/// or a silent network costs no more staleness than the timer does. A fresh key pays nothing
/// for this: only an answer served again (from memory or from the store) is watched.
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
    watcher: Option<Arc<dyn Watcher>>,
}

#[derive(Debug, Default)]
struct Cache {
    /// Keyed by the record the claim and its lease share, so keeping an answer copies no key.
    answers: HashMap<Arc<RecordKey>, Answer>,
    /// Watched answers are served until then at most: the bound after the watcher last heard
    /// from the store.
    heard_until: Option<Instant>,
    /// How long an answer is served after it was kept, or after the watcher last heard.
    bound: Duration,
    /// Answers in the order they were kept, oldest first, for eviction: (record, when kept).
    /// An item is stale when its record was kept again since.
    order: VecDeque<(Arc<RecordKey>, Instant)>,
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
    token: u64,
    watched: Watched,
}

impl Answer {
    /// Whether the store tells of any change to the key, within its retention at `now`.
    fn watched_at(&self, now: Instant) -> bool {
        self.watched == Watched::Yes && now < self.expires
    }
}

/// How far the watcher has got with an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    No,
    Asked,
    /// The store tells the watcher of any change to the key.
    Yes,
}

/// Tells a [`CachedStore`] when the answers it keeps change in the store, so that it serves
/// them for as long as they are the store's (see [`CachedStore`], "Told by the store instead of
/// a timer"). [`RedisStore::watcher`](super::RedisStore::watcher) is one.
pub trait Watcher: Send + Sync + fmt::Debug + 'static {
    /// Where to say what changed: called once, by [`CachedStore::with_watcher`]. A watcher
    /// serves one cache; another cache needs a watcher of its own.
    fn start(&self, changes: Changes);

    /// Asks to be told when `watch`'s key changes from the answer it holds. Must not wait (it
    /// is called on a request's path): the watcher answers later, through [`Changes`].
    fn watch(&self, watch: Watch);
}

/// An answer a [`CachedStore`] would serve for longer if the store tells it of changes.
#[derive(Debug, Clone)]
pub struct Watch {
    record: Arc<RecordKey>,
    fingerprint: Fingerprint,
    response: StoredResponse,
    token: u64,
}

impl Watch {
    /// The key.
    pub fn record(&self) -> &RecordKey {
        &self.record
    }

    /// The fingerprint the answer was stored for.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The answer.
    pub fn response(&self) -> &StoredResponse {
        &self.response
    }
}

/// Where a [`Watcher`] tells its [`CachedStore`] what changed.
#[derive(Debug, Clone)]
pub struct Changes {
    cache: Weak<Mutex<Cache>>,
}

impl Changes {
    fn with<T>(&self, change: impl FnOnce(&mut Cache) -> T) -> Option<T> {
        let cache = self.cache.upgrade()?;
        let mut cache = cache.lock().unwrap_or_else(PoisonError::into_inner);
        Some(change(&mut cache))
    }

    /// The store will tell of any change to `watch`'s key from now on, and the key held
    /// `watch`'s answer when it started to: the answer is served until its retention ends
    /// (while the watcher is heard from). Call it only once the store has both said so and
    /// shown the answer, on the connection that will tell.
    pub fn watching(&self, watch: &Watch) {
        self.with(|cache| {
            if let Some(answer) = cache.answers.get_mut(&watch.record)
                && answer.token == watch.token
            {
                answer.watched = Watched::Yes;
            }
        });
    }

    /// `record` changed in the store: its answer is not served again until it is kept again.
    pub fn changed(&self, record: &RecordKey) {
        self.with(|cache| cache.remove(record));
    }

    /// The watcher lost what it asked the store for (its connection, and what the store would
    /// have told on it): watched answers are not served again until they are kept again, and
    /// the others are asked for again when next served.
    pub fn lost_track(&self) {
        self.with(|cache| {
            cache.heard_until = None;
            let watched: Vec<Arc<RecordKey>> = cache
                .answers
                .iter_mut()
                .filter_map(|(record, answer)| match answer.watched {
                    Watched::Yes => Some(Arc::clone(record)),
                    Watched::Asked | Watched::No => {
                        answer.watched = Watched::No;
                        None
                    }
                })
                .collect();
            for record in &watched {
                cache.remove(record);
            }
        });
    }

    /// Every key may have changed (the store was flushed): no answer is served until it is
    /// kept again.
    pub fn all_changed(&self) {
        self.with(|cache| {
            cache.answers.clear();
            cache.order.clear();
            cache.bytes = 0;
        });
    }

    /// The watcher heard from the store in answer to what it sent at `sent` (a ping), and with
    /// it everything the store told before: watched answers are served until the cache's bound
    /// after `sent`.
    pub fn heard_since(&self, sent: Instant) {
        self.with(|cache| {
            let until = sent + cache.bound;
            cache.heard_until = Some(cache.heard_until.map_or(until, |h| h.max(until)));
        });
    }

    /// The cache's bound: how often the watcher should make sure it hears from the store.
    pub fn bound(&self) -> Option<Duration> {
        self.with(|cache| cache.bound)
    }

    /// Whether the cache was dropped: the watcher may stop.
    pub fn is_closed(&self) -> bool {
        self.cache.strong_count() == 0
    }
}

impl<S: Store> CachedStore<S> {
    /// `inner` with a cache in front, with the default bound and budget.
    pub fn new(inner: S) -> Self {
        let cache = Cache {
            max_entries: DEFAULT_CACHE_MAX_ENTRIES,
            max_bytes: DEFAULT_CACHE_MAX_BYTES,
            bound: DEFAULT_CACHE_BOUND,
            ..Cache::default()
        };
        Self {
            inner,
            cache: Arc::new(Mutex::new(cache)),
            watcher: None,
        }
    }

    /// How long an answer is served from memory at most, after this process stored or read it
    /// (1 s by default): the longest this process may replay an answer the store no longer
    /// holds. `Duration::ZERO` serves nothing from memory. With a [watcher](Self::with_watcher),
    /// how long after the watcher last heard from the store.
    pub fn with_bound(self, bound: Duration) -> Self {
        self.lock().bound = bound;
        self
    }

    /// Answers asked for again are watched by `watcher`, and served for as long as the store
    /// says they have not changed ("Told by the store instead of a timer", above).
    ///
    /// ```no_run
    /// use tower_idempotency::{IdempotencyLayer, store::{CachedStore, RedisStore}};
    ///
    /// let redis = RedisStore::open("redis://127.0.0.1:6379/")?;
    /// let store = CachedStore::new(redis.clone()).with_watcher(redis.watcher());
    /// let layer = IdempotencyLayer::new(store);
    /// # Ok::<(), tower_idempotency::redis::RedisError>(())
    /// ```
    pub fn with_watcher(mut self, watcher: impl Watcher) -> Self {
        watcher.start(Changes {
            cache: Arc::downgrade(&self.cache),
        });
        self.watcher = Some(Arc::new(watcher));
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
        let mut cache = self.lock();
        let heard = cache.heard_until;
        let answer = cache.answers.get_mut(request.shared_record())?;
        let now = Instant::now();
        let watched = answer.watched_at(now) && heard.is_some_and(|heard| now < heard);
        if !(now < answer.until || watched) || answer.fingerprint != *request.fingerprint() {
            return None;
        }
        let replay = ClaimOutcome::Completed {
            response: answer.response.clone(),
            expires_in: answer.expires.saturating_duration_since(now),
        };
        let watch = self.ask(answer, request.shared_record());
        drop(cache);
        self.send(watch);
        Some(replay)
    }

    /// What to ask the watcher for `answer`, if there is one and it was not asked yet.
    fn ask(&self, answer: &mut Answer, record: &Arc<RecordKey>) -> Option<Watch> {
        if self.watcher.is_none() || answer.watched != Watched::No {
            return None;
        }
        answer.watched = Watched::Asked;
        Some(Watch {
            record: Arc::clone(record),
            fingerprint: answer.fingerprint,
            response: answer.response.clone(),
            token: answer.token,
        })
    }

    fn send(&self, watch: Option<Watch>) {
        if let (Some(watcher), Some(watch)) = (&self.watcher, watch) {
            watcher.watch(watch);
        }
    }

    /// Keeps `response` for `record`, answered to requests with `fingerprint`; and, for an
    /// answer read `again` from the store, asks the watcher to watch it.
    fn keep(
        &self,
        record: &Arc<RecordKey>,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        (expires_in, again): (Duration, bool),
    ) {
        // Unique in the process, so that a watch answers for the answer it asked for.
        static TOKENS: AtomicU64 = AtomicU64::new(0);
        let (bytes, response) = (super::memory::size_of(response), response.clone());
        let mut cache = self.lock();
        if cache.bound.is_zero() {
            return;
        }
        let now = Instant::now();
        let mut answer = Answer {
            fingerprint,
            bytes,
            response,
            kept: now,
            until: now + cache.bound.min(expires_in),
            expires: now + expires_in,
            token: TOKENS.fetch_add(1, Ordering::Relaxed),
            watched: Watched::No,
        };
        let watch = again.then(|| self.ask(&mut answer, record)).flatten();
        let kept = cache.insert(Arc::clone(record), answer, now);
        drop(cache);
        if kept {
            self.send(watch);
        }
    }

    /// A claim answered from memory when this process holds the key's answer, else by
    /// `claim` (the inner store's), whose replay is kept.
    async fn claimed<'a>(
        &'a self,
        request: &'a ClaimRequest,
        claim: impl FnOnce() -> BoxFuture<'a, Result<ClaimOutcome, StoreError>>,
    ) -> Result<ClaimOutcome, StoreError> {
        if let Some(replay) = self.cached(request) {
            return Ok(replay);
        }
        let outcome = claim().await?;
        if let ClaimOutcome::Completed {
            response,
            expires_in,
        } = &outcome
        {
            self.keep(
                request.shared_record(),
                *request.fingerprint(),
                response,
                (*expires_in, true),
            );
        }
        Ok(outcome)
    }
}

impl Cache {
    /// Keeps `answer`; `false` when it is over the budget on its own.
    fn insert(&mut self, record: Arc<RecordKey>, answer: Answer, now: Instant) -> bool {
        if answer.bytes > self.max_bytes || self.max_entries == 0 {
            return false;
        }
        self.order.push_back((Arc::clone(&record), answer.kept));
        self.bytes += answer.bytes;
        if let Some(old) = self.answers.insert(record, answer) {
            self.bytes -= old.bytes;
        }
        self.evict(now);
        true
    }

    /// Drops the oldest answers while over budget, and those whose time is up from the front.
    fn evict(&mut self, now: Instant) {
        loop {
            let over = self.answers.len() > self.max_entries || self.bytes > self.max_bytes;
            let Some((record, kept)) = self.order.front() else {
                return;
            };
            // Kept again since, or gone: the item is stale, and only leaves the queue.
            let live = match self.answers.get(record) {
                Some(answer) if answer.kept == *kept => {
                    if !over && (now < answer.until || answer.watched_at(now)) {
                        return;
                    }
                    true
                }
                _ => false,
            };
            let (record, _) = self.order.pop_front().expect("a front item");
            if live {
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
        Box::pin(self.claimed(request, || self.inner.claim(request)))
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
            // A lease made without its claim does not know what request its answer is for.
            if let (Ok(Ownership::Held), Some(fingerprint)) = (&held, lease.fingerprint()) {
                self.keep(
                    lease.shared_record(),
                    *fingerprint,
                    response,
                    (retention, false),
                );
            }
            held
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        self.inner.release(lease)
    }

    /// Its kind, tombstones, detached twin (renewals are not cached) and [`Admin`](super::Admin) are the
    /// inner store's: a key forgotten through it is forgotten here at the bound, as one
    /// forgotten from another process; [`CachedStore::forget`] forgets it here at once.
    fn wrapped(&self) -> Option<&dyn Store> {
        Some(&self.inner)
    }
}

/// In front of an authority too: the inner store's own claim in front (no script on Redis),
/// with the same answers kept and served.
impl<S: Front> Front for CachedStore<S> {
    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(self.claimed(request, || self.inner.claim_in_front(request)))
    }
}

impl<S: Store> CachedStore<S> {
    /// Forgets `record` here at once, and in the inner store ([`Admin::forget`](super::Admin::forget)): whether the
    /// inner store held something. An inner store that offers no [`Admin`](super::Admin) answers
    /// [`StoreError::Unsupported`].
    pub async fn forget(&self, record: &RecordKey) -> Result<bool, StoreError> {
        self.lock().remove(record);
        let admin = self.inner.offers().admin.ok_or(StoreError::Unsupported {
            store: self.inner.kind(),
            operation: "forget",
        })?;
        admin.forget(record).await
    }
}
