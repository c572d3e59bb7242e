//! The one Redis string that holds a key's record: its layout, written by the Lua scripts in
//! `lua/` and read here, in one place. The scripts address the same offsets (1-based, as Lua's
//! `string.sub` counts); a test below checks that they agree with these constants.
//!
//! ```text
//! layout (1) | state (1: i, w, c) | fingerprint (32) | owner (16) | fence (16 digits) | response…
//! ```
//!
//! In flight is `i`, or `w` once a waiter marked the key (mark.lua): its owner's completion or
//! release then tells the processes that wait for it.

use bytes::Bytes;
use uuid::Uuid;

use crate::{fingerprint::Fingerprint, response::StoredResponse};

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
const WAITED: u8 = b'w';
const COMPLETED: u8 = b'c';

/// A fresh record in flight up to its fence, which claim.lua appends from the server's clock.
pub(super) fn in_flight_head(fingerprint: &Fingerprint, owner: Uuid) -> Vec<u8> {
    // Room for the fence too: the record claimed without a script is this and its digits.
    let mut head = Vec::with_capacity(RESPONSE);
    head.push(LAYOUT);
    head.push(IN_FLIGHT);
    head.extend_from_slice(fingerprint.as_bytes());
    head.extend_from_slice(owner.as_bytes());
    head
}

/// The whole record claim.lua wrote for a claim it granted with `fence`: the head and the fence's
/// 16 digits (ten of seconds, six of microseconds). `None` for a fence that is not 16 digits
/// long, which claim.lua never writes.
pub(super) fn in_flight(fingerprint: &Fingerprint, owner: Uuid, fence: u64) -> Option<Vec<u8>> {
    let mut record = in_flight_head(fingerprint, owner);
    record.extend_from_slice(itoa::Buffer::new().format(fence).as_bytes());
    (record.len() == RESPONSE).then_some(record)
}

/// The completed record an in-flight one becomes with `response` (encoded), as complete.lua
/// writes it: the same head and fence, the completed state, the response after them.
pub(super) fn completed(in_flight: &[u8], response: &[u8]) -> Vec<u8> {
    let mut record = Vec::with_capacity(in_flight.len() + response.len());
    record.extend_from_slice(in_flight);
    record[STATE] = COMPLETED;
    record.extend_from_slice(response);
    record
}

/// A decimal number the scripts wrote (a fence, the server's clock, a status), if it is one.
pub(super) fn number(digits: &[u8]) -> Option<u64> {
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// A tombstone read back (complete.lua writes it beside the record, claim.lua returns it once
/// the record expired):
///
/// ```text
/// fingerprint (32) | status (3 digits) | completed (16 digits: the server's microseconds)
/// ```
#[derive(Debug)]
pub(super) struct Tombstone<'a> {
    fingerprint: &'a [u8],
    pub(super) status: http::StatusCode,
    /// When the key completed, on the server's clock, in microseconds.
    pub(super) completed: u64,
}

/// Where the parts of a tombstone start, and its length.
const TOMBSTONE_STATUS: usize = 32;
const TOMBSTONE_COMPLETED: usize = 35;
const TOMBSTONE_LEN: usize = 51;

impl<'a> Tombstone<'a> {
    /// Reads a tombstone; `Err` says what is wrong with it.
    pub(super) fn parse(value: &'a [u8]) -> Result<Self, String> {
        if value.len() != TOMBSTONE_LEN {
            return Err(format!("tombstone of {} bytes", value.len()));
        }
        let status = number(&value[TOMBSTONE_STATUS..TOMBSTONE_COMPLETED])
            .and_then(|s| http::StatusCode::from_u16(u16::try_from(s).ok()?).ok())
            .ok_or("unreadable tombstone status")?;
        let completed =
            number(&value[TOMBSTONE_COMPLETED..TOMBSTONE_LEN]).ok_or("unreadable time")?;
        Ok(Self {
            fingerprint: &value[..TOMBSTONE_STATUS],
            status,
            completed,
        })
    }

    /// Whether the key completed for a request with `fingerprint`.
    pub(super) fn matches(&self, fingerprint: &Fingerprint) -> bool {
        self.fingerprint == fingerprint.as_bytes()
    }
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
            IN_FLIGHT | WAITED => false,
            COMPLETED => true,
            other => return Err(format!("unknown state {:?}", char::from(other))),
        };
        let owner = Uuid::from_slice(&value[OWNER..FENCE]).map_err(|e| e.to_string())?;
        let fence = number(&value[FENCE..RESPONSE]).ok_or("unreadable fence")?;
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
        let waited = format!("'{}'", char::from(WAITED));
        let completed = format!("'{}'", char::from(COMPLETED));
        let scripts = [
            ("complete", include_str!("../../../lua/complete.lua")),
            ("release", include_str!("../../../lua/release.lua")),
            ("renew", include_str!("../../../lua/renew.lua")),
        ];
        for (name, script) in scripts {
            let reads_state = format!("local state = {state}");
            let checks_owner =
                format!("(state ~= {in_flight} and state ~= {waited}) or {owner} ~= ARGV[1]");
            assert!(
                script.contains(&reads_state) && script.contains(&checks_owner),
                "{name}.lua checks no owner at {owner}"
            );
        }
        let mark = include_str!("../../../lua/mark.lua");
        let marks = format!("{layout} .. {waited} .. string.sub(record, {})", STATE + 2);
        assert!(mark.contains(&marks), "mark.lua marks another byte");
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
        // complete.lua's tombstone: the record's fingerprint, the status, the clock.
        let tombstone = format!(
            "string.sub(record, {}, {}) .. ARGV[7] .. clock",
            FINGERPRINT + 1,
            OWNER
        );
        assert!(complete.contains(&tombstone), "complete.lua's tombstone");
        assert_eq!(TOMBSTONE_LEN - TOMBSTONE_COMPLETED, RESPONSE - FENCE);
        let written = [
            fingerprint.as_bytes().as_slice(),
            b"201",
            b"1795968561227110",
        ]
        .concat();
        let read = Tombstone::parse(&written).unwrap();
        assert!(read.matches(&fingerprint));
        assert_eq!(read.status, http::StatusCode::CREATED);
        assert_eq!(read.completed, 1_795_968_561_227_110);
    }

    /// What the compare-and-set path writes is what the scripts write, and reads back the same.
    #[test]
    fn records_built_here_read_back_as_the_scripts_records() {
        let parts = http::Request::post("/").body(()).unwrap().into_parts().0;
        let fingerprint = Fingerprint::of_request(&parts, &[], b"");
        let owner = Uuid::new_v4();
        let fence = 1_795_968_561_227_110;
        let in_flight = in_flight(&fingerprint, owner, fence).unwrap();
        let record = Record::parse(&in_flight).unwrap();
        assert!(record.matches(&fingerprint));
        assert_eq!((record.owner, record.fence), (owner, fence));
        assert_eq!(record.response(), Ok(None));

        let response = StoredResponse::new(
            http::StatusCode::CREATED,
            http::HeaderMap::new(),
            Some("done".into()),
            None,
        );
        let completed = completed(&in_flight, &response.encode());
        let record = Record::parse(&completed).unwrap();
        assert!(record.matches(&fingerprint));
        assert_eq!((record.owner, record.fence), (owner, fence));
        assert_eq!(record.response(), Ok(Some(response)));
        // Only the state byte differs up to the fence.
        assert_eq!(completed[..STATE], in_flight[..STATE]);
        assert_eq!(completed[FINGERPRINT..RESPONSE], in_flight[FINGERPRINT..]);

        assert_eq!(in_flight_head(&fingerprint, owner).len(), FENCE);
        assert!(super::in_flight(&fingerprint, owner, 12_345).is_none());
    }
}
