use std::{
    cmp::Reverse,
    collections::{BinaryHeap, VecDeque},
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use hashbrown::HashTable;
use tokio::time::Instant;
use uuid::Uuid;

use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    contract::{Admin, BoxFuture, Front, Offers, Store},
    diagnosis::{Diagnosis, Severity},
    error::StoreError,
    views::{RecordInfo, RecordState},
};
use crate::{fingerprint::Fingerprint, response::StoredResponse};

/// An in-process store, **for tests and single-process development only**.
///
/// # It gives no protection across instances
///
/// Every process has its own `MemoryStore`. Run two instances of a service behind a load
/// balancer and each one happily runs the "same" request: exactly the bug this crate exists to
/// kill. Its records also vanish on restart. Use the Redis and Postgres stores in production.
///
/// Within one process it implements the whole [`Store`] contract (leases, fences, retention),
/// so it is a faithful stand-in for tests. Clones share the same records.
///
/// # Memory
///
/// Records expire in time order, each claim dropping those whose time has come, so memory
/// follows what is live rather than what was ever stored. Completed records are also held to a
/// budget: at most [`DEFAULT_MEMORY_MAX_ENTRIES`] records and [`DEFAULT_MEMORY_MAX_BYTES`] of
/// stored responses by default ([`with_max_entries`](Self::with_max_entries),
/// [`with_max_bytes`](Self::with_max_bytes)). Past either, the oldest completed records are
/// evicted first; a retry of an evicted key runs again, as after its retention. In-flight
/// records are never evicted: a claim that finds the store full of them fails, and the layer
/// answers 503.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

/// Default budget of records a [`MemoryStore`] holds: one million.
pub const DEFAULT_MEMORY_MAX_ENTRIES: usize = 1_000_000;
/// Default budget of stored response bytes a [`MemoryStore`] holds: 256 MiB.
pub const DEFAULT_MEMORY_MAX_BYTES: usize = 256 * 1024 * 1024;

#[derive(Debug)]
struct State {
    /// Hashes record keys (keyed per store, so callers cannot choose colliding keys).
    hasher: RandomState,
    /// The records, each with its key's hash, computed once. Growing the table moves 16-byte
    /// items by their stored hash, without reading a key: a `HashMap` hashed every key again
    /// under the lock, which stalled every request for 100 ms when it grew past 229k records.
    records: HashTable<Item>,
    /// Expiry times, soonest first, with each record's hash; an item is stale when its
    /// record's time has moved.
    expiries: BinaryHeap<Reverse<(Instant, u64, Arc<RecordKey>)>>,
    /// Completed records in completion order, oldest first, for eviction: (fence, hash,
    /// record). Stale items are skipped.
    completed: VecDeque<(u64, u64, Arc<RecordKey>)>,
    last_fence: u64,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    /// How long after its completion a key is kept as a tombstone once its answer is gone
    /// (zero: not at all).
    horizon: Duration,
}

impl Default for State {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            records: HashTable::new(),
            expiries: BinaryHeap::new(),
            completed: VecDeque::new(),
            last_fence: 0,
            bytes: 0,
            max_entries: DEFAULT_MEMORY_MAX_ENTRIES,
            max_bytes: DEFAULT_MEMORY_MAX_BYTES,
            horizon: Duration::ZERO,
        }
    }
}

/// A record in the table: its key's hash beside it, the rest boxed so that the table stays small.
#[derive(Debug)]
struct Item {
    hash: u64,
    entry: Box<Entry>,
}

#[derive(Debug)]
struct Entry {
    /// The map's own key, shared: the expiry and eviction queues name records with it.
    record: Arc<RecordKey>,
    fingerprint: Fingerprint,
    /// The claim that holds (or completed) the record, and when it was made.
    fence: u64,
    owner: Uuid,
    claimed_at: Instant,
    /// The lease deadline while in flight, the retention deadline once completed.
    expires_at: Instant,
    state: EntryState,
}

#[derive(Debug)]
enum EntryState {
    InFlight,
    Completed {
        response: StoredResponse,
        bytes: usize,
        completed_at: Instant,
    },
    /// Past its retention, within the horizon: what is left of a completed record.
    Tombstone {
        status: http::StatusCode,
        completed_at: Instant,
    },
}

impl MemoryStore {
    /// An empty store, with the default budget.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // One process only: a test, or local development.
    /// let store = MemoryStore::new().with_max_entries(10_000);
    /// let layer = IdempotencyLayer::new(store);
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// At most `entries` records (one million by default); past it the oldest completed ones
    /// are evicted.
    pub fn with_max_entries(self, entries: usize) -> Self {
        self.lock().max_entries = entries.max(1);
        self
    }

    /// At most `bytes` of stored responses (256 MiB by default); past it the oldest completed
    /// records are evicted.
    pub fn with_max_bytes(self, bytes: usize) -> Self {
        self.lock().max_bytes = bytes;
        self
    }

    /// Keeps a completed key as a tombstone once its answer's retention ends, until `horizon`
    /// after its completion (off by default): a late retry of the same request is then
    /// [`ClaimOutcome::AnswerExpired`] (the layer answers 410 and never runs it), another
    /// request with the key a mismatch. A tombstone holds no response bytes; it counts as a
    /// record against [`with_max_entries`](Self::with_max_entries), evicted with the oldest
    /// completed records.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::MemoryStore;
    ///
    /// // Answers replayed for the layer's retention; the keys refused for 7 days.
    /// let store = MemoryStore::new().with_tombstones(Duration::from_secs(7 * 24 * 3600));
    /// ```
    pub fn with_tombstones(self, horizon: Duration) -> Self {
        self.lock().horizon = horizon;
        self
    }

    /// The number of records held, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of stored responses held.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No operation leaves the map half-updated, so a panic elsewhere does not taint it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a stored response costs the budget: its parts, and a record's own overhead.
pub(super) fn size_of(response: &StoredResponse) -> usize {
    let fields = |map: &http::HeaderMap| {
        map.iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 16)
            .sum::<usize>()
    };
    256 + response.body().map_or(0, |body| body.len())
        + fields(response.headers())
        + response.trailers().map_or(0, fields)
}

impl State {
    fn hash(&self, record: &RecordKey) -> u64 {
        self.hasher.hash_one(record)
    }

    fn get(&self, hash: u64, record: &RecordKey) -> Option<&Entry> {
        let item = self
            .records
            .find(hash, |item| *item.entry.record == *record)?;
        Some(&item.entry)
    }

    fn get_mut(&mut self, hash: u64, record: &RecordKey) -> Option<&mut Entry> {
        let item = self
            .records
            .find_mut(hash, |item| *item.entry.record == *record)?;
        Some(&mut item.entry)
    }

    /// Drops every record whose time has come.
    fn expire(&mut self, now: Instant) {
        while let Some(Reverse((when, ..))) = self.expiries.peek() {
            if *when > now {
                break;
            }
            let Some(Reverse((when, hash, record))) = self.expiries.pop() else {
                break;
            };
            if self
                .get(hash, &record)
                .is_some_and(|e| e.expires_at == when)
                && !self.bury(hash, &record, now)
            {
                self.remove(hash, &record);
            }
        }
        // Completions whose record went (expired or released) leave the eviction queue too,
        // once they are many: looking them up costs a probe each.
        if self.completed.len() > 2 * self.records.len() + 64 {
            let mut completed = std::mem::take(&mut self.completed);
            completed.retain(|(fence, hash, record)| self.is_completed(*hash, record, *fence));
            self.completed = completed;
        }
    }

    /// Turns `record`, completed and past its retention, into a tombstone until the horizon
    /// after its completion, if that is later than `now`; whether it did.
    fn bury(&mut self, hash: u64, record: &RecordKey, now: Instant) -> bool {
        let horizon = self.horizon;
        let Some(entry) = self.get_mut(hash, record) else {
            return false;
        };
        let EntryState::Completed {
            ref response,
            bytes,
            completed_at,
        } = entry.state
        else {
            return false;
        };
        let until = completed_at + horizon;
        if until <= now {
            return false;
        }
        entry.state = EntryState::Tombstone {
            status: response.status(),
            completed_at,
        };
        entry.expires_at = until;
        let record = Arc::clone(&entry.record);
        self.bytes -= bytes;
        self.expiries.push(Reverse((until, hash, record)));
        true
    }

    /// Whether `record` is still the one completed under `fence`.
    fn is_completed(&self, hash: u64, record: &RecordKey, fence: u64) -> bool {
        self.get(hash, record)
            .is_some_and(|e| e.is_completed_under(fence))
    }

    /// Removes `record`; whether it was there.
    fn remove(&mut self, hash: u64, record: &RecordKey) -> bool {
        let Ok(found) = self
            .records
            .find_entry(hash, |item| *item.entry.record == *record)
        else {
            return false;
        };
        let (item, _) = found.remove();
        if let EntryState::Completed { bytes, .. } = item.entry.state {
            self.bytes -= bytes;
        }
        true
    }

    /// Sets the deadline of the record held by `lease`'s owner in flight; `false` if it is not.
    fn hold_until(&mut self, lease: &Lease, when: Instant) -> bool {
        let hash = self.hash(lease.record());
        let Some(entry) = self.held_mut(hash, lease) else {
            return false;
        };
        entry.expires_at = when;
        let record = Arc::clone(&entry.record);
        self.expiries.push(Reverse((when, hash, record)));
        true
    }

    /// The entry `lease`'s owner holds in flight, if it still does.
    fn held_mut(&mut self, hash: u64, lease: &Lease) -> Option<&mut Entry> {
        self.get_mut(hash, lease.record()).filter(|entry| {
            matches!(entry.state, EntryState::InFlight) && entry.owner == lease.owner()
        })
    }

    /// Evicts the oldest completed records until `room` more entries and `bytes` more bytes fit;
    /// `false` if only in-flight records are left to evict.
    fn make_room(&mut self, room: usize, bytes: usize) -> bool {
        while self.records.len() + room > self.max_entries || self.bytes + bytes > self.max_bytes {
            let Some((fence, hash, record)) = self.completed.pop_front() else {
                return false;
            };
            if self.is_completed(hash, &record, fence) {
                self.remove(hash, &record);
            }
        }
        true
    }

    fn claim(&mut self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let now = Instant::now();
        self.expire(now);
        let hash = self.hash(request.record());
        if let Some(entry) = self.get(hash, request.record()) {
            return Ok(entry.outcome_for(request, now));
        }
        if !self.make_room(1, 0) {
            let full = format!(
                "the memory store holds {} records in flight, its whole entry budget",
                self.records.len()
            );
            return Err(StoreError::backend("memory", full));
        }
        self.last_fence += 1;
        let record = Arc::clone(request.shared_record());
        let expires_at = now + request.lease();
        self.expiries
            .push(Reverse((expires_at, hash, Arc::clone(&record))));
        let entry = Box::new(Entry {
            record,
            fingerprint: *request.fingerprint(),
            fence: self.last_fence,
            owner: request.owner(),
            claimed_at: now,
            expires_at,
            state: EntryState::InFlight,
        });
        self.records
            .insert_unique(hash, Item { hash, entry }, |item| item.hash);
        Ok(ClaimOutcome::Acquired {
            fence: self.last_fence,
        })
    }

    fn complete(
        &mut self,
        lease: &Lease,
        response: &StoredResponse,
        retention: Duration,
    ) -> Ownership {
        let hash = self.hash(lease.record());
        if self.held_mut(hash, lease).is_none() {
            return Ownership::Lost;
        }
        let bytes = size_of(response);
        // Room for this one: the oldest other completed records go first. A response larger
        // than the whole budget is kept alone.
        self.make_room(0, bytes);
        let Some(entry) = self.held_mut(hash, lease) else {
            return Ownership::Lost;
        };
        let now = Instant::now();
        let expires_at = now + retention;
        entry.expires_at = expires_at;
        entry.state = EntryState::Completed {
            response: response.clone(),
            bytes,
            completed_at: now,
        };
        let record = Arc::clone(&entry.record);
        self.bytes += bytes;
        self.expiries
            .push(Reverse((expires_at, hash, Arc::clone(&record))));
        self.completed.push_back((lease.fence(), hash, record));
        Ownership::Held
    }

    fn release(&mut self, lease: &Lease) -> Ownership {
        let hash = self.hash(lease.record());
        if self.held_mut(hash, lease).is_none() {
            return Ownership::Lost;
        }
        self.remove(hash, lease.record());
        Ownership::Held
    }
}

impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        let outcome = self.lock().claim(request);
        Box::pin(async move { outcome })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let held = self.lock().hold_until(lease, Instant::now() + duration);
        let ownership = if held {
            Ownership::Held
        } else {
            Ownership::Lost
        };
        Box::pin(async move { Ok(ownership) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let ownership = self.lock().complete(lease, response, retention);
        Box::pin(async move { Ok(ownership) })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let ownership = self.lock().release(lease);
        Box::pin(async move { Ok(ownership) })
    }

    fn tombstone_horizon(&self) -> Duration {
        self.lock().horizon
    }

    fn kind(&self) -> &'static str {
        "memory"
    }

    fn offers(&self) -> Offers<'_> {
        Offers::none().with_admin(self)
    }
}

/// Any store may stand in front of an authority; the memory store claims there as it claims
/// anywhere.
impl Front for MemoryStore {}

impl Admin for MemoryStore {
    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        let mut diagnosis = Diagnosis::default();
        let message = "one process only: instances that do not share it are not protected from \
                       each other; use Redis and Postgres for a fleet";
        diagnosis.push(Severity::Warning, "memory", "fleet", message);
        Box::pin(std::future::ready(diagnosis))
    }

    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        let now = Instant::now();
        let mut state = self.lock();
        state.expire(now);
        let info = state
            .get(state.hash(record), record)
            .filter(|entry| entry.expires_at > now)
            .map(|entry| entry.info(now));
        drop(state);
        Box::pin(async move { Ok(info) })
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        let mut state = self.lock();
        let hash = state.hash(record);
        let found = state.remove(hash, record);
        drop(state);
        Box::pin(async move { Ok(found) })
    }

    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        let now = Instant::now();
        let mut stuck: Vec<RecordInfo> = self
            .lock()
            .records
            .iter()
            .map(|item| &*item.entry)
            .filter(|e| matches!(e.state, EntryState::InFlight) && e.expires_at > now)
            .filter(|e| now - e.claimed_at >= older_than)
            .map(|entry| entry.info(now))
            .collect();
        stuck.sort_by_key(|info| std::cmp::Reverse(info.age));
        stuck.truncate(limit);
        Box::pin(async move { Ok(stuck) })
    }
}

impl Entry {
    /// What a claim of this record with `request` finds.
    fn outcome_for(&self, request: &ClaimRequest, now: Instant) -> ClaimOutcome {
        if self.fingerprint != *request.fingerprint() {
            return ClaimOutcome::Mismatch;
        }
        match &self.state {
            // The owner's own claim, asked again (its first answer was lost): still its own.
            EntryState::InFlight if self.owner == request.owner() => {
                ClaimOutcome::Acquired { fence: self.fence }
            }
            EntryState::InFlight => ClaimOutcome::InFlight {
                retry_after: self.expires_at - now,
            },
            EntryState::Completed { response, .. } => ClaimOutcome::Completed {
                response: response.clone(),
                expires_in: self.expires_at - now,
            },
            EntryState::Tombstone {
                status,
                completed_at,
            } => ClaimOutcome::AnswerExpired {
                status: *status,
                completed_ago: now - *completed_at,
            },
        }
    }

    /// Whether this is the record completed under `fence` (the eviction queue names records
    /// by their fence, since a key may be released and claimed again).
    fn is_completed_under(&self, fence: u64) -> bool {
        self.fence == fence
            && matches!(
                self.state,
                EntryState::Completed { .. } | EntryState::Tombstone { .. }
            )
    }

    fn info(&self, now: Instant) -> RecordInfo {
        let (state, lease_left, status) = match &self.state {
            EntryState::InFlight => (RecordState::InFlight, Some(self.expires_at - now), None),
            EntryState::Completed { response, .. } => {
                (RecordState::Completed, None, Some(response.status()))
            }
            EntryState::Tombstone { status, .. } => {
                (RecordState::AnswerExpired, None, Some(*status))
            }
        };
        RecordInfo {
            record: RecordKey::clone(&self.record),
            state,
            fence: self.fence,
            owner: self.owner,
            lease_left,
            age: Some(now - self.claimed_at),
            expires_in: self.expires_at - now,
            status,
            unfinished: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    crate::store_conformance_tests!(async { super::MemoryStore::new() });

    mod admin {
        crate::store_admin_conformance_tests!(async { super::super::MemoryStore::new() });
    }

    mod with_tombstones {
        crate::store_tombstone_conformance_tests!(async {
            super::super::MemoryStore::new().with_tombstones(crate::conformance::TOMBSTONE_HORIZON)
        });
    }

    fn request(key: &str, lease: Duration) -> ClaimRequest {
        crate::conformance::claim_request("s", key, "", lease)
    }

    fn response(bytes: usize) -> StoredResponse {
        let body = Bytes::from(vec![b'x'; bytes]);
        StoredResponse::new(StatusCode::OK, HeaderMap::new(), Some(body), None)
    }

    async fn complete(store: &MemoryStore, key: &str, bytes: usize) {
        let request = request(key, Duration::from_secs(30));
        let ClaimOutcome::Acquired { fence } = store.claim(&request).await.unwrap() else {
            panic!("{key} not acquired");
        };
        let lease = request.lease_with_fence(fence);
        let retention = Duration::from_secs(3600);
        assert_eq!(
            store
                .complete(&lease, &response(bytes), retention)
                .await
                .unwrap(),
            Ownership::Held
        );
    }

    #[tokio::test]
    async fn the_byte_budget_evicts_the_oldest_completed_records() {
        let store = MemoryStore::new().with_max_bytes(10 * 1024 * 1024);
        for i in 0..30 {
            complete(&store, &format!("k{i}"), 1024 * 1024).await;
        }
        assert!(store.bytes() <= 10 * 1024 * 1024, "{} bytes", store.bytes());
        assert!(store.len() < 10);
        // The newest is still replayed; the oldest runs again.
        let newest = store.claim(&request("k29", Duration::from_secs(30))).await;
        assert!(
            matches!(newest, Ok(ClaimOutcome::Completed { .. })),
            "{newest:?}"
        );
        let oldest = store.claim(&request("k0", Duration::from_secs(30))).await;
        assert!(
            matches!(oldest, Ok(ClaimOutcome::Acquired { .. })),
            "{oldest:?}"
        );
    }

    #[tokio::test]
    async fn in_flight_records_are_never_evicted() {
        let store = MemoryStore::new().with_max_entries(3);
        complete(&store, "done", 10).await;
        for key in ["a", "b"] {
            store
                .claim(&request(key, Duration::from_secs(30)))
                .await
                .unwrap();
        }
        // The completed record makes room for a third claim; then the store is full.
        assert!(matches!(
            store.claim(&request("c", Duration::from_secs(30))).await,
            Ok(ClaimOutcome::Acquired { .. })
        ));
        assert!(
            store
                .claim(&request("d", Duration::from_secs(30)))
                .await
                .is_err()
        );
        for key in ["a", "b", "c"] {
            assert!(matches!(
                store.claim(&request(key, Duration::from_secs(30))).await,
                Ok(ClaimOutcome::InFlight { .. })
            ));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn expired_records_go_without_a_scan() {
        let store = MemoryStore::new();
        for i in 0..100 {
            complete(&store, &format!("k{i}"), 10).await;
        }
        store
            .claim(&request("lease", Duration::from_secs(1)))
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(2)).await;
        store
            .claim(&request("any", Duration::from_secs(30)))
            .await
            .unwrap();
        assert_eq!(store.len(), 101, "only the lapsed claim went");
        tokio::time::advance(Duration::from_secs(3600)).await;
        store
            .claim(&request("any-2", Duration::from_secs(30)))
            .await
            .unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store.bytes(), 0);
    }
}
