//! The contract every store keeps with the layer: the four owner-checked operations and what
//! the layer needs to know of a store ([`Store`]); what a store may offer besides, to an
//! operator ([`Admin`]), to the completer ([`Recovery`]) and to the duplicates that wait for a
//! key ([`Wakes`]); and the claim of a store that stands in front of another ([`Front`]).

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    diagnosis::{Diagnosis, Severity},
    error::StoreError,
    views::{Abandoned, RecordInfo},
    wake::{Marked, Wake},
};
use crate::response::StoredResponse;

/// A boxed future, as returned by [`Store`] methods (the trait stays object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A boxed error, as kept inside [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A backend for idempotency records: the four operations the layer runs every guarded
/// request through.
///
/// A store implements [`claim`](Self::claim), [`renew`](Self::renew),
/// [`complete`](Self::complete) and [`release`](Self::release), following the rules in the
/// [module docs](super); [`store_conformance_tests!`](crate::store_conformance_tests) checks
/// them. That is a working layer. The other methods have defaults:
///
/// - what the layer needs to know of the store: its [`kind`](Self::kind) (metrics labels), its
///   [`tombstone_horizon`](Self::tombstone_horizon), and its [`detached`](Self::detached) twin
///   for lease renewals;
/// - [`offers`](Self::offers): what else the store offers, each a trait of its own: an
///   operator's paths ([`Admin`]), the completer's ([`Recovery`]), waking the duplicates that
///   wait for a key ([`Wakes`]);
/// - [`wrapped`](Self::wrapped): for a store that wraps another (a cache, a fault injector, a
///   counter), the store it wraps, whose answers to the methods above are this one's unless it
///   overrides them. A wrapper implements the four operations and `wrapped`, and nothing else
///   it does not change.
pub trait Store: Send + Sync + 'static {
    /// Takes `request.record()` for `request.owner()`, or reports why not. A claim asked
    /// again by the owner that holds the key in flight is granted again, with the same fence
    /// or a later one that is still below every later claim's: the layer asks again when a
    /// claim's answer was lost on its way, and goes on with the second answer.
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>>;

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
    /// By default the wrapped store's, or `custom`.
    fn kind(&self) -> &'static str {
        self.wrapped().map_or("custom", |inner| inner.kind())
    }

    /// How long after its completion the store keeps a key as a tombstone once its answer is
    /// gone ([`ClaimOutcome::AnswerExpired`] until then). By default the wrapped store's, or
    /// zero: none.
    fn tombstone_horizon(&self) -> Duration {
        self.wrapped()
            .map_or(Duration::ZERO, |inner| inner.tombstone_horizon())
    }

    /// The same store with connections of its own, made on first use, for the calls the layer
    /// makes from a thread of its own (lease renewals): a connection made on the application's
    /// runtime is driven by that runtime, and stalls with it when its handlers block every
    /// worker. `None` for a store that does no I/O, or cannot: renewals then use the store
    /// itself.
    ///
    /// By default the wrapped store's: a wrapper's renewals go to the store it wraps, on that
    /// store's detached connections. A wrapper whose renewals must go through it (it counts
    /// or faults them) answers `None`, or a detached twin of its own.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        self.wrapped()?.detached()
    }

    /// What the store offers besides the four operations: an operator's paths ([`Admin`]:
    /// inspect, forget, list what is stuck, diagnose its servers), the completer's
    /// ([`Recovery`]), and waking waiters ([`Wakes`]). By default the wrapped store's, or
    /// nothing: a store of the four operations alone.
    fn offers(&self) -> Offers<'_> {
        self.wrapped()
            .map(|inner| inner.offers())
            .unwrap_or_default()
    }

    /// The store this one wraps, for a store that adds to another without changing what it
    /// keeps: its kind, tombstones, detached twin and [`offers`](Self::offers) are then the
    /// wrapped store's unless this one overrides them. `None` (the default) for a store of its
    /// own, and for one that combines several ([`TieredStore`](super::TieredStore)).
    ///
    /// A wrapper that changes what the keys are (a prefix on every scope, say) overrides
    /// [`offers`](Self::offers) too: the wrapped store's operators would see its records.
    fn wrapped(&self) -> Option<&dyn Store> {
        None
    }
}

/// A shared store is the store: every method goes to it.
impl<S: Store + ?Sized> Store for Arc<S> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        (**self).claim(request)
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

    fn detached(&self) -> Option<Arc<dyn Store>> {
        (**self).detached()
    }

    fn offers(&self) -> Offers<'_> {
        (**self).offers()
    }

    fn wrapped(&self) -> Option<&dyn Store> {
        (**self).wrapped()
    }
}

/// What a store offers besides the four operations ([`Store::offers`]): each capability a trait
/// of its own, `None` where the store does not offer it.
///
/// ```
/// use tower_idempotency::{MemoryStore, store::Store};
///
/// let store = MemoryStore::new();
/// assert!(store.offers().admin.is_some()); // inspect, forget, stuck, diagnose
/// assert!(store.offers().recovery.is_none()); // nothing outlives its owner in memory
/// ```
#[derive(Clone, Copy, Default)]
#[non_exhaustive]
pub struct Offers<'a> {
    /// An operator's paths: one key inspected or forgotten, the keys stuck, the servers'
    /// checks. Every store of the crate offers them.
    pub admin: Option<&'a dyn Admin>,
    /// The completer's paths, where the store keeps work that outlives its owner: Postgres,
    /// alone or behind Redis.
    pub recovery: Option<&'a dyn Recovery>,
    /// Waking the duplicates that wait for a key, wherever in the fleet they are: Redis
    /// (pub/sub) and Postgres (`LISTEN`/`NOTIFY`). Without it a duplicate on another instance
    /// polls the store.
    pub wakes: Option<&'a dyn Wakes>,
}

impl<'a> Offers<'a> {
    /// Nothing: a store of the four operations alone.
    pub fn none() -> Self {
        Self::default()
    }

    /// With an operator's paths.
    #[must_use]
    pub fn with_admin(mut self, admin: &'a dyn Admin) -> Self {
        self.admin = Some(admin);
        self
    }

    /// With the completer's paths.
    #[must_use]
    pub fn with_recovery(mut self, recovery: &'a dyn Recovery) -> Self {
        self.recovery = Some(recovery);
        self
    }

    /// With waking waiters.
    #[must_use]
    pub fn with_wakes(mut self, wakes: &'a dyn Wakes) -> Self {
        self.wakes = Some(wakes);
        self
    }
}

impl std::fmt::Debug for Offers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offers")
            .field("admin", &self.admin.is_some())
            .field("recovery", &self.recovery.is_some())
            .field("wakes", &self.wakes.is_some())
            .finish()
    }
}

/// A store that can stand in front of an authority, as the front of a
/// [`TieredStore`](super::TieredStore): it claims in a way that the authority then confirms.
///
/// The tiered store asks the authority whenever the front answers anything but a replay, so
/// the fence the front grants only names its record (the handler gets the authority's), and
/// the authority's tombstones are the ones that count: [`claim_in_front`](Self::claim_in_front)
/// need not draw a fence that grows across claims, nor read tombstones. Everything else is as
/// [`Store::claim`]: it grants a free key for the lease, answers a held key's record with what
/// is left of its life, and grants a claim asked again by its owner.
///
/// By default the store's own claim: `impl Front for MyStore {}` makes any store a front. The
/// Redis store claims with one `SET … NX GET` there (no script), tombstones or not.
pub trait Front: Store {
    /// [`Store::claim`], as a front asks it.
    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        self.claim(request)
    }
}

/// A store known only as a `dyn Store` (a [detached](Store::detached) twin, say) stands in
/// front with its own claim.
impl Front for dyn Store {}

impl<S: Front + ?Sized> Front for Arc<S> {
    fn claim_in_front<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        (**self).claim_in_front(request)
    }
}

/// What a store offers an operator: one key inspected or forgotten, the keys stuck in flight,
/// and a check of the servers it runs on. Offered ([`Store::offers`]) by every store of the
/// crate; the [`admin` example] and [`Diagnosis::of_store`] use it.
///
/// [`admin` example]: https://github.com/tower-idempotency/tower-idempotency/blob/main/examples/admin.rs
pub trait Admin: Send + Sync {
    /// What the store holds for `record`: `None` if nothing (or only an expired record).
    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>>;

    /// Deletes whatever the store holds for `record`, whoever holds it: whether there was
    /// something. Forgetting a key in flight lets a retry run the handler while the first
    /// attempt may still run; forgetting a completed key lets a retry run it again.
    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Keys claimed at least `older_than` ago and still unfinished (in flight, or committed
    /// without a response), oldest first, at most `limit` of them.
    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>>;

    /// Checks the servers the store runs on for the settings that break its guarantees (an
    /// evicting Redis, Postgres migrations behind the crate's, …), for an operator or an app at
    /// start-up: a finding per check, never an error (a server that cannot be reached is a
    /// finding too).
    fn diagnose(&self) -> BoxFuture<'_, Diagnosis>;
}

/// What a store offers the [completer](crate::completer) and the layer's
/// [recovery hook](crate::IdempotencyLayer::with_recovery): the keys abandoned mid-way, a
/// recovered answer stored for a key committed without one, and a note for the operator on
/// a key the completer could not finish. Offered ([`Store::offers`]) where the store keeps work
/// that outlives its owner (recovery points, a fence committed without an answer): Postgres,
/// alone or behind Redis.
pub trait Recovery: Send + Sync {
    /// Keys whose lease ran out with work recorded (a recovery point in flight, or a fence
    /// committed without an answer) and still within their retention, longest lapsed first, at
    /// most `limit`: what the completer finishes.
    fn abandoned<'a>(&'a self, limit: usize) -> BoxFuture<'a, Result<Vec<Abandoned>, StoreError>>;

    /// Completes a key whose handler committed and whose owner died before storing an answer
    /// ([`ClaimOutcome::Orphaned`]) with `response`, which the
    /// application rebuilt from its own records: whether it did, which it does only while the
    /// key is still orphaned and was claimed with `request`'s fingerprint.
    fn adopt<'a>(
        &'a self,
        request: &'a ClaimRequest,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Notes on `record` why the completer could not finish it, for an operator
    /// ([`RecordInfo::unfinished`]).
    fn note_unfinished<'a>(
        &'a self,
        record: &'a RecordKey,
        why: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
}

/// What a store offers the duplicates that wait for a key held elsewhere in the fleet: word of
/// the key's end, the moment its owner completes or releases it, so that a waiter claims again
/// then rather than polling. Offered ([`Store::offers`]) by Redis and Postgres.
///
/// A waiter [`listen`](Self::listen)s, then [`mark`](Self::mark)s the key's record as waited for;
/// a completion or release of a marked record tells every process that listens, and one of an
/// unmarked record tells nobody (it costs nothing more). Word may be lost (a connection
/// dropped, a failover) or come late: the layer still polls, at a slow period, and claims again
/// when the holder's lease ends.
pub trait Wakes: Send + Sync {
    /// Listens for the end of `record`, for this process: one subscription per process and key,
    /// shared by every waiter of the process, on one connection of the store's own. The
    /// [`Wake`] once the store listens; `Err` where it cannot (the waiter then polls).
    fn listen<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Wake, StoreError>>;

    /// Marks `record` as waited for, if it is held: its owner's completion or release then
    /// tells the listeners. Idempotent; a key taken over since is marked anew.
    fn mark<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<Marked, StoreError>>;
}

impl dyn Store {
    /// What the store offers an operator, or why `operation` cannot be done on it.
    pub(crate) fn admin_for(&self, operation: &'static str) -> Result<&dyn Admin, StoreError> {
        self.offers().admin.ok_or(StoreError::Unsupported {
            store: self.kind(),
            operation,
        })
    }

    /// What the store offers the duplicates that wait, if anything.
    pub(crate) fn wakes(&self) -> Option<&dyn Wakes> {
        self.offers().wakes
    }

    /// What the store offers the completer, or why `operation` cannot be done on it.
    pub(crate) fn recovery_for(
        &self,
        operation: &'static str,
    ) -> Result<&dyn Recovery, StoreError> {
        self.offers().recovery.ok_or(StoreError::Unsupported {
            store: self.kind(),
            operation,
        })
    }
}

impl Diagnosis {
    /// What `store` says of its servers ([`Admin::diagnose`]), or, for a store that offers no
    /// [`Admin`], a warning that it has no checks of its own: the start-up check of an
    /// application that holds its store as a `dyn Store`.
    pub async fn of_store(store: &(impl Store + ?Sized)) -> Diagnosis {
        match store.offers().admin {
            Some(admin) => admin.diagnose().await,
            None => {
                let mut diagnosis = Diagnosis::default();
                let message = "this store has no checks of its own: diagnose its servers by \
                               their own means";
                diagnosis.push(Severity::Warning, store.kind(), "checks", message);
                diagnosis
            }
        }
    }
}
