//! What an attempt's answer means for the logical call: final (hand it to the caller), or worth
//! another attempt with the same key, and after how long.

use std::time::{Duration, SystemTime};

use http::{
    HeaderMap, StatusCode,
    header::{DATE, RETRY_AFTER},
};

use crate::{grpc::Wire, headers::IDEMPOTENT_REPLAYED};

/// What to do with an attempt's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The server's definitive answer: return it.
    Final,
    /// Not an answer about the call: try again, after the server's hint if it gave one.
    Retry { after: Option<Duration> },
}

/// The verdict on a response (for a request that was gRPC when `grpc`).
///
/// Retried: 408, 409 with `Retry-After` (the key is in flight: the layer's other 409s, outcome
/// unknown and response not stored, carry none and are final), 429 with `Retry-After`, 502, 503
/// and 504; for gRPC, UNAVAILABLE, or ABORTED with `grpc-retry-pushback-ms`, whether the status
/// came in the headers (a trailers-only answer) or in the `trailers` read from the body.
/// Everything else is final, a replay (`Idempotent-Replayed`) always.
pub(crate) fn of_response(
    status: StatusCode,
    headers: &HeaderMap,
    trailers: Option<&HeaderMap>,
    wire: Wire,
) -> Verdict {
    if headers.contains_key(IDEMPOTENT_REPLAYED) {
        return Verdict::Final;
    }
    let said = [Some(headers), trailers]
        .into_iter()
        .flatten()
        .find(|map| map.contains_key("grpc-status"));
    if wire == Wire::Grpc
        && let Some(said) = said
    {
        let code = &said["grpc-status"];
        let pushback = said
            .get("grpc-retry-pushback-ms")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(Duration::from_millis);
        return match (code.as_bytes(), pushback) {
            (b"14", after) => Verdict::Retry { after },
            (b"10", Some(after)) => Verdict::Retry { after: Some(after) },
            _ => Verdict::Final,
        };
    }
    let retry_after = retry_after(headers);
    match (status.as_u16(), retry_after) {
        (408 | 502 | 503 | 504, after) => Verdict::Retry { after },
        (409 | 429, Some(after)) => Verdict::Retry { after: Some(after) },
        _ => Verdict::Final,
    }
}

/// A `Retry-After`: seconds, or an HTTP date. A date is read against the response's own `Date`
/// (the server's clock, as every time in the protocol), or this machine's clock when the
/// response has none; one already past means "now".
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let now = headers
        .get(DATE)
        .and_then(|date| httpdate::parse_http_date(date.to_str().ok()?).ok())
        .unwrap_or_else(SystemTime::now);
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Exponential backoff with full jitter: before attempt `attempt + 1` (the first retry after
/// attempt 1), a pause drawn uniformly from zero to `base × 2^(attempt - 1)`, at most `cap`.
pub(crate) fn backoff(attempt: u32, base: Duration, cap: Duration, random: u64) -> Duration {
    let ceiling = base
        .saturating_mul(
            1u32.checked_shl(attempt.saturating_sub(1))
                .unwrap_or(u32::MAX),
        )
        .min(cap);
    let micros = ceiling.as_micros() as u64;
    Duration::from_micros(if micros == 0 {
        0
    } else {
        random % (micros + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    fn http(status: u16, pairs: &[(&'static str, &'static str)]) -> Verdict {
        of_response(
            StatusCode::from_u16(status).unwrap(),
            &headers(pairs),
            None,
            Wire::Http,
        )
    }

    #[test]
    fn definitive_answers_are_final_and_transient_ones_retried() {
        for status in [200, 201, 400, 401, 404, 409, 422, 429, 500, 501] {
            assert_eq!(http(status, &[]), Verdict::Final, "{status}");
        }
        let after = Some(Duration::from_secs(2));
        assert_eq!(http(409, &[("retry-after", "2")]), Verdict::Retry { after });
        assert_eq!(http(429, &[("retry-after", "2")]), Verdict::Retry { after });
        assert_eq!(http(503, &[("retry-after", "2")]), Verdict::Retry { after });
        for status in [408, 502, 503, 504] {
            assert_eq!(
                http(status, &[]),
                Verdict::Retry { after: None },
                "{status}"
            );
        }
        // A replay is the answer, whatever it says.
        let replayed = [("retry-after", "2"), ("idempotent-replayed", "true")];
        assert_eq!(http(503, &replayed), Verdict::Final);
        // An unreadable hint: the backoff applies (and a 429 without one is final).
        let unreadable = [("retry-after", "soon")];
        assert_eq!(http(503, &unreadable), Verdict::Retry { after: None });
        assert_eq!(http(429, &unreadable), Verdict::Final);
    }

    #[test]
    fn a_retry_after_date_is_read_against_the_servers_date() {
        let dated = [
            ("date", "Wed, 21 Oct 2026 07:28:00 GMT"),
            ("retry-after", "Wed, 21 Oct 2026 07:28:03 GMT"),
        ];
        let after = Some(Duration::from_secs(3));
        assert_eq!(http(429, &dated), Verdict::Retry { after });
        assert_eq!(http(409, &dated), Verdict::Retry { after });
        assert_eq!(http(503, &dated), Verdict::Retry { after });
        // The obsolete formats RFC 9110 asks recipients to accept.
        let rfc850 = [
            ("date", "Wednesday, 21-Oct-26 07:28:00 GMT"),
            ("retry-after", "Wed Oct 21 07:28:05 2026"),
        ];
        let after = Some(Duration::from_secs(5));
        assert_eq!(http(503, &rfc850), Verdict::Retry { after });
        // A date already past: retry now.
        let past = [
            ("date", "Wed, 21 Oct 2026 07:28:00 GMT"),
            ("retry-after", "Wed, 21 Oct 2026 07:27:00 GMT"),
        ];
        let now = Some(Duration::ZERO);
        assert_eq!(http(429, &past), Verdict::Retry { after: now });
        // Without the server's `Date`, against this machine's clock.
        let later = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(60));
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(&later).unwrap());
        let verdict = of_response(StatusCode::TOO_MANY_REQUESTS, &headers, None, Wire::Http);
        let Verdict::Retry { after: Some(after) } = verdict else {
            panic!("{verdict:?}");
        };
        assert!(after > Duration::from_secs(58) && after <= Duration::from_secs(60));
    }

    #[test]
    fn grpc_statuses_in_trailers_only_answers() {
        let grpc = |pairs| of_response(StatusCode::OK, &headers(pairs), None, Wire::Grpc);
        assert_eq!(grpc(&[("grpc-status", "0")]), Verdict::Final);
        assert_eq!(grpc(&[("grpc-status", "9")]), Verdict::Final);
        assert_eq!(grpc(&[("grpc-status", "10")]), Verdict::Final);
        assert_eq!(
            grpc(&[("grpc-status", "14")]),
            Verdict::Retry { after: None }
        );
        let pushback = [("grpc-status", "10"), ("grpc-retry-pushback-ms", "250")];
        let after = Some(Duration::from_millis(250));
        assert_eq!(grpc(&pushback), Verdict::Retry { after });
        // The status of a full answer is in its trailers.
        assert_eq!(grpc(&[]), Verdict::Final);
        let in_trailers = |pairs| {
            let trailers = headers(pairs);
            of_response(
                StatusCode::OK,
                &HeaderMap::new(),
                Some(&trailers),
                Wire::Grpc,
            )
        };
        let unavailable = Verdict::Retry { after: None };
        assert_eq!(in_trailers(&[("grpc-status", "14")]), unavailable);
        assert_eq!(in_trailers(&[("grpc-status", "0")]), Verdict::Final);
        let after = Some(Duration::from_millis(250));
        assert_eq!(in_trailers(&pushback), Verdict::Retry { after });
        // A replay is final, whatever its trailers say.
        let replayed = headers(&[("idempotent-replayed", "true")]);
        let trailers = headers(&[("grpc-status", "14")]);
        let verdict = of_response(StatusCode::OK, &replayed, Some(&trailers), Wire::Grpc);
        assert_eq!(verdict, Verdict::Final);
    }

    #[test]
    fn backoff_doubles_to_its_cap_with_full_jitter() {
        let (base, cap) = (Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(
            backoff(1, base, cap, u64::MAX),
            Duration::from_micros(u64::MAX % 100_001)
        );
        for (attempt, ceiling) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1000),
            (40, 1000),
        ] {
            let ceiling = Duration::from_millis(ceiling);
            for random in [0, 1, 12_345, 999_999_937, u64::MAX] {
                assert!(backoff(attempt, base, cap, random) <= ceiling, "{attempt}");
            }
            assert_eq!(
                backoff(attempt, base, cap, ceiling.as_micros() as u64),
                ceiling
            );
        }
        assert_eq!(backoff(3, base, cap, 0), Duration::ZERO);
    }
}
