//! A claim: one statement in the common case (shared with the claims queued meanwhile, see
//! `batch.rs`), and a short transaction under the row lock for a row that needs settling
//! (expired, held by another transaction, or committed with its lease lapsed).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use sqlx::{Connection, PgConnection, Row, postgres::PgRow};
use tokio::sync::oneshot;
use uuid::Uuid;

use super::{
    LOCKED_RETRY, PostgresStore, STORE, backend, batch::SendBatch, connections::Plans, millis,
    sql::*,
};
use crate::{
    response::StoredResponse,
    store::{BoxError, ClaimOutcome, ClaimRequest, RecordKey, StoreError},
};

/// Taken off a claim's time left before it is sent: the claim must not insert after its caller
/// gave up, however long the message took to reach the server.
const SEND_MARGIN: Duration = Duration::from_millis(5);

/// On Citus, how many claims of one shard it takes before one insert for them all costs less
/// than each alone. Measured with pgbench on a worker (Citus 13.0.5), server CPU an insert: a
/// claim alone, the statement Citus plans once and caches, about 141 µs; four together about
/// 400 µs, sixteen about 820.
const CLAIMS_TOGETHER_FROM: usize = 3;

/// A claim waiting for a lane: what the statement binds, and where its answer goes.
pub(super) struct Queued {
    record: RecordKey,
    fingerprint: [u8; 32],
    owner: Uuid,
    lease: Duration,
    /// When the caller's claim started: the insert happens only within its time.
    started: Instant,
    answer: oneshot::Sender<Result<Round, StoreError>>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queued")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// What one round of a claim found.
#[derive(Debug)]
pub(super) enum Round {
    Outcome(ClaimOutcome),
    /// A row the claim must settle under its lock (expired, or committed with its lease lapsed).
    Settle,
    /// No row: a competing claim committed after the statement's snapshot, or the connection
    /// was gone. Read again.
    Again,
}

impl PostgresStore {
    /// One round of a claim, through the claims' lanes: sent alone when a lane is free, with
    /// the claims queued meanwhile otherwise.
    pub(super) async fn claim_round(
        &self,
        request: &ClaimRequest,
        started: Instant,
    ) -> Result<Round, StoreError> {
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            record: request.record().clone(),
            fingerprint: *request.fingerprint().as_bytes(),
            owner: request.owner(),
            lease: request.lease(),
            started,
            answer,
        };
        let send: SendBatch<Queued> = |store, batch| Box::pin(store.send_claims(batch));
        self.lanes.claims.push(self, queued, send);
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::backend(
                STORE,
                "its batch was dropped unanswered",
            ))
        })
    }

    /// One batch of claims; on Citus, in groups of one shard ([`by_shard`](Self::by_shard)),
    /// every group at once, each as one statement to its shard.
    async fn send_claims(&self, batch: Vec<Queued>) {
        if !self.distributed {
            return self.send_claim_group(batch).await;
        }
        let groups = self.by_shard(batch, CLAIMS_ON_A_SHARD, |queued| {
            (queued.record.scope(), queued.record.key().as_str(), 0)
        });
        let groups = groups.into_iter().flat_map(|group| match group.len() {
            n if n >= CLAIMS_TOGETHER_FROM => vec![group],
            _ => group.into_iter().map(|claim| vec![claim]).collect(),
        });
        join_all(groups.map(|group| self.send_claim_group(group))).await;
    }

    /// Claims that go out together. A group that fails is sent again claim by claim, so that
    /// whatever failed it fails only its own claim.
    async fn send_claim_group(&self, batch: Vec<Queued>) {
        if batch.len() > 1 {
            tracing::debug!(claims = batch.len(), "claims sent together");
        }
        let answers = match self.claim_rows(&batch).await {
            Ok(answers) => answers,
            Err(error) if batch.len() == 1 => vec![Err(error)],
            Err(_) => {
                let mut answers = Vec::with_capacity(batch.len());
                for queued in &batch {
                    let answer = self.claim_rows(std::slice::from_ref(queued)).await;
                    answers.push(answer.and_then(|mut one| one.pop().expect("one answer")));
                }
                answers
            }
        };
        for (queued, answer) in batch.into_iter().zip(answers) {
            let _ = queued.answer.send(answer);
        }
    }

    /// [`CLAIM_MANY`] for `batch`: an answer per claim, in order. A claim whose caller's time is
    /// up by the time a connection is in hand is not sent: it times out.
    async fn claim_rows(
        &self,
        batch: &[Queued],
    ) -> Result<Vec<Result<Round, StoreError>>, StoreError> {
        // On Citus a batch is of one shard (`send_claims`), sent to its worker.
        let record = &batch[0].record;
        let key = (record.scope(), record.key().as_str());
        let connections = self.connections_for(key, Plans::Generic);
        let mut connection = connections
            .lend()
            .await
            .map_err(|e| self.failed_on_route(e))?;
        // What is left of each caller's time once a connection is in hand, less a margin for
        // the message's way to the server: the server inserts only within it.
        let left: Vec<Option<Duration>> = batch
            .iter()
            .map(|q| self.timeout.checked_sub(q.started.elapsed() + SEND_MARGIN))
            .collect();
        let sent: Vec<(usize, &Queued, Duration)> = (0..batch.len())
            .filter_map(|i| Some((i, &batch[i], left[i]?)))
            .collect();
        let mut answers: Vec<Result<Round, StoreError>> =
            batch.iter().map(|_| Err(self.timed_out())).collect();
        if sent.is_empty() {
            connection.give_back(&Ok::<(), sqlx::Error>(()));
            return Ok(answers);
        }
        let rows = if self.distributed {
            claim_on_shard(&mut connection, &sent, (self.horizon, self.skew())).await
        } else {
            numbered(
                claim_many(&sent, self.horizon)
                    .fetch_all(&mut *connection)
                    .await,
            )
        };
        // A claim without a row reads its key again.
        for (i, _, _) in &sent {
            answers[*i] = Ok(Round::Again);
        }
        if connection.give_back(&rows) {
            // The connection was gone: another round, on a fresh one.
            return Ok(answers);
        }
        let rows = rows.map_err(|e| self.failed_on_route(e))?;
        for (n, row) in rows {
            let (i, queued, _) = usize::try_from(n - 1)
                .ok()
                .and_then(|n| sent.get(n))
                .ok_or_else(|| backend(sqlx::Error::RowNotFound))?;
            answers[*i] = read_claim(&row, &queued.record).map(|outcome| match outcome {
                Some(outcome) => Round::Outcome(outcome),
                None => Round::Settle,
            });
        }
        Ok(answers)
    }

    /// Settles a row the common path could not, under its row lock: takes over an expired row,
    /// or gives the owner of a committed key whose lease lapsed a grace of half a lease to
    /// renew. A row another transaction holds is in flight: its holder is alive. `None` when
    /// the row changed meanwhile and must be read again.
    pub(super) async fn settle(
        &self,
        request: &ClaimRequest,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let record = request.record();
        let key = (record.scope(), record.key().as_str());
        let connections = self.connections_for(key, Plans::Custom);
        let mut connection = connections
            .lend()
            .await
            .map_err(|e| self.failed_on_route(e))?;
        let fence = if self.distributed {
            CLOCK_FENCE
        } else {
            NEXT_FENCE
        };
        let settled = settle(&mut connection, request, (fence, self.skew())).await;
        if connection.give_back(&settled) {
            return Ok(None);
        }
        settled.map_err(|e| self.failed_on_route(e))
    }
}

/// [`CLAIM_MANY`] with the claims `sent` (each with what is left of its caller's time) and the
/// tombstone `horizon` bound.
fn claim_many<'q>(
    sent: &[(usize, &'q Queued, Duration)],
    horizon: Duration,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let scopes: Vec<&'q str> = sent.iter().map(|(_, q, _)| q.record.scope()).collect();
    let keys: Vec<&'q str> = sent
        .iter()
        .map(|(_, q, _)| q.record.key().as_str())
        .collect();
    let fingerprints: Vec<&'q [u8]> = sent.iter().map(|(_, q, _)| &q.fingerprint[..]).collect();
    let owners: Vec<Uuid> = sent.iter().map(|(_, q, _)| q.owner).collect();
    let leases: Vec<f64> = sent.iter().map(|(_, q, _)| millis(q.lease)).collect();
    let left: Vec<f64> = sent.iter().map(|(_, _, left)| millis(*left)).collect();
    sqlx::query(CLAIM_MANY)
        .bind(scopes)
        .bind(keys)
        .bind(fingerprints)
        .bind(owners)
        .bind(leases)
        .bind(left)
        .bind(millis(horizon))
}

/// The rows of [`CLAIM_MANY`], each with its ordinal `n`.
fn numbered(rows: Result<Vec<PgRow>, sqlx::Error>) -> Result<Vec<(i64, PgRow)>, sqlx::Error> {
    rows?
        .into_iter()
        .map(|row| Ok((row.try_get("n")?, row)))
        .collect()
}

/// The claims `sent`, all of one shard of a distributed table (see
/// [`PostgresStore::on_citus`]): one statement inserts those that have no row
/// ([`claims_insert`]), then [`CLAIM_READ`] reads each of the others. The rows [`CLAIM_MANY`]
/// would have answered, each with its claim's ordinal. Without the caller's time on the
/// server: Citus evaluates `clock_timestamp()` where it plans the statement, before it reaches
/// the shard, so it could not bound a wait there.
async fn claim_on_shard(
    connection: &mut PgConnection,
    sent: &[(usize, &Queued, Duration)],
    (horizon, skew): (Duration, Duration),
) -> Result<Vec<(i64, PgRow)>, sqlx::Error> {
    let mut insert = sqlx::query(claims_insert(sent.len()));
    for (_, queued, _) in sent {
        insert = insert
            .bind(queued.record.scope())
            .bind(queued.record.key().as_str())
            .bind(&queued.fingerprint[..])
            .bind(queued.owner)
            .bind(millis(queued.lease));
    }
    let mut rows = Vec::with_capacity(sent.len());
    for row in insert.fetch_all(&mut *connection).await? {
        let owner: Uuid = row.try_get("owner")?;
        let n = (1_i64..).zip(sent).find(|(_, (_, q, _))| q.owner == owner);
        rows.extend(n.map(|(n, _)| (n, row)));
    }
    for (n, (_, queued, _)) in (1_i64..).zip(sent) {
        if rows.iter().any(|(inserted, _)| *inserted == n) {
            continue;
        }
        let row = sqlx::query(CLAIM_READ)
            .bind(queued.record.scope())
            .bind(queued.record.key().as_str())
            .bind(&queued.fingerprint[..])
            .bind(queued.owner)
            .bind(n)
            .bind(millis(horizon))
            .bind(millis(skew))
            .fetch_optional(&mut *connection)
            .await?;
        rows.extend(row.map(|row| (n, row)));
    }
    Ok(rows)
}

/// What a row of [`CLAIM_MANY`] says: the outcome, or `None` for a row the claim must settle under
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
                response,
                expires_in: column_millis(row, "expires_ms")?,
            }
        }
        "in_flight" => ClaimOutcome::InFlight {
            retry_after: column_millis(row, "lease_ms")?,
        },
        "orphaned" => ClaimOutcome::Orphaned,
        "answer_expired" => ClaimOutcome::AnswerExpired {
            status: column_status(row)?
                .ok_or_else(|| corrupt("a tombstone without a status".into()))?,
            completed_ago: column_millis(row, "ran_ms")?,
        },
        "expired" | "lapsed" => return Ok(None),
        other => return Err(corrupt(format!("unknown claim verdict {other:?}").into())),
    }))
}

/// The `status` column (`NULL`, or a number no status is, as none).
pub(super) fn column_status(row: &PgRow) -> Result<Option<http::StatusCode>, StoreError> {
    let status: Option<i16> = row.try_get("status").map_err(backend)?;
    Ok(status.and_then(|s| http::StatusCode::from_u16(s as u16).ok()))
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
    clocks: (&'static str, Duration),
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let mut tx = connection.begin().await?;
    let outcome = settle_in(&mut tx, request, clocks).await?;
    tx.commit().await?;
    Ok(outcome)
}

/// The statements of [`settle`], in its transaction: `fence` draws the next fence
/// ([`NEXT_FENCE`], or [`CLOCK_FENCE`] on Citus), `skew` is the clock skew allowed for.
async fn settle_in(
    tx: &mut PgConnection,
    request: &ClaimRequest,
    (fence, skew): (&'static str, Duration),
) -> Result<Option<ClaimOutcome>, sqlx::Error> {
    let record = request.record();
    let locked = sqlx::query(LOCK)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(&request.fingerprint().as_bytes()[..])
        .bind(millis(skew))
        .fetch_optional(&mut *tx)
        .await?;
    let Some(row) = locked else {
        let unsettled: bool = sqlx::query_scalar(UNSETTLED)
            .bind(record.scope())
            .bind(record.key().as_str())
            .bind(millis(skew))
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
        return take_over(tx, request, fence).await.map(Some);
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

/// Takes over the expired row [`settle_in`] locked, with a fence the statement `fence` draws.
async fn take_over(
    tx: &mut PgConnection,
    request: &ClaimRequest,
    fence: &'static str,
) -> Result<ClaimOutcome, sqlx::Error> {
    let record = request.record();
    let fence: i64 = sqlx::query_scalar(fence).fetch_one(&mut *tx).await?;
    let fence: i64 = sqlx::query_scalar(TAKE_OVER)
        .bind(record.scope())
        .bind(record.key().as_str())
        .bind(&request.fingerprint().as_bytes()[..])
        .bind(request.owner())
        .bind(millis(request.lease()))
        .bind(fence)
        .fetch_one(&mut *tx)
        .await?;
    let fence = u64::try_from(fence).unwrap_or_default();
    Ok(ClaimOutcome::Acquired { fence })
}
