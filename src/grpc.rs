//! Everything gRPC: telling a gRPC exchange apart, its deadline (`grpc-timeout`), the status
//! codes the layer answers with, and what a finished call's status says about its key.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, header::CONTENT_TYPE};

use crate::headers::IDEMPOTENT_REPLAYED;

/// The gRPC status codes the layer answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// What an exchange speaks, told once from the request's headers where it enters the layer (or
/// the client) and carried with it: the layer answers a gRPC caller with a status in trailers,
/// an HTTP one with a problem document, and the client reads a gRPC answer's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wire {
    Http,
    Grpc,
}

impl Wire {
    /// What a request with these headers speaks.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        if is_grpc(headers) {
            Self::Grpc
        } else {
            Self::Http
        }
    }
}

/// Whether a message with these headers is gRPC.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"))
}

/// The deadline a gRPC caller announces.
const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// The deadline a gRPC caller announced (`grpc-timeout`), if it did.
pub(crate) fn deadline(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(GRPC_TIMEOUT)
        .and_then(|value| parse_timeout(value.as_bytes()))
}

/// Parses a `grpc-timeout` value: up to eight digits and a unit (H, M, S, m, u, n).
fn parse_timeout(value: &[u8]) -> Option<Duration> {
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// How a finished call's `grpc-status` (from the trailers, or the headers of a trailers-only
/// response) bears on its key: `true` when the call's answer is final and worth storing.
pub(crate) fn status_is_final(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> bool {
    let status = trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"));
    match status.map(HeaderValue::as_bytes) {
        // INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNIMPLEMENTED, UNAUTHENTICATED:
        // refused before acting.
        Some(b"3" | b"5" | b"7" | b"12" | b"16") => false,
        // CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL,
        // UNAVAILABLE: the outcome is not the call's final word.
        Some(b"1" | b"2" | b"4" | b"8" | b"10" | b"13" | b"14") | None => false,
        Some(_) => true,
    }
}

/// A trailers-only response with `grpc-status`, `grpc-message` and, when retrying helps,
/// `grpc-retry-pushback-ms`; `replayed` marks an answer that stands for a stored outcome.
pub(crate) fn status_response(
    code: Code,
    message: &str,
    pushback: Option<Duration>,
    replayed: bool,
) -> http::Response<Bytes> {
    let mut response = http::Response::new(Bytes::new());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(code as u16));
    headers.insert("grpc-message", percent_encode(message));
    if let Some(after) = pushback {
        headers.insert(
            "grpc-retry-pushback-ms",
            HeaderValue::from(after.as_millis().max(1) as u64),
        );
    }
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
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
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("50% é"), "50%25 %C3%A9");
    }

    #[test]
    fn timeouts_parse_by_unit_and_refuse_the_malformed() {
        assert_eq!(parse_timeout(b"250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout(b"2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_timeout(b"1H"), Some(Duration::from_secs(3600)));
        for bad in [&b""[..], b"m", b"123456789m", b"12x", b"-1S", b"1.5S"] {
            assert_eq!(parse_timeout(bad), None, "{bad:?}");
        }
    }
}
