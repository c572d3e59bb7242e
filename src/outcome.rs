//! What the layer did with a request: a response extension, a span field and a metrics label.

use std::fmt;

/// What the layer did with a guarded request, inserted into the response extensions of every
/// answer to one (the handler's own answer included), so that layers outside it (a trace or an
/// HTTP metrics layer) can label requests without this crate's counters. Also the `outcome`
/// field of the request's `idempotency` span and label of the `idempotency_requests_total`
/// metric ([`as_str`](Self::as_str)).
///
/// ```
/// use tower_idempotency::IdempotencyOutcome;
///
/// # let response = http::Response::new(());
/// match response.extensions().get::<IdempotencyOutcome>() {
///     Some(IdempotencyOutcome::Replayed) => { /* a retry, answered from the store */ }
///     Some(outcome) => println!("idempotency: {outcome}"),
///     None => { /* not a guarded request */ }
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum IdempotencyOutcome {
    /// The handler ran; its response is stored or its key released per the completion policy.
    Executed,
    /// A stored response was replayed.
    Replayed,
    /// The key was still in flight after the wait: 409.
    InFlight,
    /// The key was first used with a different request: 422.
    Mismatch,
    /// The stored response varies on request headers this retry sends differently: 406.
    NotAcceptable,
    /// The request completed, but its response was too large to store: 409.
    ResponseNotStored,
    /// The handler committed and its instance died before storing a response: 409.
    OutcomeUnknown,
    /// The key completed past its retention: its answer is gone, a tombstone keeps it from
    /// running again: 410.
    AnswerExpired,
    /// The store could not be reached: 503, the handler did not run.
    StoreUnavailable,
    /// The key header is invalid, repeated, or missing where required: 400.
    InvalidKey,
    /// The scope function found no scope: 500.
    NoScope,
    /// The body is over a size limit: 413.
    BodyTooLarge,
    /// The body did not arrive in time: 408.
    BodyTimeout,
    /// The body failed while being read: 400.
    BodyUnreadable,
    /// The layer's verifier refused the request (a webhook's signature): 401, its key not
    /// claimed.
    Unverified,
    /// The handler panicked or failed: 500, the key released.
    HandlerFailed,
}

impl IdempotencyOutcome {
    /// How many outcomes there are: the last one's discriminant, plus one (`HandlerFailed` stays
    /// the last variant).
    #[cfg(feature = "metrics")]
    pub(crate) const COUNT: usize = Self::HandlerFailed as usize + 1;

    /// Every outcome, in declaration order.
    #[cfg(feature = "metrics")]
    pub(crate) const ALL: [Self; Self::COUNT] = [
        Self::Executed,
        Self::Replayed,
        Self::InFlight,
        Self::Mismatch,
        Self::NotAcceptable,
        Self::ResponseNotStored,
        Self::OutcomeUnknown,
        Self::AnswerExpired,
        Self::StoreUnavailable,
        Self::InvalidKey,
        Self::NoScope,
        Self::BodyTooLarge,
        Self::BodyTimeout,
        Self::BodyUnreadable,
        Self::Unverified,
        Self::HandlerFailed,
    ];

    /// A stable, lowercase name: `executed`, `replayed`, `in_flight`, …
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::InFlight => "in_flight",
            Self::Mismatch => "mismatch",
            Self::NotAcceptable => "not_acceptable",
            Self::ResponseNotStored => "response_not_stored",
            Self::OutcomeUnknown => "outcome_unknown",
            Self::AnswerExpired => "answer_expired",
            Self::StoreUnavailable => "store_unavailable",
            Self::InvalidKey => "invalid_key",
            Self::NoScope => "no_scope",
            Self::BodyTooLarge => "body_too_large",
            Self::BodyTimeout => "body_timeout",
            Self::BodyUnreadable => "body_unreadable",
            Self::Unverified => "unverified",
            Self::HandlerFailed => "handler_failed",
        }
    }

    /// Whether the layer answered instead of the handler (everything but `Executed`).
    pub fn answered_by_layer(&self) -> bool {
        !matches!(self, Self::Executed)
    }
}

impl fmt::Display for IdempotencyOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
