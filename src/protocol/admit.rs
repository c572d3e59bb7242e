//! Admitting a request: its body read, its key claimed (after waiting for a duplicate in
//! flight), and the grant held only if its lease still stands; or the answer that replaces
//! running the handler.

use std::{ops::ControlFlow, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Response, request::Parts};
use http_body::Body;
use tokio::time::Instant;

use super::{
    Caller, Engine, Exchange, Hold, Keyed,
    lease::{Keeper, Standing},
    read,
    wait::{self, Waiting},
};
use crate::{
    IdempotencyKey,
    answers::vary_mismatch,
    body::ResponseBody,
    headers,
    kept::Resumption,
    problem::Rejection,
    settings::{RecoveryFn, Settings},
    store::{BoxError, ClaimOutcome, ClaimRequest, RecordKey, StoreError},
    telemetry::Operation,
};

/// Reads the body, verifies the request and claims the key: the claim held, the body to run
/// the handler with and the caller to answer, or `None` once the caller has been answered
/// instead (or has gone).
pub(super) async fn admit<'a, B, ResBody, E>(
    exchange: Exchange<'a, '_>,
    keyed: Keyed,
    parts: &Parts,
    body: B,
    mut reply: Caller<ResBody, E>,
) -> Option<(Hold<'a>, Bytes, Caller<ResBody, E>)>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let engine = exchange.engine;
    let read = read::read_body(&engine.settings, parts, body).await;
    let resumption = parts.extensions.get::<Resumption>();
    let admitted = read.and_then(|(body, fingerprint)| {
        let record = keyed_record(&engine.settings, &keyed, parts, &body, resumption.is_some())?;
        Ok((body, fingerprint, record))
    });
    let (body, fingerprint, record) = match admitted {
        Ok(admitted) => admitted,
        Err(rejection) => {
            let known = keyed.known();
            let answer = engine.respond(
                rejection,
                known.as_deref().map(RecordKey::key),
                exchange.wire,
            );
            let _ = reply.send(Ok(answer));
            return None;
        }
    };
    // The completer's request carries the fingerprint the key was claimed with: the headers
    // that took part in it may not have been kept.
    let fingerprint = resumption.map_or(fingerprint, |resumption| resumption.fingerprint);
    let claim = ClaimRequest::shared(
        record,
        fingerprint,
        engine.owner_token(),
        engine.settings.lease,
    );
    match claim_and_hold(exchange, claim, &mut reply).await {
        Ok(hold) => {
            tracing::Span::current().record("fence", hold.lease.fence());
            tracing::debug!(owner = %hold.lease.owner(), "claimed; running handler");
            Some((hold, body, reply))
        }
        Err(answer) => {
            if let Some(mut answer) = answer {
                exchange.wait.applied(&mut answer);
                let _ = reply.send(Ok(answer));
            }
            None
        }
    }
}

/// The record a buffered request claims, once the [verifier](crate::IdempotencyLayer::with_verifier)
/// has passed it (a request the completer resumes was verified when it came): the one its head
/// named, or its key read from its JSON body.
fn keyed_record(
    settings: &Settings,
    keyed: &Keyed,
    parts: &Parts,
    body: &Bytes,
    resumed: bool,
) -> Result<Arc<RecordKey>, Rejection> {
    if let Some(verify) = settings.verifier.as_ref().filter(|_| !resumed) {
        verify(parts, body).map_err(Rejection::Unverified)?;
    }
    let scope = match keyed {
        Keyed::Known(record) => return Ok(Arc::clone(record)),
        Keyed::InBody { scope } => scope,
    };
    let pointer = settings
        .key_in_body
        .as_ref()
        .expect("a key in the body has its pointer");
    let key = match IdempotencyKey::from_json(body, pointer) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return Err(Rejection::NoKeyInBody {
                pointer: Arc::clone(pointer),
            });
        }
        Err(error) => return Err(Rejection::InvalidKey(error)),
    };
    let shown = settings.shown(key.as_str());
    tracing::Span::current().record("key", tracing::field::display(shown));
    Ok(Arc::new(RecordKey::new(scope.clone(), key)))
}

/// Claims the key until this process holds a grant: the hold (its claim made anew for a new
/// owner when a grant came too late to act on), or the answer that replaces running the
/// handler (`None`: the caller left).
async fn claim_and_hold<'a, B, E>(
    exchange: Exchange<'a, '_>,
    mut claim: ClaimRequest,
    reply: &mut Caller<B, E>,
) -> Result<Hold<'a>, Option<Response<ResponseBody<B>>>> {
    let mut lapses = 0;
    loop {
        let grant = match claim_or_answer(exchange, &claim, reply).await {
            ControlFlow::Continue(grant) => grant,
            ControlFlow::Break(answer) => return Err(answer),
        };
        match hold_grant(exchange.engine, claim, grant, &mut lapses).await {
            Kept::Hold(hold) => return Ok(hold),
            Kept::Again(again) => claim = again,
            Kept::Refused(claim) => {
                let refusal = exchange.refuse(Rejection::StoreUnavailable, &claim);
                return Err(Some(refusal));
            }
        }
    }
}

/// How many grants in a row may come too late to act on before the work is refused.
const LAPSES: u32 = 3;

/// What became of a grant.
pub(super) enum Kept<'a> {
    /// The claim held, its keeper renewing the lease: the work may start.
    Hold(Hold<'a>),
    /// The grant came too late to act on: claim again, as this claim (of a new owner).
    Again(ClaimRequest),
    /// The store could not confirm the lease, or grants kept lapsing: the work must not run.
    Refused(ClaimRequest),
}

/// Holds the lease `grant` gave `claim` (see [`Keeper::standing`]) if it still stands now that
/// the work is about to start. A grant that lapsed before this process could act on it (its
/// runtime was blocked when the answer came) while another owner took the key is given up, and
/// the claim made anew for a new owner: claimed again, its outcome is whatever the key's is (a
/// replay, a wait for the owner that took it over). `lapses` counts those in a row.
pub(super) async fn hold_grant<'a>(
    engine: &'a Arc<Engine>,
    claim: ClaimRequest,
    grant: Grant,
    lapses: &mut u32,
) -> Kept<'a> {
    let lease = claim.lease_with_fence(grant.fence);
    let keeper = Keeper::start(engine, lease.clone(), grant.sent);
    match keeper.standing().await {
        Standing::Live => {
            engine.telemetry.executing();
            Kept::Hold(Hold {
                claim,
                lease,
                keeper,
            })
        }
        Standing::Lost => {
            engine.telemetry.grant_lapsed();
            tracing::warn!(
                owner = %lease.owner(),
                fence = lease.fence(),
                "the claim was granted, but its lease ran out before this process could act on \
                 it (its runtime was blocked?) and another attempt took the key: not running \
                 it; claiming again"
            );
            *lapses += 1;
            if *lapses == LAPSES {
                tracing::error!(lapses, "every grant lapsed before it could be acted on");
                return Kept::Refused(claim);
            }
            Kept::Again(claim.reowned(engine.owner_token()))
        }
        Standing::Unconfirmed => {
            drop(keeper);
            tracing::error!("the store did not confirm a late grant's lease; not running");
            // Nothing ran under it: giving the key back early is safe.
            let _ = engine.settings.store.release(&lease).await;
            Kept::Refused(claim)
        }
    }
}

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
pub(super) struct Asked {
    pub(super) outcome: Result<ClaimOutcome, StoreError>,
    pub(super) sent: Instant,
}

/// Claims the key, waiting (up to `wait`) while another request holds it: the fence of an
/// acquired claim, or the answer that replaces running the handler (a replay, or why not), or
/// nothing when the caller left while waiting.
///
/// A request of this process that holds the key wakes its waiters when it finalizes; one on
/// another instance, the store's word (see [`while_in_flight`]).
pub(super) async fn claim_or_answer<B, E>(
    exchange: Exchange<'_, '_>,
    claim: &ClaimRequest,
    reply: &mut Caller<B, E>,
) -> Answered<B> {
    let asked = claim_once(exchange.engine, claim).await;
    match asked.outcome {
        // Waiting is rare, and its state large: boxed apart.
        Ok(ClaimOutcome::InFlight { .. }) => {
            Box::pin(wait_for_the_first(exchange, claim, reply, asked)).await
        }
        _ => answer(exchange, claim, asked),
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
pub(super) async fn claim_once(engine: &Engine, claim: &ClaimRequest) -> Asked {
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
    Asked { outcome, sent }
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
    let adopt = async {
        let recovery = settings.store.recovery_for("adopt")?;
        recovery.adopt(claim, &stored, settings.retention).await
    };
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
    exchange: Exchange<'_, '_>,
    claim: &ClaimRequest,
    reply: &mut Caller<B, E>,
    asked: Asked,
) -> Answered<B> {
    let (engine, budget) = (exchange.engine, exchange.wait.budget);
    let waited = while_in_flight(engine, claim, asked, budget, reply.closed()).await;
    let Some(asked) = waited else {
        return ControlFlow::Break(None);
    };
    if let Ok(ClaimOutcome::InFlight { retry_after }) = asked.outcome {
        let rejection = Rejection::InFlight { retry_after };
        return ControlFlow::Break(Some(exchange.refuse(rejection, claim)));
    }
    answer(exchange, claim, asked)
}

/// Claims again while another attempt holds the key, up to `wait`: the first outcome that is
/// not "in flight", or "in flight" with a `Retry-After` drawn from recent durations once the
/// wait is over; `None` if `gone` (the caller leaving) resolved first.
///
/// A holder in this process wakes its waiters when it finalizes; one elsewhere in the fleet is
/// heard of through the store, where it gives word ([`Wakes`](crate::store::Wakes)): the waiter
/// marks the key, and claims again the moment its holder completes or releases it, when the
/// holder's lease runs out, or every 5 s anyway. Without word, it polls, after 10 ms, then twice
/// as long each time up to 200 ms.
pub(super) async fn while_in_flight(
    engine: &Engine,
    claim: &ClaimRequest,
    mut asked: Asked,
    wait: Duration,
    gone: impl Future<Output = ()>,
) -> Option<Asked> {
    let deadline = Instant::now() + wait;
    let mut waiting = None;
    let mut gone = std::pin::pin!(gone);
    loop {
        let Ok(ClaimOutcome::InFlight { retry_after }) = asked.outcome else {
            return Some(asked);
        };
        if wait::left(&mut gone) {
            return None;
        }
        if Instant::now() >= deadline {
            let retry_after = engine.state.durations.retry_after(retry_after);
            asked.outcome = Ok(ClaimOutcome::InFlight { retry_after });
            return Some(asked);
        }
        let waiting = match &mut waiting {
            Some(waiting) => waiting,
            None => waiting.insert(Waiting::start(engine, claim).await),
        };
        let record = claim.record();
        let woken = waiting.pause(engine, record, (retry_after, deadline), &mut gone);
        engine.telemetry.woke(woken.await?);
        asked = claim_once(engine, claim).await;
    }
}

/// The fence of an acquired claim, or the answer that replaces running the handler.
fn answer<B>(exchange: Exchange<'_, '_>, claim: &ClaimRequest, asked: Asked) -> Answered<B> {
    let engine = exchange.engine;
    let sent = asked.sent;
    let rejection = match asked.outcome {
        Ok(ClaimOutcome::Acquired { fence }) => {
            return ControlFlow::Continue(Grant { fence, sent });
        }
        Ok(ClaimOutcome::Completed {
            response,
            expires_in,
        }) if response.body().is_some() => {
            match vary_mismatch(&response, exchange.headers) {
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
            let answer = answer_expired(exchange, claim, (status, completed_ago));
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
    ControlFlow::Break(Some(exchange.refuse(rejection, claim)))
}

/// The refusal of a key whose answer expired, with how long its tombstone still protects it
/// when the layer says so.
fn answer_expired<B>(
    exchange: Exchange<'_, '_>,
    claim: &ClaimRequest,
    (status, completed_ago): (http::StatusCode, Duration),
) -> Response<ResponseBody<B>> {
    let rejection = Rejection::AnswerExpired {
        status,
        completed_ago,
    };
    let mut answer = exchange.refuse(rejection, claim);
    if let Some(lasts) = exchange.engine.settings.protection() {
        headers::protected_for(answer.headers_mut(), lasts.saturating_sub(completed_ago));
    }
    answer
}

/// Claims a key committed without an answer, as a retry would, for the completer: the answer
/// the recovery hook rebuilt, stored (`Completed`), or why not. A claim acquired (the key
/// expired meanwhile) is given back at once: nothing runs under it.
pub(crate) async fn claim_committed(
    engine: &Engine,
    claim: &ClaimRequest,
) -> Result<ClaimOutcome, StoreError> {
    let asked = claim_once(engine, claim).await;
    if let Ok(ClaimOutcome::Acquired { fence }) = asked.outcome {
        let _ = (engine.settings.store)
            .release(&claim.lease_with_fence(fence))
            .await;
    }
    asked.outcome
}
