//! Claiming a key: the fence to run the handler with, or the answer that replaces running it,
//! after waiting for a duplicate in flight.

use std::{ops::ControlFlow, time::Duration};

use futures_util::FutureExt;
use http::{HeaderMap, Response};
use tokio::time::Instant;

use super::{Caller, Engine, wait::Backoff};
use crate::{
    answers::vary_mismatch,
    body::ResponseBody,
    grpc::Wire,
    headers,
    problem::Rejection,
    settings::RecoveryFn,
    store::{ClaimOutcome, ClaimRequest, StoreError},
    telemetry::Operation,
};

/// What a claim ends in: a grant to run the handler under, or the answer that replaces running
/// it (nothing when the caller left while waiting).
pub(super) type Answered<B> = ControlFlow<Option<Response<ResponseBody<B>>>, Grant>;

/// A claim the store granted.
#[derive(Debug, Clone, Copy)]
pub(super) struct Grant {
    pub(super) fence: u64,
    /// When the claim that was granted was sent: its lease runs from no earlier than that,
    /// however late this process saw the answer.
    pub(super) sent: Instant,
}

/// What one claim call answered, and when it was sent.
pub(super) struct Claimed {
    pub(super) outcome: Result<ClaimOutcome, StoreError>,
    pub(super) sent: Instant,
}

/// Claims the key, waiting (up to `wait`) while another request holds it: the fence of an
/// acquired claim, or the answer that replaces running the handler (a replay, or why not), or
/// nothing when the caller left while waiting.
///
/// A request of this process that holds the key wakes its waiters when it finalizes; one on
/// another instance is noticed by polling the store, after 10 ms, then twice as long each time
/// up to 200 ms.
pub(super) async fn claim_or_answer<B, E>(
    claiming: &Claiming<'_>,
    reply: &mut Caller<B, E>,
) -> Answered<B> {
    let claimed = claim_once(claiming.engine, claiming.claim).await;
    match claimed.outcome {
        // Waiting is rare, and its state large: boxed apart.
        Ok(ClaimOutcome::InFlight { .. }) => {
            Box::pin(wait_for_the_first(claiming, reply, claimed)).await
        }
        _ => answer(claiming, claimed),
    }
}

/// A request's claim and what its answers depend on, passed whole through the claim.
pub(super) struct Claiming<'a> {
    pub(super) engine: &'a Engine,
    pub(super) claim: &'a ClaimRequest,
    /// The request's headers (a replay must agree with them on `Vary`).
    pub(super) headers: &'a HeaderMap,
    /// How long to wait for a duplicate in flight.
    pub(super) wait: Duration,
    pub(super) wire: Wire,
}

impl Claiming<'_> {
    /// The layer's own answer to this request, instead of running the handler.
    pub(super) fn refuse<B>(&self, rejection: Rejection) -> Response<ResponseBody<B>> {
        let key = Some(self.claim.record().key());
        self.engine.respond(rejection, key, self.wire)
    }
}

/// How soon a caller is told to retry a key whose recovered answer is not there yet.
const RECOVERY_RETRY: Duration = Duration::from_secs(1);

/// One claim call, timed; a key committed without an answer is given the application's, when
/// it rebuilds one.
///
/// A claim that failed on its way (a connection cut, a timeout) may still have been applied
/// by the store, its answer lost: the key would then be held by this caller's own owner token,
/// and every retry locked out for a lease although nothing runs. After a failure of the
/// backend (a connection cut: quick to tell), it is asked once more by the same owner, which a
/// store grants again when the first one was applied. After a timeout (a store that slow would
/// likely keep the caller waiting as long again), or when asking again failed too, the claim is
/// released (owner-checked, in the background) so that the retry the 503 invites is served at
/// once.
pub(super) async fn claim_once(engine: &Engine, claim: &ClaimRequest) -> Claimed {
    let store = &engine.settings.store;
    let sent = Instant::now();
    let mut outcome = engine
        .telemetry
        .timed(Operation::Claim, store.claim(claim))
        .await;
    if let Err(StoreError::Backend { .. }) = outcome {
        outcome = engine
            .telemetry
            .timed(Operation::Claim, store.claim(claim))
            .await;
    }
    if let Err(StoreError::Backend { .. } | StoreError::Timeout { .. }) = outcome {
        engine.release_unanswered(claim);
    }
    let outcome = match (outcome, &engine.settings.recovery) {
        (Ok(ClaimOutcome::Orphaned), Some(recover)) => {
            Box::pin(recovered(engine, claim, &**recover)).await
        }
        (outcome, _) => outcome,
    };
    Claimed { outcome, sent }
}

/// Asks the application for the answer of a key committed without one, and stores it: the
/// answer to replay. With a hook installed, a key committed without an answer is never given
/// up as `outcome-unknown`: when the hook has no answer yet (its read failed, say) or the store
/// cannot keep it, the key is answered as in flight, with a short `Retry-After`, so that the
/// caller's wait, or its retry, asks again.
async fn recovered(
    engine: &Engine,
    claim: &ClaimRequest,
    recover: &RecoveryFn,
) -> Result<ClaimOutcome, StoreError> {
    let not_yet = Ok(ClaimOutcome::InFlight {
        retry_after: RECOVERY_RETRY,
    });
    let Some(response) = recover(claim.record().clone()).await else {
        tracing::warn!(
            "key committed without an answer, and the recovery hook has none yet; the caller \
             is told to retry"
        );
        return not_yet;
    };
    let settings = &engine.settings;
    let stored = settings.store_rules.record(&response);
    let adopt = settings.store.adopt(claim, &stored, settings.retention);
    match engine.telemetry.timed(Operation::Adopt, adopt).await {
        Ok(true) => {
            tracing::info!(
                "stored the answer the recovery hook rebuilt for a key committed without one"
            );
            Ok(ClaimOutcome::Completed {
                response: stored,
                expires_in: settings.retention,
            })
        }
        // Another retry adopted it meanwhile: its answer is the one stored.
        Ok(false) => {
            engine
                .telemetry
                .timed(Operation::Claim, settings.store.claim(claim))
                .await
        }
        Err(error) => {
            tracing::warn!(
                error = &error as &dyn std::error::Error,
                "could not store the recovered answer; the caller is told to retry"
            );
            not_yet
        }
    }
}

/// The wait of [`claim_or_answer`] for a key found in flight.
async fn wait_for_the_first<B, E>(
    claiming: &Claiming<'_>,
    reply: &mut Caller<B, E>,
    claimed: Claimed,
) -> Answered<B> {
    let Claiming { engine, claim, .. } = *claiming;
    let waited = while_in_flight(engine, claim, claimed, claiming.wait, reply.closed()).await;
    let Some(claimed) = waited else {
        return ControlFlow::Break(None);
    };
    if let Ok(ClaimOutcome::InFlight { retry_after }) = claimed.outcome {
        let rejection = Rejection::InFlight { retry_after };
        return ControlFlow::Break(Some(claiming.refuse(rejection)));
    }
    answer(claiming, claimed)
}

/// Claims again while another attempt holds the key, up to `wait`: the first outcome that is
/// not "in flight", or "in flight" with a `Retry-After` drawn from recent durations once the
/// wait is over; `None` if `gone` (the caller leaving) resolved first.
///
/// A holder in this process wakes its waiters when it finalizes; one elsewhere in the fleet is
/// noticed by polling the store, after 10 ms, then twice as long each time up to 200 ms.
pub(super) async fn while_in_flight(
    engine: &Engine,
    claim: &ClaimRequest,
    mut claimed: Claimed,
    wait: Duration,
    gone: impl Future<Output = ()>,
) -> Option<Claimed> {
    let deadline = Instant::now() + wait;
    let mut watch = None;
    let (prefix, count) = claim.owner().as_u64_pair();
    let mut backoff = Backoff::new(prefix ^ count.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut gone = std::pin::pin!(gone);
    loop {
        let Ok(ClaimOutcome::InFlight { retry_after }) = claimed.outcome else {
            return Some(claimed);
        };
        if (&mut gone).now_or_never().is_some() {
            return None;
        }
        let now = Instant::now();
        if now >= deadline {
            let retry_after = engine.state.durations.retry_after(retry_after);
            claimed.outcome = Ok(ClaimOutcome::InFlight { retry_after });
            return Some(claimed);
        }
        let watch = watch.get_or_insert_with(|| {
            engine.telemetry.waiting();
            engine.state.waiters.watch(claim.record())
        });
        tokio::select! {
            biased;
            () = &mut gone => return None,
            () = watch.notify().notified() => {}
            () = tokio::time::sleep(backoff.pause().min(deadline - now)) => {}
        }
        claimed = claim_once(engine, claim).await;
    }
}

/// The fence of an acquired claim, or the answer that replaces running the handler.
fn answer<B>(claiming: &Claiming<'_>, claimed: Claimed) -> Answered<B> {
    let engine = claiming.engine;
    let sent = claimed.sent;
    let rejection = match claimed.outcome {
        Ok(ClaimOutcome::Acquired { fence }) => {
            return ControlFlow::Continue(Grant { fence, sent });
        }
        Ok(ClaimOutcome::Completed {
            response,
            expires_in,
        }) if response.body().is_some() => {
            match vary_mismatch(&response, claiming.headers) {
                None => {
                    let settings = &engine.settings;
                    // The key outlives its answer by what the tombstones add to the retention.
                    let protected = settings
                        .protection()
                        .map(|lasts| expires_in + lasts.saturating_sub(settings.retention));
                    let answers = &settings.answers;
                    let replayed = answers.replay(&engine.telemetry, response, protected);
                    return ControlFlow::Break(Some(replayed));
                }
                Some(headers) => Rejection::NotAcceptable { headers },
            }
        }
        Ok(ClaimOutcome::Completed { response, .. }) => Rejection::ResponseNotStored {
            status: response.status(),
        },
        Ok(ClaimOutcome::InFlight { retry_after }) => Rejection::InFlight {
            retry_after: engine.state.durations.retry_after(retry_after),
        },
        Ok(ClaimOutcome::Mismatch) => Rejection::Mismatch,
        Ok(ClaimOutcome::Orphaned) => {
            tracing::warn!("key committed but its response was lost");
            Rejection::OutcomeUnknown
        }
        Ok(ClaimOutcome::AnswerExpired {
            status,
            completed_ago,
        }) => {
            let answer = answer_expired(claiming, (status, completed_ago));
            return ControlFlow::Break(Some(answer));
        }
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "claim failed; handler not run"
            );
            Rejection::StoreUnavailable
        }
    };
    ControlFlow::Break(Some(claiming.refuse(rejection)))
}

/// The refusal of a key whose answer expired, with how long its tombstone still protects it
/// when the layer says so.
fn answer_expired<B>(
    claiming: &Claiming<'_>,
    (status, completed_ago): (http::StatusCode, Duration),
) -> Response<ResponseBody<B>> {
    let rejection = Rejection::AnswerExpired {
        status,
        completed_ago,
    };
    let mut answer = claiming.refuse(rejection);
    if let Some(lasts) = claiming.engine.settings.protection() {
        headers::protected_for(answer.headers_mut(), lasts.saturating_sub(completed_ago));
    }
    answer
}
