//! What operators and the completer see of a key: where it stands ([`RecordInfo`],
//! [`RecordState`]), and what the completer finds abandoned ([`Abandoned`]).

use std::{fmt, time::Duration};

use uuid::Uuid;

use super::claim::RecordKey;
use crate::fingerprint::Fingerprint;

/// What a store holds for one key, as an operator sees it ([`Admin::inspect`](super::Admin::inspect)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// The key and its scope.
    pub record: RecordKey,
    /// Where the key stands.
    pub state: RecordState,
    /// The fence of the claim that holds (or completed) it, as the record keeps it. A Redis
    /// record claimed without a script keeps the fence that names it (the claiming machine's
    /// clock, in µs), not the one granted (the Redis server's clock a moment later).
    pub fence: u64,
    /// The owner token of that claim.
    pub owner: Uuid,
    /// Time left on the lease, while in flight or committed (zero once it lapsed).
    pub lease_left: Option<Duration>,
    /// Time since the claim, where the store knows it.
    pub age: Option<Duration>,
    /// Time left before the store forgets the key.
    pub expires_in: Duration,
    /// The status of the stored response, once there is one.
    pub status: Option<http::StatusCode>,
    /// Why the [completer](crate::completer) could not finish the key the last time it tried
    /// (stores that keep it: Postgres).
    pub unfinished: Option<String>,
}

/// A key the application's work on was abandoned: its lease lapsed with work recorded, and
/// no attempt holds it ([`Recovery::abandoned`](super::Recovery::abandoned)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Abandoned {
    /// The key and its scope.
    pub record: RecordKey,
    /// The fingerprint of the request the key was claimed for.
    pub fingerprint: Fingerprint,
    /// [`InFlight`](RecordState::InFlight) with a recovery point, or
    /// [`Committed`](RecordState::Committed) without an answer.
    pub state: RecordState,
    /// The recovery point the last attempt recorded, if any.
    pub recovery_point: Option<String>,
    /// The request the key was claimed for, as the layer kept it (see
    /// [`IdempotencyLayer::with_kept_requests`](crate::IdempotencyLayer::with_kept_requests)),
    /// if it kept one.
    pub request: Option<bytes::Bytes>,
    /// How long ago the last lease ran out.
    pub lapsed: Duration,
}

/// Where a key stands in a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed; the handler runs (or its owner died and the lease has not run out yet).
    InFlight,
    /// The handler's business write committed through the fence; the response is not stored
    /// yet (unless the fence stored one with it).
    Committed,
    /// The response is stored; retries are replayed.
    Completed,
    /// The response is gone (past its retention); a tombstone keeps the key from running
    /// again until the store's horizon.
    AnswerExpired,
}

impl RecordState {
    /// `in_flight`, `committed`, `completed` or `answer_expired`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Committed => "committed",
            Self::Completed => "completed",
            Self::AnswerExpired => "answer_expired",
        }
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
