//! Any unit of work under the same engine as a request: claimed, run while its lease is renewed,
//! its outcome (bytes the caller serialized) stored and given to every later delivery.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use super::{
    Engine, Hold, Outcome,
    admit::{Grant, Kept, claim_once, hold_grant, while_in_flight},
    settle::{self, Finalized},
};
use crate::{
    IdempotencyClaim,
    fingerprint::Fingerprint,
    policy::Completion,
    response::StoredResponse,
    store::{ClaimOutcome, ClaimRequest, RecordKey, StoreError},
    telemetry::UnitOutcome,
};

/// What became of one delivery of a unit of work.
#[derive(Debug)]
pub(crate) enum Delivered<E> {
    /// This delivery ran the work: its outcome, now stored.
    Executed(Bytes),
    /// This delivery ran the work, but another took the key over meanwhile (its lease ran
    /// out) and the key was free again when this one looked: no outcome is the key's.
    Superseded,
    /// An earlier delivery ran it: the stored outcome.
    Replayed(Bytes),
    /// The work failed; the key was released for the next delivery (unless it had committed).
    Failed(E),
    /// An earlier delivery committed through the fence and then failed: no outcome to give.
    CommittedButFailed,
    /// Another delivery holds the key, still after the wait.
    InFlight { retry_after: Duration },
    /// The key was first used with another payload.
    Mismatch,
    /// An earlier delivery committed and its process died before storing the outcome.
    OutcomeUnknown,
    /// An earlier delivery ran it, and its outcome is past its retention.
    AnswerExpired,
    /// The store could not be reached; the work did not run.
    Store(StoreError),
}

impl<E> Delivered<E> {
    /// The `outcome` label it counts under.
    fn outcome(&self) -> UnitOutcome {
        match self {
            Self::Executed(_) => UnitOutcome::Executed,
            Self::Superseded => UnitOutcome::Superseded,
            Self::Replayed(_) => UnitOutcome::Replayed,
            Self::Failed(_) => UnitOutcome::Failed,
            Self::CommittedButFailed | Self::OutcomeUnknown => UnitOutcome::OutcomeUnknown,
            Self::AnswerExpired => UnitOutcome::AnswerExpired,
            Self::InFlight { .. } => UnitOutcome::InFlight,
            Self::Mismatch => UnitOutcome::Mismatch,
            Self::Store(_) => UnitOutcome::StoreUnavailable,
        }
    }
}

/// Claims `record` for this delivery (waiting up to `wait` for one that holds it), runs `work`
/// with the lease renewed, and stores its outcome; or says why the work did not run here.
/// Counted in `idempotency_units_total`.
pub(crate) async fn deliver<F, Fut, E>(
    engine: &Arc<Engine>,
    record: RecordKey,
    fingerprint: Fingerprint,
    wait: Duration,
    work: F,
) -> Delivered<E>
where
    F: FnOnce(IdempotencyClaim) -> Fut,
    Fut: Future<Output = Result<Bytes, E>>,
{
    let delivered = async {
        let settings = &engine.settings;
        let claim = ClaimRequest::new(record, fingerprint, engine.owner_token(), settings.lease);
        let hold = match held(engine, claim, wait).await {
            Ok(hold) => hold,
            Err(delivered) => return delivered,
        };
        let granted = IdempotencyClaim::granted(
            hold.lease.clone(),
            (settings.retention, settings.lease),
            Arc::clone(&settings.store_rules),
            (Arc::default(), None),
        );
        let started = Instant::now();
        let (outcome, delivered) = outcome_of(work(granted).await);
        engine.telemetry.handler_took(started.elapsed());
        let finalized = settle::finalize(engine, &hold, &outcome).await;
        let superseded =
            finalized == Finalized::Superseded && matches!(delivered, Delivered::Executed(_));
        let again = superseded.then(|| hold.claim.reowned(engine.owner_token()));
        settle::conclude(engine, hold, &outcome, finalized).await;
        match again {
            Some(again) => Box::pin(superseded_by(engine, &again, wait)).await,
            None => delivered,
        }
    }
    .await;
    engine.telemetry.unit(delivered.outcome());
    delivered
}

/// What the work's result stores, and what the delivery says of it. A failure releases the key
/// for the next delivery; a committed key is completed, as a failure.
fn outcome_of<E>(result: Result<Bytes, E>) -> (Outcome, Delivered<E>) {
    match result {
        Ok(value) => {
            let response = StoredResponse::of_outcome(value.clone());
            let completion = Completion::Complete;
            (
                Outcome {
                    response,
                    completion,
                },
                Delivered::Executed(value),
            )
        }
        Err(error) => {
            let empty = Some(Bytes::new());
            let status = StatusCode::INTERNAL_SERVER_ERROR;
            let response = StoredResponse::new(status, HeaderMap::new(), empty, None);
            let completion = Completion::Release;
            (
                Outcome {
                    response,
                    completion,
                },
                Delivered::Failed(error),
            )
        }
    }
}

/// Claims the key (again, by a new owner, if a grant came too late to act on) until it is held
/// for the work to start under, or says what the delivery gets instead.
async fn held<E>(
    engine: &Arc<Engine>,
    mut claim: ClaimRequest,
    wait: Duration,
) -> Result<Hold<'_>, Delivered<E>> {
    let mut lapses = 0;
    loop {
        let grant = claimed(engine, &claim, wait).await?;
        match hold_grant(engine, claim, grant, &mut lapses).await {
            Kept::Hold(hold) => return Ok(hold),
            Kept::Again(again) => claim = again,
            Kept::Refused(_) => {
                let settings = &engine.settings;
                let kind = settings.store.kind();
                return Err(Delivered::Store(StoreError::timeout(kind, settings.lease)));
            }
        }
    }
}

/// The key's outcome, for a delivery whose work ran while another took the key over: what a
/// later delivery would get (waiting for the one that holds it, claiming `again` as a new
/// owner), never this delivery's value, which was not stored.
async fn superseded_by<E>(engine: &Engine, again: &ClaimRequest, wait: Duration) -> Delivered<E> {
    tracing::info!("another delivery took the unit over: answering with the key's outcome");
    match claimed(engine, again, wait).await {
        Err(delivered) => delivered,
        // The key is free again (released, or swept): give it back; nothing is the key's.
        Ok(grant) => {
            let _ = engine
                .settings
                .store
                .release(&again.lease_with_fence(grant.fence))
                .await;
            Delivered::Superseded
        }
    }
}

/// The grant of an acquired claim, or what this delivery gets instead of running the work.
async fn claimed<E>(
    engine: &Engine,
    claim: &ClaimRequest,
    wait: Duration,
) -> Result<Grant, Delivered<E>> {
    let first = claim_once(engine, claim).await;
    // No caller to leave: a delivery waits out its whole wait.
    let waited = while_in_flight(engine, claim, first, wait, std::future::pending()).await;
    let waited = waited.expect("a pending future never resolves");
    let sent = waited.sent;
    match waited.outcome {
        Ok(ClaimOutcome::Acquired { fence }) => Ok(Grant { fence, sent }),
        Ok(ClaimOutcome::Completed { response, .. }) if response.status() == StatusCode::OK => Err(
            Delivered::Replayed(response.body().cloned().unwrap_or_default()),
        ),
        Ok(ClaimOutcome::Completed { .. }) => Err(Delivered::CommittedButFailed),
        Ok(ClaimOutcome::Mismatch) => Err(Delivered::Mismatch),
        Ok(ClaimOutcome::Orphaned) => Err(Delivered::OutcomeUnknown),
        Ok(ClaimOutcome::AnswerExpired { .. }) => Err(Delivered::AnswerExpired),
        Ok(ClaimOutcome::InFlight { retry_after }) => Err(Delivered::InFlight { retry_after }),
        Err(error) => Err(Delivered::Store(error)),
    }
}

/// Runs `work` for `record` in one transaction on a connection of `pool`, the key's claim and
/// outcome in the same transaction ([`crate::work::Once::run_in_transaction`]); or says why the
/// work did not run. Counted in `idempotency_units_total`.
#[cfg(feature = "postgres")]
pub(crate) async fn deliver_in_transaction<F, E>(
    engine: &Engine,
    pool: &sqlx::PgPool,
    (record, fingerprint): (RecordKey, Fingerprint),
    wait: Duration,
    work: F,
) -> Delivered<E>
where
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    let delivered = in_transaction(engine, pool, (&record, &fingerprint), wait, work).await;
    if let Delivered::Executed(_) = delivered {
        engine.state.waiters.wake(&record);
    }
    engine.telemetry.unit(delivered.outcome());
    delivered
}

/// See [`deliver_in_transaction`]. A fresh key begins in one round trip ([`fresh`]). Any other
/// is read under its lock until it is free (another delivery holding it, in either mode, is
/// waited for, polling, up to `wait`); the work runs once; the key's row is written with the
/// outcome and committed. A row written meanwhile by an owner in the other mode (which the lock
/// does not hold back) is read again: its outcome, or, when it was freed again,
/// [`Delivered::Superseded`], since the work ran and was rolled back.
#[cfg(feature = "postgres")]
async fn in_transaction<F, E>(
    engine: &Engine,
    pool: &sqlx::PgPool,
    unit: (&RecordKey, &Fingerprint),
    wait: Duration,
    work: F,
) -> Delivered<E>
where
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    use crate::store::postgres::unit::{self, Seen};
    let settings = &engine.settings;
    let deadline = Instant::now() + wait;
    let mut work = Some(work);
    if let Some(delivered) = fresh(engine, pool, unit, &mut work).await {
        return delivered;
    }
    let horizon = settings.store.tombstone_horizon();
    loop {
        let mut tx = match pool.begin().await {
            Ok(tx) => tx,
            Err(error) => return Delivered::Store(unit::backend(error)),
        };
        let replaced = match unit::begin(&mut tx, unit, settings.lease, horizon).await {
            Ok(Seen::Free) => None,
            Ok(Seen::Expired(fence)) => Some(fence),
            Ok(held @ (Seen::Locked | Seen::InFlight(_))) if Instant::now() < deadline => {
                drop(tx);
                let left = if let Seen::InFlight(left) = held {
                    left
                } else {
                    Duration::ZERO
                };
                let poll = left.clamp(Duration::from_millis(10), Duration::from_millis(100));
                tokio::time::sleep_until(deadline.min(Instant::now() + poll)).await;
                continue;
            }
            Ok(seen) => return already(seen, settings.lease),
            Err(error) => return Delivered::Store(error),
        };
        let Some(work) = work.take() else {
            return Delivered::Superseded;
        };
        if let Some(delivered) = work_and_commit(engine, tx, unit, replaced, work).await {
            return delivered;
        }
    }
}

/// Runs `work` in `tx`, writes the key's row with its outcome (a new row, or in place of the
/// expired one whose fence is `replaced`) and commits: how the delivery ended, or `None` when
/// another delivery's row is there instead (the transaction rolled back: read the key again).
#[cfg(feature = "postgres")]
async fn work_and_commit<F, E>(
    engine: &Engine,
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    unit: (&RecordKey, &Fingerprint),
    replaced: Option<i64>,
    work: F,
) -> Option<Delivered<E>>
where
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    use crate::store::postgres::unit;
    let started = Instant::now();
    let outcome = match work(&mut tx).await {
        Ok(outcome) => outcome,
        Err(error) => return Some(Delivered::Failed(error)),
    };
    engine.telemetry.handler_took(started.elapsed());
    let stored = StoredResponse::of_outcome(outcome.clone());
    let retention = engine.settings.retention;
    match unit::complete(&mut tx, unit, replaced, &stored, retention).await {
        Ok(true) => {}
        Ok(false) => return None,
        Err(error) => return Some(Delivered::Store(error)),
    }
    Some(match tx.commit().await {
        Ok(()) => Delivered::Executed(outcome),
        Err(error) => Delivered::Store(unit::backend(error)),
    })
}

/// The fresh path of [`in_transaction`]: the key's lock taken, and the key found without a row,
/// in the round trip of the transaction's `BEGIN`; then the work, the row and the commit. `None`
/// when the key is not free (held, or a row of any kind), the work left for the path that reads
/// the key; or when another delivery's row appeared by the insert (an owner in the other mode),
/// the work spent and rolled back, and that path says what the key holds.
#[cfg(feature = "postgres")]
async fn fresh<F, E>(
    engine: &Engine,
    pool: &sqlx::PgPool,
    unit: (&RecordKey, &Fingerprint),
    work: &mut Option<F>,
) -> Option<Delivered<E>>
where
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    use crate::store::postgres::unit;
    let mut held = match unit::DeliveryConnection::acquire(pool).await {
        Ok(held) => held,
        Err(error) => return Some(Delivered::Store(error)),
    };
    match begin_and_run(engine, &mut held, unit, work).await {
        Ok(delivered) => {
            held.ended();
            delivered
        }
        Err(error) => {
            held.roll_back().await;
            let free = !unit::not_free(&error);
            free.then(|| Delivered::Store(unit::backend(error)))
        }
    }
}

/// See [`fresh`]: its transaction on `held`, or the error of its `BEGIN`.
#[cfg(feature = "postgres")]
async fn begin_and_run<F, E>(
    engine: &Engine,
    held: &mut crate::store::postgres::unit::DeliveryConnection,
    unit: (&RecordKey, &Fingerprint),
    work: &mut Option<F>,
) -> Result<Option<Delivered<E>>, sqlx::Error>
where
    F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    use sqlx::Connection;
    let begin = crate::store::postgres::unit::begin_when_free(unit.0, engine.settings.lease);
    let tx = held.connection().begin_with(begin).await?;
    let Some(work) = work.take() else {
        return Ok(None);
    };
    Ok(work_and_commit(engine, tx, unit, None, work).await)
}

/// What a delivery gets from a key another delivery ran, or holds (in this mode, for up to
/// `lease` between its statements).
#[cfg(feature = "postgres")]
fn already<E>(seen: crate::store::postgres::unit::Seen, lease: Duration) -> Delivered<E> {
    use crate::store::postgres::unit::Seen;
    match seen {
        Seen::Completed(response) if response.status() == StatusCode::OK => {
            Delivered::Replayed(response.body().cloned().unwrap_or_default())
        }
        Seen::Completed(_) => Delivered::CommittedButFailed,
        Seen::Mismatch => Delivered::Mismatch,
        Seen::Orphaned => Delivered::OutcomeUnknown,
        Seen::AnswerExpired => Delivered::AnswerExpired,
        Seen::InFlight(retry_after) => Delivered::InFlight { retry_after },
        Seen::Locked => Delivered::InFlight { retry_after: lease },
        Seen::Free | Seen::Expired(_) => Delivered::Superseded,
    }
}

/// Runs the work of `units` in one transaction on a connection of `pool`, their claims and
/// outcomes in that same transaction ([`crate::work::Once::run_batch_in_transaction`]): what
/// became of each, in order. `work(i)` is the work of the unit at `i`, asked for each time it
/// is to run. Each unit counts in `idempotency_units_total` as a delivery.
///
/// The units whose keys are free (and not an earlier unit's of the batch) are worked one after
/// the other, their rows written in one statement and committed together ([`batch`]). Every
/// other unit, and every unit of a batch that did not commit (its rows taken meanwhile by an
/// owner in the other mode, a statement failed, the commit's answer lost), is then delivered on
/// its own through [`deliver_in_transaction`], which reads what its key holds.
#[cfg(feature = "postgres")]
pub(crate) async fn deliver_batch_in_transaction<W, E>(
    engine: &Engine,
    pool: &sqlx::PgPool,
    units: &[(RecordKey, Fingerprint)],
    wait: Duration,
    mut work: impl FnMut(usize) -> W,
) -> Vec<Delivered<E>>
where
    W: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    let mut delivered: Vec<Option<Delivered<E>>> = units.iter().map(|_| None).collect();
    let mut ended = |i: usize, unit: Delivered<E>| {
        engine.telemetry.unit(unit.outcome());
        delivered[i] = Some(unit);
    };
    match batch(engine, pool, units, &mut work).await {
        Batch::Committed(executed) => {
            for (i, outcome) in executed {
                engine.state.waiters.wake(&units[i].0);
                ended(i, Delivered::Executed(outcome));
            }
        }
        Batch::Failed(i, error) => ended(i, Delivered::Failed(error)),
        Batch::Unreachable(error) => {
            let (kind, error) = (engine.settings.store.kind(), Arc::new(error));
            for i in 0..units.len() {
                ended(
                    i,
                    Delivered::Store(StoreError::backend(kind, Arc::clone(&error))),
                );
            }
        }
        Batch::Undecided => {}
    }
    for (i, slot) in delivered.iter_mut().enumerate() {
        if slot.is_none() {
            let unit = units[i].clone();
            *slot = Some(deliver_in_transaction(engine, pool, unit, wait, work(i)).await);
        }
    }
    delivered.into_iter().flatten().collect()
}

/// How the one transaction of [`batch`] ended.
#[cfg(feature = "postgres")]
enum Batch<E> {
    /// Committed: the units worked in it, by index, with their outcomes.
    Committed(Vec<(usize, Bytes)>),
    /// This unit's work failed: the transaction rolled back.
    Failed(usize, E),
    /// No connection, or no transaction: no work ran.
    Unreachable(StoreError),
    /// Rolled back, or its commit unanswered: each unit's key says.
    Undecided,
}

/// The transaction of [`deliver_batch_in_transaction`]: the free keys' locks taken and the
/// transaction's pauses bounded by the lease in its first statement, their units worked in it
/// one after the other, their rows written in one statement, one commit. The connection is
/// closed, not handed back, when the transaction did not end cleanly (or this is dropped).
#[cfg(feature = "postgres")]
async fn batch<W, E>(
    engine: &Engine,
    pool: &sqlx::PgPool,
    units: &[(RecordKey, Fingerprint)],
    work: &mut impl FnMut(usize) -> W,
) -> Batch<E>
where
    W: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    use crate::store::postgres::unit;
    use sqlx::Connection;
    let settings = &engine.settings;
    let mut held = match unit::DeliveryConnection::acquire(pool).await {
        Ok(held) => held,
        Err(error) => return Batch::Unreachable(error),
    };
    let mut tx = match held.connection().begin().await {
        Ok(tx) => tx,
        Err(error) => return Batch::Unreachable(unit::backend(error)),
    };
    let records: Vec<&RecordKey> = units.iter().map(|(record, _)| record).collect();
    let free = match unit::begin_batch(&mut tx, &records, settings.lease).await {
        Ok(free) => free,
        Err(error) => return Batch::Unreachable(error),
    };
    let executed = match work_free(engine, &mut tx, (&records, &free), work).await {
        Ok(executed) => executed,
        Err((i, error)) => {
            if tx.rollback().await.is_ok() {
                held.ended();
            }
            return Batch::Failed(i, error);
        }
    };
    let written = executed.is_empty() || write_rows(engine, &mut tx, units, &executed).await;
    if !written {
        if tx.rollback().await.is_ok() {
            held.ended();
        }
        return Batch::Undecided;
    }
    match tx.commit().await {
        Ok(()) => {
            held.ended();
            Batch::Committed(executed)
        }
        Err(error) => {
            tracing::debug!(%error, "a batch's commit: each unit's key says how it ended");
            Batch::Undecided
        }
    }
}

/// The work of each unit of [`batch`] whose key is `free` and not an earlier unit's, in order
/// in the transaction on `tx`: their outcomes by index, or the first error, by its unit's.
#[cfg(feature = "postgres")]
async fn work_free<W, E>(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    (records, free): (&[&RecordKey], &[bool]),
    work: &mut impl FnMut(usize) -> W,
) -> Result<Vec<(usize, Bytes)>, (usize, E)>
where
    W: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<Bytes, E>,
{
    let mut executed = Vec::new();
    for (i, record) in records.iter().enumerate() {
        if !free[i] || records[..i].contains(record) {
            continue;
        }
        let started = Instant::now();
        let outcome = work(i)(&mut *tx).await.map_err(|error| (i, error))?;
        engine.telemetry.handler_took(started.elapsed());
        executed.push((i, outcome));
    }
    Ok(executed)
}

/// The rows of [`batch`]'s `executed` units, completed with their outcomes, in the transaction
/// on `tx`: whether they were written (not when a key has another delivery's row, or the
/// statement failed).
#[cfg(feature = "postgres")]
async fn write_rows(
    engine: &Engine,
    tx: &mut sqlx::PgConnection,
    units: &[(RecordKey, Fingerprint)],
    executed: &[(usize, Bytes)],
) -> bool {
    let rows: Vec<crate::store::postgres::unit::Written<'_>> = (executed.iter())
        .map(|(i, outcome)| {
            let (record, fingerprint) = &units[*i];
            (
                record,
                fingerprint,
                StoredResponse::of_outcome(outcome.clone()),
            )
        })
        .collect();
    let retention = engine.settings.retention;
    match crate::store::postgres::unit::complete_batch(tx, &rows, retention).await {
        Ok(written) => written,
        Err(error) => {
            tracing::debug!(%error, "a batch's rows: each unit's key says how it ended");
            false
        }
    }
}
