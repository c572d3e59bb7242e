//! The idempotency key: parsed from its header (or read from a JSON body) and validated.

use std::fmt;

use http::{HeaderMap, HeaderName};

/// A validated idempotency key: 1 to 255 visible ASCII characters.
///
/// The header may carry a structured-field string (`"8e03978e-40d5"`, as the IETF draft
/// specifies; RFC 9651, which replaced RFC 8941 in 2024 with the same grammar for strings) or the
/// bare token most clients send (`8e03978e-40d5`); both parse to the same key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// The longest key accepted, in characters, after unquoting: 255.
    pub const MAX_LEN: usize = 255;

    /// Parses one header value.
    ///
    /// The value is an RFC 9651 item: a string (`"order-42"`) or, as most clients send it, a bare
    /// token (`order-42`), either of them optionally followed by parameters (`;x=1`), which are
    /// ignored as RFC 9651 says. A comma outside a string makes the value a list: that is what a
    /// proxy makes of a repeated header, and it is refused as [`KeyError::Repeated`].
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, KeyError};
    ///
    /// let quoted = IdempotencyKey::parse(br#""order-42""#).unwrap();
    /// assert_eq!(IdempotencyKey::parse(b"order-42").unwrap(), quoted);
    /// assert_eq!(IdempotencyKey::parse(br#""order-42";v=1"#).unwrap(), quoted);
    /// assert_eq!(IdempotencyKey::parse(b"k1, k2"), Err(KeyError::Repeated));
    /// assert!(IdempotencyKey::parse(b"").is_err());
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        // RFC 9651 parsers discard surrounding spaces; HTTP stacks usually have already.
        let value = value.trim_ascii();
        let (key, rest) = match value {
            [b'"', rest @ ..] => unquote(rest)?,
            _ => {
                let end = value
                    .iter()
                    .position(|&b| b == b';' || b == b',')
                    .unwrap_or(value.len());
                (value[..end].to_vec(), &value[end..])
            }
        };
        parameters(rest)?;
        Self::checked(key)
    }

    /// The key `key` is, as it is (not parsed as a header value): 1 to [`MAX_LEN`](Self::MAX_LEN)
    /// visible ASCII characters.
    fn checked(key: Vec<u8>) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > Self::MAX_LEN {
            return Err(KeyError::TooLong { len: key.len() });
        }
        if let Some(&byte) = key.iter().find(|b| !b.is_ascii_graphic()) {
            return Err(KeyError::InvalidCharacter { byte });
        }
        // Every byte is visible ASCII: the bytes are already the key's UTF-8.
        Ok(Self(
            String::from_utf8(key).expect("visible ASCII is UTF-8"),
        ))
    }

    /// Reads the key from a JSON body, at `pointer` (RFC 6901): `Ok(None)` when the body is not
    /// JSON or has nothing there, an error when the value there is not a string or an integer,
    /// or not a valid key. The value is the key as it is (`"evt_1"` is `evt_1`), not parsed as a
    /// header value.
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    ///
    /// let body = br#"{"id": "evt_1NG8Du2eZvKYlo2C", "type": "charge.succeeded"}"#;
    /// let key = IdempotencyKey::from_json(body, "/id").unwrap().unwrap();
    /// assert_eq!(key.as_str(), "evt_1NG8Du2eZvKYlo2C");
    /// assert_eq!(IdempotencyKey::from_json(body, "/event_id"), Ok(None));
    /// assert!(IdempotencyKey::from_json(br#"{"id": {}}"#, "/id").is_err());
    /// ```
    pub fn from_json(body: &[u8], pointer: &str) -> Result<Option<Self>, KeyError> {
        let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) else {
            return Ok(None);
        };
        match json.pointer(pointer) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(key)) => {
                Self::checked(key.as_bytes().to_vec()).map(Some)
            }
            Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                Self::checked(n.to_string().into_bytes()).map(Some)
            }
            Some(_) => Err(KeyError::NotAString),
        }
    }

    /// Reads the key from the request header `name`: `Ok(None)` when there is none, an error when
    /// the value is invalid or the header is repeated (as separate lines or joined by commas).
    pub fn from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name).iter();
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

/// Checks that `pointer` is a JSON pointer to a field (RFC 6901: it starts with `/`), as the
/// layer's options that take one require.
///
/// # Panics
///
/// If it is not.
pub(crate) fn assert_json_pointer(pointer: &str) {
    assert!(
        pointer.starts_with('/'),
        "{pointer:?} is not a JSON pointer to a field: it must start with '/'"
    );
}

/// Why an idempotency key was refused (the layer answers 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was sent more than once, or holds a list (values joined by commas).
    #[error("the idempotency key header is repeated or holds a list; send exactly one key")]
    Repeated,
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`IdempotencyKey::MAX_LEN`].
    #[error(
        "the idempotency key has {len} characters; at most {} are allowed",
        IdempotencyKey::MAX_LEN
    )]
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
    /// The value is not a well-formed RFC 9651 item: a broken string or broken parameters.
    #[error("the idempotency key is not a well-formed structured-field item: {reason}")]
    Malformed {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The value where a JSON body holds the key
    /// ([`with_key_from_body`](crate::IdempotencyLayer::with_key_from_body)) is neither a string
    /// nor an integer.
    #[error("the idempotency key in the request body is neither a string nor an integer")]
    NotAString,
}

/// Parses the rest of an RFC 9651 sf-string after its opening quote (section 4.2.5); returns
/// the string and what follows its closing quote.
fn unquote(rest: &[u8]) -> Result<(Vec<u8>, &[u8]), KeyError> {
    let malformed = |reason| KeyError::Malformed { reason };
    let mut out = Vec::with_capacity(rest.len());
    let mut bytes = rest.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(malformed("a backslash must escape '\"' or '\\'")),
            },
            b'"' => return Ok((out, bytes.as_slice())),
            0x20..=0x7e => out.push(b),
            _ => return Err(malformed("only printable ASCII may appear inside quotes")),
        }
    }
    Err(malformed("the closing quote is missing"))
}

/// Checks what follows the item: RFC 9651 parameters (`;key` or `;key=value`), ignored once
/// well-formed. A comma means a list: a repeated header.
fn parameters(mut rest: &[u8]) -> Result<(), KeyError> {
    let malformed = |reason| KeyError::Malformed { reason };
    loop {
        match rest {
            [] => return Ok(()),
            [b',', ..] => return Err(KeyError::Repeated),
            [b';', tail @ ..] => rest = tail.trim_ascii_start(),
            _ => {
                return Err(malformed(
                    "only parameters (;name=value) may follow the key",
                ));
            }
        }
        // param-key = ( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )
        let name_len = rest
            .iter()
            .position(|b| !matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
            .unwrap_or(rest.len());
        if name_len == 0 || !matches!(rest[0], b'a'..=b'z' | b'*') {
            return Err(malformed(
                "a parameter name must start with a lowercase letter or '*'",
            ));
        }
        rest = &rest[name_len..];
        if let [b'=', value @ ..] = rest {
            rest = match value {
                [b'"', string @ ..] => unquote(string)?.1,
                _ => {
                    // Any other bare item (token, number, byte sequence, boolean): its extent
                    // is enough, since parameters are ignored.
                    let len = value
                        .iter()
                        .position(|&b| b == b';' || b == b',' || !b.is_ascii_graphic())
                        .unwrap_or(value.len());
                    if len == 0 {
                        return Err(malformed("a parameter value is empty"));
                    }
                    &value[len..]
                }
            };
        }
    }
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
        let max = "k".repeat(IdempotencyKey::MAX_LEN);
        assert!(IdempotencyKey::parse(max.as_bytes()).is_ok());
        assert!(IdempotencyKey::parse(format!("\"{max}\"").as_bytes()).is_ok());
        let over = "k".repeat(IdempotencyKey::MAX_LEN + 1);
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
            b"\"a\x01\"",
            br#""abc";"#,
            br#""abc";X=1"#,
            br#""abc";x="#,
            br#""abc";x="1"#,
            b"abc;1=2",
        ] {
            assert!(
                matches!(IdempotencyKey::parse(bad), Err(KeyError::Malformed { .. })),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn parameters_are_ignored_on_both_forms() {
        let key = IdempotencyKey::parse(b"abc").unwrap();
        for same in [
            &br#""abc";x=1"#[..],
            b"abc;x=1",
            br#""abc";x="a;b,c";y"#,
            b"abc; x=?1;y=:AQ==:;z=1.5",
            b"abc;*x=tok/en",
        ] {
            assert_eq!(IdempotencyKey::parse(same).as_ref(), Ok(&key), "{same:?}");
        }
    }

    #[test]
    fn lists_are_repeated_headers() {
        for list in [
            &b"k1,k2"[..],
            b"k1, k2",
            br#""k1", "k2""#,
            b"k1;x=1,k2",
            b"k1,",
        ] {
            assert_eq!(
                IdempotencyKey::parse(list),
                Err(KeyError::Repeated),
                "{list:?}"
            );
        }
        // A comma inside a string is part of the key.
        assert_eq!(
            IdempotencyKey::parse(br#""k1,k2""#).unwrap().as_str(),
            "k1,k2"
        );
    }

    #[test]
    fn headers_missing_single_and_repeated() {
        let name = &crate::headers::IDEMPOTENCY_KEY;
        let mut headers = HeaderMap::new();
        assert_eq!(IdempotencyKey::from_headers(&headers, name), Ok(None));
        headers.insert(name, HeaderValue::from_static("k1"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, name)
                .unwrap()
                .unwrap()
                .as_str(),
            "k1"
        );
        let legacy = HeaderName::from_static("x-idempotency-key");
        assert_eq!(IdempotencyKey::from_headers(&headers, &legacy), Ok(None));
        headers.append(name, HeaderValue::from_static("k1"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, name),
            Err(KeyError::Repeated)
        );
    }
}
