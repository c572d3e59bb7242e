//! The answers the layer gives instead of running the handler.
//!
//! HTTP callers get `application/problem+json` (RFC 9457) with one of the stable `type` URIs
//! below; gRPC callers (request `content-type: application/grpc…`) get a trailers-only response
//! with a `grpc-status`, because tonic clients report bare HTTP errors as transport failures.
//!
//! | `type` | HTTP | gRPC | when |
//! |---|---|---|---|
//! | [`INVALID_KEY`] | 400 | INVALID_ARGUMENT | the key is empty, too long, not visible ASCII, malformed or repeated |
//! | [`MISSING_KEY`] | 400 | INVALID_ARGUMENT | the layer requires a key and none was sent |
//! | [`BODY_TOO_LARGE`] | 413 | RESOURCE_EXHAUSTED | the request body is over the limit |
//! | [`BODY_UNREADABLE`] | 400 | INVALID_ARGUMENT | the request body failed while being read |
//! | [`KEY_MISMATCH`] | 422 | FAILED_PRECONDITION | the key was used with a different request |
//! | [`IN_FLIGHT`] | 409 + `Retry-After` | ABORTED + `grpc-retry-pushback-ms` | the first request with this key is still running |
//! | [`RESPONSE_NOT_STORED`] | 409 | FAILED_PRECONDITION | the request completed, but its response was over the cache limit |
//! | [`OUTCOME_UNKNOWN`] | 409 | FAILED_PRECONDITION | the handler committed, then its instance died before storing a response |
//! | [`STORE_UNAVAILABLE`] | 503 + `Retry-After` | UNAVAILABLE | the store could not be reached; the handler did not run |
//! | [`HANDLER_FAILED`] | 500 | INTERNAL | the handler panicked or failed |

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};

use crate::{IdempotencyKey, KeyError};

/// `type` of a 400: the `Idempotency-Key` header is invalid or repeated.
pub const INVALID_KEY: &str = "urn:tower-idempotency:problem:invalid-key";
/// `type` of a 400: the layer requires an `Idempotency-Key` and none was sent.
pub const MISSING_KEY: &str = "urn:tower-idempotency:problem:missing-key";
/// `type` of a 413: the request body is over the layer's limit.
pub const BODY_TOO_LARGE: &str = "urn:tower-idempotency:problem:body-too-large";
/// `type` of a 400: the request body failed while being read.
pub const BODY_UNREADABLE: &str = "urn:tower-idempotency:problem:body-unreadable";
/// `type` of a 422: the key was first used with a different request.
pub const KEY_MISMATCH: &str = "urn:tower-idempotency:problem:key-mismatch";
/// `type` of a 409: a request with this key is still running.
pub const IN_FLIGHT: &str = "urn:tower-idempotency:problem:in-flight";
/// `type` of a 409: the request completed, but its response was too large to store.
pub const RESPONSE_NOT_STORED: &str = "urn:tower-idempotency:problem:response-not-stored";
/// `type` of a 409: the request's write committed, but its response was lost with its instance.
pub const OUTCOME_UNKNOWN: &str = "urn:tower-idempotency:problem:outcome-unknown";
/// `type` of a 503: the idempotency store could not be reached.
pub const STORE_UNAVAILABLE: &str = "urn:tower-idempotency:problem:store-unavailable";
/// `type` of a 500: the handler panicked or failed.
pub const HANDLER_FAILED: &str = "urn:tower-idempotency:problem:handler-failed";

/// How long a client is told to wait after a 503 from an unreachable store.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Why the layer answered itself.
#[derive(Debug)]
pub(crate) enum Rejection {
    InvalidKey(KeyError),
    MissingKey,
    BodyTooLarge { limit: usize },
    BodyUnreadable,
    Mismatch,
    InFlight { retry_after: Duration },
    ResponseNotStored { status: StatusCode },
    OutcomeUnknown,
    StoreUnavailable,
    HandlerFailed,
}

/// gRPC status codes used below.
mod code {
    pub(super) const INVALID_ARGUMENT: u8 = 3;
    pub(super) const FAILED_PRECONDITION: u8 = 9;
    pub(super) const ABORTED: u8 = 10;
    pub(super) const RESOURCE_EXHAUSTED: u8 = 8;
    pub(super) const INTERNAL: u8 = 13;
    pub(super) const UNAVAILABLE: u8 = 14;
}

impl Rejection {
    fn describe(&self) -> (StatusCode, &'static str, &'static str, u8) {
        use Rejection::*;
        match self {
            InvalidKey(_) => (
                StatusCode::BAD_REQUEST,
                INVALID_KEY,
                "Invalid idempotency key",
                code::INVALID_ARGUMENT,
            ),
            MissingKey => (
                StatusCode::BAD_REQUEST,
                MISSING_KEY,
                "Idempotency key required",
                code::INVALID_ARGUMENT,
            ),
            BodyTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                BODY_TOO_LARGE,
                "Request body too large",
                code::RESOURCE_EXHAUSTED,
            ),
            BodyUnreadable => (
                StatusCode::BAD_REQUEST,
                BODY_UNREADABLE,
                "Request body unreadable",
                code::INVALID_ARGUMENT,
            ),
            Mismatch => (
                StatusCode::UNPROCESSABLE_ENTITY,
                KEY_MISMATCH,
                "Idempotency key reused with a different request",
                code::FAILED_PRECONDITION,
            ),
            InFlight { .. } => (
                StatusCode::CONFLICT,
                IN_FLIGHT,
                "Request in progress",
                code::ABORTED,
            ),
            ResponseNotStored { .. } => (
                StatusCode::CONFLICT,
                RESPONSE_NOT_STORED,
                "Response not stored",
                code::FAILED_PRECONDITION,
            ),
            OutcomeUnknown => (
                StatusCode::CONFLICT,
                OUTCOME_UNKNOWN,
                "Outcome unknown",
                code::FAILED_PRECONDITION,
            ),
            StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                STORE_UNAVAILABLE,
                "Idempotency store unavailable",
                code::UNAVAILABLE,
            ),
            HandlerFailed => (
                StatusCode::INTERNAL_SERVER_ERROR,
                HANDLER_FAILED,
                "Request failed",
                code::INTERNAL,
            ),
        }
    }

    fn detail(&self) -> String {
        use Rejection::*;
        match self {
            InvalidKey(error) => error.to_string(),
            MissingKey => "this endpoint requires an Idempotency-Key header".into(),
            BodyTooLarge { limit } => format!("the request body is over the {limit}-byte limit"),
            BodyUnreadable => "the request body could not be read".into(),
            Mismatch => "this idempotency key was first used with a different method, path, query, body or headers; use a new key for a new request".into(),
            InFlight { .. } => "a request with this idempotency key is still being processed; retry after the indicated time".into(),
            ResponseNotStored { status } => format!("the request with this idempotency key completed with status {}, but its response was too large to store for replay; it will not run again", status.as_u16()),
            OutcomeUnknown => "the request with this idempotency key committed its changes, but its response was lost; it will not run again: look the result up instead of retrying".into(),
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

    /// Renders the rejection for an HTTP or a gRPC caller.
    pub(crate) fn into_response(
        self,
        key: Option<&IdempotencyKey>,
        grpc: bool,
    ) -> http::Response<Bytes> {
        let (status, type_uri, title, grpc_code) = self.describe();
        let detail = self.detail();
        let retry_after = self.retry_after();
        if grpc {
            let mut response = http::Response::new(Bytes::new());
            let headers = response.headers_mut();
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/grpc"),
            );
            headers.insert("grpc-status", HeaderValue::from(u16::from(grpc_code)));
            headers.insert("grpc-message", percent_encode(&detail));
            if let Some(after) = retry_after {
                headers.insert(
                    "grpc-retry-pushback-ms",
                    HeaderValue::from(after.as_millis() as u64),
                );
            }
            return response;
        }
        let mut body = serde_json::json!({
            "type": type_uri,
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        if let Some(key) = key {
            body["idempotency_key"] = key.as_str().into();
        }
        let mut response = http::Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            // Whole seconds, rounded up: "Retry-After: 0" would invite an immediate retry.
            let secs = after.as_millis().div_ceil(1000).max(1) as u64;
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%` itself.
fn percent_encode(message: &str) -> HeaderValue {
    let mut out = String::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::try_from(out).expect("percent-encoded text is a valid header value")
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
        .into_response(Some(&key), false);
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
        .into_response(None, false);
        assert_eq!(response.headers()["retry-after"], "1");
    }

    #[test]
    fn grpc_rejections_are_trailers_only_statuses() {
        let response = Rejection::Mismatch.into_response(None, true);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "9");
        assert!(response.body().is_empty());
        let message = response.headers()["grpc-message"].to_str().unwrap();
        assert!(message.contains("different method"), "{message}");
        assert_eq!(percent_encode("50% é"), "50%25 %C3%A9");
    }
}
