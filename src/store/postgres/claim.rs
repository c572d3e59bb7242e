//! A claim: one statement in the common case, and a short transaction under the row lock for a
//! row that needs settling (expired, held by another transaction, or committed with its lease
//! lapsed).

use std::time::{Duration, Instant};

use bytes::Bytes;
use sqlx::{Connection, PgConnection, Row, postgres::PgRow};

use super::{LOCKED_RETRY, PostgresStore, STORE, backend, millis, sql::*};
use crate::{
    StoredResponse,
    store::{BoxError, ClaimOutcome, ClaimRequest, RecordKey, StoreError},
};

/// Taken off a claim's time left before it is sent: the claim must not insert after its caller
/// gave up, however long the message took to reach the server.
const SEND_MARGIN: Duration = Duration::from_millis(5);

impl PostgresStore {
    /// One round of a claim: `None` when a competing claim committed between snapshots and the
    /// row must be read again.
    pub(super) async fn claim_once(
        &self,
        request: &ClaimRequest,
        started: Instant,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let mut connection = self.connections.lend().await.map_err(backend)?;
        // What is left of the caller's time once a connection is in hand, less a margin for the
        // message's way to the server: the server inserts only within it.
        let left = self
            .timeout
            .checked_sub(started.elapsed() + SEND_MARGIN)
            .ok_or_else(|| self.timed_out())?;
        let row = sqlx::query(CLAIM)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .bind(request.owner())
            .bind(millis(request.lease()))
            .bind(millis(left))
            .fetch_optional(&mut *connection)
            .await;
        if connection.give_back(&row) {
            // The connection was gone: another round, on a fresh one.
            return Ok(None);
        }
        let row = row.map_err(|e| self.failed(e))?;
        let Some(row) = row else {
            // A competing claim committed after this statement's snapshot (or the statement ran
            // past the caller's time and inserted nothing): look again.
            return Ok(None);
        };
        match read_claim(&row, record)? {
            Some(outcome) => Ok(Some(outcome)),
            None => self.settle(request).await,
        }
    }

    /// Settles a row the common path could not, under its row lock: takes over an expired row,
    /// or gives the owner of a committed key whose lease lapsed a grace of half a lease to
    /// renew. A row another transaction holds is in flight: its holder is alive. `None` when
    /// the row changed meanwhile and must be read again.
    async fn settle(&self, request: &ClaimRequest) -> Result<Option<ClaimOutcome>, StoreError> {
        let mut connection = self.connections.lend().await.map_err(backend)?;
        let settled = settle(&mut connection, request).await;
        if connection.give_back(&settled) {
            return Ok(None);
        }
        settled.map_err(|e| self.failed(e))
    }
}

/// What a row of [`CLAIM`] says: the outcome, or `None` for a row the claim must settle under
/// its lock (expired, or committed with its lease lapsed).
fn read_claim(row: &PgRow, record: &RecordKey) -> Result<Option<ClaimOutcome>, StoreError> {
    let corrupt = |source: BoxError| StoreError::corrupt(STORE, record, source);
    let verdict: String = row.try_get("verdict").map_err(backend)?;
    Ok(Some(match verdict.as_str() {
        "acquired" => {
            let fence: i64 = row.try_get("fence").map_err(backend)?;
            ClaimOutcome::Acquired {
                fence: u64::try_from(fence).map_err(|e| corrupt(e.into()))?,
            }
        }
        "mismatch" => ClaimOutcome::Mismatch,
        "completed" => {
            let response: Option<Vec<u8>> = row.try_get("response").map_err(backend)?;
            let response =
                response.ok_or_else(|| corrupt("completed row without a response".into()))?;
            let response =
                StoredResponse::decode(Bytes::from(response)).map_err(|e| corrupt(e.into()))?;
            ClaimOutcome::Completed {
                response: Box::new(response),
                expires_in: column_millis(row, "expires_ms")?,
            }
        }
        "in_flight" => ClaimOutcome::InFlight {
            retry_after: column_millis(row, "lease_ms")?,
        },
        "orphaned" => ClaimOutcome::Orphaned,
        "expired" | "lapsed" => return Ok(None),
        other => return Err(corrupt(format!("unknown claim verdict {other:?}").into())),
    }))
}

/// A column of milliseconds (`NULL` and negative as zero) as a duration.
pub(super) fn column_millis(row: &PgRow, column: &str) -> Result<Duration, StoreError> {
    let millis: Option<i64> = row.try_get(column).map_err(backend)?;
    Ok(Duration::from_millis(
        u64::try_from(millis.unwrap_or(0)).unwrap_or(0),
    ))
}

/// See [`PostgresStore::settle`]: in a transaction of its own on `connection`, which ends
/// before the connection goes back, whatever the row said: a transaction left open would keep
/// its row lock (and the key in flight) on an idle connection until its next use.
async fn settle(
    connection: &mut PgConnection,
    request: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let mut tx = connection.begin().await?;
    let outcome = settle_in(&mut tx, request).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// The statements of [`settle`], in its transaction.
async fn settle_in(
    tx: &mut PgConnection,
    request: &ClaimRequest,
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let record = request.record();
    let locked = sqlx::query(LOCK)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(&request.fingerprint().as_bytes()[..])
        .fetch_optional(&mut *tx)
        .await?;
    let Some(row) = locked else {
        let unsettled: bool = sqlx::query_scalar(UNSETTLED)
            .bind(record.scope())
            .bind(record.key().as_str())
            .fetch_one(&mut *tx)
            .await?;
        return Ok(unsettled.then_some(ClaimOutcome::InFlight {
            retry_after: LOCKED_RETRY,
        }));
    };
    let flag = |column| row.try_get::<bool, _>(column);
    let state: String = row.try_get("state")?;
    if !flag("live")? && flag("resumable")? && !flag("same")? && state == "in_flight" {
        // Progress made for another request: not this one's to take over.
        return Ok(Some(ClaimOutcome::Mismatch));
    }
    if !flag("live")? {
        let fence: i64 = sqlx::query_scalar(TAKE_OVER)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(&request.fingerprint().as_bytes()[..])
            .bind(request.owner())
            .bind(millis(request.lease()))
            .fetch_one(&mut *tx)
            .await?;
        let fence = u64::try_from(fence).unwrap_or_default();
        return Ok(Some(ClaimOutcome::Acquired { fence }));
    }
    let lapsed = state == "committed"
        && flag("same")?
        && !flag("answered")?
        && !flag("leased")?
        && !flag("suspect")?;
    if !lapsed {
        return Ok(None);
    }
    let grace = request.lease() / 2;
    sqlx::query(SUSPECT)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(millis(grace))
        .execute(&mut *tx)
        .await?;
    Ok(Some(ClaimOutcome::InFlight { retry_after: grace }))
}
