//! What operators see: the layer's own [`Counters`], metrics through the `metrics` facade
//! (feature `metrics`), and keys in logs as pseudonyms.
//!
//! Every event is recorded in one place, which counts it in both: the process-local
//! [`Counters`] of the layer ([`IdempotencyLayer::counters`](crate::IdempotencyLayer::counters)),
//! kept whatever the features, and the facade's metrics below.
//!
//! # Metrics
//!
//! With the `metrics` feature the crate records these through the [`metrics`] facade; install
//! any recorder (`metrics-exporter-prometheus`, say) to export them. Without a recorder, or
//! without the feature, they cost nothing.
//!
//! | name | kind | labels | what it counts |
//! |---|---|---|---|
//! | `idempotency_requests_total` | counter | `outcome`, `store` | guarded requests, by [`IdempotencyOutcome`] and store kind |
//! | `idempotency_handler_seconds` | histogram | `store` | how long handlers ran |
//! | `idempotency_units_total` | counter | `outcome`, `store` | deliveries of units of work ([`Once`](crate::work::Once)), by what became of them: `executed`, `replayed`, `failed`, `in_flight`, `mismatch`, `outcome_unknown`, `superseded`, `store_unavailable` |
//! | `idempotency_unit_seconds` | histogram | `store` | how long units of work ran |
//! | `idempotency_store_call_seconds` | histogram | `operation`, `store` | claim, renew, complete and release calls, errors included |
//! | `idempotency_store_errors_total` | counter | `operation`, `store` | store calls that failed |
//! | `idempotency_claims_held` | gauge | | keys this instance holds right now (handlers running, finalizes retried) |
//! | `idempotency_waits_total` | counter | | requests that found their key in flight and waited |
//! | `idempotency_wait_wakeups_total` | counter | `by` (`process`, `store`, `poll`) | what ended each pause of a waiting request: its owner in this process finalizing, the store's word from another instance, or a poll (the slow backstop, the holder's lease ending, or a store without word) |
//! | `idempotency_leases_lost_total` | counter | | leases found in another owner's hands (the stale owner wrote nothing) |
//! | `idempotency_grants_lapsed_total` | counter | | claims granted whose lease ran out before this process could act on them (its runtime was blocked): not run, claimed again |
//! | `idempotency_finalize_failures_total` | counter | | finalizes still failing after the quick retries (then retried with the key held) |
//! | `idempotency_front_fallbacks_total` | counter | `operation` | tiered store calls that went on without the front (skipped by the breaker, or failed) |
//! | `idempotency_front_breaker_transitions_total` | counter | `to` (`open`, `closed`) | the tiered store's breaker opening and closing |
//! | `idempotency_front_breaker_open` | gauge | | 1 while the breaker skips the front |
//! | `idempotency_swept_rows_total` | counter | | expired Postgres rows the sweeper deleted |
//! | `idempotency_completer_found_total` | counter | | keys the [completer](crate::completer) found abandoned (a key found again in a later round counts again) |
//! | `idempotency_completer_finished_total` | counter | | abandoned keys it finished: resumed to an answer, or answered by the recovery hook |
//! | `idempotency_completer_failed_total` | counter | | abandoned keys it could not finish (the admin listing says why) |
//! | `idempotency_completer_oldest_abandoned_seconds` | gauge | | how long ago the lease of the oldest key it found ran out, at its last round |
//! | `idempotency_client_retries_total` | counter | | attempts the client layer made again, with the same key |
//! | `idempotency_client_retries_denied_total` | counter | | retries the client's budget refused |
//!
//! Units of work count apart from requests: they are not in `idempotency_requests_total` nor
//! `idempotency_handler_seconds`; the other metrics (store calls, leases, waits) are shared.
//!
//! When a layer (or a [`Once`](crate::work::Once), a tiered or a Postgres store) is built, its
//! counters and gauges are registered at zero, every outcome of `idempotency_requests_total`
//! and `idempotency_units_total` included, so that dashboards and alerts see them before the
//! first event (a panel on `outcome_unknown` has a series, not "No data").
//!
//! # Histograms
//!
//! A latency is worth a histogram, not a summary: quantiles of summaries cannot be added up
//! across instances, so a fleet's p99 needs buckets. [`HISTOGRAMS`] gives each histogram the
//! crate records with buckets for what it measures: store calls from 100 µs to 10 s (a Redis
//! call takes a fraction of a millisecond, a Postgres claim a few, a timeout is 250 ms to 5 s),
//! handlers from 1 ms to 5 minutes. Give them to the exporter:
//!
//! ```
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//! use tower_idempotency::telemetry::HISTOGRAMS;
//!
//! let mut builder = PrometheusBuilder::new();
//! for (name, buckets) in HISTOGRAMS {
//!     builder = builder.set_buckets_for_metric(Matcher::Full(name.into()), buckets)?;
//! }
//! // builder.install_recorder()?, then serve its handle's render() on /metrics.
//! # Ok::<(), metrics_exporter_prometheus::BuildError>(())
//! ```
//!
//! The repository's `contrib/` has a Grafana dashboard and Prometheus alert rules built on
//! these names.
//!
//! [`metrics`]: https://docs.rs/metrics

mod pseudonym;
mod registration;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

pub(crate) use self::{
    pseudonym::{Pseudonym, ShownRecord},
    registration::*,
};
use crate::{
    IdempotencyOutcome,
    stripes::{self, Padded, STRIPES},
};

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident,)*) => {
        /// Live counters shared by every service a layer built; read them with
        /// [`snapshot`](Counters::snapshot). Get them from [`IdempotencyLayer::counters`](crate::IdempotencyLayer::counters).
        #[derive(Default)]
        pub struct Counters {
            /// Each thread counts in its own stripe (see `crate::stripes`): a count every
            /// request makes would otherwise move one cache line between the workers.
            stripes: [Padded<Cells>; STRIPES],
        }

        /// One stripe of the counters.
        #[derive(Debug, Default)]
        pub(crate) struct Cells {
            $(pub(crate) $name: AtomicU64,)*
        }

        /// The counters at one instant.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct CountersSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Counters {
            /// Reads every counter.
            pub fn snapshot(&self) -> CountersSnapshot {
                let mut snapshot = CountersSnapshot::default();
                for cells in &self.stripes {
                    $(snapshot.$name += cells.$name.load(Relaxed);)*
                }
                snapshot
            }

            /// The calling thread's stripe.
            fn mine(&self) -> &Cells {
                &self.stripes[stripes::mine()]
            }

            fn add(&self, pick: impl FnOnce(&Cells) -> &AtomicU64) {
                pick(self.mine()).fetch_add(1, Relaxed);
            }
        }
    };
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Counters").field(&self.snapshot()).finish()
    }
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
    /// Pauses of a waiting request that the store's word ended (the key completed or was
    /// released on another instance), or this process's owner's.
    woken,
    /// Pauses of a waiting request that ran their course: the slow poll, or a poll without the
    /// store's word (a store that gives none, or a listener that is not connected).
    polled,
    /// 409 answers to a request whose key was still in flight after the wait (or committed by an
    /// owner that died before storing its response).
    in_flight,
    /// 422 answers to a key reused with a different request.
    mismatches,
    /// 400 answers to a missing or invalid key, or an unreadable body; a request the verifier
    /// refused (401).
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
    /// Claims the store granted whose lease ran out before this process could act on them (its
    /// runtime was blocked when the answer came) while another attempt took the key: the work
    /// did not run under them, and the key was claimed again.
    grants_lapsed,
    /// Finalizations that still failed after the first quick retries: the response is then
    /// retried in the background, with the key held, until the finalize deadline.
    finalize_errors,
    /// Handlers that panicked or returned a service error.
    handler_failures,
}

/// Bucket bounds (seconds) for `idempotency_store_call_seconds`: 100 µs to 10 s, past the
/// stores' default timeouts (250 ms for Redis, 5 s for Postgres), so that calls that run into
/// the timeout show as such instead of pinning every quantile at the top bucket.
pub const STORE_CALL_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Bucket bounds (seconds) for `idempotency_handler_seconds`: 1 ms to 5 minutes.
pub const HANDLER_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// Every histogram the crate records, with its buckets (see [Histograms](self#histograms)).
pub const HISTOGRAMS: [(&str, &[f64]); 3] = [
    ("idempotency_store_call_seconds", STORE_CALL_BUCKETS),
    ("idempotency_handler_seconds", HANDLER_BUCKETS),
    ("idempotency_unit_seconds", HANDLER_BUCKETS),
];

/// Where a layer's services record what they do: each event counted in the layer's
/// [`Counters`] and, with the `metrics` feature, in the facade, labelled with the store kind.
#[derive(Debug, Clone)]
pub(crate) struct Telemetry {
    counters: Arc<Counters>,
    #[cfg(feature = "metrics")]
    keys: Arc<Keys>,
}

/// What a [`Telemetry`] records: guarded requests, or units of work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Requests,
    Units,
}

impl Telemetry {
    pub(crate) fn new(counters: Arc<Counters>, store: &'static str, family: Family) -> Self {
        #[cfg(not(feature = "metrics"))]
        let _ = (store, family);
        Self {
            counters,
            #[cfg(feature = "metrics")]
            keys: Arc::new(Keys::new(store, family)),
        }
    }

    /// The counters this records to.
    pub(crate) fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// A guarded request's outcome: `idempotency_requests_total`, and the counter of the
    /// layer's answer it stands for.
    pub(crate) fn answered(&self, outcome: IdempotencyOutcome) {
        use IdempotencyOutcome as O;
        #[cfg(feature = "metrics")]
        facade::counter(self.keys.request(outcome)).increment(1);
        let c = self.counters.mine();
        let counter = match outcome {
            O::Executed => return,
            O::Replayed | O::ResponseNotStored | O::AnswerExpired => &c.replays,
            O::InFlight | O::OutcomeUnknown => &c.in_flight,
            O::Mismatch | O::NotAcceptable => &c.mismatches,
            O::StoreUnavailable => &c.store_unavailable,
            O::InvalidKey | O::BodyTimeout | O::BodyUnreadable | O::Unverified => &c.bad_requests,
            O::BodyTooLarge => &c.too_large,
            O::NoScope | O::HandlerFailed => &c.handler_failures,
        };
        counter.fetch_add(1, Relaxed);
    }

    /// What became of a delivery of a unit of work: `idempotency_units_total`, and the
    /// counter it stands for.
    pub(crate) fn unit(&self, outcome: UnitOutcome) {
        use UnitOutcome as O;
        #[cfg(feature = "metrics")]
        facade::counter(self.keys.unit(outcome)).increment(1);
        let c = self.counters.mine();
        let counter = match outcome {
            O::Executed | O::Superseded => return,
            O::Replayed | O::AnswerExpired => &c.replays,
            O::Failed => &c.handler_failures,
            O::InFlight | O::OutcomeUnknown => &c.in_flight,
            O::Mismatch => &c.mismatches,
            O::StoreUnavailable => &c.store_unavailable,
        };
        counter.fetch_add(1, Relaxed);
    }

    /// A claim acquired its key: the handler runs.
    pub(crate) fn executing(&self) {
        self.counters.add(|c| &c.executions);
    }

    /// A request found its key in flight and waits for the first one.
    pub(crate) fn waiting(&self) {
        self.counters.add(|c| &c.waits);
        count("idempotency_waits_total");
    }

    /// A pause of a waiting request ended: woken, or polled.
    pub(crate) fn woke(&self, by: Wakeup) {
        match by {
            Wakeup::Process | Wakeup::Store => self.counters.add(|c| &c.woken),
            Wakeup::Poll => self.counters.add(|c| &c.polled),
        }
        #[cfg(feature = "metrics")]
        metrics::counter!("idempotency_wait_wakeups_total", "by" => by.as_str()).increment(1);
    }

    /// A key completed (`true`) or released by its owner.
    pub(crate) fn finalized(&self, completed: bool) {
        self.counters.add(|c| {
            if completed {
                &c.completions
            } else {
                &c.releases
            }
        });
    }

    /// A renewal or finalize found the key in another owner's hands.
    pub(crate) fn lease_lost(&self) {
        self.counters.add(|c| &c.leases_lost);
        count("idempotency_leases_lost_total");
    }

    /// A grant lapsed before the work could start under it: claimed again.
    pub(crate) fn grant_lapsed(&self) {
        self.counters.add(|c| &c.grants_lapsed);
        count("idempotency_grants_lapsed_total");
    }

    /// A finalize still failing after the quick retries: retried with the key held.
    pub(crate) fn finalize_failing(&self) {
        self.counters.add(|c| &c.finalize_errors);
        count("idempotency_finalize_failures_total");
    }

    /// A response over the cache limit, recorded without its body.
    pub(crate) fn response_not_stored(&self) {
        self.counters.add(|c| &c.responses_not_stored);
    }

    /// A handler whose body failed after its head reached the caller (its outcome was already
    /// reported as executed).
    pub(crate) fn body_failed(&self) {
        self.counters.add(|c| &c.handler_failures);
    }

    /// How long a handler (or a unit of work) ran.
    pub(crate) fn handler_took(&self, took: Duration) {
        #[cfg(feature = "metrics")]
        facade::histogram(&self.keys.handler).record(took);
        #[cfg(not(feature = "metrics"))]
        let _ = took;
    }

    /// Runs a store call, timing it and counting it if it fails.
    pub(crate) async fn timed<T, E>(
        &self,
        operation: Operation,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        #[cfg(feature = "metrics")]
        {
            let started = std::time::Instant::now();
            let result = call.await;
            let (timing, errors) = &self.keys.calls[operation as usize];
            facade::histogram(timing).record(started.elapsed());
            if result.is_err() {
                facade::counter(errors).increment(1);
            }
            result
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = operation;
            call.await
        }
    }
}

/// The facade's keys for one layer's labelled events, made once per layer: a key made for each
/// event (as the facade's macros make one whose labels are not literals) costs a vector of
/// labels and a hash, on every request, whether or not a recorder is installed.
#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Keys {
    store: &'static str,
    /// `idempotency_requests_total` by outcome, made on first use.
    requests: [std::sync::OnceLock<metrics::Key>; IdempotencyOutcome::COUNT],
    /// `idempotency_units_total` by outcome, made on first use.
    units: [std::sync::OnceLock<metrics::Key>; UnitOutcome::ALL.len()],
    /// `idempotency_handler_seconds`, or `idempotency_unit_seconds` for units.
    handler: metrics::Key,
    /// `idempotency_store_call_seconds` and `idempotency_store_errors_total`, by operation.
    calls: [(metrics::Key, metrics::Key); Operation::ALL.len()],
}

#[cfg(feature = "metrics")]
impl Keys {
    fn new(store: &'static str, family: Family) -> Self {
        use metrics::{Key, Label};
        let handler = match family {
            Family::Requests => "idempotency_handler_seconds",
            Family::Units => "idempotency_unit_seconds",
        };
        let call = |name: &'static str, operation: Operation| {
            let labels = [("operation", operation.as_str()), ("store", store)];
            Key::from_parts(
                name,
                labels.map(|(k, v)| Label::from_static_parts(k, v)).to_vec(),
            )
        };
        Self {
            store,
            requests: Default::default(),
            units: Default::default(),
            handler: Key::from_parts(handler, vec![Label::from_static_parts("store", store)]),
            calls: Operation::ALL.map(|operation| {
                (
                    call("idempotency_store_call_seconds", operation),
                    call("idempotency_store_errors_total", operation),
                )
            }),
        }
    }

    fn request(&self, outcome: IdempotencyOutcome) -> &metrics::Key {
        self.requests[outcome as usize].get_or_init(|| {
            let labels = [("outcome", outcome.as_str()), ("store", self.store)];
            let labels = labels.map(|(k, v)| metrics::Label::from_static_parts(k, v));
            metrics::Key::from_parts("idempotency_requests_total", labels.to_vec())
        })
    }

    fn unit(&self, outcome: UnitOutcome) -> &metrics::Key {
        self.units[outcome as usize].get_or_init(|| {
            let labels = [("outcome", outcome.as_str()), ("store", self.store)];
            let labels = labels.map(|(k, v)| metrics::Label::from_static_parts(k, v));
            metrics::Key::from_parts("idempotency_units_total", labels.to_vec())
        })
    }
}

/// Recording through keys made beforehand, as the facade's macros record through theirs.
#[cfg(feature = "metrics")]
mod facade {
    use metrics::{Counter, Histogram, Key, Level, Metadata};

    static METADATA: Metadata<'static> =
        Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

    pub(super) fn counter(key: &Key) -> Counter {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA))
    }

    pub(super) fn histogram(key: &Key) -> Histogram {
        metrics::with_recorder(|recorder| recorder.register_histogram(key, &METADATA))
    }
}

/// One more (or one fewer) key held by this instance.
pub(crate) fn claims_held(delta: f64) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("idempotency_claims_held").increment(delta);
    #[cfg(not(feature = "metrics"))]
    let _ = delta;
}

/// What ended a pause of a waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wakeup {
    /// The key's owner in this process finalized it.
    Process,
    /// The store said the key ended (or may have: its listener reconnected).
    Store,
    /// The pause ran its course: the slow poll, the holder's lease ending, or a poll without
    /// the store's word.
    Poll,
}

impl Wakeup {
    #[cfg(feature = "metrics")]
    const ALL: [Self; 3] = [Self::Process, Self::Store, Self::Poll];

    /// The `by` label.
    #[cfg(feature = "metrics")]
    fn as_str(self) -> &'static str {
        match self {
            Self::Process => "process",
            Self::Store => "store",
            Self::Poll => "poll",
        }
    }
}

/// A counter without labels.
fn count(name: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(name).increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = name;
}

/// What one round of the completer found and did (`idempotency_completer_*`): keys found
/// abandoned, finished, failed, and how long ago the oldest one's lease ran out.
pub(crate) fn completer_round(found: u64, finished: u64, failed: u64, oldest: Duration) {
    #[cfg(feature = "metrics")]
    {
        metrics::counter!("idempotency_completer_found_total").increment(found);
        metrics::counter!("idempotency_completer_finished_total").increment(finished);
        metrics::counter!("idempotency_completer_failed_total").increment(failed);
        metrics::gauge!("idempotency_completer_oldest_abandoned_seconds").set(oldest.as_secs_f64());
    }
    #[cfg(not(feature = "metrics"))]
    let _ = (found, finished, failed, oldest);
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
    }
    #[cfg(not(feature = "metrics"))]
    let _ = open;
}

/// Whether the tiered store skips its front right now (`idempotency_front_breaker_open`): from
/// a failure until its cooldown ends, and again while a probe's cooldown runs.
pub(crate) fn front_skipped(skipped: bool) {
    #[cfg(feature = "metrics")]
    metrics::gauge!("idempotency_front_breaker_open").set(if skipped { 1.0 } else { 0.0 });
    #[cfg(not(feature = "metrics"))]
    let _ = skipped;
}

#[cfg(test)]
mod tests {
    /// A store call that runs into its store's default timeout lands in a bucket below the
    /// top one: quantiles during an outage read the timeout, not the top bound.
    #[cfg(all(feature = "postgres", feature = "redis"))]
    #[test]
    fn store_call_buckets_reach_past_the_default_timeouts() {
        let top = STORE_CALL_BUCKETS[STORE_CALL_BUCKETS.len() - 1];
        let below_top = STORE_CALL_BUCKETS[STORE_CALL_BUCKETS.len() - 2];
        for timeout in [
            crate::store::DEFAULT_POSTGRES_TIMEOUT,
            crate::store::DEFAULT_REDIS_TIMEOUT,
        ] {
            assert!(timeout.as_secs_f64() <= below_top, "{timeout:?}");
        }
        assert!(top > below_top);
    }

    use super::*;

    /// The keys made beforehand carry the labels the macros gave: each operation's calls and
    /// errors, and each outcome, under their own names.
    #[cfg(feature = "metrics")]
    #[test]
    fn events_are_recorded_under_their_own_labels() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let telemetry = Telemetry::new(Arc::default(), "memory", Family::Requests);
        let outcomes = [
            IdempotencyOutcome::Executed,
            IdempotencyOutcome::HandlerFailed,
        ];
        metrics::with_local_recorder(&recorder, || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            for (n, operation) in Operation::ALL.into_iter().enumerate() {
                for _ in 0..=n {
                    let failed = telemetry.timed(operation, async { Err::<(), ()>(()) });
                    assert!(runtime.block_on(failed).is_err());
                }
            }
            for outcome in outcomes {
                telemetry.answered(outcome);
            }
        });
        let recorded: Vec<_> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let labels: Vec<_> = key.labels().map(|l| (l.key(), l.value())).collect();
                let count = match value {
                    DebugValue::Counter(n) => n as usize,
                    DebugValue::Histogram(values) => values.len(),
                    DebugValue::Gauge(_) => 0,
                };
                (format!("{} {labels:?}", key.name()), count)
            })
            .collect();
        let count = |name: &str, label: (&str, &str)| {
            let wanted = format!("{name} [{label:?}, (\"store\", \"memory\")]");
            let found = recorded.iter().find(|(key, _)| *key == wanted);
            found
                .map(|(_, n)| *n)
                .unwrap_or_else(|| panic!("{wanted} in {recorded:?}"))
        };
        for (n, operation) in Operation::ALL.into_iter().enumerate() {
            let label = ("operation", operation.as_str());
            assert_eq!(count("idempotency_store_call_seconds", label), n + 1);
            assert_eq!(count("idempotency_store_errors_total", label), n + 1);
        }
        for outcome in outcomes {
            assert_eq!(
                count("idempotency_requests_total", ("outcome", outcome.as_str())),
                1
            );
        }
    }

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
