//! The one Redis string that holds a key's record: its layout, written by the Lua scripts in
//! `lua/` and read here, in one place. The scripts address the same offsets (1-based, as Lua's
//! `string.sub` counts); a test below checks that they agree with these constants.
//!
//! ```text
//! layout (1) | state (1: i, c) | fingerprint (32) | owner (16) | fence (16 digits) | response…
//! ```

use bytes::Bytes;
use uuid::Uuid;

use crate::{Fingerprint, StoredResponse};

/// The layout of the record (its first byte; the response encoding after it carries its own
/// version).
pub(super) const LAYOUT: u8 = 2;

/// Where the parts of a record start.
const STATE: usize = 1;
const FINGERPRINT: usize = 2;
const OWNER: usize = 34;
const FENCE: usize = 50;
const RESPONSE: usize = 66;

/// A record's state byte.
const IN_FLIGHT: u8 = b'i';
const COMPLETED: u8 = b'c';

/// A fresh record in flight up to its fence, which claim.lua appends from the server's clock.
pub(super) fn in_flight_head(fingerprint: &Fingerprint, owner: Uuid) -> Vec<u8> {
    let mut head = Vec::with_capacity(FENCE);
    head.push(LAYOUT);
    head.push(IN_FLIGHT);
    head.extend_from_slice(fingerprint.as_bytes());
    head.extend_from_slice(owner.as_bytes());
    head
}

/// A record read back.
#[derive(Debug)]
pub(super) struct Record<'a> {
    fingerprint: &'a [u8],
    pub(super) owner: Uuid,
    /// The claim's time on the server's clock, in microseconds.
    pub(super) fence: u64,
    completed: bool,
    response: &'a [u8],
}

impl<'a> Record<'a> {
    /// Reads a record; `Err` says what is wrong with it.
    pub(super) fn parse(value: &'a [u8]) -> Result<Self, String> {
        if value.len() < RESPONSE {
            return Err(format!("record of {} bytes is too short", value.len()));
        }
        if value[0] != LAYOUT {
            return Err(format!(
                "record layout version {}, expected {LAYOUT}",
                value[0]
            ));
        }
        let completed = match value[STATE] {
            IN_FLIGHT => false,
            COMPLETED => true,
            other => return Err(format!("unknown state {:?}", char::from(other))),
        };
        let owner = Uuid::from_slice(&value[OWNER..FENCE]).map_err(|e| e.to_string())?;
        let fence = std::str::from_utf8(&value[FENCE..RESPONSE])
            .ok()
            .and_then(|f| f.parse().ok())
            .ok_or("unreadable fence")?;
        Ok(Self {
            fingerprint: &value[FINGERPRINT..OWNER],
            owner,
            fence,
            completed,
            response: &value[RESPONSE..],
        })
    }

    /// Whether the record was claimed with `fingerprint`.
    pub(super) fn matches(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint == fingerprint.as_bytes()
    }

    /// The stored response of a completed record; `None` while in flight.
    pub(super) fn response(&self) -> Result<Option<StoredResponse>, String> {
        if !self.completed {
            return Ok(None);
        }
        StoredResponse::decode(Bytes::copy_from_slice(self.response))
            .map(Some)
            .map_err(|error| error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts read the state, compare the owner and keep the record up to its fence at
    /// exactly the offsets above.
    #[test]
    fn the_scripts_agree_with_the_layout() {
        let state = format!("string.sub(record, {}, {})", STATE + 1, STATE + 1);
        let owner = format!("string.sub(record, {}, {})", OWNER + 1, FENCE);
        let head = format!("string.sub(record, {}, {})", FINGERPRINT + 1, RESPONSE);
        let layout = format!("string.sub(record, 1, {STATE})");
        let in_flight = format!("'{}'", char::from(IN_FLIGHT));
        let completed = format!("'{}'", char::from(COMPLETED));
        let scripts = [
            ("complete", include_str!("../../../lua/complete.lua")),
            ("release", include_str!("../../../lua/release.lua")),
            ("renew", include_str!("../../../lua/renew.lua")),
        ];
        for (name, script) in scripts {
            let checks_owner = format!("{state} ~= {in_flight} or {owner} ~= ARGV[1]");
            assert!(
                script.contains(&checks_owner),
                "{name}.lua checks no owner at {owner}"
            );
        }
        let complete = scripts[0].1;
        let rewrite = format!("{layout} .. {completed} .. {head} .. ARGV[2]");
        assert!(
            complete.contains(&rewrite),
            "complete.lua keeps another part: {rewrite}"
        );
        // claim.lua appends the fence to the head Rust builds: 16 digits, seconds and micros.
        let claim = include_str!("../../../lua/claim.lua");
        assert!(claim.contains("string.format('%06d', tonumber(now[2]))"));
        assert_eq!(
            RESPONSE - FENCE,
            16,
            "ten digits of seconds and six of micros"
        );
        let parts = http::Request::post("/").body(()).unwrap().into_parts().0;
        let fingerprint = Fingerprint::of_request(&parts, &[], b"");
        assert_eq!(in_flight_head(&fingerprint, Uuid::nil()).len(), FENCE);
    }
}
