//! How long a server protects a key after its request completed: learned from the
//! `Idempotency-Key-Protected-Until` of its answers, per origin, or configured.

use std::{
    collections::HashMap,
    sync::{Mutex, PoisonError},
    time::{Duration, SystemTime},
};

use http::{HeaderMap, Uri, header::DATE};

use crate::headers::{IDEMPOTENCY_KEY_PROTECTED_UNTIL, IDEMPOTENT_REPLAYED};

/// The most origins whose protection a client remembers; past it, it starts over.
const MAX_ORIGINS: usize = 1024;

/// What a client learned of its servers' protection, shared by the services a layer builds.
#[derive(Debug, Default)]
pub(crate) struct Learned {
    by_origin: Mutex<HashMap<String, Duration>>,
}

impl Learned {
    /// Learns from an answer of `uri`'s origin: an answer that completed a key (a replay says
    /// less: its key completed earlier) and says until when it is protected. The server's
    /// `Date` is the completion (this machine's clock when it has none): the protection is the
    /// time between the two, less the second both are rounded to.
    pub(crate) fn learn(&self, uri: &Uri, headers: &HeaderMap) {
        if headers.contains_key(IDEMPOTENT_REPLAYED) {
            return;
        }
        let Some(until) = date(headers, &IDEMPOTENCY_KEY_PROTECTED_UNTIL) else {
            return;
        };
        let now = date(headers, &DATE).unwrap_or_else(SystemTime::now);
        let window = until.duration_since(now).unwrap_or_default();
        let window = window.saturating_sub(Duration::from_secs(1));
        let mut learned = self.lock();
        if learned.len() >= MAX_ORIGINS {
            learned.clear();
        }
        learned.insert(origin(uri), window);
    }

    /// The protection last learned from `uri`'s origin.
    pub(crate) fn of(&self, uri: &Uri) -> Option<Duration> {
        self.lock().get(&origin(uri)).copied()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Duration>> {
        self.by_origin
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// A header's HTTP date.
fn date(headers: &HeaderMap, name: &http::HeaderName) -> Option<SystemTime> {
    httpdate::parse_http_date(headers.get(name)?.to_str().ok()?).ok()
}

/// The scheme and authority of `uri` (both empty for a relative one, as a tonic channel's
/// requests are: the channel's one origin).
fn origin(uri: &Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or_default();
    let authority = uri.authority().map_or("", |a| a.as_str());
    format!("{scheme}://{}", authority.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn answer(date: SystemTime, until: SystemTime, replayed: bool) -> HeaderMap {
        let mut headers = HeaderMap::new();
        let http_date = |at| HeaderValue::from_str(&httpdate::fmt_http_date(at)).unwrap();
        headers.insert(DATE, http_date(date));
        headers.insert(IDEMPOTENCY_KEY_PROTECTED_UNTIL, http_date(until));
        if replayed {
            headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        headers
    }

    #[test]
    fn the_protection_is_learned_per_origin_from_answers_that_completed_a_key() {
        let learned = Learned::default();
        let (a, b): (Uri, Uri) = (
            "http://A:1/x".parse().unwrap(),
            "http://b:1/y".parse().unwrap(),
        );
        // A server whose clock is an hour ahead: only the difference of its two dates counts.
        let server_now = SystemTime::now() + Duration::from_secs(3600);
        learned.learn(
            &a,
            &answer(server_now, server_now + Duration::from_secs(60), false),
        );
        assert_eq!(
            learned.of(&"http://a:1/z".parse().unwrap()),
            Some(Duration::from_secs(59))
        );
        assert_eq!(learned.of(&b), None, "another origin");
        // A replay's date is later than its key's completion: it teaches nothing.
        learned.learn(
            &a,
            &answer(server_now, server_now + Duration::from_secs(5), true),
        );
        assert_eq!(learned.of(&a), Some(Duration::from_secs(59)));
        // A server that changed its retention: the latest answer counts.
        learned.learn(
            &a,
            &answer(server_now, server_now + Duration::from_secs(30), false),
        );
        assert_eq!(learned.of(&a), Some(Duration::from_secs(29)));
        // An answer without the header, or with a date already past, teaches nothing or zero.
        learned.learn(&b, &HeaderMap::new());
        assert_eq!(learned.of(&b), None);
        learned.learn(
            &b,
            &answer(server_now, server_now - Duration::from_secs(5), false),
        );
        assert_eq!(learned.of(&b), Some(Duration::ZERO));
    }
}
