//! The completer: finishes the requests a client gave up on and an instance died in the middle
//! of, without waiting for a retry that may never come.
//!
//! A handler that records [recovery points](crate::guide::recovery) leaves its progress in the
//! store; a fence committed without an answer leaves the business write. When the instance
//! running it dies and the client has given up, nobody retries, and the key stays unfinished
//! (a payment charged and left pending) until its retention ends. The completer, which runs on
//! every instance, finds those keys once their lease has lapsed and drives each to its end as a
//! retry would:
//!
//! - a key **in flight with a recovery point** is resumed: the request it was claimed for, as
//!   the layer kept it ([`KeptRequests`]), goes through the application's service, and the
//!   layer takes the key over and runs the handler from its last recovery point;
//! - a key **committed without an answer** is answered by the layer's
//!   [recovery hook](crate::IdempotencyLayer::with_recovery), and that answer stored: the
//!   hook of the layer on its route when its request was kept (it goes through the service as
//!   above), else the hook of the layer the completer was built from.
//!
//! Run one completer per store on each instance, built from a layer on that store, and give it
//! the service that holds every route guarded by a layer on that store: it finishes every
//! abandoned key the store holds.
//!
//! Each key is claimed through the store like any request, so the guarantees are a retry's:
//! at most one attempt at a time, through the fence; the answer stored and replayed to a later
//! retry; a retry arriving meanwhile waits for it and gets the same answer; a completer that
//! finds the key held (by a retry, or by the completer of another instance) leaves it. There is
//! no leader to configure. Keys with nothing recorded (the handler died before its first step)
//! are left to expire: the next retry runs them cleanly.
//!
//! ```no_run
//! # async fn run(pool: tower_idempotency::sqlx::PgPool) {
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, completer::KeptRequests, store::PostgresStore};
//!
//! # async fn pay() {}
//! let layer = IdempotencyLayer::new(PostgresStore::new(pool))
//!     .with_kept_requests(KeptRequests::new());
//! let app = Router::new().route("/payments", post(pay).route_layer(layer.clone()));
//! // The service the completer sends kept requests to: the router, inside any layer that
//! // authenticates (kept requests carry no credentials; the key's scope comes with it).
//! layer.completer(app.clone()).spawn();
//! # }
//! ```
//!
//! It needs a store that keeps such work: Postgres, alone or behind Redis
//! ([`Recovery::abandoned`](crate::store::Recovery::abandoned)). What it could not finish (no request
//! kept, a handler that failed again, no recovery hook) it notes on the key: the admin listing
//! ([`Admin::stuck`](crate::store::Admin::stuck),
//! [`RecordInfo::unfinished`](crate::store::RecordInfo::unfinished)) says why, and the
//! `idempotency_completer_*` metrics count it (see [`telemetry`](crate::telemetry)).
//!
//! The service takes `http::Request<http_body_util::Full<Bytes>>`, as an axum `Router` or any
//! service generic over its request body does.

use std::{collections::HashMap, fmt, sync::Arc, task::Context, time::Duration};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use tokio::task::{JoinHandle, JoinSet};
use tower_service::Service;

pub use crate::kept::{DEFAULT_KEPT_MAX_BODY, KeptRequests};
use crate::{
    IdempotencyOutcome,
    kept::{KeptRequest, Resumption},
    protocol::{self, Engine},
    store::{Abandoned, ClaimOutcome, ClaimRequest, RecordKey, RecordState, StoreError},
};

/// How often the completer looks for abandoned keys, by default: 5 s.
pub const DEFAULT_COMPLETER_PERIOD: Duration = Duration::from_secs(5);

/// How many abandoned keys one round finishes at most, at once, by default: 16.
pub const DEFAULT_COMPLETER_PACE: usize = 16;

/// How long a round waits for one resumed request before it moves on (the handler goes on
/// running, and its answer is stored, as for a caller that left).
const PATIENCE: Duration = Duration::from_secs(60);

/// Finishes abandoned keys: see the [module](self). Built by
/// [`IdempotencyLayer::completer`](crate::IdempotencyLayer::completer).
pub struct Completer<S> {
    engine: Arc<Engine>,
    service: S,
    period: Duration,
    pace: usize,
}

/// What one round of the completer found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Round {
    /// Keys found abandoned.
    pub found: usize,
    /// Keys finished: resumed to an answer, or answered by the recovery hook (or by another
    /// attempt meanwhile).
    pub finished: usize,
    /// Keys that could not be finished; each says why on its record.
    pub failed: usize,
    /// Keys another attempt held (a retry, another instance's completer), or whose owner's
    /// grace was still running: left for a later round.
    pub busy: usize,
    /// How long ago the oldest one's lease ran out.
    pub oldest: Option<Duration>,
}

/// What became of one key.
#[derive(Debug)]
enum Fate {
    Finished,
    Busy,
    Failed(String),
}

impl<S> Completer<S> {
    pub(crate) fn new(engine: Arc<Engine>, service: S) -> Self {
        Self {
            engine,
            service,
            period: DEFAULT_COMPLETER_PERIOD,
            pace: DEFAULT_COMPLETER_PACE,
        }
    }

    /// How often to look for abandoned keys ([`DEFAULT_COMPLETER_PERIOD`]). A key is finished
    /// about a lease plus a period after its instance died.
    pub fn with_period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// How many abandoned keys one round takes on at most, at once
    /// ([`DEFAULT_COMPLETER_PACE`]); the rest wait for the next round.
    pub fn with_pace(mut self, keys: usize) -> Self {
        self.pace = keys.max(1);
        self
    }
}

impl<S, R> Completer<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: fmt::Display + Send + 'static,
    R: Send + 'static,
{
    /// Runs a round every period, on the Tokio runtime, until the handle is aborted. A round
    /// that fails (the store down) is logged and tried again a period later; a hook or handler
    /// that panics fails its key only.
    pub fn spawn(mut self) -> JoinHandle<()> {
        crate::telemetry::register_completer_metrics();
        tokio::spawn(async move {
            // Instances started together look at different moments.
            let offset = self.period.mul_f64(f64::from(rand_fraction()));
            tokio::time::sleep(offset).await;
            loop {
                match self.run_once().await {
                    Ok(round) if round.found > 0 => tracing::info!(?round, "completer round"),
                    Ok(_) => {}
                    Err(error) => tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "the completer could not list abandoned keys"
                    ),
                }
                tokio::time::sleep(self.period).await;
            }
        })
    }

    /// One round: lists the abandoned keys (up to the pace) and drives each to its end, at
    /// once; what became of them. Fails only when the store cannot list them.
    pub async fn run_once(&mut self) -> Result<Round, StoreError> {
        let recovery = self.engine.settings.store.recovery_for("abandoned")?;
        let found = recovery.abandoned(self.pace).await?;
        let mut round = Round {
            found: found.len(),
            oldest: found.iter().map(|abandoned| abandoned.lapsed).max(),
            ..Round::default()
        };
        let mut tasks = JoinSet::new();
        let mut records = HashMap::new();
        for abandoned in found {
            let record = abandoned.record.clone();
            let finishing = self.finishing();
            let task = tasks.spawn(async move { finishing.finish(abandoned).await });
            records.insert(task.id(), record);
        }
        while let Some(joined) = tasks.join_next_with_id().await {
            let (record, fate) = match joined {
                Ok((id, fate)) => (records.remove(&id), fate),
                Err(error) => {
                    let why = format!("the completer's task failed: {error}");
                    (records.remove(&error.id()), Fate::Failed(why))
                }
            };
            tally(&self.engine, &mut round, record, fate).await;
        }
        let oldest = round.oldest.unwrap_or_default();
        let counts = (
            round.found as u64,
            round.finished as u64,
            round.failed as u64,
        );
        crate::telemetry::completer_round(counts.0, counts.1, counts.2, oldest);
        Ok(round)
    }

    /// What a task needs to finish one key.
    fn finishing(&self) -> Finishing<S> {
        Finishing {
            engine: Arc::clone(&self.engine),
            service: self.service.clone(),
        }
    }
}

/// Counts a key's fate, and notes on its record why it could not be finished.
async fn tally(engine: &Engine, round: &mut Round, record: Option<RecordKey>, fate: Fate) {
    let settings = &engine.settings;
    match fate {
        Fate::Finished => round.finished += 1,
        Fate::Busy => round.busy += 1,
        Fate::Failed(why) => {
            round.failed += 1;
            let Some(record) = record else { return };
            let shown = settings.shown_record(&record);
            tracing::warn!(record = %shown, why, "the completer could not finish a key");
            let noted = async {
                let recovery = settings.store.recovery_for("note_unfinished")?;
                recovery.note_unfinished(&record, &why).await
            };
            if let Err(error) = noted.await {
                tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    "could not note why on the key"
                );
            }
        }
    }
}

/// One key's work: the layer's engine, and the service to resume it through.
struct Finishing<S> {
    engine: Arc<Engine>,
    service: S,
}

impl<S, R> Finishing<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<R>> + Send,
    S::Error: fmt::Display,
{
    async fn finish(self, abandoned: Abandoned) -> Fate {
        // A kept request goes through the service, to its route's layer (and that layer's
        // recovery hook, for a key committed without an answer).
        match (&abandoned.request, abandoned.state) {
            (Some(kept), _) => self.resume(&abandoned, kept).await,
            (None, RecordState::Committed) => answer_committed(&self.engine, &abandoned).await,
            (None, _) => Fate::Failed(
                "no request kept to resume it with: the route keeps none \
                 (IdempotencyLayer::with_kept_requests), or its body was over the limit"
                    .to_owned(),
            ),
        }
    }

    /// A key with a kept request: the request, through the service, with the key's scope and
    /// fingerprint; the layer takes the key over and the handler resumes at its recovery point
    /// (or, for a key committed without an answer, the layer's recovery hook answers).
    async fn resume(mut self, abandoned: &Abandoned, kept: &Bytes) -> Fate {
        let mut request: Request<Full<Bytes>> = match KeptRequest::decode(kept) {
            Ok(request) => request,
            Err(error) => return Fate::Failed(format!("the kept request is unreadable: {error}")),
        };
        let settings = &self.engine.settings;
        let key = HeaderValue::try_from(abandoned.record.key().as_str());
        if let Ok(key) = key {
            request
                .headers_mut()
                .insert(settings.key_header.clone(), key);
        }
        // Held by another attempt: leave it to that one, at once.
        let wait = HeaderValue::from_static("wait=0");
        request
            .headers_mut()
            .insert(http::header::HeaderName::from_static("prefer"), wait);
        request.extensions_mut().insert(Resumption {
            record: Arc::new(abandoned.record.clone()),
            fingerprint: abandoned.fingerprint,
        });
        let service = &mut self.service;
        if let Err(error) =
            std::future::poll_fn(|cx: &mut Context<'_>| service.poll_ready(cx)).await
        {
            return Fate::Failed(format!("the service is not ready: {error}"));
        }
        let response = match tokio::time::timeout(PATIENCE, service.call(request)).await {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => return Fate::Failed(format!("the service failed: {error}")),
            Err(_) => return Fate::Busy,
        };
        let status = response.status();
        match response.extensions().get::<IdempotencyOutcome>() {
            // The handler ran: finished if the key is complete now (the completion policy may
            // have released it, or a fence completed it whatever the status).
            Some(IdempotencyOutcome::Executed) => {
                completed(&self.engine, &abandoned.record, status).await
            }
            Some(IdempotencyOutcome::Replayed) => Fate::Finished,
            Some(IdempotencyOutcome::InFlight) => Fate::Busy,
            Some(outcome) => Fate::Failed(format!("the layer answered {status} ({outcome})")),
            None => Fate::Failed(format!(
                "answered {status} without passing through the idempotency layer: give the \
                 completer the service the layer guards"
            )),
        }
    }
}

/// A key committed without an answer, and no request kept: this layer's recovery hook's
/// answer, stored.
async fn answer_committed(engine: &Engine, abandoned: &Abandoned) -> Fate {
    if engine.settings.recovery.is_none() {
        return Fate::Failed(
            "committed without an answer, and the layer has no recovery hook \
             (IdempotencyLayer::with_recovery)"
                .to_owned(),
        );
    }
    let record = abandoned.record.clone();
    let owner = engine.owner_token();
    let claim = ClaimRequest::new(record, abandoned.fingerprint, owner, engine.settings.lease);
    match protocol::claim_committed(engine, &claim).await {
        Ok(ClaimOutcome::Completed { .. }) => Fate::Finished,
        // The dead owner's grace, or a hook without an answer yet: a later round.
        Ok(ClaimOutcome::InFlight { .. }) => Fate::Busy,
        Ok(ClaimOutcome::Acquired { .. }) => Fate::Failed("expired meanwhile".to_owned()),
        Ok(other) => Fate::Failed(format!("the store answered {}", outcome_name(&other))),
        Err(error) => Fate::Failed(format!("the store failed: {error}")),
    }
}

/// Whether a key whose handler the completer ran is complete now, as the store says.
async fn completed(engine: &Engine, record: &RecordKey, status: http::StatusCode) -> Fate {
    let inspected = async {
        let admin = engine.settings.store.admin_for("inspect")?;
        admin.inspect(record).await
    };
    match inspected.await {
        Ok(Some(info)) if info.state == RecordState::Completed => Fate::Finished,
        Ok(info) => Fate::Failed(format!(
            "the handler answered {status}, and the key is {}: tried again next round",
            info.map_or("gone", |info| info.state.as_str())
        )),
        Err(error) => Fate::Failed(format!("the store could not say how it ended: {error}")),
    }
}

/// A claim's outcome in a few words.
fn outcome_name(outcome: &ClaimOutcome) -> &'static str {
    match outcome {
        ClaimOutcome::Acquired { .. } => "acquired",
        ClaimOutcome::InFlight { .. } => "in flight",
        ClaimOutcome::Completed { .. } => "completed",
        ClaimOutcome::Mismatch => "a different request (mismatch)",
        ClaimOutcome::Orphaned => "outcome unknown",
        _ => "an answer expired",
    }
}

/// A fraction in [0, 1) that differs between processes and rounds.
fn rand_fraction() -> f32 {
    let bits = uuid::Uuid::new_v4().as_u64_pair().0;
    (bits >> 40) as f32 / (1u64 << 24) as f32
}

impl<S: fmt::Debug> fmt::Debug for Completer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completer")
            .field("service", &self.service)
            .field("period", &self.period)
            .field("pace", &self.pace)
            .finish_non_exhaustive()
    }
}
