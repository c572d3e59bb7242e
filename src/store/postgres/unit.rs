//! A unit of work claimed inside its own transaction
//! ([`Once::run_in_transaction`](crate::work::Once::run_in_transaction)): the key's lock and
//! row are read first in the delivery's transaction, and its outcome written last in it, so the
//! work, the claim and the answer commit together or not at all.

use std::time::Duration;

use bytes::Bytes;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, Row, pool::PoolConnection};

pub(crate) use super::backend;
use super::{STORE, millis, sql::*};
use crate::{
    fingerprint::Fingerprint,
    response::StoredResponse,
    store::{RecordKey, StoreError},
};

/// What the key's row said once the delivery held the key's lock.
#[derive(Debug)]
pub(crate) enum Seen {
    /// Another delivery in this mode holds the key's lock: roll back, and try again shortly.
    Locked,
    /// No row: the key is free.
    Free,
    /// A row the delivery may replace, by its fence: its record expired, or an owner in the
    /// other mode let its lease run out before committing.
    Expired(i64),
    /// The key's stored outcome.
    Completed(StoredResponse),
    /// The key was first used with another payload.
    Mismatch,
    /// An owner in the other mode ([`Once::run`](crate::work::Once::run)) holds the key, for
    /// about this long yet.
    InFlight(Duration),
    /// An owner in the other mode committed its work and died before storing its outcome.
    Orphaned,
    /// The key completed, and its outcome is past its retention: a tombstone.
    AnswerExpired,
}

/// A connection of the pool for one delivery, closed instead of returned when the delivery is
/// dropped (or fails to roll back) before its transaction ended: the server then rolls the
/// transaction back. A transaction begun in the round trip of its key's lock must never go back
/// to the pool half-open, as a `BEGIN` cut short by a dropped future does in sqlx.
pub(crate) struct DeliveryConnection {
    connection: PoolConnection<Postgres>,
    ended: bool,
}

impl DeliveryConnection {
    /// A connection of `pool`.
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, StoreError> {
        let connection = pool.acquire().await.map_err(backend)?;
        Ok(Self {
            connection,
            ended: false,
        })
    }

    /// The connection, to begin the transaction on.
    pub(crate) fn connection(&mut self) -> &mut PgConnection {
        &mut self.connection
    }

    /// Rolls back what a failed `BEGIN` left open.
    pub(crate) async fn roll_back(&mut self) {
        let rolled_back = sqlx::raw_sql("ROLLBACK")
            .execute(&mut *self.connection)
            .await;
        self.ended = rolled_back.is_ok();
    }

    /// The transaction ended (committed, or its rollback queued by sqlx on the connection):
    /// the connection may go back to the pool.
    pub(crate) fn ended(&mut self) {
        self.ended = true;
    }
}

impl Drop for DeliveryConnection {
    fn drop(&mut self) {
        if !self.ended {
            self.connection.close_on_drop();
        }
    }
}

/// The `BEGIN` of a unit whose key is free, in one round trip: the transaction, its pauses
/// bounded by `lease`, and `record`'s lock, taken only if it is free and the key has no row.
/// It fails with [`not_free`] otherwise. A simple query, so its arguments are literals.
pub(crate) fn begin_when_free(record: &RecordKey, lease: Duration) -> AssertSqlSafe<String> {
    // An escape string: the same whatever `standard_conforming_strings` says.
    let literal = |text: &str| format!("E'{}'", text.replace('\\', "\\\\").replace('\'', "''"));
    AssertSqlSafe(format!(
        "BEGIN; SELECT idempotency_unit_begin_free({}, {}, {})",
        literal(record.scope()),
        literal(record.key().as_str()),
        millis(lease)
    ))
}

/// Whether a [`begin_when_free`] failed because the key is held or has a row.
pub(crate) fn not_free(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("55P03"))
}

/// Takes `record`'s lock in the transaction on `connection` if it is free, bounds the
/// transaction's pauses by `lease`, and reads the key's row (a tombstone within `horizon`).
pub(crate) async fn begin(
    connection: &mut PgConnection,
    (record, fingerprint): (&RecordKey, &Fingerprint),
    lease: Duration,
    horizon: Duration,
) -> Result<Seen, StoreError> {
    let row = sqlx::query(UNIT_BEGIN)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(millis(lease))
        .bind(millis(horizon))
        .fetch_one(connection)
        .await
        .map_err(backend)?;
    if !row.try_get::<bool, _>("locked").map_err(backend)? {
        return Ok(Seen::Locked);
    }
    let Some(state) = row.try_get::<Option<String>, _>("state").map_err(backend)? else {
        return Ok(Seen::Free);
    };
    let column = |name| {
        row.try_get::<Option<bool>, _>(name)
            .map(|b| b == Some(true))
    };
    let (leased, live, buried) = (
        column("leased").map_err(backend)?,
        column("live").map_err(backend)?,
        column("buried").map_err(backend)?,
    );
    let fence: i64 = row.try_get("fence").map_err(backend)?;
    let stored: Vec<u8> = row.try_get("fingerprint").map_err(backend)?;
    let response: Option<Vec<u8>> = row.try_get("response").map_err(backend)?;
    let same = stored[..] == fingerprint.as_bytes()[..];
    Ok(match (state.as_str(), response) {
        _ if buried && same => Seen::AnswerExpired,
        _ if buried => Seen::Mismatch,
        _ if !live => Seen::Expired(fence),
        _ if !same => Seen::Mismatch,
        (_, Some(response)) => Seen::Completed(
            StoredResponse::decode(Bytes::from(response))
                .map_err(|e| StoreError::corrupt(STORE, record, e))?,
        ),
        (_, None) if leased => {
            let left: Option<i64> = row.try_get("lease_ms").map_err(backend)?;
            Seen::InFlight(Duration::from_millis(left.unwrap_or(0).max(0) as u64))
        }
        ("in_flight", None) => Seen::Expired(fence),
        _ => Seen::Orphaned,
    })
}

/// Writes `record`'s row, completed with `outcome` and kept for `retention`, in the transaction
/// on `connection`: a new row, or in place of the one whose fence is `replaced`. `false` when
/// another delivery's row is there instead (the transaction may be aborted: roll back and read
/// it).
pub(crate) async fn complete(
    connection: &mut PgConnection,
    (record, fingerprint): (&RecordKey, &Fingerprint),
    replaced: Option<i64>,
    outcome: &StoredResponse,
    retention: Duration,
) -> Result<bool, StoreError> {
    let written = sqlx::query(if replaced.is_some() {
        UNIT_REPLACE
    } else {
        UNIT_INSERT
    })
    .bind(record.scope())
    .bind(record.key().as_str())
    .bind(&fingerprint.as_bytes()[..])
    .bind(uuid::Uuid::new_v4())
    .bind(millis(retention))
    .bind(outcome.status().as_u16() as i16)
    .bind(outcome.encode().to_vec());
    let written = match replaced {
        Some(fence) => written.bind(fence),
        None => written,
    };
    match written.execute(connection).await {
        Ok(done) => Ok(done.rows_affected() == 1),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
        Err(error) => Err(backend(error)),
    }
}

/// A unit of a batch, as its row is written: its key, its request's fingerprint and its
/// outcome.
pub(crate) type Written<'a> = (&'a RecordKey, &'a Fingerprint, StoredResponse);

/// Bounds the pauses of the transaction on `connection` by `lease`, and says per unit of
/// `records` whether its key is free: no row, and its lock taken now, in the transaction
/// (`UNITS_BEGIN_FREE`).
pub(crate) async fn begin_batch(
    connection: &mut PgConnection,
    records: &[&RecordKey],
    lease: Duration,
) -> Result<Vec<bool>, StoreError> {
    let scopes: Vec<&str> = records.iter().map(|r| r.scope()).collect();
    let keys: Vec<&str> = records.iter().map(|r| r.key().as_str()).collect();
    let free: Vec<bool> = sqlx::query_scalar(UNITS_BEGIN_FREE)
        .bind(scopes)
        .bind(keys)
        .bind(millis(lease))
        .fetch_one(connection)
        .await
        .map_err(backend)?;
    if free.len() != records.len() {
        let answered = format!("{} answers for {} units", free.len(), records.len());
        return Err(backend(sqlx::Error::Protocol(answered)));
    }
    Ok(free)
}

/// Writes the rows of `units`, each completed with its outcome and kept for `retention`, in
/// the transaction on `connection`, in one statement. `false` when a key of theirs has a row
/// already, another delivery's (the transaction is aborted: roll back, and read the keys).
pub(crate) async fn complete_batch(
    connection: &mut PgConnection,
    units: &[Written<'_>],
    retention: Duration,
) -> Result<bool, StoreError> {
    let scopes: Vec<&str> = units.iter().map(|u| u.0.scope()).collect();
    let keys: Vec<&str> = units.iter().map(|u| u.0.key().as_str()).collect();
    let fingerprints: Vec<&[u8]> = units.iter().map(|u| &u.1.as_bytes()[..]).collect();
    let owners: Vec<uuid::Uuid> = units.iter().map(|_| uuid::Uuid::new_v4()).collect();
    let statuses: Vec<i16> = units.iter().map(|u| u.2.status().as_u16() as i16).collect();
    let answers: Vec<Bytes> = units.iter().map(|u| u.2.encode()).collect();
    let written = sqlx::query(UNITS_INSERT)
        .bind(scopes)
        .bind(keys)
        .bind(fingerprints)
        .bind(owners)
        .bind(millis(retention))
        .bind(statuses)
        .bind(answers.iter().map(|a| &a[..]).collect::<Vec<_>>())
        .execute(connection)
        .await;
    match written {
        Ok(done) => Ok(done.rows_affected() == units.len() as u64),
        Err(sqlx::Error::Database(e)) if e.is_unique_violation() => Ok(false),
        Err(error) => Err(backend(error)),
    }
}
