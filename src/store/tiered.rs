//! A fast store in front of an authoritative one: Redis in front of Postgres.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{
    claim::{ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey},
    contract::{Admin, BoxFuture, Front, Offers, Store},
    diagnosis::{Diagnosis, Severity},
    error::StoreError,
    views::RecordInfo,
};
use crate::response::StoredResponse;

/// A fast first line (`front`, typically [`RedisStore`](crate::store::RedisStore)) in front of
/// the source of truth (`authority`, typically [`PostgresStore`](crate::store::PostgresStore)),
/// with one owner token across both.
///
/// - **Claim**: the front answers replays at once (one round trip, a
///   [`claim_in_front`](Front::claim_in_front): on Redis 7.0 and newer one `SET … NX GET`, no
///   script); when it acquires, says the
///   key is in flight or finds another request's record (a mismatch), the authority is asked,
///   and its answer stands (so a claim that reached a frozen Redis late never hides a key the
///   authority completed, and a stale record never turns a request away). A key
///   the authority has completed but the front had lost is written back to the front and
///   replayed. Whatever the authority refuses, or fails on, releases the front's claim.
/// - **Finalize**: the authority first, then the front. The fence handed to the handler is the
///   authority's.
/// - **The front failing** (an error, or its timeout) costs that one call: the request goes on
///   through the authority alone, and a breaker skips the front for a cooldown (5 s by default)
///   so a dead Redis costs no timeout per request. After the cooldown one call probes it; the
///   first success closes the breaker.
/// - **The authority failing** is an error: the layer answers 503 and the handler never runs;
///   but a key the front holds completed is replayed, breaker or not.
///
/// Correctness rests on the authority alone: the front may lose every record (flush, eviction,
/// restart, failover) and only the load on the authority rises. A stale claim the front keeps
/// (one that arrived after its owner finished) costs the authority a read per retry until its
/// lease runs out; it never changes an answer.
#[derive(Debug)]
pub struct TieredStore<F, A> {
    front: F,
    authority: A,
    breaker: Breaker,
}

/// How long the front is skipped after it fails, by default.
pub const DEFAULT_BREAKER_COOLDOWN: Duration = Duration::from_secs(5);

impl<F: Front, A: Store> TieredStore<F, A> {
    /// `front` in front of `authority`.
    ///
    /// ```no_run
    /// use tower_idempotency::{
    ///     IdempotencyLayer,
    ///     sqlx::PgPool,
    ///     store::{PostgresStore, RedisStore, TieredStore},
    /// };
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPool::connect("postgres://127.0.0.1/app").await?;
    /// let store = TieredStore::new(
    ///     RedisStore::open("redis://127.0.0.1:6379/")?,
    ///     PostgresStore::new(pool),
    /// );
    /// let layer = IdempotencyLayer::new(store);
    /// # Ok(()) }
    /// ```
    pub fn new(front: F, authority: A) -> Self {
        crate::telemetry::register_tiered_metrics();
        Self {
            front,
            authority,
            breaker: Breaker::new(DEFAULT_BREAKER_COOLDOWN),
        }
    }

    /// How long the front is skipped after a failure before it is tried again.
    pub fn with_breaker_cooldown(mut self, cooldown: Duration) -> Self {
        self.breaker = Breaker::new(cooldown);
        self
    }

    /// The front store.
    pub fn front(&self) -> &F {
        &self.front
    }

    /// The authoritative store.
    pub fn authority(&self) -> &A {
        &self.authority
    }

    /// Whether the breaker currently skips the front.
    pub fn front_skipped(&self) -> bool {
        self.breaker.is_open()
    }

    /// Runs a call on the front unless the breaker skips it; `None` when skipped or failed.
    async fn on_front<T>(
        &self,
        what: &'static str,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        if !self.breaker.allows() {
            crate::telemetry::front_fallback(what);
            return None;
        }
        self.front_result(what, call.await)
    }

    /// Reads the result of a front call, opening the breaker on a failure; `None` when failed.
    fn front_result<T>(&self, what: &'static str, result: Result<T, StoreError>) -> Option<T> {
        match result {
            Ok(value) => {
                self.breaker.succeeded();
                Some(value)
            }
            // One unreadable record says nothing about the front's health.
            Err(error @ StoreError::Corrupt { .. }) => {
                crate::telemetry::front_fallback(what);
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "front store {what} failed; using the authority"
                );
                None
            }
            Err(error) => {
                crate::telemetry::front_fallback(what);
                if self.breaker.failed() {
                    crate::telemetry::breaker(true);
                    tracing::warn!(error = &error as &dyn std::error::Error, cooldown = ?self.breaker.cooldown, "front store {what} failed; skipping it for the cooldown");
                }
                None
            }
        }
    }

    /// With the authority failing, asks the front even though the breaker skips it: a
    /// completed key is still replayed. Anything else keeps the authority's error, and a claim
    /// the front grants is given back.
    async fn last_resort(
        &self,
        request: &ClaimRequest,
        failed: Result<ClaimOutcome, StoreError>,
    ) -> Result<ClaimOutcome, StoreError> {
        match self.front.claim_in_front(request).await {
            Ok(replay @ ClaimOutcome::Completed { .. }) => {
                self.breaker.succeeded();
                Ok(replay)
            }
            Ok(ClaimOutcome::Acquired { fence }) => {
                let _ = self.front.release(&request.lease_with_fence(fence)).await;
                failed
            }
            _ => failed,
        }
    }
}

impl<F: Front, A: Store> Store for TieredStore<F, A> {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            let front_allowed = self.breaker.allows();
            let front_lease = if front_allowed {
                match self.front_result("claim", self.front.claim_in_front(request).await) {
                    Some(ClaimOutcome::Acquired { fence }) => Some(request.lease_with_fence(fence)),
                    // A final answer the front holds: replays cost one round trip.
                    Some(answer @ ClaimOutcome::Completed { .. }) => return Ok(answer),
                    // "In flight" and "mismatch" are confirmed with the authority: the front may
                    // hold a claim that arrived late (a frozen Redis running a queued script) for
                    // a key the authority has completed, or a stale record (its release failed)
                    // of another request for a key the authority does not have.
                    Some(_) | None => None,
                }
            } else {
                crate::telemetry::front_fallback("claim");
                None
            };
            let outcome = self.authority.claim(request).await;
            if let Some(front_lease) = front_lease {
                match &outcome {
                    Ok(ClaimOutcome::Acquired { .. }) => {}
                    // The front had lost this record: put it back, so the next retry is one
                    // round trip again.
                    Ok(ClaimOutcome::Completed {
                        response,
                        expires_in,
                    }) => {
                        self.on_front(
                            "write-back",
                            self.front.complete(&front_lease, response, *expires_in),
                        )
                        .await;
                    }
                    Ok(_) | Err(_) => {
                        self.on_front("release", self.front.release(&front_lease))
                            .await;
                    }
                }
            } else if outcome.is_err() && !front_allowed {
                // The authority is down and the front was skipped: it may still replay a
                // completed key, whatever the breaker says.
                return self.last_resort(request, outcome).await;
            }
            outcome
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let (ownership, _) = tokio::join!(
                self.authority.renew(lease, duration),
                self.on_front("renew", self.front.renew(lease, duration)),
            );
            ownership
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let ownership = self.authority.complete(lease, response, retention).await?;
            match ownership {
                Ownership::Held => {
                    self.on_front("complete", self.front.complete(lease, response, retention))
                        .await;
                }
                // A stale owner: free the front of its claim, if it still has one.
                _ => {
                    self.on_front("release", self.front.release(lease)).await;
                }
            }
            Ok(ownership)
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move {
            let ownership = self.authority.release(lease).await?;
            // Committed: the caller completes the key next, which writes the front.
            if ownership != Ownership::Committed {
                self.on_front("release", self.front.release(lease)).await;
            }
            Ok(ownership)
        })
    }

    fn kind(&self) -> &'static str {
        "tiered"
    }

    /// The authority's: the front keeps no tombstones of its own, and a claim the front lets
    /// through is answered by the authority.
    fn tombstone_horizon(&self) -> Duration {
        self.authority.tombstone_horizon()
    }

    /// Both tiers detached, when both can be (Redis and Postgres can); otherwise the store
    /// itself.
    fn detached(&self) -> Option<Arc<dyn Store>> {
        let (front, authority) = (self.front.detached()?, self.authority.detached()?);
        Some(Arc::new(TieredStore::new(front, authority)))
    }

    /// An operator's paths where the authority offers them (the truth is the authority's,
    /// and a key is forgotten in both tiers); the authority's recovery, which knows what was
    /// committed and abandoned; and the front's word of a key's end, where it gives it.
    ///
    /// The front's word rather than the authority's: a key's completion writes the front right
    /// after the authority, so its word comes a round trip after the answer exists, and the
    /// waiter it wakes is answered by the front in one; marking a key and telling of its end
    /// cost the front a command each, where telling them through Postgres would take its
    /// notify lock at the completion's commit. While the front is down, its waiters poll.
    fn offers(&self) -> Offers<'_> {
        let (front, authority) = (self.front.offers(), self.authority.offers());
        Offers {
            admin: authority.admin.map(|_| self as &dyn Admin),
            recovery: authority.recovery,
            wakes: front.wakes.or(authority.wakes),
        }
    }
}

/// What each tier offers an operator, put together: the authority's records (the truth), a
/// key forgotten in both tiers, both tiers' checks, and the authority's recovery.
impl<F: Front, A: Store> Admin for TieredStore<F, A> {
    /// The authority's record. [`TieredStore::inspect_tiers`] shows both.
    fn inspect<'a>(
        &'a self,
        record: &'a RecordKey,
    ) -> BoxFuture<'a, Result<Option<RecordInfo>, StoreError>> {
        Box::pin(async move {
            (&self.authority as &dyn Store)
                .admin_for("inspect")?
                .inspect(record)
                .await
        })
    }

    /// Forgets the key in both tiers, the authority first.
    fn forget<'a>(&'a self, record: &'a RecordKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let authority = (&self.authority as &dyn Store)
                .admin_for("forget")?
                .forget(record)
                .await?;
            let front = match self.front.offers().admin {
                Some(front) => front.forget(record).await?,
                None => false,
            };
            Ok(authority || front)
        })
    }

    /// The authority's stuck keys.
    fn stuck<'a>(
        &'a self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<RecordInfo>, StoreError>> {
        Box::pin(async move {
            let authority = (&self.authority as &dyn Store).admin_for("stuck")?;
            authority.stuck(older_than, limit).await
        })
    }

    /// The front's findings, its risks lowered to warnings (the authority keeps the guarantee
    /// whatever the front loses: only the authority's load rises), then the authority's.
    fn diagnose(&self) -> BoxFuture<'_, Diagnosis> {
        Box::pin(async move {
            let (front, authority) = tokio::join!(
                Diagnosis::of_store(&self.front),
                Diagnosis::of_store(&self.authority)
            );
            let mut findings = front.findings;
            for finding in &mut findings {
                if finding.severity == Severity::Risk {
                    finding.severity = Severity::Warning;
                    finding.message.push_str(" (as a front: the authority behind it keeps the guarantee, only its load rises)");
                }
            }
            findings.extend(authority.findings);
            // The tiers' own policies give way to the pair's.
            findings.retain(|finding| finding.check != "failure-policy");
            let (front, authority) = (self.front.kind(), self.authority.kind());
            let policy = format!(
                "{front} down or slow: requests go on through {authority} alone, and {front} is \
                 skipped for {:?} after a failure; {authority} down: guarded requests answer 503 \
                 with Retry-After and no handler runs, while keys {front} holds completed are \
                 still replayed",
                self.breaker.cooldown
            );
            let mut diagnosis = Diagnosis { findings };
            diagnosis.push(Severity::Ok, "tiered", "failure-policy", policy);
            diagnosis
        })
    }
}

impl<F: Front, A: Store> TieredStore<F, A> {
    /// What each tier holds for `record`: the front's, then the authority's.
    pub async fn inspect_tiers(
        &self,
        record: &RecordKey,
    ) -> (
        Result<Option<RecordInfo>, StoreError>,
        Result<Option<RecordInfo>, StoreError>,
    ) {
        let inspect = async |store: &dyn Store| store.admin_for("inspect")?.inspect(record).await;
        tokio::join!(inspect(&self.front), inspect(&self.authority))
    }
}

/// Skips the front for a cooldown after it fails. Times are this process's monotonic clock:
/// they only pace retries, never decide who owns a key.
#[derive(Debug)]
struct Breaker {
    epoch: Instant,
    cooldown: Duration,
    state: Arc<BreakerState>,
}

#[derive(Debug, Default)]
struct BreakerState {
    /// Milliseconds since `epoch` until which the front is skipped; 0 when closed.
    open_until: AtomicU64,
    /// What `idempotency_front_breaker_open` says: whether the front is skipped right now.
    skipping: AtomicBool,
}

impl Breaker {
    fn new(cooldown: Duration) -> Self {
        Self {
            epoch: Instant::now(),
            cooldown,
            state: Arc::default(),
        }
    }

    fn now(&self) -> u64 {
        // +1 keeps "now" apart from the closed marker 0.
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    fn is_open(&self) -> bool {
        self.state.open_until.load(Ordering::Relaxed) > self.now()
    }

    /// Whether to call the front now. Once the cooldown is over, one caller gets to probe it while
    /// the others keep skipping it for another cooldown.
    fn allows(&self) -> bool {
        let open_until = &self.state.open_until;
        let until = open_until.load(Ordering::Relaxed);
        if until == 0 {
            return true;
        }
        let now = self.now();
        let probe_until = now + self.cooldown.as_millis() as u64;
        let probes = now >= until
            && open_until
                .compare_exchange(until, probe_until, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok();
        if probes {
            self.skipping_until(probe_until);
        }
        probes
    }

    fn succeeded(&self) {
        if self.state.open_until.swap(0, Ordering::Relaxed) != 0 {
            crate::telemetry::breaker(false);
            tracing::info!("front store answers again");
        }
        if self.state.skipping.swap(false, Ordering::Relaxed) {
            crate::telemetry::front_skipped(false);
        }
    }

    /// Opens the breaker; `true` if it was closed (worth a log line).
    fn failed(&self) -> bool {
        let until = self.now() + self.cooldown.as_millis() as u64;
        let was_closed = self.state.open_until.swap(until, Ordering::Relaxed) == 0;
        self.skipping_until(until);
        was_closed
    }

    /// Says the front is skipped until `until`, and no longer once that passes, unless the
    /// breaker skipped it again meanwhile: an idle instance whose front is back does not
    /// report it skipped for ever (no call comes to close the breaker).
    fn skipping_until(&self, until: u64) {
        if !self.state.skipping.swap(true, Ordering::Relaxed) {
            crate::telemetry::front_skipped(true);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (state, cooldown) = (Arc::clone(&self.state), self.cooldown);
        runtime.spawn(async move {
            tokio::time::sleep(cooldown).await;
            if state.open_until.load(Ordering::Relaxed) == until
                && state.skipping.swap(false, Ordering::Relaxed)
            {
                crate::telemetry::front_skipped(false);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, StoreError};
    use http::{HeaderMap, StatusCode};
    use std::sync::atomic::AtomicUsize;

    mod memory_behind_memory {
        crate::store_conformance_tests!(async {
            super::super::TieredStore::new(
                crate::store::MemoryStore::new(),
                crate::store::MemoryStore::new(),
            )
        });

        mod admin {
            crate::store_admin_conformance_tests!(async {
                super::super::super::TieredStore::new(
                    crate::store::MemoryStore::new(),
                    crate::store::MemoryStore::new(),
                )
            });
        }
    }

    /// A memory store that can be switched off, and counts its calls.
    #[derive(Clone, Default)]
    struct Switchable {
        inner: MemoryStore,
        down: Arc<AtomicBool>,
        calls: Arc<AtomicUsize>,
    }

    impl Switchable {
        fn check(&self) -> Result<(), StoreError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                Err(StoreError::timeout("switchable", Duration::from_millis(1)))
            } else {
                Ok(())
            }
        }
    }

    impl Store for Switchable {
        fn claim<'a>(
            &'a self,
            request: &'a ClaimRequest,
        ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
            Box::pin(async move {
                self.check()?;
                self.inner.claim(request).await
            })
        }
        fn renew<'a>(
            &'a self,
            lease: &'a Lease,
            duration: Duration,
        ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
            Box::pin(async move {
                self.check()?;
                self.inner.renew(lease, duration).await
            })
        }
        fn complete<'a>(
            &'a self,
            lease: &'a Lease,
            response: &'a StoredResponse,
            retention: Duration,
        ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
            Box::pin(async move {
                self.check()?;
                self.inner.complete(lease, response, retention).await
            })
        }
        fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
            Box::pin(async move {
                self.check()?;
                self.inner.release(lease).await
            })
        }
    }

    impl Front for Switchable {}

    fn request(key: &str) -> ClaimRequest {
        crate::conformance::claim_request("s", key, "", Duration::from_secs(30))
    }

    fn ok() -> StoredResponse {
        StoredResponse::new(StatusCode::OK, HeaderMap::new(), Some("ok".into()), None)
    }

    async fn acquire(store: &impl Store, request: &ClaimRequest) -> Lease {
        match store.claim(request).await.unwrap() {
            ClaimOutcome::Acquired { fence } => request.lease_with_fence(fence),
            other => panic!("not acquired: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_lost_front_record_is_written_back_from_the_authority() {
        let front = MemoryStore::new();
        let store = TieredStore::new(front.clone(), MemoryStore::new());
        let first = request("k");
        let lease = acquire(&store, &first).await;
        store
            .complete(&lease, &ok(), Duration::from_secs(60))
            .await
            .unwrap();

        // The front loses everything (a FLUSHALL, say).
        let flushed = MemoryStore::new();
        let store = TieredStore::new(flushed.clone(), store.authority);
        assert!(matches!(
            store.claim(&request("k")).await.unwrap(),
            ClaimOutcome::Completed { .. }
        ));
        // Written back: the front alone now replays it.
        assert!(matches!(
            flushed.claim(&request("k")).await.unwrap(),
            ClaimOutcome::Completed { expires_in, .. } if expires_in <= Duration::from_secs(60)
        ));
        drop(front);
    }

    #[tokio::test]
    async fn a_claim_the_authority_refuses_releases_the_front() {
        let front = MemoryStore::new();
        let authority = MemoryStore::new();
        // Another instance holds the key in the authority only (its front claim was flushed).
        acquire(&authority, &request("k")).await;
        let store = TieredStore::new(front.clone(), authority);
        assert!(matches!(
            store.claim(&request("k")).await.unwrap(),
            ClaimOutcome::InFlight { .. }
        ));
        assert!(
            front.is_empty(),
            "the front kept a claim the authority refused"
        );
    }

    #[tokio::test]
    async fn a_failing_front_is_skipped_for_the_cooldown_then_probed() {
        let front = Switchable::default();
        let store = TieredStore::new(front.clone(), MemoryStore::new())
            .with_breaker_cooldown(Duration::from_millis(200));
        front.down.store(true, Ordering::SeqCst);

        let lease = acquire(&store, &request("a")).await;
        assert!(store.front_skipped());
        let calls = front.calls.load(Ordering::SeqCst);
        for key in ["b", "c", "d"] {
            acquire(&store, &request(key)).await;
        }
        store
            .complete(&lease, &ok(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(
            front.calls.load(Ordering::SeqCst),
            calls,
            "an open breaker still called the front"
        );

        front.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        acquire(&store, &request("e")).await;
        assert!(
            !store.front_skipped(),
            "a successful probe must close the breaker"
        );
        assert!(front.calls.load(Ordering::SeqCst) > calls);
    }

    #[tokio::test]
    async fn a_failing_authority_is_an_error_and_frees_the_front() {
        let front = MemoryStore::new();
        let authority = Switchable::default();
        authority.down.store(true, Ordering::SeqCst);
        let store = TieredStore::new(front.clone(), authority);
        assert!(store.claim(&request("k")).await.is_err());
        assert!(
            front.is_empty(),
            "the front kept the claim of a request that will not run"
        );
    }
}
