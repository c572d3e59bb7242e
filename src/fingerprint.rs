//! The request fingerprint: what makes "the same request".

use std::fmt;

use bytes::Bytes;
use http::{HeaderName, request::Parts};
use sha2::{Digest, Sha256};

/// A SHA-256 digest of a request's method, path and query, `Content-Type`, configured headers
/// and body.
///
/// A retry must carry the same fingerprint as the request that first used its key; a different
/// one is answered with 422 and never reaches the handler. Every part before the body is
/// length-prefixed, so moving bytes from one part to another changes the digest.
///
/// The path is the one the client sent: under axum (feature `axum`), a router nested with
/// `Router::nest` strips its prefix before the layer sees the request, so the layer reads axum's
/// `OriginalUri` when it is there, and `/v1/payments` and `/v2/payments` stay different
/// requests.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Digests a request head and its buffered body.
    ///
    /// `headers` names the request headers that take part besides `Content-Type` (in this
    /// order); every value of each counts, and a header that is absent counts as absent, not as
    /// empty.
    pub fn of_request(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Self {
        let mut hasher = FingerprintHasher::new(parts, headers);
        hasher.update(body);
        hasher.finish()
    }

    /// Digests the payload of a unit of work that is not an HTTP request (a consumed message, a
    /// scheduled run): SHA-256 over a label that keeps it apart from request fingerprints, and
    /// the payload.
    pub fn of_payload(payload: &[u8]) -> Self {
        let mut digest = Sha256::new();
        digest.update(b"tower-idempotency unit of work\0");
        digest.update(payload);
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

/// A fingerprint in the making: the head first, then the body as it arrives.
pub(crate) struct FingerprintHasher<D = Sha256> {
    digest: D,
    body_len: u64,
}

/// Where the framed input goes: the digest, or (for the fuzz target that checks the framing)
/// the bytes themselves.
pub(crate) trait Absorb {
    fn absorb(&mut self, bytes: &[u8]);
}

impl Absorb for Sha256 {
    fn absorb(&mut self, bytes: &[u8]) {
        self.update(bytes);
    }
}

impl Absorb for Vec<u8> {
    fn absorb(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl FingerprintHasher {
    pub(crate) fn new(parts: &Parts, headers: &[HeaderName]) -> Self {
        Self::framing(Sha256::new(), parts, headers)
    }

    pub(crate) fn finish(self) -> Fingerprint {
        Fingerprint(self.close().finalize().into())
    }
}

impl<D: Absorb> FingerprintHasher<D> {
    fn framing(mut digest: D, parts: &Parts, headers: &[HeaderName]) -> Self {
        let mut field = |bytes: &[u8]| {
            digest.absorb(&(bytes.len() as u64).to_be_bytes());
            digest.absorb(bytes);
        };
        // A version tag, so a future change of this layout cannot match an old digest.
        field(b"tower-idempotency/fingerprint/v2");
        field(parts.method.as_str().as_bytes());
        field(original_path_and_query(parts).as_bytes());
        let content_type = http::header::CONTENT_TYPE;
        let configured = headers.iter().filter(|name| **name != content_type);
        for name in std::iter::once(&content_type).chain(configured) {
            field(name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            field(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                field(value.as_bytes());
            }
        }
        Self {
            digest,
            body_len: 0,
        }
    }

    /// Adds body bytes. The body is the last part, so it needs no prefix; its length closes
    /// the digest.
    pub(crate) fn update(&mut self, chunk: &[u8]) {
        self.digest.absorb(chunk);
        self.body_len += chunk.len() as u64;
    }

    fn close(mut self) -> D {
        self.digest.absorb(&self.body_len.to_be_bytes());
        self.digest
    }
}

/// The bytes [`Fingerprint::of_request`] digests, for the fuzz target that checks they can be
/// read back into the request's parts (so no two requests share them). Built under
/// `cargo fuzz` only.
#[cfg(fuzzing)]
#[doc(hidden)]
pub fn fingerprint_input(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Vec<u8> {
    let mut framing = FingerprintHasher::framing(Vec::new(), parts, headers);
    framing.update(body);
    framing.close()
}

/// A hook that decides what of the body takes part in the fingerprint; see
/// [`IdempotencyLayer::with_fingerprint_body`](crate::IdempotencyLayer::with_fingerprint_body).
pub(crate) type BodyFingerprintFn = dyn Fn(&Parts, &Bytes) -> Bytes + Send + Sync;

/// The path and query the client sent, before any router stripped a prefix from it.
pub(crate) fn original_path_and_query(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    let uri = parts
        .extensions
        .get::<axum::extract::OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    #[cfg(not(feature = "axum"))]
    let uri = &parts.uri;
    uri.path_and_query().map_or("/", |pq| pq.as_str())
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
    fn content_type_always_counts() {
        let json = parts("POST", "/", &[("content-type", "application/json")]);
        let form = parts(
            "POST",
            "/",
            &[("content-type", "application/x-www-form-urlencoded")],
        );
        let none = parts("POST", "/", &[]);
        let json_fp = Fingerprint::of_request(&json, &[], b"a=1");
        assert_ne!(json_fp, Fingerprint::of_request(&form, &[], b"a=1"));
        assert_ne!(json_fp, Fingerprint::of_request(&none, &[], b"a=1"));
        // Naming it again changes nothing.
        let named = [http::header::CONTENT_TYPE];
        assert_eq!(json_fp, Fingerprint::of_request(&json, &named, b"a=1"));
    }

    #[test]
    fn a_body_hashed_in_chunks_is_the_same_body() {
        let p = parts("POST", "/", &[]);
        let mut hasher = FingerprintHasher::new(&p, &[]);
        for chunk in [&b"hel"[..], b"", b"lo"] {
            hasher.update(chunk);
        }
        assert_eq!(hasher.finish(), Fingerprint::of_request(&p, &[], b"hello"));
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
