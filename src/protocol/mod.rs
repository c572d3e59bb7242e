//! The engine: one guarded request, from its body to its finalized key, and the live state the
//! requests of one layer share.
//!
//! [`run`] is `admit → execute → settle`, one file per phase, in the order a request meets
//! them: [`admit`](mod@admit) claims the key once [`read`] has buffered and fingerprinted the
//! body (waiting for a duplicate in flight, see [`wait`]); [`execute`](mod@execute) runs the
//! handler and reads its response while [`settle`](mod@settle) renews the lease, then
//! finalizes the key. [`units`] is the same for a unit of work beyond HTTP.

mod admit;
mod read;
mod wait;
mod execute;
mod settle;
mod units;

use std::{
    cell::Cell,
    ops::ControlFlow,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, request::Parts};
use http_body::Body;
use tokio::{sync::oneshot, time::Instant};
use tower_service::Service;
use uuid::Uuid;

pub(crate) use self::units::{Delivered, deliver};
#[cfg(feature = "postgres")]
pub(crate) use self::units::{deliver_batch_in_transaction, deliver_in_transaction};
use self::{
    admit::{Claiming, Grant},
    execute::Handled,
    settle::{Finalized, Finalizing, Keeper, Leases, Standing},
    wait::{Durations, Waiters},
};
use crate::{
    IdempotencyClaim, IdempotencyKey, IdempotencyOutcome,
    body::{RequestBody, ResponseBody},
    grpc,
    grpc::Wire,
    headers,
    kept::Resumption,
    policy::Completion,
    problem::Rejection,
    response::StoredResponse,
    settings::Settings,
    store::{BoxError, ClaimOutcome, ClaimRequest, Lease, RecordKey, Store},
    stripes::Padded,
    telemetry::Telemetry,
};

/// What the work on a guarded request sends back to its caller.
pub(crate) type Reply<B, E> = Result<Response<ResponseBody<B>>, E>;

/// Where the answer to the caller goes.
pub(crate) type Caller<B, E> = oneshot::Sender<Reply<B, E>>;

/// What the services of one layer share: its settings, where they record what they do, and
/// what they learn at run time.
///
/// Aligned to a pair of cache lines, so that the count of the `Arc` every request clones is
/// not on a line with the settings every request reads (see `crate::stripes`).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Engine {
    pub(crate) settings: Settings,
    pub(crate) telemetry: Telemetry,
    state: Arc<State>,
}

/// The live state of one layer's requests, shared by every service it builds.
#[derive(Default)]
pub(crate) struct State {
    /// Requests waiting for a duplicate of theirs to finish.
    waiters: Waiters,
    /// The leases this layer's requests hold, and the task that renews them: locked by every
    /// request, so on cache lines of its own.
    leases: Padded<Leases>,
    /// Recent handler durations, for `Retry-After` hints.
    durations: Durations,
    /// Whether the warning about a timeout layer inside this one was logged.
    warned_inner_timeout: AtomicBool,
    /// The store renewals go through: the store's detached twin, made with the first lease.
    renewals: std::sync::OnceLock<Arc<dyn Store>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("waiters", &self.waiters)
            .field("leases", &self.leases)
            .field("durations", &self.durations)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(crate) fn new(settings: Settings, telemetry: Telemetry, state: Arc<State>) -> Self {
        Self {
            settings,
            telemetry,
            state,
        }
    }

    /// The layer's own answer to a request, rendered and reported.
    pub(crate) fn respond<B>(
        &self,
        rejection: Rejection,
        key: Option<&IdempotencyKey>,
        wire: Wire,
    ) -> Response<ResponseBody<B>> {
        self.settings
            .answers
            .respond(&self.telemetry, rejection, key, wire)
    }

    /// The store renewals go through (see [`Store::detached`]).
    fn renewal_store(&self) -> &dyn Store {
        let store = &self.settings.store;
        &**self
            .state
            .renewals
            .get_or_init(|| store.detached().unwrap_or_else(|| Arc::clone(store)))
    }

    /// Reports what the layer did with a request on its answer.
    fn report<B>(&self, outcome: IdempotencyOutcome, response: &mut Response<B>) {
        self.settings
            .answers
            .report(&self.telemetry, outcome, response);
    }
}

/// What the handler's run left to store.
struct Outcome {
    response: StoredResponse,
    completion: Completion,
}

/// Runs one guarded request: buffer and fingerprint, claim (waiting for a duplicate in flight),
/// run the handler while the lease is renewed, finalize the key, then answer.
pub(crate) async fn run<S, ReqBody, ResBody>(
    engine: Arc<Engine>,
    inner: S,
    record: Arc<RecordKey>,
    request: Request<ReqBody>,
    reply: Caller<ResBody, S::Error>,
    wire: Wire,
) where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let admitted = admit(&engine, record, &parts, body, wire, reply).await;
    let Some(Admitted {
        claim,
        lease,
        keeper,
        body,
        reply,
    }) = admitted
    else {
        return;
    };
    let (handled, headers) = execute(&engine, inner, parts, body, &lease, reply, wire).await;
    let attempt = Attempt {
        claim: &claim,
        lease: &lease,
        headers: &headers,
        wire,
    };
    settle(&engine, attempt, handled, keeper).await;
}

/// The claim a request ran its handler under.
struct Attempt<'a> {
    claim: &'a ClaimRequest,
    lease: &'a Lease,
    /// The request's headers (a replay must agree with them on `Vary`).
    headers: &'a HeaderMap,
    wire: Wire,
}

/// A request admitted to run its handler.
struct Admitted<'a, ResBody, E> {
    claim: ClaimRequest,
    lease: Lease,
    /// Renews the lease until the key is finalized.
    keeper: Keeper<'a>,
    body: Bytes,
    reply: Caller<ResBody, E>,
}

/// Reads the body and claims the key: the claim and its held lease, the body to run the
/// handler with and the caller to answer, or `None` once the caller has been answered instead
/// (or has gone).
async fn admit<'a, B, ResBody, E>(
    engine: &'a Arc<Engine>,
    record: Arc<RecordKey>,
    parts: &Parts,
    body: B,
    wire: Wire,
    mut reply: Caller<ResBody, E>,
) -> Option<Admitted<'a, ResBody, E>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let (body, fingerprint) = match read::read_body(&engine.settings, parts, body).await {
        Ok(read) => read,
        Err(rejection) => {
            let answer = engine.respond(rejection, Some(record.key()), wire);
            let _ = reply.send(Ok(answer));
            return None;
        }
    };
    // The completer's request carries the fingerprint the key was claimed with: the headers
    // that took part in it may not have been kept.
    let fingerprint = parts
        .extensions
        .get::<Resumption>()
        .map_or(fingerprint, |resumption| resumption.fingerprint);
    let claim = ClaimRequest::shared(
        record,
        fingerprint,
        engine.owner_token(),
        engine.settings.lease,
    );
    let wait = Wait::of(&engine.settings, &parts.headers);
    let claiming = (&parts.headers, wait.budget, wire);
    match claim_and_hold(engine, claim, claiming, &mut reply).await {
        Ok((claim, lease, keeper)) => {
            tracing::Span::current().record("fence", lease.fence());
            tracing::debug!(owner = %lease.owner(), "claimed; running handler");
            Some(Admitted {
                claim,
                lease,
                keeper,
                body,
                reply,
            })
        }
        Err(answer) => {
            if let Some(mut answer) = answer {
                wait.applied(&mut answer);
                let _ = reply.send(Ok(answer));
            }
            None
        }
    }
}

/// Claims the key until this process holds a grant: the claim (its owner renewed when a grant
/// came too late to act on) with its lease and keeper, or the answer that replaces running the
/// handler (`None`: the caller left). `(headers, wait, wire)`: see [`Claiming`].
async fn claim_and_hold<'a, B, E>(
    engine: &'a Arc<Engine>,
    mut claim: ClaimRequest,
    (headers, wait, wire): (&HeaderMap, Duration, Wire),
    reply: &mut Caller<B, E>,
) -> Result<(ClaimRequest, Lease, Keeper<'a>), Option<Response<ResponseBody<B>>>> {
    let mut lapses = 0;
    loop {
        let claiming = Claiming {
            engine,
            claim: &claim,
            headers,
            wait,
            wire,
        };
        let grant = match admit::claim_or_answer(&claiming, reply).await {
            ControlFlow::Continue(grant) => grant,
            ControlFlow::Break(answer) => return Err(answer),
        };
        match hold_grant(engine, &mut claim, grant, &mut lapses).await {
            Kept::Held(lease, keeper) => return Ok((claim, lease, keeper)),
            Kept::Again => {}
            Kept::Refused => {
                let key = Some(claim.record().key());
                return Err(Some(engine.respond(Rejection::StoreUnavailable, key, wire)));
            }
        }
    }
}

/// How many grants in a row may come too late to act on before the work is refused.
const LAPSES: u32 = 3;

/// What became of a grant.
enum Kept<'a> {
    /// The lease, and its keeper renewing it: the work may start.
    Held(Lease, Keeper<'a>),
    /// The grant came too late to act on: claim again, as `claim` (now of a new owner).
    Again,
    /// The store could not confirm the lease, or grants kept lapsing: the work must not run.
    Refused,
}

/// Holds the lease `grant` gave `claim` (see [`Keeper::standing`]) if it still stands now that
/// the work is about to start. A grant that lapsed before this process could act on it (its
/// runtime was blocked when the answer came) while another owner took the key is given up, and
/// `claim` made anew for a new owner: claimed again, its outcome is whatever the key's is (a
/// replay, a wait for the owner that took it over). `lapses` counts those in a row.
async fn hold_grant<'a>(
    engine: &'a Arc<Engine>,
    claim: &mut ClaimRequest,
    grant: Grant,
    lapses: &mut u32,
) -> Kept<'a> {
    let lease = claim.lease_with_fence(grant.fence);
    let keeper = Keeper::start(engine, lease.clone(), grant.sent);
    match keeper.standing().await {
        Standing::Live => {
            engine.telemetry.executing();
            Kept::Held(lease, keeper)
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
                return Kept::Refused;
            }
            *claim = claim.reowned(engine.owner_token());
            Kept::Again
        }
        Standing::Unconfirmed => {
            drop(keeper);
            tracing::error!("the store did not confirm a late grant's lease; not running");
            // Nothing ran under it: giving the key back early is safe.
            let _ = engine.settings.store.release(&lease).await;
            Kept::Refused
        }
    }
}

/// Runs the handler on the buffered request, with its claim in the extensions; what it left, and
/// the request's headers.
async fn execute<S, ReqBody, ResBody>(
    engine: &Engine,
    inner: S,
    parts: Parts,
    body: Bytes,
    lease: &Lease,
    reply: Caller<ResBody, S::Error>,
    wire: Wire,
) -> (Handled<ResBody, S::Error>, Arc<HeaderMap>)
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    // The response may vary on request headers (`Vary`): keep them to store with it.
    let request_headers = Arc::new(parts.headers.clone());
    let settings = &engine.settings;
    let kept = (settings.kept_requests.as_ref()).and_then(|keep| keep.keep(&parts, &body));
    let mut request = Request::from_parts(parts, RequestBody::buffered(body));
    request.extensions_mut().insert(IdempotencyClaim::granted(
        lease.clone(),
        (settings.retention, settings.lease),
        Arc::clone(&settings.store_rules),
        (Arc::clone(&request_headers), kept),
    ));
    let started = Instant::now();
    let key = lease.record().key();
    let handled = execute::handle(engine, inner, request, &request_headers, reply, key, wire).await;
    let took = started.elapsed();
    engine.state.durations.record(took);
    engine.telemetry.handler_took(took);
    (handled, request_headers)
}

/// Finalizes the key, then answers the caller (if the response was not streamed already), then
/// keeps finalizing with the key held if the store fails, and wakes this process's duplicates.
async fn settle<B, E>(
    engine: &Engine,
    attempt: Attempt<'_>,
    handled: Handled<B, E>,
    keeper: Keeper<'_>,
) {
    let Outcome {
        response,
        completion,
    } = handled.outcome;
    let lease = attempt.lease;
    let finalizing = Finalizing {
        lease,
        response: &response,
        completion,
        keeper: &keeper,
    };
    let mut finalized = settle::finalize(engine, finalizing).await;
    // Answered only now, so that a caller who has its answer finds the key final: a retry sent
    // the moment it arrives is replayed (or runs again, if released), never refused as in
    // flight. If the store keeps failing, the caller is answered anyway and the write goes on
    // with the key held. An attempt another took over does not answer for the key: its caller
    // gets the key's outcome, as a duplicate would.
    if finalized == Finalized::Superseded {
        drop(keeper);
        if let Some((reply, _own)) = handled.answer {
            Box::pin(answer_superseded(engine, &attempt, reply)).await;
        }
        return;
    }
    if let Some((reply, mut answer)) = handled.answer {
        if let (Finalized::Done, Completion::Complete, Ok(answer)) =
            (finalized, completion, &mut answer)
            && let Some(lasts) = engine.settings.protection()
        {
            crate::headers::protected_for(answer.headers_mut(), lasts);
        }
        let _ = reply.send(answer);
    }
    if let Finalized::Failing = finalized {
        let later = settle::finalize_later(engine, finalizing);
        finalized = Box::pin(later).await;
    }
    drop(keeper);
    if let Finalized::Done = finalized {
        engine.state.waiters.wake(lease.record());
    }
}

/// The key's outcome, for the caller of an attempt that another took over (its lease ran out
/// while it ran): waited for as a duplicate waits, never the superseded handler's own answer.
async fn answer_superseded<B, E>(engine: &Engine, attempt: &Attempt<'_>, mut reply: Caller<B, E>) {
    tracing::info!("another attempt took the key over: answering with the key's outcome");
    let settings = &engine.settings;
    let (record, fingerprint) = (attempt.claim.record(), *attempt.claim.fingerprint());
    let again = ClaimRequest::new(
        record.clone(),
        fingerprint,
        engine.owner_token(),
        settings.lease,
    );
    let wait = Wait::of(settings, attempt.headers);
    let claiming = Claiming {
        engine,
        claim: &again,
        headers: attempt.headers,
        wait: wait.budget,
        wire: attempt.wire,
    };
    let answer = match admit::claim_or_answer(&claiming, &mut reply).await {
        ControlFlow::Break(Some(mut answer)) => {
            wait.applied(&mut answer);
            answer
        }
        ControlFlow::Break(None) => return,
        // The key is free again (the other attempt released it): nothing to replay. Give it
        // back, and tell the caller to come again; its retry runs cleanly.
        ControlFlow::Continue(grant) => {
            let _ = settings
                .store
                .release(&again.lease_with_fence(grant.fence))
                .await;
            let rejection = Rejection::InFlight {
                retry_after: Duration::from_secs(1),
            };
            claiming.refuse(rejection)
        }
    };
    let _ = reply.send(Ok(answer));
}

/// Claims a key committed without an answer, as a retry would, for the completer: the answer
/// the recovery hook rebuilt, stored (`Completed`), or why not. A claim acquired (the key
/// expired meanwhile) is given back at once: nothing runs under it.
pub(crate) async fn claim_committed(
    engine: &Engine,
    claim: &ClaimRequest,
) -> Result<ClaimOutcome, crate::store::StoreError> {
    let claimed = admit::claim_once(engine, claim).await;
    if let Ok(ClaimOutcome::Acquired { fence }) = claimed.outcome {
        let _ = (engine.settings.store)
            .release(&claim.lease_with_fence(fence))
            .await;
    }
    claimed.outcome
}

impl Engine {
    /// A fresh owner token, unique across the fleet without a system call per request: 64
    /// random bits each thread draws once, and a counter of the thread's own (one the threads
    /// shared would move between the workers' caches on every request); or, for a layer with
    /// a seed, the seed and a counter of the layer's own.
    pub(crate) fn owner_token(&self) -> Uuid {
        thread_local! {
            static TOKENS: Cell<(u64, u64)> = Cell::new((Uuid::new_v4().as_u64_pair().0, 0));
        }
        match &self.settings.seed {
            Some(seed) => seed.token(),
            None => TOKENS.with(|tokens| {
                let (thread, count) = tokens.get();
                tokens.set((thread, count + 1));
                Uuid::from_u64_pair(thread, count)
            }),
        }
    }
}

/// How long a duplicate may wait for the first request with its key, and whether that is the
/// request's own preference.
#[derive(Debug, Clone, Copy)]
struct Wait {
    budget: Duration,
    /// The request asked (`Prefer: wait=N`) and the layer honors it.
    preferred: bool,
}

impl Wait {
    /// The request's preference up to the layer's maximum, or the layer's budget; within the
    /// deadline a gRPC caller announced (`grpc-timeout`).
    fn of(settings: &Settings, headers: &HeaderMap) -> Self {
        let preferred = headers::preferred_wait(headers);
        let budget = preferred.map_or(settings.wait, |wait| wait.min(settings.max_wait));
        let budget = match grpc::deadline(headers) {
            // Leave the caller a fifth of its deadline to read the answer.
            Some(deadline) => budget.min(deadline * 4 / 5),
            None => budget,
        };
        Self {
            budget,
            preferred: preferred.is_some(),
        }
    }

    /// Says on the layer's own answer that the preference was honored, and for how long.
    fn applied<B>(self, answer: &mut http::Response<B>) {
        if self.preferred {
            let applied = format!("wait={}", self.budget.as_secs());
            let value = http::HeaderValue::try_from(applied).expect("digits");
            answer
                .headers_mut()
                .insert(headers::PREFERENCE_APPLIED, value);
        }
    }
}
