//! The metrics registered at zero when a layer, a store or a unit runner is built, so that they
//! are exported (and alerts on them evaluate) before their first event; and the labels they
//! take.

/// What became of one delivery of a unit of work: the `outcome` label of
/// `idempotency_units_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnitOutcome {
    Executed,
    Replayed,
    Failed,
    InFlight,
    Mismatch,
    OutcomeUnknown,
    AnswerExpired,
    Superseded,
    StoreUnavailable,
}

#[cfg(feature = "metrics")]
impl UnitOutcome {
    pub(super) const ALL: [Self; 9] = [
        Self::Executed,
        Self::Replayed,
        Self::Failed,
        Self::InFlight,
        Self::Mismatch,
        Self::OutcomeUnknown,
        Self::AnswerExpired,
        Self::Superseded,
        Self::StoreUnavailable,
    ];

    /// The `outcome` label.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Failed => "failed",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::OutcomeUnknown => "outcome_unknown",
            Self::AnswerExpired => "answer_expired",
            Self::Superseded => "superseded",
            Self::StoreUnavailable => "store_unavailable",
        }
    }
}

/// Registers `idempotency_units_total` at zero for every outcome on `store`, and describes it.
pub(crate) fn register_unit_metrics(store: &'static str) {
    #[cfg(not(feature = "metrics"))]
    let _ = store;
    #[cfg(feature = "metrics")]
    {
        metrics::describe_counter!(
            "idempotency_units_total",
            "deliveries of units of work, by outcome and store"
        );
        metrics::describe_histogram!(
            "idempotency_unit_seconds",
            metrics::Unit::Seconds,
            "how long units of work ran"
        );
        for outcome in UnitOutcome::ALL {
            metrics::counter!("idempotency_units_total", "outcome" => outcome.as_str(), "store" => store)
                .increment(0);
        }
    }
}

/// Registers the layer's metrics without labels at zero, with their descriptions, so that they
/// are exported (and alerts on them evaluate) before their first event.
pub(crate) fn register_layer_metrics(store: &'static str) {
    #[cfg(not(feature = "metrics"))]
    let _ = store;
    #[cfg(feature = "metrics")]
    {
        use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
        describe_counter!(
            "idempotency_requests_total",
            "guarded requests, by outcome and store"
        );
        describe_histogram!(
            "idempotency_handler_seconds",
            Unit::Seconds,
            "how long handlers ran"
        );
        describe_histogram!(
            "idempotency_store_call_seconds",
            Unit::Seconds,
            "store calls (claim, renew, complete, release), errors included"
        );
        describe_counter!("idempotency_store_errors_total", "store calls that failed");
        describe_gauge!(
            "idempotency_claims_held",
            "keys this instance holds right now"
        );
        let counters = [
            (
                "idempotency_leases_lost_total",
                "leases found in another owner's hands",
            ),
            (
                "idempotency_grants_lapsed_total",
                "claims granted too late to act on (not run, claimed again)",
            ),
            (
                "idempotency_finalize_failures_total",
                "finalizes still failing after the quick retries",
            ),
        ];
        for (name, help) in counters {
            describe_counter!(name, help);
            metrics::counter!(name).increment(0);
        }
        metrics::gauge!("idempotency_claims_held").increment(0.0);
        register_waits();
        // Every outcome's series, so that a panel or an alert on a rare one (outcome_unknown)
        // has a series from the start, not "No data" until it first happens.
        for outcome in crate::IdempotencyOutcome::ALL {
            metrics::counter!("idempotency_requests_total", "outcome" => outcome.as_str(), "store" => store)
                .increment(0);
        }
        for operation in STORE_OPERATIONS {
            metrics::counter!("idempotency_store_errors_total", "operation" => operation.as_str(), "store" => store)
                .increment(0);
        }
    }
}

/// Registers the waits of duplicates, and what ends their pauses, at zero.
#[cfg(feature = "metrics")]
fn register_waits() {
    metrics::describe_counter!(
        "idempotency_waits_total",
        "requests that found their key in flight and waited"
    );
    metrics::counter!("idempotency_waits_total").increment(0);
    metrics::describe_counter!(
        "idempotency_wait_wakeups_total",
        "what ended each pause of a waiting duplicate: its owner in this process, the store's word, or the slow poll"
    );
    for by in super::Wakeup::ALL {
        metrics::counter!("idempotency_wait_wakeups_total", "by" => by.as_str()).increment(0);
    }
}

/// The store calls whose error counters are registered at zero.
#[cfg(feature = "metrics")]
const STORE_OPERATIONS: [Operation; 4] = [
    Operation::Claim,
    Operation::Renew,
    Operation::Complete,
    Operation::Release,
];

/// A store call the layer times (`operation` label of the store call metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    Claim,
    Adopt,
    Renew,
    Complete,
    Release,
    /// A waiter marking the key it waits for, and listening for its end.
    Mark,
}

#[cfg(feature = "metrics")]
impl Operation {
    pub(super) const ALL: [Self; 6] = [
        Self::Claim,
        Self::Adopt,
        Self::Renew,
        Self::Complete,
        Self::Release,
        Self::Mark,
    ];

    /// The `operation` label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Adopt => "adopt",
            Self::Renew => "renew",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Mark => "mark",
        }
    }
}

/// Registers a tiered store's metrics (the breaker closed, no fallbacks yet).
pub(crate) fn register_tiered_metrics() {
    #[cfg(feature = "metrics")]
    {
        use metrics::{describe_counter, describe_gauge};
        describe_counter!(
            "idempotency_front_fallbacks_total",
            "tiered store calls that went on without the front"
        );
        describe_counter!(
            "idempotency_front_breaker_transitions_total",
            "the tiered store's breaker opening and closing"
        );
        describe_gauge!(
            "idempotency_front_breaker_open",
            "1 while the breaker skips the front"
        );
        metrics::gauge!("idempotency_front_breaker_open").increment(0.0);
        for to in ["open", "closed"] {
            metrics::counter!("idempotency_front_breaker_transitions_total", "to" => to)
                .increment(0);
        }
        for operation in STORE_OPERATIONS {
            metrics::counter!("idempotency_front_fallbacks_total", "operation" => operation.as_str())
                .increment(0);
        }
    }
}

/// Registers the completer's counters and gauge at zero.
pub(crate) fn register_completer_metrics() {
    #[cfg(feature = "metrics")]
    {
        use metrics::{Unit, describe_counter, describe_gauge};
        describe_counter!(
            "idempotency_completer_found_total",
            "keys the completer found abandoned"
        );
        describe_counter!(
            "idempotency_completer_finished_total",
            "abandoned keys the completer finished"
        );
        describe_counter!(
            "idempotency_completer_failed_total",
            "abandoned keys the completer could not finish"
        );
        describe_gauge!(
            "idempotency_completer_oldest_abandoned_seconds",
            Unit::Seconds,
            "how long ago the lease of the oldest abandoned key ran out"
        );
        super::completer_round(0, 0, 0, std::time::Duration::ZERO);
    }
}

/// Registers the Postgres store's sweeper counter at zero.
#[cfg(feature = "postgres")]
pub(crate) fn register_postgres_metrics() {
    #[cfg(feature = "metrics")]
    {
        let name = "idempotency_swept_rows_total";
        metrics::describe_counter!(name, "expired Postgres rows the sweeper deleted");
        metrics::counter!(name).increment(0);
    }
}

/// A client retried a logical call (`idempotency_client_retries_total`).
#[cfg(feature = "client")]
pub(crate) fn client_retry() {
    super::count("idempotency_client_retries_total");
}

/// A client's retry refused by its budget (`idempotency_client_retries_denied_total`).
#[cfg(feature = "client")]
pub(crate) fn client_retry_denied() {
    super::count("idempotency_client_retries_denied_total");
}
