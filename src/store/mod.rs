//! The store contract: where claims, leases and stored responses live.
//!
//! The layer talks to a store through four owner-checked operations:
//!
//! | operation | what it does |
//! |---|---|
//! | [`claim`](Store::claim) | atomically take an absent (or expired) key for a new owner, or report why not |
//! | [`renew`](Store::renew) | extend the owner's lease while the handler runs |
//! | [`complete`](Store::complete) | store the response and make the key replay it for the retention period |
//! | [`release`](Store::release) | delete the key so the client can retry cleanly |
//!
//! # States of one key
//!
//! ```text
//! absent ──claim──▶ in_flight(owner, fence, lease) ──complete──▶ completed(response)
//!    ▲                    │          │
//!    └─────release────────┘          └─(lease expires)─▶ claimable again, with a greater fence
//! ```
//!
//! Stores that can join the handler's own transaction (Postgres) add `committed`: the handler's
//! business write has committed, so the key can no longer be released or reclaimed, only completed.
//!
//! Stores with tombstones (every store of the crate, `with_tombstones(horizon)`) keep a
//! completed key past its retention: its answer goes, and a compact tombstone (fingerprint,
//! status, when it completed) stays until `horizon` after its completion, so a late retry is
//! [`ClaimOutcome::AnswerExpired`] (never run again) and another request with the key still a
//! mismatch. Past the horizon the key is absent.
//!
//! # Rules every implementation follows
//!
//! - A claim is a single atomic step; two concurrent claims of one key never both acquire.
//! - Every write after a claim is conditional on the owner token: a stale owner (whose lease
//!   expired and was reclaimed) changes nothing and learns [`Ownership::Lost`]. The owner's
//!   leases hold whichever of its own claims wrote what the key holds now (its claim asked again
//!   after the lease ran out writes the record anew).
//! - An `in_flight` key whose lease has expired is treated exactly like an absent one.
//! - A grant is good for its lease counted from when its claim was sent. A caller that gets the
//!   answer late (the layer: a third of its lease or more) renews the lease, owner-checked,
//!   before any work runs under it, and runs nothing if the key is gone. Fences grow across the
//!   grants used so (a store may read a grant's fence a moment after its claim took the key).
//! - A key with a different fingerprint is a [`ClaimOutcome::Mismatch`] while it exists.
//! - Lease and retention times are measured on the store's clock, never the application's.
//!
//! [`conformance`](crate::conformance) checks all of this against any implementation.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use uuid::Uuid;

use crate::IdempotencyKey;
pub use crate::{
    fingerprint::Fingerprint,
    response::{DecodeError, StoredResponse},
};

mod cached;
mod diagnosis;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod tiered;

pub use cached::{
    CachedStore, Changes, DEFAULT_CACHE_BOUND, DEFAULT_CACHE_MAX_BYTES, DEFAULT_CACHE_MAX_ENTRIES,
    Watch, Watcher,
};
pub use diagnosis::{Diagnosis, Finding, NotReady, Severity};
pub use memory::{DEFAULT_MEMORY_MAX_BYTES, DEFAULT_MEMORY_MAX_ENTRIES, MemoryStore};
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_CLOCK_SKEW, DEFAULT_POSTGRES_BATCH, DEFAULT_POSTGRES_CONNECTIONS,
    DEFAULT_POSTGRES_TIMEOUT, DEFAULT_SWEEP_BATCH, DISTRIBUTE_ON_CITUS, FenceError, MIGRATOR,
    PARTITION_BY_HASH, PostgresStore, RecoveryPoint,
};
#[cfg(feature = "postgres")]
pub(crate) use postgres::{advance, commit, recovery_point, unit};
#[cfg(feature = "redis")]
pub use redis::{DEFAULT_REDIS_TIMEOUT, RedisStore, RedisWatcher};
pub use tiered::{DEFAULT_BREAKER_COOLDOWN, TieredStore};

/// A boxed future, as returned by [`Store`] methods (the trait stays object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A boxed error, as kept inside [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A backend for idempotency records.
///
/// Implementations must follow the rules in the [module docs](self); run
/// [`store_conformance_tests!`](crate::store_conformance_tests) in their tests to check.
pub trait Store: Send + Sync + 'static {
    /// Takes `request.record()` for `request.owner()`, or reports why not. A claim asked
    /// again by the owner that holds the key in flight is granted again, with the same fence
    /// or a later one that is still below every later claim's: the layer asks again when a
    /// claim's answer was lost on its way, and goes on with the second answer.
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>>;

    /// [`claim`](Self::claim), asked of a store that stands in front of an authority (the
    /// front of a [`TieredStore`]), which asks the authority whenever this answers anything
    /// but a replay. The fence granted here only names the claim's record (the handler gets the
    /// authority's), and the authority's tombstones are the ones that count, so this claim
    /// need not draw a fence that grows across claims, nor read tombstones; everything else is
    /// as `claim`: it grants a free key for the lease, answers a held key's record with what is
    /// left of its life, and grants a claim asked again by its owner. By default, `claim`; the
    /// Redis store claims with one `SET … NX GET` either way, and here even where it keeps
    /// tombstones.
    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        self.claim(request)
    }

    /// Extends the lease to `duration` from now, if `lease`'s owner still holds the key. Never
    /// waits on a lock the handler's own transaction holds: answers [`Ownership::Busy`] instead.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>>;

    /// Stores `response` for `retention` and moves the key to completed, if `lease`'s owner still
    /// holds it (in flight or committed).
    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>>;

    /// Deletes the key if `lease`'s owner still holds it in flight. A committed key is not
    /// released: the answer is [`Ownership::Committed`] and the caller completes it instead.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>>;

    /// What kind of store this is, for metrics labels: `memory`, `redis`, `postgres`, `tiered`.
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// How long after its completion the store keeps a key as a tombstone once its answer is
    /// gone ([`ClaimOutcome::AnswerExpired`] until then); zero when it keeps none (the default).
    fn tombstone_horizon(&self) -> Duration {
        Duration::ZERO
    }

    /// What the store holds for `record`, for an operator: `None` if nothing (or only an
    /// expired record). Stores that cannot tell answer [`StoreError::Unsupported`].
    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        let _ = record;
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "inspect",
            })
        })
    }

    /// Deletes whatever the store holds for `record`, whoever holds it, for an operator:
    /// whether there was something. Forgetting a key in flight lets a retry run the handler
    /// while the first attempt may still run; forgetting a completed key lets a retry run it
    /// again. Stores that cannot answer [`StoreError::Unsupported`].
    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        let _ = record;
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "forget",
            })
        })
    }

    /// Keys claimed at least `older_than` ago and still unfinished (in flight, or committed
    /// without a response), oldest first, at most `limit` of them, for an operator. Stores that
    /// cannot list them answer [`StoreError::Unsupported`].
    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        let _ = (older_than, limit);
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "stuck",
            })
        })
    }

    /// Completes a key whose handler committed and whose owner died before storing an answer
    /// ([`ClaimOutcome::Orphaned`]) with `response`, which the application rebuilt from its
    /// own records (see [`IdempotencyLayer::with_recovery`](crate::IdempotencyLayer::with_recovery)):
    /// whether it did, which it does only while the key is still orphaned and was claimed with
    /// `request`'s fingerprint. Stores that cannot answer [`StoreError::Unsupported`].
    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let _ = (request, response, retention);
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "adopt",
            })
        })
    }

    /// Keys whose lease ran out with work recorded (a recovery point in flight, or a fence
    /// committed without an answer) and still within their retention, longest lapsed first, at
    /// most `limit`: what the [completer](crate::completer) finishes. Stores that keep no such
    /// work (the memory store, Redis alone) answer [`StoreError::Unsupported`].
    fn abandoned<'a>(&'a self, limit: usize) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>> {
        let _ = limit;
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "abandoned",
            })
        })
    }

    /// Notes on `record` why the completer could not finish it, for an operator
    /// ([`RecordInfo::unfinished`]). Stores that cannot answer [`StoreError::Unsupported`].
    fn note_unfinished<'a>(
        &'a self,
        record: &'a RecordKey,
        why: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let _ = (record, why);
        Box::pin(async move {
            Err(StoreError::Unsupported {
                store: self.kind(),
                operation: "note_unfinished",
            })
        })
    }

    /// The same store with connections of its own, made on first use, for the calls the layer
    /// makes from a thread of its own (lease renewals): a connection made on the application's
    /// runtime is driven by that runtime, and stalls with it when its handlers block every
    /// worker. `None` (the default) for a store that does no I/O, or cannot: renewals then use
    /// the store itself.
    ///
    /// A store that wraps another (to count, trace or fault its calls) forwards this, wrapped
    /// again if its renewals must go through the wrapper too; left at `None`, renewals go
    /// through the wrapper and the inner store's connections, which the application's runtime
    /// drives.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        None
    }

    /// Checks the servers the store runs on for the settings that break its guarantees (an
    /// evicting Redis, Postgres migrations behind the crate's, …), for an operator or an app at
    /// start-up: a finding per check, never an error (a server that cannot be reached is a
    /// finding too). Stores without checks say so in a warning.
    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        Box::pin(async move { diagnosis::unchecked(self) })
    }
}

impl<S: Store + ?Sized> Store for Arc<S> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        (**self).claim(request)
    }

    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        (**self).claim_in_front(request)
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        (**self).renew(lease, duration)
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        (**self).complete(lease, response, retention)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        (**self).release(lease)
    }

    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn tombstone_horizon(&self) -> Duration {
        (**self).tombstone_horizon()
    }

    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        (**self).inspect(record)
    }

    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        (**self).forget(record)
    }

    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        (**self).stuck(older_than, limit)
    }

    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        (**self).adopt(request, response, retention)
    }

    fn abandoned<'a>(&'a self, limit: usize) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>> {
        (**self).abandoned(limit)
    }

    fn note_unfinished<'a>(
        &'a self,
        record: &'a RecordKey,
        why: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        (**self).note_unfinished(record, why)
    }

    fn detached(&self) -> Option<Arc<dyn Store>> {
        (**self).detached()
    }

    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        (**self).diagnose()
    }
}

/// What a store holds for one key, as an operator sees it ([`Store::inspect`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The key and its scope.
    pub record: RecordKey,
    /// Where the key stands.
    pub state: RecordState,
    /// The fence of the claim that holds (or completed) it, as the record keeps it. A Redis
    /// record claimed without a script keeps the fence that names it (the claiming machine's
    /// clock, in µs), not the one granted (the Redis server's clock a moment later).
    pub fence: u64,
    /// The owner token of that claim.
    pub owner: Uuid,
    /// Time left on the lease, while in flight or committed (zero once it lapsed).
    pub lease_left: Option<Duration>,
    /// Time since the claim, where the store knows it.
    pub age: Option<Duration>,
    /// Time left before the store forgets the key.
    pub expires_in: Duration,
    /// The status of the stored response, once there is one.
    pub status: Option<http::StatusCode>,
    /// Why the [completer](crate::completer) could not finish the key the last time it tried
    /// (stores that keep it: Postgres).
    pub unfinished: Option<String>,
}

/// A key the application's work on was abandoned: its lease lapsed with work recorded, and
/// no attempt holds it ([`Store::abandoned`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Abandoned {
    /// The key and its scope.
    pub record: RecordKey,
    /// The fingerprint of the request the key was claimed for.
    pub fingerprint: Fingerprint,
    /// [`InFlight`](RecordState::InFlight) with a recovery point, or
    /// [`Committed`](RecordState::Committed) without an answer.
    pub state: RecordState,
    /// The recovery point the last attempt recorded, if any.
    pub recovery_point: Option<String>,
    /// The request the key was claimed for, as the layer kept it (see
    /// [`IdempotencyLayer::with_kept_requests`](crate::IdempotencyLayer::with_kept_requests)),
    /// if it kept one.
    pub request: Option<bytes::Bytes>,
    /// How long ago the last lease ran out.
    pub lapsed: Duration,
}

/// Where a key stands in a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed; the handler runs (or its owner died and the lease has not run out yet).
    InFlight,
    /// The handler's business write committed through the fence; the response is not stored
    /// yet (unless the fence stored one with it).
    Committed,
    /// The response is stored; retries are replayed.
    Completed,
    /// The response is gone (past its retention); a tombstone keeps the key from running
    /// again until the store's horizon.
    AnswerExpired,
}

impl RecordState {
    /// `in_flight`, `committed`, `completed` or `answer_expired`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Committed => "committed",
            Self::Completed => "completed",
            Self::AnswerExpired => "answer_expired",
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The identity of a record: a key within a scope (tenant, account, subject).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey {
    scope: String,
    key: IdempotencyKey,
}

impl RecordKey {
    /// The record for `key` within `scope`.
    pub fn new(scope: impl Into<String>, key: IdempotencyKey) -> Self {
        Self {
            scope: scope.into(),
            key,
        }
    }

    /// The scope ("" when the layer has no scope function).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The idempotency key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }
}

impl fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RecordKey({self})")
    }
}

/// `scope #… key #…`: pseudonyms of both (SHA-256 prefixes), since this is what error messages
/// and logs print; [`scope`](RecordKey::scope) and [`key`](RecordKey::key) give them as they are.
impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pseudonym = |value| crate::telemetry::Pseudonym {
            value,
            clear: false,
        };
        write!(
            f,
            "scope {} key {}",
            pseudonym(&self.scope),
            pseudonym(self.key.as_str())
        )
    }
}

/// What a claim asks for.
#[derive(Debug)]
pub struct ClaimRequest {
    record: Arc<RecordKey>,
    fingerprint: Fingerprint,
    owner: Uuid,
    lease: Duration,
    /// The fence of the record the Redis store wrote when it last granted this claim (0: none),
    /// carried into the lease as its [`Receipt`].
    written: AtomicU64,
}

impl Clone for ClaimRequest {
    fn clone(&self) -> Self {
        Self {
            record: Arc::clone(&self.record),
            fingerprint: self.fingerprint,
            owner: self.owner,
            lease: self.lease,
            written: AtomicU64::new(self.written.load(Ordering::Relaxed)),
        }
    }
}

impl ClaimRequest {
    /// A claim of `record` by `owner` (a fresh random token per request attempt) for `lease`.
    pub fn new(record: RecordKey, fingerprint: Fingerprint, owner: Uuid, lease: Duration) -> Self {
        Self::shared(Arc::new(record), fingerprint, owner, lease)
    }

    /// A claim of a record already shared (with the request's future, which names it if the
    /// work fails).
    pub(crate) fn shared(
        record: Arc<RecordKey>,
        fingerprint: Fingerprint,
        owner: Uuid,
        lease: Duration,
    ) -> Self {
        Self {
            record,
            fingerprint,
            owner,
            lease,
            written: AtomicU64::new(0),
        }
    }

    /// The same claim by another owner: for an attempt that claims again.
    pub(crate) fn reowned(&self, owner: Uuid) -> Self {
        Self::shared(
            Arc::clone(&self.record),
            self.fingerprint,
            owner,
            self.lease,
        )
    }

    /// The record claimed.
    pub fn record(&self) -> &RecordKey {
        &self.record
    }

    /// The record claimed, shared: a store that keeps it keeps this one, not a copy.
    pub(crate) fn shared_record(&self) -> &Arc<RecordKey> {
        &self.record
    }

    /// The fingerprint of the request behind the claim.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// The claimant's owner token.
    pub fn owner(&self) -> Uuid {
        self.owner
    }

    /// How long the claim holds without renewal.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The lease this claim yields once acquired with `fence`.
    pub fn lease_with_fence(&self, fence: u64) -> Lease {
        let written = self.written.load(Ordering::Relaxed);
        Lease {
            record: Arc::clone(&self.record),
            owner: self.owner,
            fence,
            fingerprint: Some(self.fingerprint),
            written: (written != 0).then_some(written),
        }
    }

    /// Notes that the Redis store granted this claim by writing its record with `fence`: the
    /// leases made from it from now on carry it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn note_written(&self, fence: u64) {
        self.written.store(fence, Ordering::Relaxed);
    }
}

/// What the Redis store wrote when it granted a claim: the fingerprint and the fence of its
/// in-flight record (which, where it claimed without a script, names the record but is not the
/// lease's fence: that one is the server's clock, or behind [`TieredStore`] the authority's).
/// With the owner token they make the record's exact bytes, so a server that compares and sets
/// (`SET … IFEQ`) finalizes without a script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Receipt<'a> {
    pub(crate) fingerprint: &'a Fingerprint,
    pub(crate) fence: u64,
}

/// What an owner holds after a successful claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Shared with the claim it came from: handed around (to the handler, the keeper) without
    /// copying the scope and key.
    record: Arc<RecordKey>,
    owner: Uuid,
    fence: u64,
    /// The claim's, on a lease made from it.
    fingerprint: Option<Fingerprint>,
    /// The fence of the in-flight record the Redis store wrote, on the leases of claims it
    /// granted.
    written: Option<u64>,
}

impl AsRef<Lease> for Lease {
    fn as_ref(&self) -> &Lease {
        self
    }
}

impl Lease {
    /// The lease `owner` holds on `record`, granted with `fence`.
    ///
    /// A lease made here, rather than by [`ClaimRequest::lease_with_fence`], does not know the
    /// request's fingerprint, nor the exact record a Redis store wrote: that store finalizes it
    /// with its scripts, and a [`CachedStore`] does not keep its answer.
    pub fn new(record: RecordKey, owner: Uuid, fence: u64) -> Self {
        Self {
            record: Arc::new(record),
            owner,
            fence,
            fingerprint: None,
            written: None,
        }
    }

    /// The record held.
    pub fn record(&self) -> &RecordKey {
        &self.record
    }

    /// The record held, shared with the claim it came from.
    pub(crate) fn shared_record(&self) -> &Arc<RecordKey> {
        &self.record
    }

    /// The owner token every conditional write checks.
    pub fn owner(&self) -> Uuid {
        self.owner
    }

    /// The fence the claim was granted with: it grows with every claim and reclaim of the key.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// The fingerprint of the request the claim was made for, on a lease made from its claim
    /// ([`ClaimRequest::lease_with_fence`]).
    pub fn fingerprint(&self) -> Option<&Fingerprint> {
        self.fingerprint.as_ref()
    }

    /// What the Redis store wrote for this lease's claim, if it granted it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn receipt(&self) -> Option<Receipt<'_>> {
        Some(Receipt {
            fingerprint: self.fingerprint.as_ref()?,
            fence: self.written?,
        })
    }
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The claimant now owns the key: run the handler.
    Acquired {
        /// Greater than the fence of every earlier claim of this key the store remembers (of
        /// every grant used within its lease: see the [module's rules](self)).
        fence: u64,
    },
    /// Another owner holds a live lease (or has committed and not yet completed).
    InFlight {
        /// How long until the current lease runs out.
        retry_after: Duration,
    },
    /// The key completed with this fingerprint: replay its response.
    Completed {
        /// The stored response.
        response: StoredResponse,
        /// How long the store keeps the record from now (what is left of its retention).
        expires_in: Duration,
    },
    /// The key exists with a different fingerprint.
    Mismatch,
    /// The handler committed its business write, then its owner died before storing a response.
    /// The request must not run again, and there is no response to replay.
    Orphaned,
    /// The key completed with this fingerprint, and its answer is gone (past its retention):
    /// only a tombstone is left, until the store's horizon. The request must not run again, and
    /// there is no response to replay.
    AnswerExpired {
        /// The status the key completed with.
        status: http::StatusCode,
        /// How long ago it completed.
        completed_ago: Duration,
    },
}

/// Whether an owner-checked write applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ownership {
    /// The owner still held the key; the write applied.
    Held,
    /// The owner no longer holds the key (its lease was reclaimed, it expired, or the key is
    /// finished); nothing was written.
    Lost,
    /// Answer to a release: the owner's handler committed, so the key cannot be released.
    /// Complete it instead.
    Committed,
    /// Answer to a renewal: the owner still holds the key, but its record is locked by a
    /// transaction (the handler's own fence, typically), so nothing was written. The lock itself
    /// keeps the key from being reclaimed; renew again shortly.
    Busy,
}

/// A store operation failed. The layer answers 503 and never runs the handler on a failed claim.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed or could not be reached.
    #[error("{store} store failed")]
    Backend {
        /// Which store ("redis", "postgres", …).
        store: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// The backend did not answer in time.
    #[error("{store} store did not answer within {after:?}")]
    Timeout {
        /// Which store.
        store: &'static str,
        /// The bound that passed.
        after: Duration,
    },
    /// The store does not offer this operation (an operator's: inspect, forget, stuck).
    #[error("the {store} store does not support {operation}")]
    Unsupported {
        /// Which store.
        store: &'static str,
        /// The operation asked for.
        operation: &'static str,
    },
    /// A record could not be read back (corrupted, or written by an incompatible version).
    #[error("{store} store holds an unreadable record for {record}")]
    Corrupt {
        /// Which store.
        store: &'static str,
        /// The record involved.
        record: RecordKey,
        /// What is wrong with it.
        #[source]
        source: BoxError,
    },
}

impl StoreError {
    /// The backend `store` failed with `source`.
    pub(crate) fn backend(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            store,
            source: source.into(),
        }
    }

    /// `store` did not answer within `after`.
    pub(crate) fn timeout(store: &'static str, after: Duration) -> Self {
        Self::Timeout { store, after }
    }

    /// `store` holds an unreadable `record`: `source` says what is wrong with it.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn corrupt(
        store: &'static str,
        record: &RecordKey,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Corrupt {
            store,
            record: record.clone(),
            source: source.into(),
        }
    }
}

/// Runs a call to `store`'s backend within `timeout`: past it, [`StoreError::Timeout`]; the
/// call's own errors as `failed` says.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
pub(crate) async fn bounded<T, E>(
    store: &'static str,
    timeout: Duration,
    call: impl Future<Output = Result<T, E>>,
    failed: impl FnOnce(E) -> StoreError,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(failed),
        Err(_elapsed) => Err(StoreError::timeout(store, timeout)),
    }
}
