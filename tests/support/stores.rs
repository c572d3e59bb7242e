//! Stores that misbehave on purpose, and claims made directly on a store.

use super::*;

/// A store whose renewals never arrive, like an instance frozen by a long pause: its leases run
/// out while its handlers still run.
#[derive(Clone)]
pub struct FrozenRenewals<S>(pub S);

impl<S: Store> Store for FrozenRenewals<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        self.0.claim(request)
    }

    fn renew<'a>(
        &'a self,
        _: &'a store::Lease,
        _: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        Box::pin(async { Ok(store::Ownership::Held) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.0.complete(lease, response, retention)
    }

    fn release<'a>(
        &'a self,
        lease: &'a store::Lease,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.0.release(lease)
    }
}

/// A store whose renewals answer `delay` late (a slow network, a store with a queue): the store
/// itself renews when asked, and the answer comes later. Never detached, so that the layer's
/// renewals go through the delay.
#[derive(Clone)]
pub struct SlowRenewals<S> {
    pub inner: S,
    pub delay: Duration,
}

impl<S: Store> Store for SlowRenewals<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        self.inner.claim(request)
    }

    fn renew<'a>(
        &'a self,
        lease: &'a store::Lease,
        duration: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        Box::pin(async move {
            let renewed = self.inner.renew(lease, duration).await;
            tokio::time::sleep(self.delay).await;
            renewed
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.complete(lease, response, retention)
    }

    fn release<'a>(
        &'a self,
        lease: &'a store::Lease,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.release(lease)
    }
}

/// A store whose `complete` fails while `failing` is set, as a store that cannot take a write
/// would; every other operation goes through, renewals on the inner store's detached twin as
/// the inner store's own would.
#[derive(Clone)]
pub struct FailingCompletes<S> {
    pub inner: S,
    pub failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<S: Store> Store for FailingCompletes<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        self.inner.claim(request)
    }

    fn renew<'a>(
        &'a self,
        lease: &'a store::Lease,
        duration: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.renew(lease, duration)
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async {
                Err(store::StoreError::Backend {
                    store: "failing",
                    source: "the store refuses writes".into(),
                })
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

    fn detached(&self) -> Option<std::sync::Arc<dyn Store>> {
        self.inner.detached()
    }
}

/// A claim of `key` in scope "tenant" for a fixed request, by a fresh owner.
pub fn claim_request(key: &str, lease: Duration) -> store::ClaimRequest {
    tower_idempotency::conformance::claim_request("tenant", key, "body", lease)
}

/// Claims and expects to acquire; returns the lease.
pub async fn acquire(store: &impl Store, request: &store::ClaimRequest) -> store::Lease {
    match store.claim(request).await.unwrap() {
        store::ClaimOutcome::Acquired { fence } => request.lease_with_fence(fence),
        other => panic!("expected to acquire {}, got {other:?}", request.record()),
    }
}
