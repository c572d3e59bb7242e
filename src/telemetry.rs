//! What operators see: metrics through the `metrics` facade (feature `metrics`), the layer's
//! events, and keys in logs as pseudonyms.
//!
//! # Metrics
//!
//! With the `metrics` feature the crate records these through the [`metrics`] facade; install
//! any recorder (`metrics-exporter-prometheus`, say) to export them. Without a recorder, or
//! without the feature, they cost nothing. [`Metrics`](crate::Metrics) keeps process-local
//! counters either way.
//!
//! | name | kind | labels | what it counts |
//! |---|---|---|---|
//! | `idempotency_requests_total` | counter | `outcome`, `store` | guarded requests, by [`IdempotencyOutcome`] and store kind |
//! | `idempotency_handler_seconds` | histogram | `store` | how long handlers ran |
//! | `idempotency_store_call_seconds` | histogram | `operation`, `store` | claim, renew, complete and release calls, errors included |
//! | `idempotency_store_errors_total` | counter | `operation`, `store` | store calls that failed |
//! | `idempotency_claims_held` | gauge | | keys this instance holds right now (handlers running, finalizes retried) |
//! | `idempotency_waits_total` | counter | | requests that found their key in flight and waited |
//! | `idempotency_leases_lost_total` | counter | | leases found in another owner's hands (the stale owner wrote nothing) |
//! | `idempotency_finalize_failures_total` | counter | | finalizes still failing after the quick retries (then retried with the key held) |
//! | `idempotency_front_fallbacks_total` | counter | `operation` | tiered store calls that went on without the front (skipped by the breaker, or failed) |
//! | `idempotency_front_breaker_transitions_total` | counter | `to` (`open`, `closed`) | the tiered store's breaker opening and closing |
//! | `idempotency_front_breaker_open` | gauge | | 1 while the breaker skips the front |
//! | `idempotency_swept_rows_total` | counter | | expired Postgres rows the sweeper deleted |
//!
//! [`metrics`]: https://docs.rs/metrics

use std::{fmt, time::Duration};

use sha2::{Digest, Sha256};

use crate::IdempotencyOutcome;

/// Counts a guarded request's outcome.
pub(crate) fn answered(outcome: IdempotencyOutcome, store: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_requests_total", "outcome" => outcome.as_str(), "store" => store)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, store);
}

/// Runs a store call, timing it and counting it if it fails.
pub(crate) async fn timed<T, E>(
    operation: &'static str,
    store: &'static str,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, E> {
    #[cfg(feature = "metrics")]
    {
        let started = std::time::Instant::now();
        let result = call.await;
        metrics::histogram!("idempotency_store_call_seconds", "operation" => operation, "store" => store)
            .record(started.elapsed());
        if result.is_err() {
            metrics::counter!("idempotency_store_errors_total", "operation" => operation, "store" => store)
                .increment(1);
        }
        result
    }
    #[cfg(not(feature = "metrics"))]
    {
        let _ = (operation, store);
        call.await
    }
}

pub(crate) fn handler_took(store: &'static str, took: Duration) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idempotency_handler_seconds", "store" => store).record(took);
    #[cfg(not(feature = "metrics"))]
    let _ = (store, took);
}

/// One more (or one fewer) key held by this instance.
pub(crate) fn claims_held(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("idempotency_claims_held").increment(delta);
    #[cfg(not(feature = "metrics"))]
    let _ = delta;
}

/// A counter without labels.
pub(crate) fn count(name: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(name).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = name;
}

/// `n` on a counter without labels.
#[cfg(feature = "postgres")]
pub(crate) fn count_n(name: &'static str, n: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!(name).increment(n);
    #[cfg(not(feature = "metrics"))]
    let _ = (name, n);
}

/// A tiered store call that went on without its front.
pub(crate) fn front_fallback(operation: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_front_fallbacks_total", "operation" => operation).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = operation;
}

/// The tiered store's breaker opened (`true`) or closed.
pub(crate) fn breaker(open: bool) {
    #[cfg(feature = "metrics")]
    {
        let to = if open { "open" } else { "closed" };
        metrics::counter!("idempotency_front_breaker_transitions_total", "to" => to).increment(1);
        metrics::gauge!("idempotency_front_breaker_open").set(if open { 1.0 } else { 0.0 });
    }
    #[cfg(not(feature = "metrics"))]
    let _ = open;
}

/// A key or scope as logs show it: a pseudonym (`#` and 12 hex digits of its SHA-256), the same
/// on every instance, so an operator can follow one key through the logs without the key (a
/// customer's order number, a tenant's name) appearing in them. It is not encryption: a guessable
/// key can be found by hashing guesses. [`IdempotencyLayer::log_keys_in_clear`] shows them as
/// they are.
///
/// [`IdempotencyLayer::log_keys_in_clear`]: crate::IdempotencyLayer::log_keys_in_clear
pub(crate) struct Pseudonym<'a> {
    pub(crate) value: &'a str,
    pub(crate) clear: bool,
}

impl fmt::Display for Pseudonym<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.clear {
            return f.write_str(self.value);
        }
        let digest = Sha256::digest(self.value.as_bytes());
        f.write_str("#")?;
        digest[..6].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A record's scope and key as logs show them.
pub(crate) struct ShownRecord<'a> {
    pub(crate) scope: Pseudonym<'a>,
    pub(crate) key: Pseudonym<'a>,
}

impl fmt::Display for ShownRecord<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scope {} key {}", self.scope, self.key)
    }
}

impl fmt::Debug for Pseudonym<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pseudonyms_hide_the_value_and_stay_stable() {
        let hidden = Pseudonym {
            value: "order-42",
            clear: false,
        }
        .to_string();
        assert!(hidden.starts_with('#') && hidden.len() == 13, "{hidden}");
        assert!(!hidden.contains("order-42"));
        let again = Pseudonym {
            value: "order-42",
            clear: false,
        };
        assert_eq!(again.to_string(), hidden);
        let clear = Pseudonym {
            value: "order-42",
            clear: true,
        };
        assert_eq!(clear.to_string(), "order-42");
    }
}
