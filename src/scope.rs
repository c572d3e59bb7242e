//! Whose key is it: the scope that keeps callers' records apart.

use http::{header::AUTHORIZATION, request::Parts};
use sha2::{Digest, Sha256};

/// The scope of requests that carry no `Authorization` header, under the default scope.
pub const ANONYMOUS_SCOPE: &str = "anonymous";

/// The default scope: the caller's credentials, so that two callers never share a record.
///
/// A request with an `Authorization` header is scoped to a digest of its value
/// (`cred:` and 32 hex digits of its SHA-256, so the credential itself is never stored or
/// logged); a request without one is scoped to [`ANONYMOUS_SCOPE`]. This is the IETF draft's
/// "composite key": the key plus the client's identity.
///
/// It keys on the credential, not on who it names: a client that retries with a **refreshed
/// token** lands in a new scope, where the key is unknown, and the request runs again. Where
/// tokens rotate, scope by the authenticated subject instead (a tenant or account id that an
/// authentication layer installed *outside* the idempotency layer put in the request
/// extensions), with [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope).
///
/// ```
/// use tower_idempotency::scope::{ANONYMOUS_SCOPE, by_credentials};
///
/// let parts = http::Request::post("/").body(()).unwrap().into_parts().0;
/// assert_eq!(by_credentials(&parts).as_deref(), Some(ANONYMOUS_SCOPE));
///
/// let parts = http::Request::post("/")
///     .header("authorization", "Bearer sk_test_1")
///     .body(())
///     .unwrap()
///     .into_parts()
///     .0;
/// let scope = by_credentials(&parts).unwrap();
/// assert!(scope.starts_with("cred:") && !scope.contains("sk_test_1"));
/// ```
pub fn by_credentials(parts: &Parts) -> Option<String> {
    let Some(credentials) = parts.headers.get(AUTHORIZATION) else {
        return Some(ANONYMOUS_SCOPE.to_owned());
    };
    let digest = Sha256::digest(credentials.as_bytes());
    let mut scope = String::with_capacity(5 + 32);
    scope.push_str("cred:");
    for byte in &digest[..16] {
        scope.push(char::from(HEX[usize::from(byte >> 4)]));
        scope.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    Some(scope)
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// One scope for every request: the scope of a route whose callers are one sender, such as a
/// webhook receiver (`fixed("stripe")`). A sender does not authenticate with a credential of
/// its own: it signs each delivery (a signature that changes with every attempt), so the
/// default [`by_credentials`] would put every sender without an `Authorization` header in
/// [`ANONYMOUS_SCOPE`] together. Give each sender's route a scope of its own (or the identity
/// of the secret its deliveries are signed with), and check the signature first
/// ([`IdempotencyLayer::with_verifier`](crate::IdempotencyLayer::with_verifier)).
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};
///
/// let stripe = IdempotencyLayer::new(MemoryStore::new()).with_scope(scope::fixed("stripe"));
/// ```
pub fn fixed(scope: &str) -> impl Fn(&Parts) -> Option<String> + Clone + Send + Sync + 'static {
    let scope = scope.to_owned();
    move |_: &Parts| Some(scope.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(authorization: Option<&str>) -> Parts {
        let mut request = http::Request::post("/");
        if let Some(value) = authorization {
            request = request.header(AUTHORIZATION, value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn different_credentials_are_different_scopes() {
        let a = by_credentials(&parts(Some("Bearer a"))).unwrap();
        let b = by_credentials(&parts(Some("Bearer b"))).unwrap();
        assert_ne!(a, b);
        assert_eq!(a, by_credentials(&parts(Some("Bearer a"))).unwrap());
        assert_eq!(a.len(), 37);
        assert_ne!(a, ANONYMOUS_SCOPE);
        assert_eq!(by_credentials(&parts(None)).unwrap(), ANONYMOUS_SCOPE);
    }
}
