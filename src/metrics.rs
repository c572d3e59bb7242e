//! Counters of what the layer did, for dashboards and alerts.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Live counters shared by every service a layer built; read them with
        /// [`snapshot`](Metrics::snapshot). Get them from [`IdempotencyLayer::metrics`](crate::IdempotencyLayer::metrics).
        #[derive(Debug, Default)]
        pub struct Metrics {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// The counters at one instant.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            /// Reads every counter.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.$name.load(Relaxed),)* }
            }

            /// Counts one event on the counter `pick` selects.
            pub(crate) fn add(&self, pick: impl FnOnce(&Self) -> &AtomicU64) {
                pick(self).fetch_add(1, Relaxed);
            }
        }
    };
}

counters! {
    /// Requests whose claim acquired the key, so the handler ran.
    executions,
    /// Stored responses replayed.
    replays,
    /// Keys completed (response stored).
    completions,
    /// Keys released for a clean retry.
    releases,
    /// Requests that found their key in flight and waited for the first request to finish.
    waits,
    /// 409 answers to a request whose key was still in flight after the wait (or committed by an
    /// owner that died before storing its response).
    in_flight,
    /// 422 answers to a key reused with a different request.
    mismatches,
    /// 400 answers to a missing or invalid key, or an unreadable body.
    bad_requests,
    /// 413 answers to a body over the limit.
    too_large,
    /// 503 answers because the store failed; the handler did not run.
    store_unavailable,
    /// Responses over the cache limit, recorded without their body.
    responses_not_stored,
    /// Renewals or finalizations refused because the lease had been lost: the stale owner wrote
    /// nothing. Worth an alert: lease too short, or instances stalling.
    leases_lost,
    /// Finalizations that still failed after the first quick retries: the response is then
    /// retried in the background, with the key held, until the finalize deadline.
    finalize_errors,
    /// Handlers that panicked or returned a service error.
    handler_failures,
}
