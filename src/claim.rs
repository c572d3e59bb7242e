//! The request extension a guarded handler runs under.

use std::time::Duration;

use uuid::Uuid;

use crate::{IdempotencyKey, store::Lease};

/// The claim the current request holds: inserted into the request extensions by the layer before
/// the handler runs, for requests that carry an `Idempotency-Key`.
///
/// Handlers use it to forward the key to downstream providers (so a payment provider deduplicates
/// too), to log it, and (with the `postgres` feature) to fence their business write: see
/// `IdempotencyClaim::commit`.
///
/// With the `axum` feature it is an extractor; without it, read it with
/// `request.extensions().get::<IdempotencyClaim>()`.
#[derive(Debug, Clone)]
pub struct IdempotencyClaim {
    lease: Lease,
    retention: Duration,
}

impl IdempotencyClaim {
    /// The claim for `lease`, kept for `retention` once finished. The layer builds it for every
    /// guarded request; this constructor lets a handler be tested without the layer.
    pub fn new(lease: Lease, retention: Duration) -> Self {
        Self { lease, retention }
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
    /// sqlx::query("INSERT INTO payments (id, amount_cents) VALUES ($1, $2)")
    ///     .bind("pay_1")
    ///     .bind(4900_i64)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// claim.commit(&mut tx).await?; // FenceError::LeaseLost: drop `tx`, nothing is written
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// A handler whose lease expired during a stall, and whose key another attempt reclaimed,
    /// gets [`FenceError::LeaseLost`](crate::store::FenceError::LeaseLost) and its transaction
    /// rolls back: exactly one business commit per key, even when two attempts ran. Once the
    /// transaction commits, the key can no longer be released or reclaimed: the layer completes
    /// it whatever the response, and if the instance dies before that, retries get an
    /// `outcome-unknown` problem, never a second execution.
    ///
    /// The row is locked until the transaction ends: keep it short, since retries of this key
    /// wait on it. Needs the Postgres store (alone or behind Redis), the `idempotency_keys`
    /// table on the transaction's `search_path`, and the `postgres` feature.
    #[cfg(feature = "postgres")]
    pub async fn commit(
        &self,
        connection: &mut sqlx::PgConnection,
    ) -> Result<(), crate::store::FenceError> {
        crate::store::commit(connection, &self.lease, self.retention).await
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
