//! The store's Lua scripts (`lua/`): loaded once, invoked with `EVALSHA` and loaded again where
//! the server lost them (`NOSCRIPT`); the claim by claim.lua and its reply read; the
//! owner-checked completion, renewal and release where the server cannot compare and set.

use std::{sync::LazyLock, time::Duration};

use ::redis::{
    Cmd, ErrorKind, FromRedisValue, RedisError, Script, ServerErrorKind, ToRedisArgs, Value,
};

use super::{
    Connection, RedisStore, STORE, command, millis,
    record::{self, Record, Tombstone},
    since,
};
use crate::store::{ClaimOutcome, ClaimRequest, Lease, Ownership, StoreError};

pub(super) static CLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/claim.lua")));
pub(super) static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/complete.lua")));
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/release.lua")));
pub(super) static MARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/mark.lua")));
pub(super) static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../../lua/renew.lua")));

impl RedisStore {
    /// The claim by claim.lua: on a server without `SET … NX GET`, and on a store that keeps
    /// tombstones. The record's fence is the claim's.
    pub(super) async fn claim_by_script(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        let head = record::in_flight_head(request.fingerprint(), request.owner());
        let key = self.record_key(request.record());
        let tombstone = self.tombstone_key(&key);
        let args = ((&head[..], millis(request.lease())), head.len());
        let eval = evalsha(&CLAIM, (&key, tombstone.as_deref()), args);
        let reply: Value = self
            .call(async |connection| evaluate(connection, &CLAIM, &eval).await)
            .await?;
        let (outcome, written) = parse_claim(reply, request)
            .map_err(|reason| StoreError::corrupt(STORE, request.record(), reason))?;
        if let Some(written) = written {
            request.note_written(written);
        }
        Ok(outcome)
    }

    /// Runs an owner-checked script that answers 1 (applied) or 0 (not the owner), on the
    /// lease's record (at `key`) and, when given, its `tombstone`, with the owner token and then
    /// `args` (each part of a tuple one argument; `None::<u64>` for none) of about `len` bytes.
    pub(super) async fn owner_checked(
        &self,
        script: &Script,
        (lease, key, tombstone): (&Lease, &str, Option<&str>),
        (args, len): (impl ToRedisArgs, usize),
    ) -> Result<Ownership, StoreError> {
        let owner = lease.owner();
        let args = ((&owner.as_bytes()[..], args), len);
        let eval = evalsha(script, (key, tombstone), args);
        let applied: i64 = self
            .call(async |connection| evaluate(connection, script, &eval).await)
            .await?;
        Ok(if applied == 1 {
            Ownership::Held
        } else {
            Ownership::Lost
        })
    }
}

/// What an `EVALSHA` holds besides its keys and the caller's longer arguments: its name, the
/// script's SHA-1, the number of keys, an owner token and a few numbers.
const EVALSHA: usize = 128;

/// The most arguments a script call of the store has: complete.lua's, with `EVALSHA`, the
/// SHA-1, the number of keys, two keys, the owner token and six more.
const EVALSHA_ARGS: usize = 12;

/// `EVALSHA` of `script` on `key` (and `tombstone`), with `args` (each part of a tuple one
/// argument) of about `len` bytes beyond [`EVALSHA`]'s, built to size. A `ScriptInvocation`
/// copies each key and argument into a `Vec` of its own, then all of them into its command.
pub(super) fn evalsha(
    script: &Script,
    (key, tombstone): (&str, Option<&str>),
    (args, len): (impl ToRedisArgs, usize),
) -> Cmd {
    let keys = 1 + usize::from(tombstone.is_some());
    let bytes = EVALSHA + key.len() + tombstone.map_or(0, str::len) + len;
    let mut eval = command("EVALSHA", EVALSHA_ARGS, bytes);
    eval.arg(script.get_hash()).arg(keys).arg(key);
    if let Some(tombstone) = tombstone {
        eval.arg(tombstone);
    }
    eval.arg(args);
    eval
}

/// Sends `eval` (see [`evalsha`]) as `ScriptInvocation::invoke_async` runs a script: where the
/// server does not have `script` (restarted, failed over, flushed), it is loaded and `eval`
/// sent again.
pub(super) async fn evaluate<T: FromRedisValue>(
    connection: &mut Connection,
    script: &Script,
    eval: &Cmd,
) -> Result<T, RedisError> {
    match eval.query_async(connection).await {
        // Boxed: a server that lost its scripts is rare, and every call would carry this.
        Err(error) if error.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            Box::pin(async {
                script.load_async(connection).await?;
                eval.query_async(connection).await
            })
            .await
        }
        reply => reply,
    }
}

/// Reads claim.lua's reply: the outcome and, where it granted the claim, the fence that names the
/// record (which the lease finalizes); `Err` describes what is wrong with the record.
fn parse_claim(
    reply: Value,
    request: &ClaimRequest,
) -> Result<(ClaimOutcome, Option<u64>), String> {
    let Value::Array(items) = reply else {
        return Err(format!("unexpected claim reply {reply:?}"));
    };
    let unexpected = || format!("unexpected claim reply {items:?}");
    match items.as_slice() {
        [Value::Int(0), Value::BulkString(fence)] => record::number(fence)
            .map(|fence| (ClaimOutcome::Acquired { fence }, Some(fence)))
            .ok_or_else(|| format!("unreadable fence {fence:?}")),
        [
            Value::Int(1),
            Value::BulkString(record),
            Value::Int(pttl),
            now @ ..,
        ] => {
            let left = Duration::from_millis(u64::try_from(*pttl).unwrap_or(0));
            match (read_record(record, request, left)?, now) {
                // Its owner's, asked again: granted with the server's clock of this moment.
                (ClaimOutcome::Acquired { fence: written }, [Value::BulkString(now)]) => {
                    let fence = record::number(now).ok_or("unreadable server time")?;
                    Ok((ClaimOutcome::Acquired { fence }, Some(written)))
                }
                (ClaimOutcome::Acquired { .. }, _) | (_, [_, ..]) => Err(unexpected()),
                (outcome, []) => Ok((outcome, None)),
            }
        }
        [
            Value::Int(2),
            Value::BulkString(tombstone),
            Value::BulkString(now),
        ] => {
            let tombstone = Tombstone::parse(tombstone)?;
            if !tombstone.matches(request.fingerprint()) {
                return Ok((ClaimOutcome::Mismatch, None));
            }
            let now = record::number(now).ok_or("unreadable server time")?;
            Ok((
                ClaimOutcome::AnswerExpired {
                    status: tombstone.status,
                    completed_ago: since(u128::from(tombstone.completed), u128::from(now)),
                },
                None,
            ))
        }
        _ => Err(unexpected()),
    }
}

/// What a record someone holds says to a claim of the same key.
pub(super) fn read_record(
    record: &[u8],
    request: &ClaimRequest,
    left: Duration,
) -> Result<ClaimOutcome, String> {
    let record = Record::parse(record)?;
    if !record.matches(request.fingerprint()) {
        return Ok(ClaimOutcome::Mismatch);
    }
    Ok(match record.response()? {
        // The owner's own claim, asked again (its first answer was lost): still its own.
        None if record.owner == request.owner() => ClaimOutcome::Acquired {
            fence: record.fence,
        },
        None => ClaimOutcome::InFlight { retry_after: left },
        Some(response) => ClaimOutcome::Completed {
            response,
            expires_in: left,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoredResponse;

    fn request() -> ClaimRequest {
        crate::conformance::claim_request("s", "k", "", Duration::from_secs(30))
    }

    /// The claim script's answer for a record it found, with its expiry in ms.
    fn held(record: Vec<u8>, pttl: i64) -> Value {
        Value::Array(vec![
            Value::Int(1),
            Value::BulkString(record),
            Value::Int(pttl),
        ])
    }

    use super::record::LAYOUT;

    /// A record as the scripts write it.
    fn record(layout: u8, state: u8, fingerprint: &[u8; 32], response: &[u8]) -> Vec<u8> {
        let mut record = vec![layout, state];
        record.extend_from_slice(fingerprint);
        record.extend_from_slice(&[7; 16]);
        record.extend_from_slice(b"1795968561227110");
        record.extend_from_slice(response);
        record
    }

    /// The outcome claim.lua's reply says.
    fn outcome(reply: Value, request: &ClaimRequest) -> Result<ClaimOutcome, String> {
        parse_claim(reply, request).map(|(outcome, _)| outcome)
    }

    #[test]
    fn records_are_read_by_state_and_fingerprint() {
        let request = request();
        let fp = request.fingerprint().as_bytes();
        assert_eq!(
            outcome(held(record(LAYOUT, b'i', fp, b""), 1500), &request),
            Ok(ClaimOutcome::InFlight {
                retry_after: Duration::from_millis(1500)
            })
        );
        assert_eq!(
            outcome(held(record(LAYOUT, b'i', &[0; 32], b""), 1500), &request),
            Ok(ClaimOutcome::Mismatch)
        );
        let response = StoredResponse::new(
            http::StatusCode::OK,
            http::HeaderMap::new(),
            Some("done".into()),
            None,
        );
        let completed = outcome(
            held(record(LAYOUT, b'c', fp, &response.encode()), 1500),
            &request,
        );
        assert_eq!(
            completed,
            Ok(ClaimOutcome::Completed {
                response,
                expires_in: Duration::from_millis(1500)
            })
        );
        let acquired = Value::Array(vec![
            Value::Int(0),
            Value::BulkString(b"1795968561227110".to_vec()),
        ]);
        assert_eq!(
            parse_claim(acquired, &request),
            Ok((
                ClaimOutcome::Acquired {
                    fence: 1_795_968_561_227_110
                },
                Some(1_795_968_561_227_110)
            ))
        );
    }

    /// The claimant's own record, asked again: granted with the server's clock the script read,
    /// the lease finalizing the record by the fence that names it.
    #[test]
    fn a_claim_asked_again_is_granted_with_the_servers_clock() {
        let request = request();
        let own = record::in_flight(
            request.fingerprint(),
            request.owner(),
            1_795_968_561_227_110,
        );
        let Value::Array(mut reply) = held(own.unwrap(), 1500) else {
            unreachable!()
        };
        reply.push(Value::BulkString(b"1795968561999999".to_vec()));
        assert_eq!(
            parse_claim(Value::Array(reply.clone()), &request),
            Ok((
                ClaimOutcome::Acquired {
                    fence: 1_795_968_561_999_999
                },
                Some(1_795_968_561_227_110)
            ))
        );
        // Without the clock, or with a clock for a record that is not the claimant's: unreadable.
        reply.pop();
        assert!(parse_claim(Value::Array(reply), &request).is_err());
        let fp = request.fingerprint().as_bytes();
        let Value::Array(mut others) = held(record(LAYOUT, b'i', fp, b""), 1500) else {
            unreachable!()
        };
        others.push(Value::BulkString(b"1795968561999999".to_vec()));
        assert!(parse_claim(Value::Array(others), &request).is_err());
    }

    #[test]
    fn unreadable_replies_are_errors() {
        let request = request();
        let fp = request.fingerprint().as_bytes();
        let bad = [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(0), Value::BulkString(b"x".to_vec())]),
            held(b"short".to_vec(), 1000),
            held(record(1, b'i', fp, b""), 1000),
            held(record(LAYOUT, b'x', fp, b""), 1000),
            held(record(LAYOUT, b'c', fp, b"garbage"), 1000),
            Value::Array(vec![Value::Int(1), Value::Nil, Value::Int(1000)]),
            Value::Array(vec![Value::Int(9)]),
        ];
        for reply in bad {
            assert!(
                parse_claim(reply.clone(), &request).is_err(),
                "{reply:?} was accepted"
            );
        }
    }
}
