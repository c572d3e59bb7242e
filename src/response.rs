//! The stored outcome of a request, and its binary encoding.

use std::{fmt, sync::Arc};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};

/// What a completed request answered, as stored and replayed.
///
/// Headers and trailers keep every value of a repeated field and the order the handler produced
/// them in. The body is `None` when it exceeded the layer's cache limit: the outcome is recorded
/// (so the request is never run again) but later retries get a problem response instead of it.
///
/// A response that varies on request headers (`Vary: accept-encoding`, as a compression layer
/// inside the idempotency layer sets it) also keeps the first request's values of those headers:
/// a retry that sends them differently is not given a body negotiated for someone else.
///
/// Cloning one is cheap: the clones share its parts (a store that keeps the response it was
/// given, as the memory store does, copies nothing).
#[derive(Clone, PartialEq, Eq)]
pub struct StoredResponse(Arc<Parts>);

/// A stored response's parts, shared by its clones.
#[derive(Clone, PartialEq, Eq)]
struct Parts {
    status: StatusCode,
    headers: HeaderMap,
    body: Option<Bytes>,
    trailers: Option<HeaderMap>,
    varied: HeaderMap,
}

impl StoredResponse {
    /// A stored response.
    pub fn new(
        status: StatusCode,
        headers: HeaderMap,
        body: Option<Bytes>,
        trailers: Option<HeaderMap>,
    ) -> Self {
        Self(Arc::new(Parts {
            status,
            headers,
            body,
            trailers,
            varied: HeaderMap::new(),
        }))
    }

    /// A unit of work's outcome as the stores keep it: a 200 whose body is the serialized
    /// value.
    pub(crate) fn of_outcome(outcome: Bytes) -> Self {
        Self::new(StatusCode::OK, HeaderMap::new(), Some(outcome), None)
    }

    /// Records the first request's values of the headers the response's `Vary` names.
    pub fn with_varied_request_headers(mut self, varied: HeaderMap) -> Self {
        Arc::make_mut(&mut self.0).varied = varied;
        self
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.0.status
    }

    /// The stored response headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.0.headers
    }

    /// The body, or `None` if it was over the cache limit and was not stored.
    pub fn body(&self) -> Option<&Bytes> {
        self.0.body.as_ref()
    }

    /// The trailers, if the response had any (gRPC responses always do).
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.0.trailers.as_ref()
    }

    /// The first request's values of the request headers the response varies on (its `Vary`).
    pub fn varied_request_headers(&self) -> &HeaderMap {
        &self.0.varied
    }

    /// Splits the response into status, headers, body and trailers (copies of them if clones
    /// of this response are still about).
    pub fn into_parts(self) -> (StatusCode, HeaderMap, Option<Bytes>, Option<HeaderMap>) {
        let parts = Arc::unwrap_or_clone(self.0);
        (parts.status, parts.headers, parts.body, parts.trailers)
    }

    /// Encodes the response in the crate's versioned binary format, the form stores keep.
    ///
    /// The format is binary-safe (any body bytes, any header value bytes), compact (lengths
    /// are varints) and starts with a magic and a version, so a record written by another
    /// version is reported, not misread.
    pub fn encode(&self) -> Bytes {
        let parts = &*self.0;
        let body_len = parts.body.as_ref().map_or(0, Bytes::len);
        let mut out = BytesMut::with_capacity(16 + body_len + 48 * parts.headers.len());
        out.put_slice(MAGIC);
        out.put_u8(VERSION);
        out.put_u16(parts.status.as_u16());
        let flags = u8::from(parts.body.is_some())
            | u8::from(parts.trailers.is_some()) << 1
            | u8::from(!parts.varied.is_empty()) << 2;
        out.put_u8(flags);
        put_fields(&mut out, &parts.headers);
        if let Some(body) = &parts.body {
            put_varint(&mut out, body.len() as u64);
            out.put_slice(body);
        }
        if let Some(trailers) = &parts.trailers {
            put_fields(&mut out, trailers);
        }
        if !parts.varied.is_empty() {
            put_fields(&mut out, &parts.varied);
        }
        out.freeze()
    }

    /// Decodes a response written by [`encode`](Self::encode). Never panics, whatever the bytes.
    pub fn decode(mut bytes: Bytes) -> Result<Self, DecodeError> {
        let buf = &mut bytes;
        if take(buf, MAGIC.len())? != MAGIC {
            return Err(DecodeError::NotARecord);
        }
        match take(buf, 1)?[0] {
            VERSION => {}
            other => return Err(DecodeError::UnknownVersion(other)),
        }
        let status = take(buf, 2)?;
        let status = StatusCode::from_u16(u16::from_be_bytes([status[0], status[1]]))
            .map_err(|_| DecodeError::Invalid)?;
        let flags = take(buf, 1)?[0];
        if flags & !0b111 != 0 {
            return Err(DecodeError::Invalid);
        }
        let headers = take_fields(buf)?;
        let body = if flags & 1 != 0 {
            let len = take_len(buf)?;
            Some(take(buf, len)?)
        } else {
            None
        };
        let trailers = if flags & 2 != 0 {
            Some(take_fields(buf)?)
        } else {
            None
        };
        let varied = if flags & 4 != 0 {
            take_fields(buf)?
        } else {
            HeaderMap::new()
        };
        if buf.has_remaining() {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(Self::new(status, headers, body, trailers).with_varied_request_headers(varied))
    }
}

impl fmt::Debug for StoredResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts = &*self.0;
        f.debug_struct("StoredResponse")
            .field("status", &parts.status)
            .field("headers", &parts.headers)
            .field("body", &parts.body)
            .field("trailers", &parts.trailers)
            .field("varied", &parts.varied)
            .finish()
    }
}

/// Default limit of a response body kept for replay: 1 MiB.
pub(crate) const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;

/// What of a response is stored: every header but the hop-by-hop ones and the configured
/// per-exchange ones, and the body up to the cache limit.
#[derive(Debug, Clone)]
pub(crate) struct StoreRules {
    pub(crate) unstored: Vec<HeaderName>,
    pub(crate) max_body: usize,
}

/// Hop-by-hop headers describe one connection, not the response: never stored, never replayed.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl StoreRules {
    /// The response headers kept for replay, in their order.
    pub(crate) fn headers(&self, headers: &HeaderMap) -> HeaderMap {
        let mut kept = HeaderMap::with_capacity(headers.len());
        for (name, value) in headers {
            if !HOP_BY_HOP.contains(&name.as_str()) && !self.unstored.contains(name) {
                kept.append(name, value.clone());
            }
        }
        kept
    }

    /// A whole response as it is stored: its body only within the cache limit.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn record(&self, response: &http::Response<Bytes>) -> StoredResponse {
        let body = (response.body().len() <= self.max_body).then(|| response.body().clone());
        StoredResponse::new(
            response.status(),
            self.headers(response.headers()),
            body,
            None,
        )
    }
}

impl Default for StoreRules {
    fn default() -> Self {
        Self {
            unstored: vec![
                header::DATE,
                header::SET_COOKIE,
                HeaderName::from_static("x-request-id"),
                HeaderName::from_static("request-id"),
                HeaderName::from_static("traceparent"),
                HeaderName::from_static("tracestate"),
                HeaderName::from_static("server-timing"),
            ],
            max_body: DEFAULT_MAX_RESPONSE_BODY,
        }
    }
}

/// A stored response could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes do not start with this crate's record magic.
    #[error("not a tower-idempotency response record")]
    NotARecord,
    /// The record was written by a version of this crate that this one cannot read.
    #[error(
        "response record format version {0} is not supported (this build reads version {VERSION})"
    )]
    UnknownVersion(u8),
    /// The record ends early.
    #[error("response record is truncated")]
    Truncated,
    /// The record holds an invalid status, header name, header value, flag or length.
    #[error("response record holds an invalid status, header, flag or length")]
    Invalid,
    /// Bytes follow the end of the record.
    #[error("response record has trailing bytes")]
    TrailingBytes,
}

const MAGIC: &[u8] = b"TIR";
const VERSION: u8 = 2;

fn put_varint(out: &mut BytesMut, mut n: u64) {
    while n >= 0x80 {
        out.put_u8((n as u8) | 0x80);
        n >>= 7;
    }
    out.put_u8(n as u8);
}

fn put_fields(out: &mut BytesMut, fields: &HeaderMap) {
    put_varint(out, fields.len() as u64);
    for (name, value) in fields {
        put_varint(out, name.as_str().len() as u64);
        out.put_slice(name.as_str().as_bytes());
        put_varint(out, value.len() as u64);
        out.put_slice(value.as_bytes());
    }
}

fn take_varint(buf: &mut Bytes) -> Result<u64, DecodeError> {
    let mut n = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = take(buf, 1)?[0];
        let bits = u64::from(byte & 0x7f);
        if shift == 63 && bits > 1 {
            return Err(DecodeError::Invalid);
        }
        n |= bits << shift;
        if byte & 0x80 == 0 {
            return Ok(n);
        }
    }
    Err(DecodeError::Invalid)
}

/// A length, which cannot exceed what is left of the record.
fn take_len(buf: &mut Bytes) -> Result<usize, DecodeError> {
    let len = take_varint(buf)?;
    if len > buf.remaining() as u64 {
        return Err(DecodeError::Truncated);
    }
    Ok(len as usize)
}

fn take_fields(buf: &mut Bytes) -> Result<HeaderMap, DecodeError> {
    // Each field takes at least three bytes: never trust a count to size an allocation.
    let count = take_varint(buf)?;
    if count > buf.remaining() as u64 / 3 {
        return Err(DecodeError::Truncated);
    }
    let mut fields = HeaderMap::with_capacity(count as usize);
    for _ in 0..count {
        let name_len = take_len(buf)?;
        let name =
            HeaderName::from_bytes(&take(buf, name_len)?).map_err(|_| DecodeError::Invalid)?;
        let value_len = take_len(buf)?;
        let value = HeaderValue::from_maybe_shared(take(buf, value_len)?)
            .map_err(|_| DecodeError::Invalid)?;
        fields.append(name, value);
    }
    Ok(fields)
}

fn take(buf: &mut Bytes, len: usize) -> Result<Bytes, DecodeError> {
    if buf.remaining() < len {
        return Err(DecodeError::Truncated);
    }
    Ok(buf.split_to(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.append("location", HeaderValue::from_static("/payments/1"));
        headers.append("x-multi", HeaderValue::from_static("one"));
        headers.append("x-multi", HeaderValue::from_static("two"));
        headers.append("x-opaque", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        let mut varied = HeaderMap::new();
        varied.append("accept-encoding", HeaderValue::from_static("gzip"));
        StoredResponse::new(
            StatusCode::CREATED,
            headers,
            Some(Bytes::from_static(b"\x00\xff binary \r\n")),
            Some(trailers),
        )
        .with_varied_request_headers(varied)
    }

    #[test]
    fn round_trips_every_part() {
        let original = sample();
        let decoded = StoredResponse::decode(original.encode()).unwrap();
        assert_eq!(decoded, original);
        let order: Vec<_> = decoded.headers().iter().map(|(_, v)| v.clone()).collect();
        let expected: Vec<_> = original.headers().iter().map(|(_, v)| v.clone()).collect();
        assert_eq!(order, expected);

        let bare = StoredResponse::new(StatusCode::OK, HeaderMap::new(), None, None);
        assert_eq!(StoredResponse::decode(bare.encode()).unwrap(), bare);
    }

    #[test]
    fn damaged_records_are_errors_not_panics() {
        let encoded = sample().encode();
        for len in 0..encoded.len() {
            assert!(StoredResponse::decode(encoded.slice(..len)).is_err());
        }
        let mut longer = encoded.to_vec();
        longer.push(0);
        assert_eq!(
            StoredResponse::decode(longer.into()),
            Err(DecodeError::TrailingBytes)
        );
        let mut future = encoded.to_vec();
        future[3] = 9;
        assert_eq!(encoded[3], VERSION);
        assert_eq!(
            StoredResponse::decode(future.into()),
            Err(DecodeError::UnknownVersion(9))
        );
        assert_eq!(
            StoredResponse::decode(Bytes::from_static(b"{\"json\":1}")),
            Err(DecodeError::NotARecord)
        );
        // A count or a length larger than the record is refused before any allocation.
        for hostile in [
            &b"TIR\x02\x00\xc8\x00\xff\xff\xff\xff\x0f"[..],
            b"TIR\x02\x00\xc8\x01\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
            b"TIR\x02\x00\xc8\x00\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",
        ] {
            assert!(StoredResponse::decode(Bytes::from_static(hostile)).is_err());
        }
    }

    #[test]
    fn varints_round_trip_at_their_edges() {
        for n in [
            0,
            1,
            127,
            128,
            300,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = BytesMut::new();
            put_varint(&mut out, n);
            assert_eq!(take_varint(&mut out.freeze()), Ok(n));
        }
    }
}
