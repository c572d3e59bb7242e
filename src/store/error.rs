//! How a store call fails, and the one helper every store bounds its backend's calls with.

use std::{future::Future, time::Duration};

use super::{BoxError, RecordKey};

/// A store operation failed. The layer answers 503 and never runs the handler on a failed claim.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed or could not be reached.
    #[error("{store} store failed")]
    Backend {
        /// Which store ("redis", "postgres", …).
        store: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// The backend did not answer in time.
    #[error("{store} store did not answer within {after:?}")]
    Timeout {
        /// Which store.
        store: &'static str,
        /// The bound that passed.
        after: Duration,
    },
    /// The store does not offer this operation (an operator's: inspect, forget, stuck).
    #[error("the {store} store does not support {operation}")]
    Unsupported {
        /// Which store.
        store: &'static str,
        /// The operation asked for.
        operation: &'static str,
    },
    /// A record could not be read back (corrupted, or written by an incompatible version).
    #[error("{store} store holds an unreadable record for {record}")]
    Corrupt {
        /// Which store.
        store: &'static str,
        /// The record involved.
        record: RecordKey,
        /// What is wrong with it.
        #[source]
        source: BoxError,
    },
}

impl StoreError {
    /// The backend `store` failed with `source`.
    pub(crate) fn backend(store: &'static str, source: impl Into<BoxError>) -> Self {
        Self::Backend {
            store,
            source: source.into(),
        }
    }

    /// `store` did not answer within `after`.
    pub(crate) fn timeout(store: &'static str, after: Duration) -> Self {
        Self::Timeout { store, after }
    }

    /// `store` holds an unreadable `record`: `source` says what is wrong with it.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn corrupt(
        store: &'static str,
        record: &RecordKey,
        source: impl Into<BoxError>,
    ) -> Self {
        Self::Corrupt {
            store,
            record: record.clone(),
            source: source.into(),
        }
    }
}

/// Runs a call to `store`'s backend within `timeout`: past it, [`StoreError::Timeout`]; the
/// call's own errors as `failed` says.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
pub(crate) async fn bounded<T, E>(
    store: &'static str,
    timeout: Duration,
    call: impl Future<Output = Result<T, E>>,
    failed: impl FnOnce(E) -> StoreError,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(failed),
        Err(_elapsed) => Err(StoreError::timeout(store, timeout)),
    }
}
