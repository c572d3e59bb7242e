//! Stores that misbehave on purpose, and claims made directly on a store.

use super::*;

/// A store that misbehaves on purpose in one way (its [`StoreFault`]); every other call goes to
/// `inner`.
#[derive(Clone)]
pub struct Faulty<S> {
    pub inner: S,
    pub fault: StoreFault,
}

/// How a [`Faulty`] store misbehaves.
#[derive(Clone)]
pub enum StoreFault {
    /// Renewals never arrive, like an instance frozen by a long pause: leases run out while
    /// their handlers still run.
    FrozenRenewals,
    /// Renewals answer this late (a slow network, a store with a queue): the store renews when
    /// asked, and the answer comes later.
    LateRenewals(Duration),
    /// `complete` fails while this is set, as a store that cannot take a write would.
    FailingCompletes(std::sync::Arc<std::sync::atomic::AtomicBool>),
    /// Renewals wait this long before they reach the store, like an instance frozen (SIGSTOP)
    /// whose renewal goes out once it thaws: the lease runs out meanwhile.
    StalledRenewals(Duration),
    /// Completions are written, then answered this late (a front store that hangs after the
    /// authority completed): renewals meanwhile meet the owner's own completed record.
    SlowCompletes(Duration),
    /// The next claim the store grants while `armed` is set (then cleared) blocks the thread
    /// that polls it for `pause` before it answers: a runtime blocked by another handler just
    /// as the grant arrived, so the process sees it only after its lease may have run out.
    BlockedAfterGrant {
        armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
        pause: Duration,
    },
    /// The next claim while `armed` is set (then cleared) is applied by the store, and its
    /// caller told it timed out: the answer lost on a store that slow.
    TimedOutAfterApplying(std::sync::Arc<std::sync::atomic::AtomicBool>),
}

impl<S: Store> Store for Faulty<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        if let StoreFault::TimedOutAfterApplying(armed) = &self.fault {
            return Box::pin(async move {
                let outcome = self.inner.claim(request).await;
                if armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    let after = Duration::from_secs(5);
                    return Err(store::StoreError::Timeout {
                        store: "faulty",
                        after,
                    });
                }
                outcome
            });
        }
        let StoreFault::BlockedAfterGrant { armed, pause } = &self.fault else {
            return self.inner.claim(request);
        };
        Box::pin(async move {
            let outcome = self.inner.claim(request).await;
            if matches!(outcome, Ok(store::ClaimOutcome::Acquired { .. }))
                && armed.swap(false, std::sync::atomic::Ordering::SeqCst)
            {
                // Synchronous on purpose: nothing else on this thread runs meanwhile.
                std::thread::sleep(*pause);
            }
            outcome
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a store::Lease,
        duration: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        match &self.fault {
            StoreFault::FrozenRenewals => Box::pin(async { Ok(store::Ownership::Held) }),
            StoreFault::LateRenewals(delay) => Box::pin(async move {
                let renewed = self.inner.renew(lease, duration).await;
                tokio::time::sleep(*delay).await;
                renewed
            }),
            StoreFault::StalledRenewals(delay) => Box::pin(async move {
                tokio::time::sleep(*delay).await;
                self.inner.renew(lease, duration).await
            }),
            _ => self.inner.renew(lease, duration),
        }
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::store::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        if let StoreFault::FailingCompletes(failing) = &self.fault
            && failing.load(std::sync::atomic::Ordering::SeqCst)
        {
            return Box::pin(async {
                Err(store::StoreError::Backend {
                    store: "failing",
                    source: "the store refuses writes".into(),
                })
            });
        }
        if let StoreFault::SlowCompletes(delay) = &self.fault {
            return Box::pin(async move {
                let completed = self.inner.complete(lease, response, retention).await;
                tokio::time::sleep(*delay).await;
                completed
            });
        }
        self.inner.complete(lease, response, retention)
    }

    fn release<'a>(
        &'a self,
        lease: &'a store::Lease,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.release(lease)
    }

    /// Everything but the four operations is the inner store's.
    fn wrapped(&self) -> Option<&dyn Store> {
        Some(&self.inner)
    }

    /// The inner store's detached twin, as the inner store's own renewals would use, unless the
    /// fault is in the renewals: then they go through it.
    fn detached(&self) -> Option<std::sync::Arc<dyn Store>> {
        match self.fault {
            StoreFault::FailingCompletes(_)
            | StoreFault::BlockedAfterGrant { .. }
            | StoreFault::TimedOutAfterApplying(_)
            | StoreFault::SlowCompletes(_) => self.inner.detached(),
            StoreFault::FrozenRenewals
            | StoreFault::LateRenewals(_)
            | StoreFault::StalledRenewals(_) => None,
        }
    }
}

/// A claim of `key` in scope "tenant" for a fixed request, by a fresh owner.
pub fn claim_request(key: &str, lease: Duration) -> store::ClaimRequest {
    tower_idempotency::conformance::claim_request("tenant", key, "body", lease)
}

/// What kind of outcome a claim had, by name, for comparing many at once: acquired, completed,
/// in flight or a mismatch (any other fails the test).
pub fn outcome_kind(outcome: &store::ClaimOutcome) -> &'static str {
    match outcome {
        store::ClaimOutcome::Acquired { .. } => "acquired",
        store::ClaimOutcome::Completed { .. } => "completed",
        store::ClaimOutcome::InFlight { .. } => "in_flight",
        store::ClaimOutcome::Mismatch => "mismatch",
        other => panic!("{other:?}"),
    }
}

/// Claims and expects to acquire; returns the lease.
pub async fn acquire(store: &impl Store, request: &store::ClaimRequest) -> store::Lease {
    match store.claim(request).await.unwrap() {
        store::ClaimOutcome::Acquired { fence } => request.lease_with_fence(fence),
        other => panic!("expected to acquire {}, got {other:?}", request.record()),
    }
}

/// Grows `idempotency_keys` by 200,000 completed rows (scope "grown"): a table that was empty
/// when its plans were made, and is large now.
pub async fn grow_by_200000_completed_rows(pool: &sqlx::PgPool) {
    sqlx::query(
        "INSERT INTO idempotency_keys (scope, key, fingerprint, state, owner, fence, lease_until,
                                       expires_at, status, response)
         SELECT 'grown', 'g' || i, '\\x00', 'completed', gen_random_uuid(), i, now(),
                now() + interval '1 day', 200, '\\x00'
         FROM generate_series(1, 200000) AS i",
    )
    .execute(pool)
    .await
    .unwrap();
}
