//! A fresh key on the Redis store, as `benches/counts.rs` counts it and `tests/allocations.rs`
//! holds it to a budget: a claim (made apart, as the layer makes it), then a completion with
//! the payment route's answer.

use std::time::Duration;

use axum::http::StatusCode;
use bytes::Bytes;
use http::HeaderMap;
use tower_idempotency::{
    IdempotencyKey,
    store::{
        ClaimOutcome, ClaimRequest, Fingerprint, RecordKey, RedisStore, Store, StoredResponse,
    },
};
use uuid::Uuid;

use crate::route::ANSWER;

pub struct FreshKeys {
    response: StoredResponse,
    fingerprint: Fingerprint,
}

impl FreshKeys {
    pub fn new() -> Self {
        let answer = Some(Bytes::from_static(ANSWER.as_bytes()));
        Self {
            response: StoredResponse::new(StatusCode::CREATED, HeaderMap::new(), answer, None),
            fingerprint: Fingerprint::of_payload(b"{}"),
        }
    }

    /// The claim of the `i`th key, of an owner of its own, for a 30 s lease.
    pub fn claim(&self, i: u64) -> ClaimRequest {
        let key = IdempotencyKey::try_from(format!("fresh-{i}").as_str()).unwrap();
        let record = RecordKey::new("anonymous", key);
        let lease = Duration::from_secs(30);
        ClaimRequest::new(record, self.fingerprint, Uuid::new_v4(), lease)
    }

    /// Claims the key of `claim`, which must be fresh, and completes it for 10 minutes.
    pub async fn claim_and_complete(&self, store: &RedisStore, claim: &ClaimRequest) {
        let ClaimOutcome::Acquired { fence } = store.claim(claim).await.unwrap() else {
            panic!("{} was not fresh", claim.record().key());
        };
        let lease = claim.lease_with_fence(fence);
        let retention = Duration::from_secs(600);
        store
            .complete(&lease, &self.response, retention)
            .await
            .unwrap();
    }
}
