//! The answers the layer gives instead of running the handler.
//!
//! HTTP callers get `application/problem+json` (RFC 9457) with one of the stable `type` URIs
//! below (or whatever [`IdempotencyLayer::with_problem_response`] renders from the [`Problem`]);
//! gRPC callers (request `content-type: application/grpc…`) get a trailers-only response with a
//! `grpc-status`, because tonic clients report bare HTTP errors as transport failures.
//!
//! | `type` | HTTP | gRPC | when |
//! |---|---|---|---|
//! | [`INVALID_KEY`] | 400 | INVALID_ARGUMENT | the key is empty, too long, not visible ASCII, malformed, repeated or a list |
//! | [`MISSING_KEY`] | 400 | INVALID_ARGUMENT | the layer requires a key and none was sent (or the JSON body has none where the layer reads it) |
//! | [`NO_SCOPE`] | 500 | INTERNAL | the scope function found no scope for the request (see [`IdempotencyLayer::with_scope`]) |
//! | [`BODY_TOO_LARGE`] | 413 | RESOURCE_EXHAUSTED | the request body is over a size limit (this layer's or one outside it) |
//! | [`BODY_TIMEOUT`] | 408 | DEADLINE_EXCEEDED | the request body did not arrive within the layer's time limit |
//! | [`BODY_UNREADABLE`] | 400 | INVALID_ARGUMENT | the request body failed while being read |
//! | [`KEY_MISMATCH`] | 422 | FAILED_PRECONDITION | the key was used with a different request |
//! | [`IN_FLIGHT`] | 409 + `Retry-After` | ABORTED + `grpc-retry-pushback-ms` | the first request with this key is still running (after the layer waited for it), or its answer is being recovered (`with_recovery`) |
//! | [`REPLAY_NOT_ACCEPTABLE`] | 406 | FAILED_PRECONDITION | the stored response varies (`Vary`) on request headers this retry sends differently |
//! | [`RESPONSE_NOT_STORED`] | 409 | FAILED_PRECONDITION | the request completed, but its response was over the cache limit |
//! | [`OUTCOME_UNKNOWN`] | 409 | FAILED_PRECONDITION | the handler committed, then its instance died before storing a response (and the layer has no recovery hook) |
//! | [`ANSWER_EXPIRED`] | 410 | FAILED_PRECONDITION | the request completed, and its answer is past its retention; a tombstone keeps it from running again (stores `with_tombstones`) |
//! | [`STORE_UNAVAILABLE`] | 503 + `Retry-After` | UNAVAILABLE | the store could not be reached; the handler did not run |
//! | [`HANDLER_FAILED`] | 500 | INTERNAL | the handler panicked or failed |
//! | [`UNVERIFIED`] | 401 (or the status the verifier names) | UNAUTHENTICATED | the [verifier](crate::IdempotencyLayer::with_verifier) refused the request (a webhook's signature or timestamp); its key was not claimed |
//!
//! [`IdempotencyLayer::with_problem_response`]: crate::IdempotencyLayer::with_problem_response
//! [`IdempotencyLayer::with_scope`]: crate::IdempotencyLayer::with_scope

use std::{fmt, time::Duration};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode, header};

use crate::{
    IdempotencyKey, KeyError,
    grpc::{self, Code},
    headers::IDEMPOTENT_REPLAYED,
};

/// `type` of a 400: the idempotency key header is invalid or repeated.
pub const INVALID_KEY: &str = "urn:tower-idempotency:problem:invalid-key";
/// `type` of a 400: the layer requires an idempotency key and none was sent.
pub const MISSING_KEY: &str = "urn:tower-idempotency:problem:missing-key";
/// `type` of a 500: the scope function found no scope for the request.
pub const NO_SCOPE: &str = "urn:tower-idempotency:problem:no-scope";
/// `type` of a 413: the request body is over a size limit.
pub const BODY_TOO_LARGE: &str = "urn:tower-idempotency:problem:body-too-large";
/// `type` of a 408: the request body did not arrive in time.
pub const BODY_TIMEOUT: &str = "urn:tower-idempotency:problem:body-timeout";
/// `type` of a 400: the request body failed while being read.
pub const BODY_UNREADABLE: &str = "urn:tower-idempotency:problem:body-unreadable";
/// `type` of a 422: the key was first used with a different request.
pub const KEY_MISMATCH: &str = "urn:tower-idempotency:problem:key-mismatch";
/// `type` of a 409: a request with this key is still running.
pub const IN_FLIGHT: &str = "urn:tower-idempotency:problem:in-flight";
/// `type` of a 406: the stored response cannot be replayed to a request that negotiates
/// differently.
pub const REPLAY_NOT_ACCEPTABLE: &str = "urn:tower-idempotency:problem:replay-not-acceptable";
/// `type` of a 409: the request completed, but its response was too large to store.
pub const RESPONSE_NOT_STORED: &str = "urn:tower-idempotency:problem:response-not-stored";
/// `type` of a 409: the request's write committed, but its response was lost with its instance.
pub const OUTCOME_UNKNOWN: &str = "urn:tower-idempotency:problem:outcome-unknown";
/// `type` of a 410: the request completed and its answer is past its retention; it will not run
/// again.
pub const ANSWER_EXPIRED: &str = "urn:tower-idempotency:problem:answer-expired";
/// `type` of a 503: the idempotency store could not be reached.
pub const STORE_UNAVAILABLE: &str = "urn:tower-idempotency:problem:store-unavailable";
/// `type` of a 500: the handler panicked or failed.
pub const HANDLER_FAILED: &str = "urn:tower-idempotency:problem:handler-failed";
/// `type` of a 401 (or the verifier's own 4xx): the request failed the layer's verifier, and its
/// key was not claimed.
pub const UNVERIFIED: &str = "urn:tower-idempotency:problem:unverified";

/// How long a client is told to wait after a 503 from an unreachable store.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Why the layer answered itself.
#[derive(Debug, Clone)]
pub(crate) enum Rejection {
    InvalidKey(KeyError),
    MissingKey,
    /// The JSON body has no key at the layer's pointer.
    NoKeyInBody {
        pointer: std::sync::Arc<str>,
    },
    Unverified(Unverified),
    NoScope,
    /// `limit` is this layer's limit when it is the one that tripped.
    BodyTooLarge {
        limit: Option<usize>,
    },
    BodyTimeout {
        after: Duration,
    },
    BodyUnreadable,
    Mismatch,
    InFlight {
        retry_after: Duration,
    },
    NotAcceptable {
        headers: Vec<HeaderName>,
    },
    ResponseNotStored {
        status: StatusCode,
    },
    OutcomeUnknown,
    AnswerExpired {
        status: StatusCode,
        completed_ago: Duration,
    },
    StoreUnavailable,
    HandlerFailed,
}

impl Rejection {
    /// Status, `type`, title and gRPC code.
    fn describe(&self) -> (StatusCode, &'static str, &'static str, Code) {
        use Code::*;
        use Rejection::*;
        #[rustfmt::skip]
        let (status, type_uri, title, code) = match self {
            InvalidKey(_) => (400, INVALID_KEY, "Invalid idempotency key", InvalidArgument),
            MissingKey | NoKeyInBody { .. } => (400, MISSING_KEY, "Idempotency key required", InvalidArgument),
            Unverified(unverified) => (unverified.status.as_u16(), UNVERIFIED, "Request not verified", Unauthenticated),
            NoScope => (500, NO_SCOPE, "No idempotency scope", Internal),
            BodyTooLarge { .. } => (413, BODY_TOO_LARGE, "Request body too large", ResourceExhausted),
            BodyTimeout { .. } => (408, BODY_TIMEOUT, "Request body timed out", DeadlineExceeded),
            BodyUnreadable => (400, BODY_UNREADABLE, "Request body unreadable", InvalidArgument),
            Mismatch => (422, KEY_MISMATCH, "Idempotency key reused with a different request", FailedPrecondition),
            InFlight { .. } => (409, IN_FLIGHT, "Request in progress", Aborted),
            NotAcceptable { .. } => (406, REPLAY_NOT_ACCEPTABLE, "Stored response not acceptable", FailedPrecondition),
            ResponseNotStored { .. } => (409, RESPONSE_NOT_STORED, "Response not stored", FailedPrecondition),
            OutcomeUnknown => (409, OUTCOME_UNKNOWN, "Outcome unknown", FailedPrecondition),
            AnswerExpired { .. } => (410, ANSWER_EXPIRED, "Answer expired", FailedPrecondition),
            StoreUnavailable => (503, STORE_UNAVAILABLE, "Idempotency store unavailable", Unavailable),
            HandlerFailed => (500, HANDLER_FAILED, "Request failed", Internal),
        };
        let status = StatusCode::from_u16(status).expect("the statuses above are valid");
        (status, type_uri, title, code)
    }

    fn detail(&self) -> String {
        use Rejection::*;
        match self {
            InvalidKey(error) => error.to_string(),
            MissingKey => "this endpoint requires an idempotency key header".into(),
            NoKeyInBody { pointer } => format!("this endpoint requires an idempotency key in the JSON request body, at {pointer}"),
            Unverified(unverified) => unverified.reason.clone(),
            NoScope => "the request could not be attributed to a caller, so its idempotency key has no scope; the layer that authenticates requests must run before (outside) the idempotency layer".into(),
            BodyTooLarge { limit: Some(limit) } => {
                format!("the request body is over the {limit}-byte limit")
            }
            BodyTooLarge { limit: None } => "the request body is over a size limit".into(),
            BodyTimeout { after } => format!(
                "the request body did not arrive within {} ms",
                after.as_millis()
            ),
            BodyUnreadable => "the request body could not be read".into(),
            Mismatch => "this idempotency key was first used with a different method, path, query, content type, body or headers; use a new key for a new request".into(),
            InFlight { .. } => "a request with this idempotency key is still being processed; retry after the indicated time".into(),
            NotAcceptable { headers } => {
                let names: Vec<&str> = headers.iter().map(HeaderName::as_str).collect();
                format!("the request with this idempotency key completed, and its stored response depends on request headers ({}) that this retry sends differently; retry with the same headers as the first request", names.join(", "))
            }
            ResponseNotStored { status } => format!("the request with this idempotency key completed with status {}, but its response was too large to store for replay; it will not run again", status.as_u16()),
            OutcomeUnknown => "the request with this idempotency key committed its changes, but its response was lost; it will not run again: look the result up instead of retrying".into(),
            AnswerExpired { status, completed_ago } => format!("the request with this idempotency key completed {} s ago with status {}, and its answer is no longer kept; it will not run again: look the result up instead of retrying, or use a new key for a new request", completed_ago.as_secs(), status.as_u16()),
            StoreUnavailable => "the idempotency store could not be reached, so the request was not processed; retry with the same key".into(),
            HandlerFailed => "the request failed; retry with the same key".into(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::InFlight { retry_after } => Some(*retry_after),
            Rejection::StoreUnavailable => Some(STORE_RETRY_AFTER),
            _ => None,
        }
    }

    /// What the layer did, for operators.
    pub(crate) fn outcome(&self) -> crate::IdempotencyOutcome {
        use crate::IdempotencyOutcome as O;
        match self {
            Rejection::InvalidKey(_) | Rejection::MissingKey | Rejection::NoKeyInBody { .. } => {
                O::InvalidKey
            }
            Rejection::Unverified(_) => O::Unverified,
            Rejection::NoScope => O::NoScope,
            Rejection::BodyTooLarge { .. } => O::BodyTooLarge,
            Rejection::BodyTimeout { .. } => O::BodyTimeout,
            Rejection::BodyUnreadable => O::BodyUnreadable,
            Rejection::Mismatch => O::Mismatch,
            Rejection::InFlight { .. } => O::InFlight,
            Rejection::NotAcceptable { .. } => O::NotAcceptable,
            Rejection::ResponseNotStored { .. } => O::ResponseNotStored,
            Rejection::OutcomeUnknown => O::OutcomeUnknown,
            Rejection::AnswerExpired { .. } => O::AnswerExpired,
            Rejection::StoreUnavailable => O::StoreUnavailable,
            Rejection::HandlerFailed => O::HandlerFailed,
        }
    }

    /// The problem this rejection is, about `key` if known.
    pub(crate) fn problem(self, key: Option<&IdempotencyKey>) -> Problem {
        let (status, type_uri, title, grpc_code) = self.describe();
        Problem {
            status,
            type_uri,
            title,
            detail: self.detail(),
            key: key.cloned(),
            retry_after: self.retry_after(),
            replayed: matches!(self, Rejection::ResponseNotStored { .. }),
            grpc_code,
        }
    }
}

/// Why a [verifier](crate::IdempotencyLayer::with_verifier) refused a request: answered
/// [`UNVERIFIED`], 401 unless it names another client-error status, with its reason as the
/// problem's `detail`. Say what failed ("no signature matches", "the timestamp is 7 minutes
/// old"), never the secret or the signature expected.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::problem::Unverified;
///
/// let forged = Unverified::new("no signature matches");
/// assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
/// let malformed = Unverified::new("no Stripe-Signature header").with_status(StatusCode::BAD_REQUEST);
/// assert_eq!(malformed.status(), StatusCode::BAD_REQUEST);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unverified {
    status: StatusCode,
    reason: String,
}

impl Unverified {
    /// A refusal, answered 401 with `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            reason: reason.into(),
        }
    }

    /// Answered with `status` instead (400 for a malformed delivery, say), if it is a client
    /// error (4xx); any other status leaves it at 401.
    #[must_use]
    pub fn with_status(mut self, status: StatusCode) -> Self {
        if status.is_client_error() {
            self.status = status;
        }
        self
    }

    /// The status it is answered with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Why the request was refused.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Unverified {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request not verified ({}): {}", self.status, self.reason)
    }
}

impl std::error::Error for Unverified {}

/// An answer the layer gives instead of the handler's: what went wrong, as RFC 9457 describes a
/// problem. [`to_response`](Self::to_response) renders it as `application/problem+json`; a
/// hook given to [`IdempotencyLayer::with_problem_response`](crate::IdempotencyLayer::with_problem_response)
/// can render it in an application's own error envelope instead.
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    type_uri: &'static str,
    title: &'static str,
    detail: String,
    key: Option<IdempotencyKey>,
    retry_after: Option<Duration>,
    replayed: bool,
    grpc_code: Code,
}

impl Problem {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable `type` URI (one of this module's constants): match on it, not on the text.
    pub fn type_uri(&self) -> &'static str {
        self.type_uri
    }

    /// A short, stable summary.
    pub fn title(&self) -> &'static str {
        self.title
    }

    /// What happened to this request and what the client should do.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The idempotency key concerned, once the header was read.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// How long the client should wait before retrying, when retrying helps (409 in flight, 503).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether this answer stands for a stored outcome (it then carries `Idempotent-Replayed`).
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// The default rendering: an `application/problem+json` body with `type`, `title`, `status`,
    /// `detail` and `idempotency_key`, a `Retry-After` header in whole seconds (rounded up, at
    /// least 1) when [`retry_after`](Self::retry_after) is set, and `Idempotent-Replayed: true`
    /// when [`replayed`](Self::replayed).
    pub fn to_response(&self) -> http::Response<Bytes> {
        let mut body = serde_json::json!({
            "type": self.type_uri,
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(key) = &self.key {
            body["idempotency_key"] = key.as_str().into();
        }
        let mut response = http::Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        self.add_headers(&mut response);
        response
    }

    /// The `Retry-After` and `Idempotent-Replayed` headers this problem calls for.
    fn add_headers(&self, response: &mut http::Response<Bytes>) {
        let headers = response.headers_mut();
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up: "Retry-After: 0" would invite an immediate retry.
            let secs = after.as_millis().div_ceil(1000).max(1) as u64;
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.replayed {
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
    }

    /// The rendering for a gRPC caller: a trailers-only response with `grpc-status`,
    /// `grpc-message` and, when retrying helps, `grpc-retry-pushback-ms`.
    pub(crate) fn to_grpc_response(&self) -> http::Response<Bytes> {
        grpc::status_response(
            self.grpc_code,
            &self.detail,
            self.retry_after,
            self.replayed,
        )
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.title,
            self.detail
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_rejections_are_problem_documents() {
        let key = IdempotencyKey::try_from("k-1").unwrap();
        let response = Rejection::InFlight {
            retry_after: Duration::from_millis(1500),
        }
        .problem(Some(&key))
        .to_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(response.headers()["retry-after"], "2");
        let body: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(body["type"], IN_FLIGHT);
        assert_eq!(body["status"], 409);
        assert_eq!(body["idempotency_key"], "k-1");
    }

    #[test]
    fn retry_after_is_never_zero() {
        let response = Rejection::InFlight {
            retry_after: Duration::from_millis(3),
        }
        .problem(None)
        .to_response();
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn grpc_rejections_are_trailers_only_statuses() {
        let response = Rejection::Mismatch.problem(None).to_grpc_response();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "9");
        assert!(response.body().is_empty());
        let message = response.headers()["grpc-message"].to_str().unwrap();
        assert!(message.contains("different method"), "{message}");
        let pushback = Rejection::InFlight {
            retry_after: Duration::from_millis(250),
        }
        .problem(None)
        .to_grpc_response();
        assert_eq!(pushback.headers()["grpc-retry-pushback-ms"], "250");
    }

    #[test]
    fn the_size_limit_named_is_the_one_that_tripped() {
        let ours = Rejection::BodyTooLarge { limit: Some(16) }.problem(None);
        assert!(ours.detail().contains("16-byte"), "{ours}");
        let outer = Rejection::BodyTooLarge { limit: None }.problem(None);
        assert!(!outer.detail().contains("byte limit"), "{outer}");
        assert_eq!(outer.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }
}
