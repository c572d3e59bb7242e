//! What a claim asks for and what it gets: the record, the claim, the lease an owner holds,
//! and the answers of a claim and of an owner-checked write.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use uuid::Uuid;

use crate::{IdempotencyKey, fingerprint::Fingerprint, response::StoredResponse};

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
/// lease's fence: that one is the server's clock, or behind [`TieredStore`](super::TieredStore) the authority's).
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
    /// with its scripts, and a [`CachedStore`](super::CachedStore) does not keep its answer.
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
        /// every grant used within its lease: see the [module's rules](super)).
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
