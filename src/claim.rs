//! The request extension a guarded handler runs under.

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
}

impl IdempotencyClaim {
    pub(crate) fn new(lease: Lease) -> Self {
        Self { lease }
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
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::{
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
