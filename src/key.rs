//! The `Idempotency-Key` header: parsing and validation.

use std::fmt;

use http::{HeaderMap, HeaderName};

/// The request header that carries the key (`Idempotency-Key`; gRPC metadata `idempotency-key`).
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted, in characters, after unquoting.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to 255 visible ASCII characters.
///
/// The header may carry an RFC 8941 string (`"8e03978e-40d5"`, as the IETF draft specifies) or the
/// bare token most clients send (`8e03978e-40d5`); both parse to the same key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Parses one header value.
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    ///
    /// let quoted = IdempotencyKey::parse(br#""order-42""#).unwrap();
    /// let bare = IdempotencyKey::parse(b"order-42").unwrap();
    /// assert_eq!(quoted, bare);
    /// assert!(IdempotencyKey::parse(b"").is_err());
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        // RFC 8941 parsers discard surrounding spaces; HTTP stacks usually have already.
        let value = value.trim_ascii();
        let key = match value {
            [b'"', rest @ ..] => unquote(rest)?,
            _ => value.to_vec(),
        };
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: key.len() });
        }
        if let Some(&byte) = key.iter().find(|b| !b.is_ascii_graphic()) {
            return Err(KeyError::InvalidCharacter { byte });
        }
        Ok(Self(key.into_iter().map(char::from).collect()))
    }

    /// Reads the key from request headers: `Ok(None)` when there is none, an error when the value
    /// is invalid or the header is repeated.
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key as sent by the client, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = KeyError;

    fn try_from(value: &str) -> Result<Self, Self::Error> {
        Self::parse(value.as_bytes())
    }
}

/// Why an `Idempotency-Key` header was refused (the layer answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was sent more than once.
    #[error("the Idempotency-Key header is repeated; send exactly one")]
    Repeated,
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key has {len} characters; at most {MAX_KEY_LEN} are allowed")]
    TooLong {
        /// The length after unquoting.
        len: usize,
    },
    /// The key holds a byte that is not visible ASCII (spaces and control characters included).
    #[error(
        "the idempotency key holds byte 0x{byte:02x}; only visible ASCII (0x21-0x7e) is allowed"
    )]
    InvalidCharacter {
        /// The first offending byte.
        byte: u8,
    },
    /// A value starting with `"` is not a well-formed RFC 8941 string.
    #[error("the idempotency key is not a well-formed structured-field string: {reason}")]
    MalformedString {
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Parses the rest of an RFC 8941 sf-string after its opening quote (section 4.2.5).
fn unquote(rest: &[u8]) -> Result<Vec<u8>, KeyError> {
    let malformed = |reason| KeyError::MalformedString { reason };
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(malformed("a backslash must escape '\"' or '\\'")),
            },
            b'"' => {
                return if bytes.as_slice().is_empty() {
                    Ok(out)
                } else {
                    Err(malformed("characters follow the closing quote"))
                };
            }
            0x20..=0x7e => out.push(b),
            _ => return Err(malformed("only printable ASCII may appear inside quotes")),
        }
    }
    Err(malformed("the closing quote is missing"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        let bare = IdempotencyKey::parse(b"abc-123_X.y~z").unwrap();
        let quoted = IdempotencyKey::parse(br#""abc-123_X.y~z""#).unwrap();
        assert_eq!(bare, quoted);
        assert_eq!(bare.as_str(), "abc-123_X.y~z");
    }

    #[test]
    fn escapes_in_strings_are_unquoted() {
        let key = IdempotencyKey::parse(br#""a\"b\\c""#).unwrap();
        assert_eq!(key.as_str(), r#"a"b\c"#);
    }

    #[test]
    fn length_limits_apply_after_unquoting() {
        let max = "k".repeat(MAX_KEY_LEN);
        assert!(IdempotencyKey::parse(max.as_bytes()).is_ok());
        assert!(IdempotencyKey::parse(format!("\"{max}\"").as_bytes()).is_ok());
        let over = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            IdempotencyKey::parse(over.as_bytes()),
            Err(KeyError::TooLong { len: 256 })
        );
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"   "), Err(KeyError::Empty));
    }

    #[test]
    fn invisible_characters_are_refused() {
        for bad in [&b"a b"[..], b"a\tb", b"caf\xc3\xa9", b"a\x7fb", b"\"a b\""] {
            assert!(
                matches!(
                    IdempotencyKey::parse(bad),
                    Err(KeyError::InvalidCharacter { .. })
                ),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn malformed_strings_are_refused() {
        for bad in [
            &br#""abc"#[..],
            br#""abc"def"#,
            br#""a\nb""#,
            br#""abc", "def""#,
            b"\"a\x01\"",
        ] {
            assert!(
                matches!(
                    IdempotencyKey::parse(bad),
                    Err(KeyError::MalformedString { .. })
                ),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn headers_missing_single_and_repeated() {
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers), Ok(None));
        headers.insert(&IDEMPOTENCY_KEY, HeaderValue::from_static("k1"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers)
                .unwrap()
                .unwrap()
                .as_str(),
            "k1"
        );
        headers.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("k1"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers),
            Err(KeyError::Repeated)
        );
    }
}
