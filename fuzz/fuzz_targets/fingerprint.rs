//! The fingerprint's input framing: the bytes SHA-256 digests must name one request only, so
//! two requests that differ in method, path and query, `Content-Type`, a configured header or
//! the body never share a fingerprint, however their bytes are split between the parts.
//!
//! Checked by reading the framed bytes back: a framing that can be decoded into the request's
//! parts is injective. The fingerprint is checked to be the SHA-256 of exactly those bytes.
//!
//! The body's declared form (`JsonFields`) never panics, and is its own canonical form: read
//! back and written again, it is the same bytes.

#![no_main]

use arbitrary::Arbitrary;
use http::{HeaderName, HeaderValue, Method, Request, request::Parts};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use tower_idempotency::{JsonFields, fingerprint_input, store::Fingerprint};

#[derive(Arbitrary, Debug)]
struct Input {
    method: String,
    path_and_query: String,
    content_type: Vec<Vec<u8>>,
    configured: Vec<Vec<u8>>,
    /// Lists `Content-Type` among the configured headers too (it must count once).
    configure_content_type: bool,
    body: Vec<u8>,
}

/// The header the fingerprint is configured with besides `Content-Type`.
static CONFIGURED: HeaderName = HeaderName::from_static("x-tenant");

/// The parts as the framing must carry them.
#[derive(Debug, PartialEq)]
struct Decoded {
    tag: Vec<u8>,
    method: Vec<u8>,
    path_and_query: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<Vec<u8>>)>,
    body: Vec<u8>,
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u64(&mut self) -> u64 {
        let (head, rest) = self.0.split_first_chunk::<8>().expect("a length");
        self.0 = rest;
        u64::from_be_bytes(*head)
    }

    fn field(&mut self) -> Vec<u8> {
        let len = usize::try_from(self.u64()).unwrap();
        let (field, rest) = self
            .0
            .split_at_checked(len)
            .expect("a field as long as its prefix");
        self.0 = rest;
        field.to_vec()
    }
}

/// Reads the framing back, knowing only how many headers it has.
fn decode(framed: &[u8], header_count: usize) -> Decoded {
    let mut reader = Reader(framed);
    let tag = reader.field();
    let method = reader.field();
    let path_and_query = reader.field();
    let headers = (0..header_count)
        .map(|_| {
            let name = reader.field();
            let count = u64::from_be_bytes(reader.field().try_into().expect("a count"));
            let mut values = Vec::new();
            for _ in 0..count {
                values.push(reader.field());
            }
            (name, values)
        })
        .collect();
    let (body, len) = reader.0.split_last_chunk::<8>().expect("the body length");
    assert_eq!(
        u64::from_be_bytes(*len),
        body.len() as u64,
        "the body length closes"
    );
    Decoded {
        tag,
        method,
        path_and_query,
        headers,
        body: body.to_vec(),
    }
}

impl Input {
    /// The request head, or `None` for inputs HTTP cannot carry.
    fn parts(&self) -> Option<Parts> {
        let mut request = Request::builder()
            .method(Method::from_bytes(self.method.as_bytes()).ok()?)
            .uri(format!("/{}", self.path_and_query))
            .body(())
            .ok()?;
        let headers = request.headers_mut();
        for (name, values) in [
            (&http::header::CONTENT_TYPE, &self.content_type),
            (&CONFIGURED, &self.configured),
        ] {
            for value in values {
                headers.append(name, HeaderValue::from_bytes(value).ok()?);
            }
        }
        Some(request.into_parts().0)
    }
}

fuzz_target!(|input: Input| {
    let body = bytes::Bytes::from(input.body.clone());
    for fields in [
        JsonFields::except(["/a", "/0"]),
        JsonFields::only(["/a", "/b/0"]),
    ] {
        let declared = fields.canonical(&body);
        if declared != body {
            let everything = JsonFields::except(Vec::<String>::new());
            assert_eq!(everything.canonical(&declared), declared, "a fixpoint");
        }
    }
    let Some(parts) = input.parts() else {
        return;
    };
    let mut configured = vec![CONFIGURED.clone()];
    if input.configure_content_type {
        configured.insert(0, http::header::CONTENT_TYPE);
    }
    let framed = fingerprint_input(&parts, &configured, &input.body);
    let values = |name: &HeaderName| -> Vec<Vec<u8>> {
        let all = parts.headers.get_all(name).iter();
        all.map(|value| value.as_bytes().to_vec()).collect()
    };
    let expected = Decoded {
        tag: b"tower-idempotency/fingerprint/v2".to_vec(),
        method: parts.method.as_str().as_bytes().to_vec(),
        path_and_query: parts
            .uri
            .path_and_query()
            .unwrap()
            .as_str()
            .as_bytes()
            .to_vec(),
        headers: vec![
            (
                b"content-type".to_vec(),
                values(&http::header::CONTENT_TYPE),
            ),
            (b"x-tenant".to_vec(), values(&CONFIGURED)),
        ],
        body: input.body.clone(),
    };
    assert_eq!(decode(&framed, 2), expected);
    let fingerprint = Fingerprint::of_request(&parts, &configured, &input.body);
    let digest: [u8; 32] = Sha256::digest(&framed).into();
    assert_eq!(
        fingerprint.as_bytes(),
        &digest,
        "the fingerprint digests the framing"
    );
});
