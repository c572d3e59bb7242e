//! Which responses are stored for replay, and which free the key for a clean retry:
//! [`IdempotencyLayer::with_completion_policy`](crate::IdempotencyLayer::with_completion_policy).

use std::{fmt, sync::Arc};

use http::{HeaderMap, StatusCode};

use crate::grpc;

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
/// - HTTP: `Complete` for status < 500, except two kinds of answer, which `Release`:
///   - "nothing was executed": 400, 401, 403, 404, 405, 413, 415 and 422, the answers of
///     routers, extractors and authentication layers that refuse a request before a handler
///     acts on it (a mistyped path, a missing `Content-Type`, malformed JSON, a failed
///     validation). A corrected request with the same key then runs, as Stripe does: a
///     result is saved only once an endpoint started executing;
///   - "try again": 408, 409, 425 and 429;
///
///   and every 5xx releases too. A handler that has acted and then answers with one of these
///   statuses should commit through the fence (a committed key is always completed) or answer
///   with another status: a released key runs again on the next retry.
/// - gRPC (`content-type: application/grpc…`): read `grpc-status` from the trailers (or from the
///   headers of a trailers-only response). `Release` for the codes that mean the call was
///   refused before acting (INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNIMPLEMENTED,
///   UNAUTHENTICATED), for those that mean "try again" (CANCELLED, UNKNOWN, DEADLINE_EXCEEDED,
///   RESOURCE_EXHAUSTED, ABORTED, INTERNAL, UNAVAILABLE), and when the status is missing;
///   `Complete` for OK and every other code (ALREADY_EXISTS, FAILED_PRECONDITION, OUT_OF_RANGE,
///   DATA_LOSS).
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
    /// use tower_idempotency::policy::{Completion, CompletionPolicy};
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
    if grpc::is_grpc(response.headers) {
        return if grpc::status_is_final(response.headers, response.trailers) {
            Completion::Complete
        } else {
            Completion::Release
        };
    }
    match response.status.as_u16() {
        // Nothing was executed: a router, an extractor or an authentication layer refused.
        400 | 401 | 403 | 404 | 405 | 413 | 415 | 422 => Completion::Release,
        // Try again.
        408 | 409 | 425 | 429 | 500.. => Completion::Release,
        _ => Completion::Complete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, header::CONTENT_TYPE};

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
        for status in [200, 201, 202, 204, 301, 303, 402, 406, 410, 412] {
            assert_eq!(
                decide(status, &none, None),
                Completion::Complete,
                "{status}"
            );
        }
        for status in [
            400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 425, 429, 500, 502, 503, 504,
        ] {
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
        for code in ["0", "6", "9", "11", "15"] {
            assert_eq!(
                decide(200, &headers, Some(&trailers(code))),
                Completion::Complete,
                "{code}"
            );
        }
        for code in [
            "1", "2", "3", "4", "5", "7", "8", "10", "12", "13", "14", "16",
        ] {
            assert_eq!(
                decide(200, &headers, Some(&trailers(code))),
                Completion::Release,
                "{code}"
            );
        }
        assert_eq!(decide(200, &headers, None), Completion::Release);
        let mut trailers_only = headers.clone();
        trailers_only.insert("grpc-status", HeaderValue::from_static("6"));
        assert_eq!(decide(200, &trailers_only, None), Completion::Complete);
    }
}
