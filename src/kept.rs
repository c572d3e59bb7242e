//! The request a key was claimed for, kept for the completer: what the application chose to
//! keep ([`KeptRequests`]), its encoding in the store, and the resumption the completer sends
//! it as.

use std::sync::Arc;

use bytes::{BufMut, Bytes};
use http::{HeaderName, HeaderValue, Method, Request, header, request::Parts};

use crate::{fingerprint::Fingerprint, store::RecordKey};

/// Which requests a layer keeps for the [completer](crate::completer), and what of them:
/// method, path and query, the body, and the headers listed here (`Content-Type` by default).
/// Credentials (`Authorization`, `Proxy-Authorization`, `Cookie`) are never kept, even when
/// listed. A request whose body is over [`with_max_body`](Self::with_max_body) is not kept.
///
/// Install it with
/// [`IdempotencyLayer::with_kept_requests`](crate::IdempotencyLayer::with_kept_requests) on the
/// routes whose handlers record recovery points: a key's request is written to the store with
/// its first recovery point (in the step's transaction, with one statement more), and dropped
/// when the key completes or is taken over by another request.
#[derive(Debug, Clone)]
pub struct KeptRequests {
    max_body: usize,
    headers: Vec<HeaderName>,
}

/// The default [`KeptRequests::with_max_body`]: 64 KiB.
pub const DEFAULT_KEPT_MAX_BODY: usize = 64 * 1024;

/// Headers never kept, whatever the application lists.
const CREDENTIALS: [HeaderName; 3] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::COOKIE,
];

impl Default for KeptRequests {
    fn default() -> Self {
        Self::new()
    }
}

impl KeptRequests {
    /// Keeps requests with bodies of up to [`DEFAULT_KEPT_MAX_BODY`], and their `Content-Type`.
    pub fn new() -> Self {
        Self {
            max_body: DEFAULT_KEPT_MAX_BODY,
            headers: vec![header::CONTENT_TYPE],
        }
    }

    /// Keeps requests whose body is at most `bytes` long; a longer one is not kept (the
    /// completer then reports its key as one it cannot finish).
    pub fn with_max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// The headers to keep, instead of `Content-Type` alone: those the handler reads. The
    /// credentials among them are dropped.
    pub fn with_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.headers = headers
            .into_iter()
            .filter(|name| !CREDENTIALS.contains(name))
            .collect();
        self
    }

    /// What to keep of a request, or `None` when its body is over the limit.
    pub(crate) fn keep(&self, parts: &Parts, body: &Bytes) -> Option<Arc<KeptRequest>> {
        if body.len() > self.max_body {
            return None;
        }
        let headers = self
            .headers
            .iter()
            .flat_map(|name| parts.headers.get_all(name).iter().map(move |v| (name, v)))
            .filter_map(|(name, value)| Some((name.to_string(), value.to_str().ok()?.to_owned())))
            .collect();
        let uri = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        Some(Arc::new(KeptRequest {
            method: parts.method.to_string(),
            uri: uri.to_owned(),
            headers,
            body: body.clone(),
        }))
    }
}

/// A request as kept: method, path and query, the kept headers (those with text values), body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeptRequest {
    method: String,
    uri: String,
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl KeptRequest {
    /// The stored form: the head's length (4 bytes, big-endian), the head (JSON), the body.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn encode(&self) -> Vec<u8> {
        let head = serde_json::json!({
            "method": self.method,
            "uri": self.uri,
            "headers": self.headers,
        });
        let head = head.to_string().into_bytes();
        let mut encoded = Vec::with_capacity(4 + head.len() + self.body.len());
        encoded.put_u32(u32::try_from(head.len()).expect("a head under 4 GiB"));
        encoded.extend_from_slice(&head);
        encoded.extend_from_slice(&self.body);
        encoded
    }

    /// The request `encoded` holds, with its body as `B`.
    pub(crate) fn decode<B: From<Bytes>>(encoded: &Bytes) -> Result<Request<B>, String> {
        let short = || "a kept request cut short".to_owned();
        let length = encoded.get(..4).ok_or_else(short)?;
        let length = u32::from_be_bytes(length.try_into().expect("4 bytes")) as usize;
        let head = encoded.get(4..4 + length).ok_or_else(short)?;
        let head: serde_json::Value = serde_json::from_slice(head).map_err(|e| e.to_string())?;
        let text = |field: &str| {
            head[field]
                .as_str()
                .ok_or(format!("no {field} in a kept request"))
        };
        let method = Method::from_bytes(text("method")?.as_bytes()).map_err(|e| e.to_string())?;
        let mut request = Request::builder().method(method).uri(text("uri")?);
        for pair in head["headers"].as_array().into_iter().flatten() {
            let (Some(name), Some(value)) = (pair[0].as_str(), pair[1].as_str()) else {
                return Err("a kept header not a pair of strings".to_owned());
            };
            let name = HeaderName::try_from(name).map_err(|e| e.to_string())?;
            let value = HeaderValue::try_from(value).map_err(|e| e.to_string())?;
            request = request.header(name, value);
        }
        let body = B::from(encoded.slice(4 + length..));
        request.body(body).map_err(|e| e.to_string())
    }
}

/// A request the completer sends for a key nobody finished: the layer takes the key and the
/// fingerprint from here, not from the request, whose credentials (which may name the scope)
/// and headers (which may take part in the fingerprint) were not kept. Only this crate makes
/// one.
#[derive(Debug, Clone)]
pub(crate) struct Resumption {
    pub(crate) record: Arc<RecordKey>,
    pub(crate) fingerprint: Fingerprint,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_request_comes_back_without_its_credentials() {
        let request = Request::post("/payments?x=1")
            .header("content-type", "application/json")
            .header("authorization", "Bearer secret")
            .header("x-tenant", "t1")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        let keep = KeptRequests::new().with_headers([
            header::CONTENT_TYPE,
            header::AUTHORIZATION,
            HeaderName::from_static("x-tenant"),
        ]);
        let kept = keep.keep(&parts, &Bytes::from_static(b"{}")).unwrap();
        let back: Request<Bytes> = KeptRequest::decode(&Bytes::from(kept.encode())).unwrap();
        assert_eq!(back.method(), Method::POST);
        assert_eq!(back.uri(), "/payments?x=1");
        assert_eq!(back.headers()["content-type"], "application/json");
        assert_eq!(back.headers()["x-tenant"], "t1");
        assert!(back.headers().get("authorization").is_none());
        assert_eq!(back.body().as_ref(), b"{}");
        assert!(
            keep.with_max_body(1)
                .keep(&parts, &Bytes::from_static(b"{}"))
                .is_none()
        );
        let cut = Bytes::from(kept.encode()).slice(..6);
        assert!(KeptRequest::decode::<Bytes>(&cut).is_err());
    }
}
