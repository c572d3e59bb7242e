//! Settling a key: finalized owner-checked (completed or released), the caller answered, the
//! write retried with the key held while the store fails, and this process's duplicates woken.

use std::{ops::ControlFlow, time::Duration};

use tokio::time::Instant;

use super::{Caller, Engine, Exchange, Hold, Outcome, admit, execute::Handled, wait::Wait};
use crate::{
    policy::Completion,
    problem::Rejection,
    store::{ClaimRequest, Ownership, StoreError},
    telemetry::Operation,
};

/// Finalizes the key, then answers the caller (if the response was not streamed already), then
/// keeps finalizing with the key held if the store fails, and wakes this process's duplicates.
pub(super) async fn settle<B, E>(
    exchange: Exchange<'_, '_>,
    hold: Hold<'_>,
    handled: Handled<B, E>,
) {
    let engine = exchange.engine;
    let outcome = handled.outcome;
    let finalized = finalize(engine, &hold, &outcome).await;
    // Answered only now, so that a caller who has its answer finds the key final: a retry sent
    // the moment it arrives is replayed (or runs again, if released), never refused as in
    // flight. If the store keeps failing, the caller is answered anyway and the write goes on
    // with the key held. An attempt another took over does not answer for the key: its caller
    // gets the key's outcome, as a duplicate would.
    if finalized == Finalized::Superseded {
        let Hold { claim, keeper, .. } = hold;
        drop(keeper);
        if let Some((reply, _own)) = handled.answer {
            Box::pin(answer_superseded(exchange, &claim, reply)).await;
        }
        return;
    }
    if let Some((reply, mut answer)) = handled.answer {
        if let (Finalized::Done, Completion::Complete, Ok(answer)) =
            (finalized, outcome.completion, &mut answer)
            && let Some(lasts) = engine.settings.protection()
        {
            crate::headers::protected_for(answer.headers_mut(), lasts);
        }
        let _ = reply.send(answer);
    }
    conclude(engine, hold, &outcome, finalized).await;
}

/// What every settle ends with, a request's or a unit's: a finalize that failed goes on with the
/// key held, then the hold goes (its lease no longer renewed), and a key completed or released
/// wakes this process's duplicates waiting on it. How the finalize ended.
pub(super) async fn conclude(
    engine: &Engine,
    hold: Hold<'_>,
    outcome: &Outcome,
    mut finalized: Finalized,
) -> Finalized {
    if let Finalized::Failing = finalized {
        finalized = Box::pin(finalize_later(engine, &hold, outcome)).await;
    }
    let record = std::sync::Arc::clone(hold.lease.shared_record());
    drop(hold);
    if let Finalized::Done = finalized {
        engine.state.waiters.wake(&record);
    }
    finalized
}

/// The key's outcome, for the caller of an attempt that another took over (its lease ran out
/// while it ran): waited for as a duplicate waits, never the superseded handler's own answer.
async fn answer_superseded<B, E>(
    exchange: Exchange<'_, '_>,
    claim: &ClaimRequest,
    mut reply: Caller<B, E>,
) {
    tracing::info!("another attempt took the key over: answering with the key's outcome");
    let engine = exchange.engine;
    let again = claim.reowned(engine.owner_token());
    let wait = Wait::of(&engine.settings, exchange.headers);
    let exchange = Exchange { wait, ..exchange };
    let answer = match admit::claim_or_answer(exchange, &again, &mut reply).await {
        ControlFlow::Break(Some(mut answer)) => {
            wait.applied(&mut answer);
            answer
        }
        ControlFlow::Break(None) => return,
        // The key is free again (the other attempt released it): nothing to replay. Give it
        // back, and tell the caller to come again; its retry runs cleanly.
        ControlFlow::Continue(grant) => {
            let lease = again.lease_with_fence(grant.fence);
            let _ = engine.settings.store.release(&lease).await;
            let rejection = Rejection::InFlight {
                retry_after: Duration::from_secs(1),
            };
            exchange.refuse(rejection, &again)
        }
    };
    let _ = reply.send(Ok(answer));
}

/// How a finalize ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Finalized {
    /// The key is completed or released.
    Done,
    /// Another attempt holds (or finished) the key: this one wrote nothing, and its answer is
    /// not the key's.
    Superseded,
    /// The store kept failing: the caller may be answered, and the write retried while the key
    /// stays held.
    Failing,
}

/// Completes or releases the key, owner-checked; a committed key is completed whatever the
/// policy. A few quick attempts; a store that still fails leaves it to [`finalize_later`].
pub(super) async fn finalize(engine: &Engine, hold: &Hold<'_>, outcome: &Outcome) -> Finalized {
    hold.keeper.finalizing();
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=QUICK_ATTEMPTS {
        match finalize_once(engine, hold, outcome).await {
            Ok(finalized) => return finalized,
            Err(error) => {
                tracing::warn!(
                    attempt,
                    error = &error as &dyn std::error::Error,
                    "finalize failed; retrying"
                );
            }
        }
        if attempt < QUICK_ATTEMPTS {
            tokio::time::sleep(delay).await;
            delay *= 4;
        }
    }
    Finalized::Failing
}

/// Attempts at finalizing before the caller is answered anyway.
const QUICK_ATTEMPTS: u32 = 3;

/// Keeps retrying a finalize that failed, with the key held, until it succeeds, the lease is
/// lost, or the layer's finalize deadline passes. The key is never freed for a second execution
/// while the write is retried: retries of it wait or get 409.
async fn finalize_later(engine: &Engine, hold: &Hold<'_>, outcome: &Outcome) -> Finalized {
    let keeper = &hold.keeper;
    engine.telemetry.finalize_failing();
    let deadline = Instant::now() + engine.settings.finalize_deadline;
    let mut delay = Duration::from_millis(250);
    while Instant::now() < deadline && !keeper.lost() {
        tokio::time::sleep(delay.min(deadline - Instant::now())).await;
        delay = (delay * 2).min(Duration::from_secs(5));
        match finalize_once(engine, hold, outcome).await {
            Ok(finalized) => {
                tracing::info!("finalized after store failures");
                return finalized;
            }
            Err(error) => {
                tracing::warn!(
                    error = &error as &dyn std::error::Error,
                    "finalize still failing; the key stays held"
                );
            }
        }
    }
    tracing::error!(deadline = ?engine.settings.finalize_deadline, "gave up finalizing; the key frees itself when its lease ends");
    Finalized::Failing
}

/// One attempt: `Err` only for a store failure worth retrying.
async fn finalize_once(
    engine: &Engine,
    hold: &Hold<'_>,
    outcome: &Outcome,
) -> Result<Finalized, StoreError> {
    let (lease, keeper) = (&hold.lease, &hold.keeper);
    let Outcome {
        response,
        completion,
    } = outcome;
    let (settings, telemetry) = (&engine.settings, &engine.telemetry);
    let store = &settings.store;
    let complete = || {
        telemetry.timed(
            Operation::Complete,
            store.complete(lease, response, settings.retention),
        )
    };
    let ownership = match *completion {
        Completion::Complete => complete().await?,
        Completion::Release => match telemetry
            .timed(Operation::Release, store.release(lease))
            .await?
        {
            Ownership::Committed => complete().await?,
            Ownership::Held => {
                telemetry.finalized(false);
                tracing::debug!("key released");
                return Ok(Finalized::Done);
            }
            other => other,
        },
    };
    match ownership {
        Ownership::Held => {
            telemetry.finalized(true);
            tracing::debug!(status = response.status().as_u16(), "key completed");
            Ok(Finalized::Done)
        }
        _ => {
            keeper.finalize_lost();
            Ok(Finalized::Superseded)
        }
    }
}
