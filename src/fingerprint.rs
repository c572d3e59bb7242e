//! The request fingerprint: what makes "the same request".

use std::fmt;

use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

/// A SHA-256 digest of a request's method, path and query, configured headers and body.
///
/// A retry must carry the same fingerprint as the request that first used its key; a different
/// one is answered with 422 and never reaches the handler. Every part is length-prefixed before
/// hashing, so moving bytes from one part to another changes the digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Digests a request head and its buffered body.
    ///
    /// `headers` names the request headers that take part (in this order); every value of each
    /// counts, and a header that is absent counts as absent, not as empty.
    pub fn of_request(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Self {
        let mut digest = Sha256::new();
        let mut field = |bytes: &[u8]| {
            digest.update((bytes.len() as u64).to_be_bytes());
            digest.update(bytes);
        };
        // A version tag, so a future change of this layout cannot match an old digest.
        field(b"tower-idempotency/fingerprint/v1");
        field(parts.method.as_str().as_bytes());
        field(
            parts
                .uri
                .path_and_query()
                .map_or("/", |pq| pq.as_str())
                .as_bytes(),
        );
        for name in headers {
            field(name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            field(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                field(value.as_bytes());
            }
        }
        field(body);
        Self(digest.finalize().into())
    }

    /// Wraps a digest read back from a store.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 digest bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut builder = Request::builder().method(method).uri(uri);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_part_of_the_request_counts() {
        let base = Fingerprint::of_request(&parts("POST", "/pay?x=1", &[]), &[], b"{}");
        let same = Fingerprint::of_request(&parts("POST", "/pay?x=1", &[]), &[], b"{}");
        assert_eq!(base, same);
        for other in [
            Fingerprint::of_request(&parts("PATCH", "/pay?x=1", &[]), &[], b"{}"),
            Fingerprint::of_request(&parts("POST", "/pay?x=2", &[]), &[], b"{}"),
            Fingerprint::of_request(&parts("POST", "/pay", &[]), &[], b"{}"),
            Fingerprint::of_request(&parts("POST", "/pay?x=1", &[]), &[], b"{ }"),
            Fingerprint::of_request(&parts("POST", "/pay?x=1", &[]), &[], b""),
        ] {
            assert_ne!(base, other);
        }
    }

    #[test]
    fn only_configured_headers_count() {
        let tenant = [HeaderName::from_static("x-tenant")];
        let a = parts("POST", "/", &[("x-tenant", "a"), ("x-trace", "1")]);
        let b = parts("POST", "/", &[("x-tenant", "b"), ("x-trace", "2")]);
        assert_eq!(
            Fingerprint::of_request(&a, &[], b""),
            Fingerprint::of_request(&b, &[], b"")
        );
        assert_ne!(
            Fingerprint::of_request(&a, &tenant, b""),
            Fingerprint::of_request(&b, &tenant, b"")
        );
        let absent = parts("POST", "/", &[]);
        let empty = parts("POST", "/", &[("x-tenant", "")]);
        assert_ne!(
            Fingerprint::of_request(&absent, &tenant, b""),
            Fingerprint::of_request(&empty, &tenant, b"")
        );
    }

    #[test]
    fn an_empty_body_is_not_an_empty_fingerprint() {
        // A complaint about other libraries: digests that silently ignored the payload.
        let p = parts("POST", "/", &[]);
        assert_ne!(
            Fingerprint::of_request(&p, &[], b"a"),
            Fingerprint::of_request(&p, &[], b"b")
        );
        assert_ne!(Fingerprint::of_request(&p, &[], b"").as_bytes(), &[0; 32]);
    }
}
