//! A conformance suite for [`Store`] implementations.
//!
//! Every store in this crate runs it, and so should yours: one line in your tests generates a
//! `#[tokio::test]` per case, each against a fresh store from your expression.
//!
//! ```no_run
//! # use tower_idempotency::MemoryStore as MyStore;
//! // In tests/my_store.rs: one #[tokio::test] per case, each on a store from the expression.
//! tower_idempotency::store_conformance_tests!(async { MyStore::new() });
//! ```
//!
//! The suite is in parts, one per thing a store may offer; a store runs the parts of what it
//! offers, and the parts it ran are what was checked:
//!
//! | part | macro | cases | checks |
//! |---|---|---|---|
//! | [`FOUR_OPERATIONS`] | [`store_conformance_tests!`](crate::store_conformance_tests) | [`cases`] | claim, renew, complete, release: every store |
//! | [`ADMIN`] | [`store_admin_conformance_tests!`](crate::store_admin_conformance_tests) | [`admin_cases`] | an operator's paths ([`Admin`](crate::store::Admin), in [`Store::offers`]) |
//! | [`TOMBSTONES`] | [`store_tombstone_conformance_tests!`](crate::store_tombstone_conformance_tests) | [`tombstone_cases`] | a key past its retention refused until the horizon (and, through [`Admin`](crate::store::Admin), seen and forgotten) |
//!
//! The completer's paths ([`Recovery`](crate::store::Recovery)) have no part yet: the Postgres
//! store's own tests check them.
//!
//! Each case works under a scope of its own (a random UUID), so cases can share one backend and
//! run in parallel. Some cases wait for leases and retention to expire: with the short times they
//! use, the whole suite takes a few seconds. A case panics with a message naming the rule broken.
//!
//! Needs the `conformance` feature and `tokio` with the `macros` and `rt-multi-thread` features.

mod cases;

use std::time::Duration;

use uuid::Uuid;

pub use self::cases::*;

use crate::{
    IdempotencyKey,
    fingerprint::Fingerprint,
    store::{BoxFuture, ClaimRequest, RecordKey, Store},
};

/// Generates one `#[tokio::test]` per case of the four operations, each calling `$make.await`
/// for its store: what every store must pass. The same cases for a harness of your own:
/// [`cases`].
///
/// A store that offers an operator's paths ([`Store::offers`]) runs
/// [`store_admin_conformance_tests!`](crate::store_admin_conformance_tests) too, and one that keeps tombstones
/// [`store_tombstone_conformance_tests!`](crate::store_tombstone_conformance_tests).
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@plain @cases $make;);
    };
    // The lists of cases, each written once: for the tests here and for `cases`.
    (@plain $($then:tt)*) => {
        $crate::store_conformance_tests! { $($then)*
            fresh_key_is_acquired,
            live_claim_is_in_flight,
            a_claim_asked_again_by_its_owner_is_its_own,
            an_owner_asking_again_after_its_lease_ran_out_holds_the_key_anew,
            other_fingerprint_mismatches_in_flight,
            completed_key_replays_its_response,
            other_fingerprint_mismatches_completed,
            response_without_body_replays_as_such,
            released_key_is_claimable_with_greater_fence,
            expired_lease_is_reclaimable_with_greater_fence,
            renewal_keeps_the_lease,
            held_renewals_keep_every_claimant_out,
            stale_owner_changes_nothing,
            strangers_change_nothing,
            finished_key_cannot_be_finalized_again,
            retention_expiry_frees_the_key,
            scopes_are_independent,
            concurrent_claims_have_one_winner,
        }
    };
    (@admin $($then:tt)*) => {
        $crate::store_conformance_tests! { $($then)*
            an_operator_can_inspect_list_and_forget_keys,
            a_diagnosis_names_the_store,
        }
    };
    (@tombstone $($then:tt)*) => {
        $crate::store_conformance_tests! { $($then)*
            a_key_past_its_retention_is_refused_until_the_horizon,
            an_operator_sees_and_forgets_a_tombstone,
        }
    };
    (@cases $make:expr; $($case:ident,)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let store = $make.await;
                $crate::conformance::$case(&store).await;
            }
        )*
    };
    (@list $capability:expr; $($case:ident,)*) => {
        ::std::vec![$(
            $crate::conformance::Case {
                name: ::std::stringify!($case),
                capability: $capability,
                run: |store| ::std::boxed::Box::pin($crate::conformance::$case(store)),
            },
        )*]
    };
}

/// Generates one `#[tokio::test]` per case of an operator's paths ([`Admin`](crate::store::Admin): inspect,
/// forget, stuck, diagnose), each calling `$make.await` for a store that offers them
/// ([`Store::offers`]); a store that offers none fails them, saying so. The same cases for a
/// harness of your own: [`admin_cases`].
///
/// ```no_run
/// use tower_idempotency::MemoryStore;
///
/// tower_idempotency::store_admin_conformance_tests!(async { MemoryStore::new() });
/// ```
#[macro_export]
macro_rules! store_admin_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@admin @cases $make;);
    };
}

/// Generates one `#[tokio::test]` per tombstone case, each calling `$make.await` for a store
/// built with tombstones kept for [`TOMBSTONE_HORIZON`] (`with_tombstones`) that offers an
/// operator's paths ([`Store::offers`]). Such a store answers a key past its retention
/// differently from the plain suite's `retention_expiry_frees_the_key`, so build the plain
/// suite's stores without them. The same cases for a harness of your own:
/// [`tombstone_cases`].
///
/// ```no_run
/// use tower_idempotency::{MemoryStore, conformance::TOMBSTONE_HORIZON};
///
/// tower_idempotency::store_tombstone_conformance_tests!(async {
///     MemoryStore::new().with_tombstones(TOMBSTONE_HORIZON)
/// });
/// ```
#[macro_export]
macro_rules! store_tombstone_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@tombstone @cases $make;);
    };
}

/// One case of the suite, for a harness of your own: its name, and the check to run on a
/// fresh store.
pub struct Case<S> {
    /// The case's name, as [`store_conformance_tests!`](crate::store_conformance_tests) names its test.
    pub name: &'static str,
    /// What it checks: [`FOUR_OPERATIONS`], [`ADMIN`] or [`TOMBSTONES`].
    pub capability: &'static str,
    /// Runs the case on `store`; panics with the rule broken.
    pub run: for<'a> fn(&'a S) -> BoxFuture<'a, ()>,
}

impl<S> std::fmt::Debug for Case<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("capability", &self.capability)
            .finish()
    }
}

/// The cases [`store_conformance_tests!`](crate::store_conformance_tests) generates tests for, for a harness of your own
/// (such as `libtest-mimic`): run each on a fresh store.
///
/// ```
/// use tower_idempotency::{MemoryStore, conformance};
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// for case in conformance::cases::<MemoryStore>() {
///     if case.name == "fresh_key_is_acquired" {
///         (case.run)(&MemoryStore::new()).await;
///     }
/// }
/// # });
/// ```
pub fn cases<S: Store>() -> Vec<Case<S>> {
    crate::store_conformance_tests!(@plain @list FOUR_OPERATIONS;)
}

/// The cases [`store_admin_conformance_tests!`](crate::store_admin_conformance_tests) generates tests for, for a harness of your
/// own: run each on a fresh store that offers an operator's paths ([`Store::offers`]).
pub fn admin_cases<S: Store>() -> Vec<Case<S>> {
    crate::store_conformance_tests!(@admin @list ADMIN;)
}

/// The cases [`store_tombstone_conformance_tests!`](crate::store_tombstone_conformance_tests) generates tests for, for a harness of your
/// own: run each on a fresh store that keeps tombstones for [`TOMBSTONE_HORIZON`].
pub fn tombstone_cases<S: Store>() -> Vec<Case<S>> {
    crate::store_conformance_tests!(@tombstone @list TOMBSTONES;)
}

/// What [`cases`] check: the four operations every store implements.
pub const FOUR_OPERATIONS: &str = "four operations";
/// What [`admin_cases`] check: an operator's paths ([`Admin`](crate::store::Admin)).
pub const ADMIN: &str = "admin";
/// What [`tombstone_cases`] check: a store's tombstones.
pub const TOMBSTONES: &str = "tombstones";

/// The horizon the tombstone cases expect their store to keep tombstones for.
pub const TOMBSTONE_HORIZON: Duration = Duration::from_millis(1500);

/// The lease used by cases that do not wait for it to expire.
const LONG: Duration = Duration::from_secs(30);
/// The lease (or retention) used by cases that wait for it to expire.
const SHORT: Duration = Duration::from_millis(300);
/// Comfortably past [`SHORT`], for clocks that tick coarsely.
const PAST_SHORT: Duration = Duration::from_millis(700);

/// A fresh record under a scope of its own.
fn record() -> RecordKey {
    RecordKey::new(
        format!("conformance-{}", Uuid::new_v4()),
        IdempotencyKey::try_from("key-1").unwrap(),
    )
}

fn fingerprint(body: &str) -> Fingerprint {
    let parts = http::Request::post("/payments")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    Fingerprint::of_request(&parts, &[], body.as_bytes())
}

fn request(record: &RecordKey, body: &str, lease: Duration) -> ClaimRequest {
    ClaimRequest::new(record.clone(), fingerprint(body), Uuid::new_v4(), lease)
}

/// A claim of `key` in `scope` by a fresh owner, for a `POST /payments` with `body`: the claim a
/// store's own tests make, as the cases here do.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{MemoryStore, conformance::claim_request, store::{ClaimOutcome, Store}};
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let claim = claim_request("tenant-1", "order-42", "{}", Duration::from_secs(30));
/// assert!(matches!(store.claim(&claim).await, Ok(ClaimOutcome::Acquired { .. })));
/// # });
/// ```
pub fn claim_request(scope: &str, key: &str, body: &str, lease: Duration) -> ClaimRequest {
    let key = IdempotencyKey::try_from(key).expect("a valid idempotency key");
    request(&RecordKey::new(scope, key), body, lease)
}
