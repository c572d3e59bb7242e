//! The senders' signatures: Standard Webhooks (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature`) and Stripe (`Stripe-Signature`), each checked over the body exactly as
//! received, within the sender's tolerance, and compared in constant time. The signing halves
//! are for trying the receiver (`cargo run --example webhooks -- sign …`) and for its tests.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use sha2::Sha256;
use tower_idempotency::problem::Unverified;

type HmacSha256 = Hmac<Sha256>;

/// How far a delivery's timestamp may be from now: both specs' default, 5 minutes.
pub const TOLERANCE: Duration = Duration::from_secs(300);

/// Seconds since the epoch, now.
pub fn now() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH);
    since.map_or(0, |since| since.as_secs())
}

/// A Standard Webhooks secret: the `whsec_…` form, base64 after the prefix.
#[derive(Clone)]
pub struct StandardSecret(Vec<u8>);

impl StandardSecret {
    /// Reads the `whsec_…` form (the prefix is optional, as the spec's libraries allow).
    pub fn parse(secret: &str) -> Result<Self, String> {
        let encoded = secret.strip_prefix("whsec_").unwrap_or(secret);
        match BASE64.decode(encoded) {
            Ok(key) if !key.is_empty() => Ok(Self(key)),
            Ok(_) => Err("the webhook secret is empty".into()),
            Err(error) => Err(format!(
                "the webhook secret is not base64 after whsec_: {error}"
            )),
        }
    }

    fn mac(&self, id: &str, timestamp: &str, body: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for part in [id.as_bytes(), b".", timestamp.as_bytes(), b".", body] {
            mac.update(part);
        }
        mac
    }

    /// The `webhook-signature` header a sender puts on delivery `id` of `body` at `timestamp`.
    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        let signature = self
            .mac(id, &timestamp.to_string(), body)
            .finalize()
            .into_bytes();
        format!("v1,{}", BASE64.encode(signature))
    }

    /// Checks a delivery: its `webhook-id`, a `webhook-timestamp` within [`TOLERANCE`] of
    /// `now`, and one `v1` signature of `webhook-signature` (space-separated) that matches.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now: u64) -> Result<(), Unverified> {
        let header = |name| {
            let value = headers.get(name).and_then(|v| v.to_str().ok());
            value.ok_or_else(|| malformed(format!("no {name} header")))
        };
        let (id, timestamp) = (header("webhook-id")?, header("webhook-timestamp")?);
        within_tolerance(timestamp, now, true)?;
        let mac = self.mac(id, timestamp, body);
        let signatures = header("webhook-signature")?.split(' ');
        let matches = signatures
            .filter_map(|signature| signature.strip_prefix("v1,"))
            .filter_map(|signature| BASE64.decode(signature).ok())
            .any(|signature| mac.clone().verify_slice(&signature).is_ok());
        matches
            .then_some(())
            .ok_or_else(|| Unverified::new("no webhook-signature matches the delivery"))
    }
}

/// A Stripe endpoint's signing secret (`whsec_…`), used as it is: Stripe's HMAC key is the
/// secret's text, not its decoding.
#[derive(Clone)]
pub struct StripeSecret(String);

impl StripeSecret {
    pub fn new(secret: &str) -> Self {
        Self(secret.to_owned())
    }

    fn mac(&self, timestamp: &str, body: &[u8]) -> HmacSha256 {
        let key = self.0.as_bytes();
        let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
        for part in [timestamp.as_bytes(), b".", body] {
            mac.update(part);
        }
        mac
    }

    /// The `Stripe-Signature` header Stripe puts on `body` at `timestamp`.
    pub fn sign(&self, timestamp: u64, body: &[u8]) -> String {
        let signature = self
            .mac(&timestamp.to_string(), body)
            .finalize()
            .into_bytes();
        format!("t={timestamp},v1={}", hex::encode(signature))
    }

    /// Checks an event as Stripe's libraries do: one `v1` signature of `Stripe-Signature` over
    /// `{t}.{body}` that matches, and `t` no older than [`TOLERANCE`].
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now: u64) -> Result<(), Unverified> {
        let header = headers
            .get("stripe-signature")
            .and_then(|v| v.to_str().ok());
        let header = header.ok_or_else(|| malformed("no Stripe-Signature header".into()))?;
        let pairs = || header.split(',').filter_map(|pair| pair.split_once('='));
        let timestamp = pairs().find(|(name, _)| *name == "t").map(|(_, t)| t);
        let timestamp =
            timestamp.ok_or_else(|| malformed("no timestamp (t=) in Stripe-Signature".into()))?;
        let mac = self.mac(timestamp, body);
        let matches = pairs()
            .filter(|(name, _)| *name == "v1")
            .filter_map(|(_, signature)| hex::decode(signature).ok())
            .any(|signature| mac.clone().verify_slice(&signature).is_ok());
        if !matches {
            return Err(Unverified::new(
                "no v1 signature of Stripe-Signature matches the event",
            ));
        }
        within_tolerance(timestamp, now, false)
    }
}

/// Whether `timestamp` (seconds) is within [`TOLERANCE`] of `now`: in the past only, or both
/// ways (`both_ways`: Standard Webhooks refuses a timestamp from the future too).
fn within_tolerance(timestamp: &str, now: u64, both_ways: bool) -> Result<(), Unverified> {
    let timestamp: u64 = timestamp.parse().map_err(|_| {
        malformed(format!(
            "the timestamp {timestamp:?} is not a number of seconds"
        ))
    })?;
    let tolerance = TOLERANCE.as_secs();
    if timestamp + tolerance < now {
        let age = now - timestamp;
        return Err(Unverified::new(format!(
            "the delivery is {age} s old, past the {tolerance} s tolerance"
        )));
    }
    if both_ways && timestamp > now + tolerance {
        return Err(Unverified::new("the delivery's timestamp is in the future"));
    }
    Ok(())
}

/// A delivery without what a signed one carries: 400.
fn malformed(reason: String) -> Unverified {
    Unverified::new(reason).with_status(http::StatusCode::BAD_REQUEST)
}
