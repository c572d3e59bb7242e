//! The fence in the handler's own transaction: commit, recovery points, and why a fence failed.

use std::time::Duration;

use sqlx::{PgConnection, Row};

use super::{millis, sql::*};
use crate::{
    response::StoredResponse,
    store::{Lease, RecordKey},
};

/// Moves the key from in flight to committed inside the caller's transaction, if `lease`'s owner
/// still holds it, storing `response` with it when given. See
/// [`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit).
pub(crate) async fn commit(
    connection: &mut PgConnection,
    lease: &Lease,
    times: (Duration, Duration),
    response: Option<&StoredResponse>,
) -> Result<(), FenceError> {
    let (retention, lease_duration) = times;
    let record = lease.record();
    let committed: bool = sqlx::query_scalar(COMMIT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(millis(retention))
        .bind(millis(lease_duration))
        .bind(response.map(|r| r.status().as_u16() as i16))
        .bind(response.map(|r| r.encode().to_vec()))
        .fetch_one(connection)
        .await
        .map_err(|source| FenceError::Database {
            record: record.clone(),
            source,
        })?;
    fenced(committed, lease)
}

/// How far a multi-step handler got with its key: the point its last finished step recorded,
/// and what it left for the next ([`IdempotencyClaim::advance`](crate::IdempotencyClaim::advance)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryPoint {
    name: String,
    payload: serde_json::Value,
}

impl RecoveryPoint {
    /// The point's name, as the handler gave it (`"intent_recorded"`, say).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What the step left for the next (`null` when it left nothing).
    pub fn payload(&self) -> &serde_json::Value {
        &self.payload
    }
}

/// Moves the key's recovery point to `point`, with `payload`, inside the caller's transaction, if
/// `lease`'s owner still holds it in flight. See
/// [`IdempotencyClaim::advance`](crate::IdempotencyClaim::advance).
pub(crate) async fn advance(
    connection: &mut PgConnection,
    lease: &Lease,
    times: (Duration, Duration),
    (point, payload, request): (&str, &serde_json::Value, Option<&[u8]>),
) -> Result<(), FenceError> {
    let (retention, lease_duration) = times;
    let record = lease.record();
    let failed = |source| FenceError::Database {
        record: record.clone(),
        source,
    };
    let advanced: bool = sqlx::query_scalar(ADVANCE)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .bind(point)
        .bind(payload.to_string())
        .bind(millis(retention))
        .bind(millis(lease_duration))
        .fetch_one(&mut *connection)
        .await
        .map_err(failed)?;
    if !advanced {
        return Err(refused(connection, lease).await);
    }
    if let Some(request) = request {
        sqlx::query(KEEP_REQUEST)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(lease.owner())
            .bind(request)
            .execute(&mut *connection)
            .await
            .map_err(failed)?;
    }
    Ok(())
}

/// The key's recovery point, if `lease`'s owner holds it. See
/// [`IdempotencyClaim::recovery_point`](crate::IdempotencyClaim::recovery_point).
pub(crate) async fn recovery_point(
    connection: &mut PgConnection,
    lease: &Lease,
) -> Result<Option<RecoveryPoint>, FenceError> {
    let record = lease.record();
    let failed = |source| FenceError::Database {
        record: record.clone(),
        source,
    };
    let row = sqlx::query(RECOVERY)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(lease.owner())
        .fetch_optional(&mut *connection)
        .await
        .map_err(failed)?;
    let Some(row) = row else {
        return Err(refused(connection, lease).await);
    };
    let name: Option<String> = row.try_get("recovery_point").map_err(failed)?;
    let payload: Option<String> = row.try_get("payload").map_err(failed)?;
    let payload = match payload {
        Some(text) => {
            serde_json::from_str(&text).map_err(|e| failed(sqlx::Error::Decode(e.into())))?
        }
        None => serde_json::Value::Null,
    };
    Ok(name.map(|name| RecoveryPoint { name, payload }))
}

/// Why an owner-checked statement found no row of `lease`'s owner: another attempt holds the
/// key, or there is no row for it at all (the layer's store is not Postgres, or the key went).
async fn refused(connection: &mut PgConnection, lease: &Lease) -> FenceError {
    let record = lease.record();
    let exists: Result<bool, _> = sqlx::query_scalar(RECORD_EXISTS)
        .bind(record.scope())
        .bind(record.key().as_str())
        .fetch_one(connection)
        .await;
    match exists {
        Ok(false) => FenceError::NoRecord {
            record: record.clone(),
        },
        Ok(true) | Err(_) => FenceError::LeaseLost {
            record: record.clone(),
            fence: lease.fence(),
        },
    }
}

/// `Ok` if the owner-checked statement found the owner, else the fence's refusal.
fn fenced(held: bool, lease: &Lease) -> Result<(), FenceError> {
    if held {
        Ok(())
    } else {
        Err(FenceError::LeaseLost {
            record: lease.record().clone(),
            fence: lease.fence(),
        })
    }
}

/// The fence refused a handler's commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The request no longer owns its key: its lease expired and another attempt reclaimed it
    /// (or the key finished). Roll the transaction back: the other attempt is the one that counts.
    #[error("the claim on {record} (fence {fence}) was lost to another attempt; roll back")]
    LeaseLost {
        /// The record whose claim was lost.
        record: RecordKey,
        /// The fence this request was granted.
        fence: u64,
    },
    /// There is no record of the key in `idempotency_keys` (on this connection's
    /// `search_path`): the layer's store is not Postgres (recovery points need it, alone or
    /// behind Redis), or the key was released meanwhile.
    #[error(
        "no idempotency_keys row for {record} on this connection: is the layer's store Postgres \
         (alone or behind Redis), with its table on this transaction's search_path?"
    )]
    NoRecord {
        /// The record involved.
        record: RecordKey,
    },
    /// The outcome given to [`IdempotencyClaim::commit_with_outcome`] could not be
    /// serialized: nothing was written.
    ///
    /// [`IdempotencyClaim::commit_with_outcome`]: crate::IdempotencyClaim::commit_with_outcome
    #[error("the outcome of {record} could not be serialized")]
    Outcome {
        /// The record involved.
        record: RecordKey,
        /// What serde said.
        #[source]
        source: serde_json::Error,
    },
    /// The fence statement itself failed (the transaction is likely aborted).
    #[error("could not fence {record}")]
    Database {
        /// The record involved.
        record: RecordKey,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
}
