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

/// The parts of a JSON body that make "the same request", declared by JSON pointer (RFC 6901)
/// rather than written as a hook: [`only`](Self::only) some fields, or everything
/// [`except`](Self::except) some. Given to
/// [`IdempotencyLayer::with_fingerprint_json`](crate::IdempotencyLayer::with_fingerprint_json).
///
/// The fingerprint then covers the body's JSON meaning: neither whitespace nor the order of an
/// object's members counts. A field left out is removed wherever it is (an array element left
/// out counts as `null`, so the others keep their places); a field kept that is absent counts
/// as absent, not as `null`. A number counts as the integer or the `f64` it names (`1e2` is
/// `100.0`, which differs from `100`). A body that is not JSON counts as sent.
///
/// ```
/// use bytes::Bytes;
/// use tower_idempotency::JsonFields;
///
/// // A sender that stamps each attempt: the same event, whatever the attempt's fields say.
/// let fields = JsonFields::except(["/delivery_attempt", "/sent_at"]);
/// let first = fields.canonical(&Bytes::from(r#"{"id": "evt_1", "sent_at": 1, "delivery_attempt": 1}"#));
/// let retry = fields.canonical(&Bytes::from(r#"{"delivery_attempt": 2, "sent_at": 9, "id": "evt_1"}"#));
/// assert_eq!(first, retry);
///
/// // Only what the handler acts on.
/// let fields = JsonFields::only(["/type", "/data/object/id"]);
/// let a = fields.canonical(&Bytes::from(r#"{"type": "refund", "data": {"object": {"id": "re_1", "note": "a"}}}"#));
/// let b = fields.canonical(&Bytes::from(r#"{"type": "refund", "data": {"object": {"id": "re_1", "note": "b"}}}"#));
/// assert_eq!(a, b);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonFields {
    /// `true`: only these pointers count; `false`: everything but them.
    only: bool,
    pointers: Vec<String>,
}

impl JsonFields {
    /// Only the values at `pointers` count (each `/`-separated, as `/data/object/id`).
    ///
    /// # Panics
    ///
    /// If a pointer does not start with `/`.
    pub fn only<P: Into<String>>(pointers: impl IntoIterator<Item = P>) -> Self {
        Self::new(true, pointers)
    }

    /// Everything but the values at `pointers` counts.
    ///
    /// # Panics
    ///
    /// If a pointer does not start with `/`.
    pub fn except<P: Into<String>>(pointers: impl IntoIterator<Item = P>) -> Self {
        Self::new(false, pointers)
    }

    fn new<P: Into<String>>(only: bool, pointers: impl IntoIterator<Item = P>) -> Self {
        let pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        for pointer in &pointers {
            crate::key::assert_json_pointer(pointer);
        }
        Self { only, pointers }
    }

    /// The bytes that stand for `body` in the fingerprint: the declared fields in a canonical
    /// form (object members sorted, no whitespace), or `body` itself if it is not JSON.
    pub fn canonical(&self, body: &Bytes) -> Bytes {
        let Ok(mut json) = serde_json::from_slice::<serde_json::Value>(body) else {
            return body.clone();
        };
        let json = if self.only {
            let kept = (self.pointers.iter())
                .filter_map(|pointer| Some((pointer.clone(), json.pointer(pointer)?.clone())));
            serde_json::Value::Object(kept.collect())
        } else {
            for pointer in &self.pointers {
                left_out(&mut json, pointer);
            }
            json
        };
        let mut out = Vec::with_capacity(body.len());
        canonical(&json, &mut out);
        Bytes::from(out)
    }
}

/// Leaves the value at `pointer` out of `json`: an object's member is removed, an array's
/// element becomes `null`.
fn left_out(json: &mut serde_json::Value, pointer: &str) {
    let (parent, last) = pointer.rsplit_once('/').expect("pointers start with '/'");
    let last = last.replace("~1", "/").replace("~0", "~");
    match json.pointer_mut(parent) {
        Some(serde_json::Value::Object(members)) => {
            members.remove(&last);
        }
        Some(serde_json::Value::Array(elements)) => {
            if let Some(element) = last.parse().ok().and_then(|i: usize| elements.get_mut(i)) {
                *element = serde_json::Value::Null;
            }
        }
        _ => {}
    }
}

/// Writes `json` with its objects' members sorted by name and no whitespace, whatever order the
/// JSON library keeps them in.
fn canonical(json: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match json {
        Value::Array(elements) => {
            out.push(b'[');
            for (i, element) in elements.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                canonical(element, out);
            }
            out.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (name, value)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let name = serde_json::to_string(name).expect("a string serializes");
                out.extend_from_slice(name.as_bytes());
                out.push(b':');
                canonical(value, out);
            }
            out.push(b'}');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

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
