//! The header names of the protocol: the key a request carries ([`IDEMPOTENCY_KEY`]), and what
//! the layer says on its answers ([`IDEMPOTENT_REPLAYED`], [`IDEMPOTENCY_KEY_PROTECTED_UNTIL`]).
//! (Within the crate: the values the layer reads and writes on the wire.)

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, header::VARY};

/// The request header that carries the key (`Idempotency-Key`; gRPC metadata `idempotency-key`).
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replayed answer (`Idempotent-Replayed: true`): a retry's
/// answer is the stored one, not a new execution.
///
/// ```
/// # let response = http::Response::new(());
/// use tower_idempotency::headers::IDEMPOTENT_REPLAYED;
///
/// let replayed = response.headers().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true");
/// # assert!(!replayed);
/// ```
// A `HeaderName`, not a string: a map given a string parses it on every call, and copies a name
// it does not know into a new allocation when it inserts it.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header that says which of a request's preferences were honored (RFC 7240).
pub(crate) const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// The header that says until when the answer's key is protected (an HTTP date), on the
/// answers of a layer built
/// [`with_protected_until_header`](crate::IdempotencyLayer::with_protected_until_header).
pub const IDEMPOTENCY_KEY_PROTECTED_UNTIL: HeaderName =
    HeaderName::from_static("idempotency-key-protected-until");

/// Says on an answer that its key is protected for `left` from now: retries with it get the
/// answer it carries (or, past the retention, a refusal) until then, and run again after.
pub(crate) fn protected_for(headers: &mut HeaderMap, left: Duration) {
    let until = httpdate::fmt_http_date(SystemTime::now() + left);
    let value = HeaderValue::from_str(&until).expect("an HTTP date is a valid header value");
    headers.insert(IDEMPOTENCY_KEY_PROTECTED_UNTIL, value);
}

/// A request's preferences (RFC 7240).
const PREFER: HeaderName = HeaderName::from_static("prefer");

/// How long a request prefers to wait for its answer (`Prefer: wait=N`, RFC 7240, in whole
/// seconds), if it says. Other preferences, and a preference's parameters, are ignored; a
/// `wait` that is not a whole number of seconds is no preference.
pub(crate) fn preferred_wait(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|list| list.split(','))
        .find_map(|preference| {
            let token = preference.split(';').next()?;
            let (name, value) = token.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            let seconds: u64 = value.trim().trim_matches('"').parse().ok()?;
            Some(Duration::from_secs(seconds))
        })
}

/// The request header names a response's `Vary` headers list (`*` names none in particular).
pub(crate) fn vary_names(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(VARY)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|list| list.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
}

/// The values `request` sends for each header a response with `response_headers` varies on:
/// what a replay of that response must be sent again to be acceptable.
pub(crate) fn varied_request_headers(
    response_headers: &HeaderMap,
    request: &HeaderMap,
) -> HeaderMap {
    let mut varied = HeaderMap::new();
    for name in vary_names(response_headers) {
        for value in request.get_all(&name) {
            varied.append(name.clone(), value.clone());
        }
    }
    varied
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn prefer(values: &[&'static str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append("prefer", HeaderValue::from_static(value));
        }
        preferred_wait(&headers)
    }

    #[test]
    fn the_wait_preference_is_read_among_others_and_its_parameters() {
        let secs = |n| Some(Duration::from_secs(n));
        assert_eq!(prefer(&[]), None);
        assert_eq!(prefer(&["wait=30"]), secs(30));
        assert_eq!(prefer(&["respond-async, WAIT = 5"]), secs(5));
        assert_eq!(
            prefer(&["handling=lenient", "wait=\"7\"; foo=bar"]),
            secs(7)
        );
        assert_eq!(prefer(&["return=minimal"]), None);
        assert_eq!(prefer(&["wait=1.5"]), None);
        assert_eq!(prefer(&["wait=-1"]), None);
        assert_eq!(prefer(&["waiting=3"]), None);
    }
}
