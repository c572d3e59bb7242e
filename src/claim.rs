//! The request extension a guarded handler runs under.

use std::{sync::Arc, time::Duration};

use uuid::Uuid;

use crate::{IdempotencyKey, kept::KeptRequest, response::StoreRules, store::Lease};

/// The claim the current request holds: inserted into the request extensions by the layer before
/// the handler runs, for requests that carry an idempotency key.
///
/// Handlers use it to forward the key to downstream providers (so a payment provider deduplicates
/// too), to log it, and (with the `postgres` feature) to fence their business write: see
/// `IdempotencyClaim::commit`.
///
/// With the `axum` feature it is an extractor; without it, read it with
/// `request.extensions().get::<IdempotencyClaim>()`.
#[derive(Clone)]
pub struct IdempotencyClaim {
    lease: Lease,
    retention: Duration,
    lease_duration: Duration,
    /// How `commit_with_response` stores a response, as the layer would.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    rules: Arc<StoreRules>,
    /// The request's headers, for the ones a response stored with the fence varies on
    /// (`Vary`), as the layer stores them.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    request_headers: Arc<http::HeaderMap>,
    /// The request, where the layer keeps it for the completer: written with the first
    /// recovery point.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    kept: Option<Arc<KeptRequest>>,
}

/// Without the request's headers: they may carry credentials.
/// The claim's lease: what [`PostgresStore::pool_for`](crate::store::PostgresStore::pool_for)
/// routes by.
impl AsRef<Lease> for IdempotencyClaim {
    fn as_ref(&self) -> &Lease {
        &self.lease
    }
}

impl std::fmt::Debug for IdempotencyClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyClaim")
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("lease_duration", &self.lease_duration)
            .finish_non_exhaustive()
    }
}

impl IdempotencyClaim {
    /// The claim for `lease`, kept for `retention` once finished, with the default lease length
    /// and storage rules. The layer builds it for every guarded request; this constructor lets
    /// a handler be tested without the layer.
    pub fn new(lease: Lease, retention: Duration) -> Self {
        Self {
            lease,
            retention,
            lease_duration: crate::settings::DEFAULT_LEASE,
            rules: Arc::default(),
            request_headers: Arc::default(),
            kept: None,
        }
    }

    /// The lease length the fence restarts the lease with (the layer's; 30 s for a claim built
    /// with [`new`](Self::new)).
    pub fn with_lease_duration(mut self, lease: Duration) -> Self {
        self.lease_duration = lease;
        self
    }

    /// The claim the layer hands to a handler.
    pub(crate) fn granted(
        lease: Lease,
        (retention, lease_duration): (Duration, Duration),
        rules: Arc<StoreRules>,
        (request_headers, kept): (Arc<http::HeaderMap>, Option<Arc<KeptRequest>>),
    ) -> Self {
        Self {
            lease,
            retention,
            lease_duration,
            rules,
            request_headers,
            kept,
        }
    }

    /// The idempotency key, as the client sent it (unquoted).
    pub fn key(&self) -> &IdempotencyKey {
        self.lease.record().key()
    }

    /// The scope the key lives in.
    pub fn scope(&self) -> &str {
        self.lease.record().scope()
    }

    /// The fence: it grows with every claim and reclaim of this key, so a downstream resource that
    /// remembers the highest fence it has seen can refuse a stale request.
    pub fn fence(&self) -> u64 {
        self.lease.fence()
    }

    /// A key for a call this handler makes to another system, labelled `label` (say
    /// `"charge"`): the same for every attempt of this request, on any instance, and different
    /// for every label, key and scope. Send it to the provider, so that a retried request that
    /// reaches it again is deduplicated there, and two different calls of one request never
    /// share a key. Computed, not stored: SHA-256 over the scope, the key and the label, each
    /// length-prefixed, as 64 hex digits.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyClaim, IdempotencyKey, store::{Lease, RecordKey}};
    ///
    /// let record = RecordKey::new("tenant-1", IdempotencyKey::try_from("order-42").unwrap());
    /// let claim = IdempotencyClaim::new(Lease::new(record, uuid::Uuid::new_v4(), 1), Duration::from_secs(60));
    /// let charge = claim.derived_key("charge");
    /// assert_eq!(charge, claim.derived_key("charge"));
    /// assert_ne!(charge, claim.derived_key("refund"));
    /// ```
    pub fn derived_key(&self, label: &str) -> IdempotencyKey {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(b"tower-idempotency derived key 1\0");
        for part in [self.scope(), self.key().as_str(), label] {
            hash.update((part.len() as u64).to_be_bytes());
            hash.update(part.as_bytes());
        }
        let hex: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
        IdempotencyKey::try_from(hex.as_str()).expect("64 hex digits are a valid key")
    }

    /// This attempt's owner token.
    pub fn owner(&self) -> Uuid {
        self.lease.owner()
    }

    /// The lease behind the claim.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// How long the key's outcome is kept once committed or completed.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The fence: moves the key from in flight to committed **inside the handler's own
    /// transaction**, if this request still owns it, and fails otherwise.
    ///
    /// Make the business write and this call in one transaction, and commit only if it succeeds:
    ///
    /// ```no_run
    /// # async fn handler(pool: sqlx::PgPool, claim: tower_idempotency::IdempotencyClaim) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// claim.commit(&mut tx).await?; // FenceError::LeaseLost: drop `tx`, nothing is written
    /// sqlx::query("INSERT INTO payments (id, amount_cents) VALUES ($1, $2)")
    ///     .bind("pay_1")
    ///     .bind(4900_i64)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// A handler whose lease expired during a stall, and whose key another attempt reclaimed,
    /// gets [`FenceError::LeaseLost`](crate::store::FenceError::LeaseLost) and its transaction
    /// rolls back: exactly one business commit per key, even when two attempts ran. Once the
    /// transaction commits, the key can no longer be released or reclaimed: the layer completes
    /// it whatever the response.
    ///
    /// If the instance dies after the commit and before the layer stored the response, retries
    /// get an `outcome-unknown` problem, never a second execution; prefer
    /// [`commit_with_response`](Self::commit_with_response), which stores the answer in the
    /// same transaction.
    ///
    /// Called first, the fence stops a stale attempt before it does anything. The row stays
    /// locked until the transaction ends; meanwhile the layer's renewals do not wait on it, and
    /// retries of the key wait (or get 409) as for any request in flight. Needs the Postgres
    /// store (alone or behind Redis), the `idempotency_keys` table on the transaction's
    /// `search_path`, and the `postgres` feature.
    #[cfg(feature = "postgres")]
    pub async fn commit(
        &self,
        connection: &mut sqlx::PgConnection,
    ) -> Result<(), crate::store::FenceError> {
        let times = (self.retention, self.lease_duration);
        crate::store::postgres::fence::commit(connection, &self.lease, times, None).await
    }

    /// The fence, and the answer with it: like [`commit`](Self::commit), and stores `response`
    /// (what the handler is about to return) in the same transaction. If this instance dies
    /// after the transaction commits, retries are answered with `response` at once, instead of
    /// `outcome-unknown`; and it is the key's one answer from then on: retries arriving before
    /// the handler returns get it too, and the layer's completion keeps it. Return the same
    /// response. It is stored as the layer stores any response, with the request's values of
    /// the headers it varies on (`Vary`).
    ///
    /// ```no_run
    /// # use axum::{body::Body, response::Response};
    /// # async fn handler(pool: sqlx::PgPool, claim: tower_idempotency::IdempotencyClaim) -> Result<Response, Box<dyn std::error::Error>> {
    /// let mut tx = pool.begin().await?;
    /// claim.commit(&mut tx).await?; // first: a stale attempt stops here
    /// sqlx::query("INSERT INTO payments (id) VALUES ($1)").bind("pay_1").execute(&mut *tx).await?;
    /// let response = http::Response::builder()
    ///     .status(201)
    ///     .header("content-type", "application/json")
    ///     .body(bytes::Bytes::from_static(br#"{"id":"pay_1"}"#))?;
    /// claim.commit_with_response(&mut tx, &response).await?;
    /// tx.commit().await?;
    /// Ok(response.map(Body::from))
    /// # }
    /// ```
    ///
    /// The response is stored as the layer stores any: without per-exchange headers, and
    /// without its body over the cache limit.
    #[cfg(feature = "postgres")]
    pub async fn commit_with_response(
        &self,
        connection: &mut sqlx::PgConnection,
        response: &http::Response<bytes::Bytes>,
    ) -> Result<(), crate::store::FenceError> {
        let times = (self.retention, self.lease_duration);
        // Stored as the layer stores the response the handler returns: the same copy, so
        // a retry meets one answer whichever of the two it finds.
        let varied =
            crate::headers::varied_request_headers(response.headers(), &self.request_headers);
        let stored = self
            .rules
            .record(response)
            .with_varied_request_headers(varied);
        crate::store::postgres::fence::commit(connection, &self.lease, times, Some(&stored)).await
    }

    /// The fence, and a unit of work's outcome with it: for [`Once::run`](crate::work::Once::run)
    /// what [`commit_with_response`](Self::commit_with_response) is for a handler. Stores
    /// `outcome` (what the work is about to return) in the same transaction as the work's
    /// writes: if this process dies after the transaction commits, later deliveries get
    /// `outcome` at once (replayed), instead of [`WorkError::OutcomeUnknown`] for the whole
    /// retention; and it is the unit's one outcome from then on. Return the same value.
    ///
    /// ```no_run
    /// use tower_idempotency::work::{Once, Unit};
    ///
    /// # async fn consume(once: Once, pool: sqlx::PgPool, id: &str, payload: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    /// let unit = Unit::new("orders", id, payload)?;
    /// let done = once
    ///     .run(unit, |claim| async move {
    ///         let mut tx = pool.begin().await?;
    ///         claim.commit(&mut tx).await?; // first: a stale delivery stops here
    ///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
    ///             .bind(claim.key().as_str())
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         let shipment = format!("shipment for {}", claim.key());
    ///         claim.commit_with_outcome(&mut tx, &shipment).await?;
    ///         tx.commit().await?;
    ///         Ok::<_, Box<dyn std::error::Error + Send + Sync>>(shipment)
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// [`WorkError::OutcomeUnknown`]: crate::work::WorkError::OutcomeUnknown
    #[cfg(feature = "postgres")]
    pub async fn commit_with_outcome<T: serde::Serialize>(
        &self,
        connection: &mut sqlx::PgConnection,
        outcome: &T,
    ) -> Result<(), crate::store::FenceError> {
        let times = (self.retention, self.lease_duration);
        let outcome =
            serde_json::to_vec(outcome).map_err(|source| crate::store::FenceError::Outcome {
                record: self.lease.record().clone(),
                source,
            })?;
        let stored = crate::response::StoredResponse::of_outcome(outcome.into());
        crate::store::postgres::fence::commit(connection, &self.lease, times, Some(&stored)).await
    }
}

/// # Multi-step handlers: recovery points (Postgres)
///
/// A handler that does several things (record the intent, call a provider, record the result)
/// cuts its work into steps, each a short transaction of its own that also advances the key's
/// recovery point; calls to other systems run between steps, with no transaction open and no
/// lock held, carrying a key derived from this one ([`derived_key`](Self::derived_key)) so the
/// other system deduplicates them. A retry of an interrupted request, on any instance, runs the
/// handler again once the first attempt's lease has run out: it reads where that attempt got to
/// ([`recovery_point`](Self::recovery_point)) and continues from there. The last step stores
/// the answer with the fence ([`commit_with_response`](Self::commit_with_response)).
///
/// ```no_run
/// # async fn charge(key: &str, amount: i64) -> Result<String, Box<dyn std::error::Error>> { Ok(String::new()) }
/// use tower_idempotency::IdempotencyClaim;
///
/// async fn pay(pool: sqlx::PgPool, claim: IdempotencyClaim) -> Result<http::Response<bytes::Bytes>, Box<dyn std::error::Error>> {
///     let resumed = claim.recovery_point(&mut *pool.acquire().await?).await?;
///     let payment_id = match resumed {
///         // A previous attempt recorded the intent: continue from there.
///         Some(point) if point.name() == "intent_recorded" => point.payload()["payment_id"].as_str().unwrap().to_owned(),
///         _ => {
///             // Step 1: the intent, and the recovery point, in one short transaction.
///             let id = format!("pay_{}", uuid::Uuid::new_v4().simple());
///             let mut tx = pool.begin().await?;
///             sqlx::query("INSERT INTO payments (id, status) VALUES ($1, 'pending')").bind(&id).execute(&mut *tx).await?;
///             claim.advance(&mut tx, "intent_recorded", &serde_json::json!({ "payment_id": id })).await?;
///             tx.commit().await?;
///             id
///         }
///     };
///     // The provider, with no transaction open: the derived key makes a repeated call a no-op.
///     let charge_id = charge(claim.derived_key("charge").as_str(), 4900).await?;
///     // Step 2: the result and the answer, fenced, in one short transaction.
///     let mut tx = pool.begin().await?;
///     sqlx::query("UPDATE payments SET status = 'succeeded', charge_id = $2 WHERE id = $1")
///         .bind(&payment_id).bind(&charge_id).execute(&mut *tx).await?;
///     let response = http::Response::builder().status(201).body(bytes::Bytes::from(payment_id))?;
///     claim.commit_with_response(&mut tx, &response).await?;
///     tx.commit().await?;
///     Ok(response)
/// }
/// ```
///
/// A key with a recovery point is never deleted while in flight: when the completion policy
/// releases it (the provider failed, say), its lease ends instead, and the next retry resumes.
/// Only the request it was first claimed for may resume it; another with the same key gets 422.
/// Recovery points live in Postgres (alone, or behind Redis); a handler on the memory or Redis
/// store alone gets [`FenceError::NoRecord`](crate::store::FenceError::NoRecord), which says
/// so.
#[cfg(feature = "postgres")]
impl IdempotencyClaim {
    /// How far an earlier attempt of this request got: the recovery point its last finished
    /// step recorded, or `None` on a first attempt (or one whose predecessors recorded none).
    /// Fails with [`FenceError::LeaseLost`](crate::store::FenceError::LeaseLost) if this
    /// attempt no longer holds the key.
    pub async fn recovery_point(
        &self,
        connection: &mut sqlx::PgConnection,
    ) -> Result<Option<crate::store::RecoveryPoint>, crate::store::FenceError> {
        crate::store::postgres::fence::recovery_point(connection, &self.lease).await
    }

    /// Records that the handler got to `point`, leaving `payload` for the steps after it,
    /// **inside the handler's own transaction**, if this attempt still holds the key in flight:
    /// the step's writes and its recovery point commit together, or neither does. Restarts the
    /// lease, and keeps the key (and so the progress) for the retention period. Fails with
    /// [`FenceError::LeaseLost`](crate::store::FenceError::LeaseLost) if another attempt took
    /// the key over: roll back.
    ///
    /// Where the layer keeps requests
    /// ([`with_kept_requests`](crate::IdempotencyLayer::with_kept_requests)), the first
    /// recovery point also keeps the request, so that the [completer](crate::completer) can
    /// resume the handler if its instance dies and nobody retries.
    pub async fn advance(
        &self,
        connection: &mut sqlx::PgConnection,
        point: &str,
        payload: &serde_json::Value,
    ) -> Result<(), crate::store::FenceError> {
        let times = (self.retention, self.lease_duration);
        let kept = self.kept.as_deref().map(KeptRequest::encode);
        let step = (point, payload, kept.as_deref());
        crate::store::postgres::fence::advance(connection, &self.lease, times, step).await
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        response::{IntoResponse, Response},
    };
    use http::{StatusCode, request::Parts};

    use super::IdempotencyClaim;

    /// Rejection of the [`IdempotencyClaim`] extractor: the request holds no claim.
    #[derive(Debug, Clone, Copy, thiserror::Error)]
    #[error(
        "no IdempotencyClaim in the request extensions: is IdempotencyLayer installed on this \
         route, its method guarded, and the key required? Use Option<IdempotencyClaim> where the \
         key is optional"
    )]
    pub struct MissingClaim;

    impl IntoResponse for MissingClaim {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for IdempotencyClaim {
        type Rejection = MissingClaim;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts.extensions.get::<Self>().cloned().ok_or(MissingClaim)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyClaim {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Self>().cloned())
        }
    }
}

#[cfg(feature = "axum")]
pub use extract::MissingClaim;
