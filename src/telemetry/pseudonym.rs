//! Keys and scopes as logs show them.

use std::fmt;

use sha2::{Digest, Sha256};

/// A key or scope as logs show it: a pseudonym (`#` and 12 hex digits of its SHA-256), the same
/// on every instance, so an operator can follow one key through the logs without the key (a
/// customer's order number, a tenant's name) appearing in them. It is not encryption: a guessable
/// key can be found by hashing guesses. [`IdempotencyLayer::with_clear_keys_in_logs`] shows them as
/// they are.
///
/// [`IdempotencyLayer::with_clear_keys_in_logs`]: crate::IdempotencyLayer::with_clear_keys_in_logs
pub(crate) struct Pseudonym<'a> {
    pub(crate) value: &'a str,
    pub(crate) clear: bool,
}

impl fmt::Display for Pseudonym<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.clear {
            return f.write_str(self.value);
        }
        let digest = Sha256::digest(self.value.as_bytes());
        f.write_str("#")?;
        digest[..6].iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// A record's scope and key as logs show them.
pub(crate) struct ShownRecord<'a> {
    pub(crate) scope: Pseudonym<'a>,
    pub(crate) key: Pseudonym<'a>,
}

impl fmt::Display for ShownRecord<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "scope {} key {}", self.scope, self.key)
    }
}

impl fmt::Debug for Pseudonym<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
