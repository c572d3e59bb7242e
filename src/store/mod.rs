//! The store contract: where claims, leases and stored responses live.
//!
//! The layer talks to a store through four owner-checked operations, the [`Store`] trait:
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
//!
//! # What a store may offer besides
//!
//! | trait | offered by | for |
//! |---|---|---|
//! | [`Admin`], in [`Store::offers`] | every store of the crate | an operator: [`inspect`](Admin::inspect), [`forget`](Admin::forget), [`stuck`](Admin::stuck), [`diagnose`](Admin::diagnose) |
//! | [`Recovery`], in [`Store::offers`] | Postgres, alone or behind Redis | the [completer](crate::completer) and the [recovery hook](crate::IdempotencyLayer::with_recovery) |
//! | [`Wakes`], in [`Store::offers`] | Redis, Postgres, and Redis in front of Postgres | waking the duplicates that wait for a key held elsewhere in the fleet |
//! | [`Front`] | Redis, the memory store, [`CachedStore`] of a front | standing in front of an authority in a [`TieredStore`] |
//!
//! A store that wraps another names it ([`Store::wrapped`]) and implements only what it
//! changes: the rest is the wrapped store's.

mod cached;
mod claim;
mod contract;
mod diagnosis;
mod error;
mod memory;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod tiered;
mod views;
mod wake;

pub use self::{
    cached::{
        CachedStore, Changes, DEFAULT_CACHE_BOUND, DEFAULT_CACHE_MAX_BYTES,
        DEFAULT_CACHE_MAX_ENTRIES, Watch, Watcher,
    },
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    contract::{Admin, BoxError, BoxFuture, Front, Offers, Recovery, Store, Wakes},
    diagnosis::{Diagnosis, Finding, NotReady, Severity},
    error::StoreError,
    memory::{DEFAULT_MEMORY_MAX_BYTES, DEFAULT_MEMORY_MAX_ENTRIES, MemoryStore},
    tiered::{DEFAULT_BREAKER_COOLDOWN, TieredStore},
    views::{Abandoned, RecordInfo, RecordState},
    wake::{Marked, Wake},
};
pub use crate::{
    fingerprint::Fingerprint,
    response::{DecodeError, StoredResponse},
};
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_CLOCK_SKEW, DEFAULT_POSTGRES_BATCH, DEFAULT_POSTGRES_CONNECTIONS,
    DEFAULT_POSTGRES_TIMEOUT, DEFAULT_SWEEP_BATCH, DISTRIBUTE_ON_CITUS, FenceError, MIGRATOR,
    PARTITION_BY_HASH, PostgresStore, RecoveryPoint,
};
#[cfg(feature = "redis")]
pub use redis::{DEFAULT_REDIS_TIMEOUT, RedisStore, RedisWatcher};
