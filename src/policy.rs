//! Which responses are stored for replay, and which free the key for a clean retry.

use std::{fmt, sync::Arc};

use http::{HeaderMap, StatusCode, header::CONTENT_TYPE};

/// What happens to a key once its handler has answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Store the response; every later retry gets it replayed.
    Complete,
    /// Delete the key; the next retry runs the handler again.
    Release,
}

/// Decides [`Completion`] from a finished response.
///
/// The default ([`CompletionPolicy::default`]):
///
/// - HTTP: `Complete` for status < 500, except 408, 409, 425 and 429 (answers that mean "try
///   again"); `Release` for those and every 5xx.
/// - gRPC (`content-type: application/grpc…`): read `grpc-status` from the trailers (or from the
///   headers of a trailers-only response). `Release` for CANCELLED, UNKNOWN, DEADLINE_EXCEEDED,
///   RESOURCE_EXHAUSTED, ABORTED, INTERNAL and UNAVAILABLE, and when the status is missing;
///   `Complete` for OK and every other (deterministic) code.
///
/// Whatever the policy says, a key whose handler committed through the fence is always completed.
#[derive(Clone)]
pub struct CompletionPolicy {
    decide: Arc<dyn Fn(&ResponseSummary<'_>) -> Completion + Send + Sync>,
}

/// The parts of a finished response a [`CompletionPolicy`] decides on.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ResponseSummary<'a> {
    /// The response status.
    pub status: StatusCode,
    /// The response headers.
    pub headers: &'a HeaderMap,
    /// The trailers, if the body ended with any.
    pub trailers: Option<&'a HeaderMap>,
}

impl CompletionPolicy {
    /// A policy from a function.
    ///
    /// ```
    /// use tower_idempotency::{Completion, CompletionPolicy};
    ///
    /// // Store every answer, even 5xx (Stripe's choice).
    /// let policy = CompletionPolicy::new(|_| Completion::Complete);
    /// ```
    pub fn new(
        decide: impl Fn(&ResponseSummary<'_>) -> Completion + Send + Sync + 'static,
    ) -> Self {
        Self {
            decide: Arc::new(decide),
        }
    }

    /// Applies the policy.
    pub fn decide(&self, response: &ResponseSummary<'_>) -> Completion {
        (self.decide)(response)
    }
}

impl Default for CompletionPolicy {
    fn default() -> Self {
        Self::new(default_policy)
    }
}

impl fmt::Debug for CompletionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionPolicy").finish_non_exhaustive()
    }
}

fn default_policy(response: &ResponseSummary<'_>) -> Completion {
    if is_grpc(response.headers) {
        let status = response
            .trailers
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| response.headers.get("grpc-status"));
        return match status.map(|s| s.as_bytes()) {
            // CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, INTERNAL,
            // UNAVAILABLE: the outcome is not the call's final word.
            Some(b"1" | b"2" | b"4" | b"8" | b"10" | b"13" | b"14") | None => Completion::Release,
            Some(_) => Completion::Complete,
        };
    }
    match response.status.as_u16() {
        408 | 409 | 425 | 429 | 500.. => Completion::Release,
        _ => Completion::Complete,
    }
}

/// Whether a message with these headers is gRPC.
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn decide(status: u16, headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Completion {
        CompletionPolicy::default().decide(&ResponseSummary {
            status: StatusCode::from_u16(status).unwrap(),
            headers,
            trailers,
        })
    }

    #[test]
    fn http_statuses() {
        let none = HeaderMap::new();
        for status in [200, 201, 204, 301, 400, 404, 422] {
            assert_eq!(
                decide(status, &none, None),
                Completion::Complete,
                "{status}"
            );
        }
        for status in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert_eq!(decide(status, &none, None), Completion::Release, "{status}");
        }
    }

    #[test]
    fn grpc_reads_the_status_from_trailers_or_headers() {
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        let trailers = |code: &'static str| {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", HeaderValue::from_static(code));
            t
        };
        for code in ["0", "3", "5", "6", "7", "9", "11", "12", "16"] {
            assert_eq!(
                decide(200, &headers, Some(&trailers(code))),
                Completion::Complete,
                "{code}"
            );
        }
        for code in ["1", "2", "4", "8", "10", "13", "14"] {
            assert_eq!(
                decide(200, &headers, Some(&trailers(code))),
                Completion::Release,
                "{code}"
            );
        }
        assert_eq!(decide(200, &headers, None), Completion::Release);
        let mut trailers_only = headers.clone();
        trailers_only.insert("grpc-status", HeaderValue::from_static("5"));
        assert_eq!(decide(200, &trailers_only, None), Completion::Complete);
    }
}
