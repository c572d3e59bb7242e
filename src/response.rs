//! The stored outcome of a request, and its binary encoding.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// What a completed request answered, as stored and replayed.
///
/// Headers and trailers keep every value of a repeated field and the order the handler produced
/// them in. The body is `None` when it exceeded the layer's cache limit: the outcome is recorded
/// (so the request is never run again) but later retries get a problem response instead of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl StoredResponse {
    /// A stored response.
    pub fn new(
        status: StatusCode,
        headers: HeaderMap,
        body: Option<Bytes>,
        trailers: Option<HeaderMap>,
    ) -> Self {
        Self {
            status,
            headers,
            body,
            trailers,
        }
    }

    /// The response status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stored response headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body, or `None` if it was over the cache limit and was not stored.
    pub fn body(&self) -> Option<&Bytes> {
        self.body.as_ref()
    }

    /// The trailers, if the response had any (gRPC responses always do).
    pub fn trailers(&self) -> Option<&HeaderMap> {
        self.trailers.as_ref()
    }

    /// Splits the response into its parts.
    pub fn into_parts(self) -> (StatusCode, HeaderMap, Option<Bytes>, Option<HeaderMap>) {
        (self.status, self.headers, self.body, self.trailers)
    }

    /// Encodes the response in the crate's versioned binary format, the form stores keep.
    ///
    /// The format is binary-safe (any body bytes, any header value bytes) and starts with a
    /// magic and a version, so a record written by another version is reported, not misread.
    pub fn encode(&self) -> Bytes {
        let body_len = self.body.as_ref().map_or(0, Bytes::len);
        let mut out = BytesMut::with_capacity(64 + body_len + 64 * self.headers.len());
        out.put_slice(MAGIC);
        out.put_u8(VERSION);
        out.put_u16(self.status.as_u16());
        put_fields(&mut out, &self.headers);
        out.put_u8(u8::from(self.body.is_some()) | u8::from(self.trailers.is_some()) << 1);
        if let Some(body) = &self.body {
            out.put_u64(body.len() as u64);
            out.put_slice(body);
        }
        if let Some(trailers) = &self.trailers {
            put_fields(&mut out, trailers);
        }
        out.freeze()
    }

    /// Decodes a response written by [`encode`](Self::encode).
    pub fn decode(mut bytes: Bytes) -> Result<Self, DecodeError> {
        let buf = &mut bytes;
        if take(buf, MAGIC.len())? != MAGIC {
            return Err(DecodeError::NotARecord);
        }
        match take_u8(buf)? {
            VERSION => {}
            other => return Err(DecodeError::UnknownVersion(other)),
        }
        let status = StatusCode::from_u16(take_u16(buf)?).map_err(|_| DecodeError::Invalid)?;
        let headers = take_fields(buf)?;
        let flags = take_u8(buf)?;
        if flags & !0b11 != 0 {
            return Err(DecodeError::Invalid);
        }
        let body = if flags & 1 != 0 {
            let len = usize::try_from(take_u64(buf)?).map_err(|_| DecodeError::Truncated)?;
            Some(take(buf, len)?)
        } else {
            None
        };
        let trailers = if flags & 2 != 0 {
            Some(take_fields(buf)?)
        } else {
            None
        };
        if buf.has_remaining() {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(Self::new(status, headers, body, trailers))
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
    /// The record holds an invalid status, header name or header value.
    #[error("response record holds an invalid status, header or flag")]
    Invalid,
    /// Bytes follow the end of the record.
    #[error("response record has trailing bytes")]
    TrailingBytes,
}

const MAGIC: &[u8] = b"TIR";
const VERSION: u8 = 1;

fn put_fields(out: &mut BytesMut, fields: &HeaderMap) {
    out.put_u32(fields.len() as u32);
    for (name, value) in fields {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
}

fn take_fields(buf: &mut Bytes) -> Result<HeaderMap, DecodeError> {
    let count = take_u32(buf)? as usize;
    // Each field takes at least six bytes: never trust a count to size an allocation.
    let mut fields = HeaderMap::with_capacity(count.min(buf.remaining() / 6));
    for _ in 0..count {
        let name_len = usize::from(take_u16(buf)?);
        let name =
            HeaderName::from_bytes(&take(buf, name_len)?).map_err(|_| DecodeError::Invalid)?;
        let value_len = take_u32(buf)? as usize;
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

fn take_u8(buf: &mut Bytes) -> Result<u8, DecodeError> {
    Ok(take(buf, 1)?.get_u8())
}

fn take_u16(buf: &mut Bytes) -> Result<u16, DecodeError> {
    Ok(take(buf, 2)?.get_u16())
}

fn take_u32(buf: &mut Bytes) -> Result<u32, DecodeError> {
    Ok(take(buf, 4)?.get_u32())
}

fn take_u64(buf: &mut Bytes) -> Result<u64, DecodeError> {
    Ok(take(buf, 8)?.get_u64())
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
        StoredResponse::new(
            StatusCode::CREATED,
            headers,
            Some(Bytes::from_static(b"\x00\xff binary \r\n")),
            Some(trailers),
        )
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
        assert_eq!(
            StoredResponse::decode(future.into()),
            Err(DecodeError::UnknownVersion(9))
        );
        assert_eq!(
            StoredResponse::decode(Bytes::from_static(b"{\"json\":1}")),
            Err(DecodeError::NotARecord)
        );
    }
}
