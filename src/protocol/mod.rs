//! One guarded request, from its body to its finalized key. Runs in a task of its own.

mod handle;
mod lease;
mod read;
mod wait;

use std::{
    ops::ControlFlow,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, header};
use http_body::Body;
use tokio::{sync::oneshot, time::Instant};
use tower_service::Service;
use uuid::Uuid;

pub(crate) use self::{
    lease::Leases,
    wait::{Durations, Waiters},
};
use self::{
    lease::{Finalized, Keeper},
    wait::Backoff,
};
use crate::{
    Completion, IdempotencyClaim, IdempotencyKey, IdempotencyOutcome, StoredResponse,
    body::{RequestBody, ResponseBody},
    future::Reply,
    layer::Config,
    policy::is_grpc,
    problem::Rejection,
    store::{BoxError, ClaimOutcome, ClaimRequest, RecordKey, StoreError},
    telemetry,
};

/// The header that marks a replayed response.
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// Where the answer to the caller goes.
type Caller<B, E> = oneshot::Sender<Reply<B, E>>;

/// What the handler's run left to store.
struct Outcome {
    response: StoredResponse,
    completion: Completion,
}

/// Runs one guarded request: buffer and fingerprint, claim (waiting for a duplicate in flight),
/// run the handler while another task renews the lease, finalize the key, then answer.
pub(crate) async fn run<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    record: RecordKey,
    request: Request<ReqBody>,
    mut reply: Caller<ResBody, S::Error>,
) where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let grpc = is_grpc(request.headers());
    let (parts, body) = request.into_parts();
    let (body, fingerprint) = match read::read_body(&config, &parts, body).await {
        Ok(read) => read,
        Err(rejection) => {
            let _ = reply.send(Ok(respond(&config, rejection, Some(record.key()), grpc)));
            return;
        }
    };
    let claim = ClaimRequest::new(record, fingerprint, owner_token(), config.lease);
    let wait = wait_budget(&config, &parts.headers);
    let fence = match claim_or_answer(&config, &claim, &parts.headers, wait, grpc, &mut reply).await
    {
        ControlFlow::Continue(fence) => fence,
        ControlFlow::Break(answer) => {
            if let Some(answer) = answer {
                let _ = reply.send(Ok(answer));
            }
            return;
        }
    };
    config.metrics.add(|m| &m.executions);
    let lease = claim.lease_with_fence(fence);
    tracing::Span::current().record("fence", fence);
    tracing::debug!(owner = %lease.owner(), "claimed; running handler");
    let keeper = Keeper::start(Arc::clone(&config), lease.clone()).await;

    // The response may vary on request headers (`Vary`): keep them to store with it.
    let request_headers = parts.headers.clone();
    let mut request = Request::from_parts(parts, RequestBody::buffered(body));
    request.extensions_mut().insert(IdempotencyClaim::granted(
        lease.clone(),
        config.retention,
        config.lease,
        Arc::clone(&config.store_rules),
    ));
    let started = Instant::now();
    let handled = handle::handle(
        &config,
        inner,
        request,
        &request_headers,
        reply,
        lease.record().key(),
        grpc,
    )
    .await;
    let took = started.elapsed();
    config.shared.durations.record(took);
    telemetry::handler_took(config.store.kind(), took);
    let Outcome {
        response,
        completion,
    } = handled.outcome;
    let mut finalized = lease::finalize(&config, &lease, &response, completion).await;
    // Answered only now, so that a caller who has its answer finds the key final: a retry sent
    // the moment it arrives is replayed (or runs again, if released), never refused as in
    // flight. If the store keeps failing, the caller is answered anyway and the write goes on
    // with the key held.
    if let Some((reply, answer)) = handled.answer {
        let _ = reply.send(answer);
    }
    if let Finalized::Failing = finalized {
        finalized = Box::pin(lease::finalize_later(
            &config, &lease, &response, completion, &keeper,
        ))
        .await;
    }
    drop(keeper);
    if let Finalized::Done = finalized {
        config.shared.waiters.wake(lease.record());
    }
}

/// A fresh owner token, unique across the fleet without a system call per request: 64 random
/// bits drawn once per process, and a counter.
fn owner_token() -> Uuid {
    static PROCESS: LazyLock<u64> = LazyLock::new(|| Uuid::new_v4().as_u64_pair().0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    Uuid::from_u64_pair(*PROCESS, COUNTER.fetch_add(1, Relaxed))
}

/// How long a duplicate may wait for the first request with its key: the layer's budget, within
/// the deadline a gRPC caller announced (`grpc-timeout`).
fn wait_budget(config: &Config, headers: &HeaderMap) -> Duration {
    match headers
        .get("grpc-timeout")
        .and_then(|v| grpc_timeout(v.as_bytes()))
    {
        // Leave the caller a fifth of its deadline to read the answer.
        Some(deadline) => config.wait.min(deadline * 4 / 5),
        None => config.wait,
    }
}

/// Parses a `grpc-timeout` value: up to eight digits and a unit (H, M, S, m, u, n).
fn grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Claims the key, waiting (up to `wait`) while another request holds it: the fence of an
/// acquired claim, or the answer that replaces running the handler (a replay, or why not), or
/// nothing when the caller left while waiting.
///
/// A request of this process that holds the key wakes its waiters when it finalizes; one on
/// another instance is noticed by polling the store, after 10 ms, then twice as long each time
/// up to 200 ms.
async fn claim_or_answer<B, E>(
    config: &Config,
    claim: &ClaimRequest,
    request_headers: &HeaderMap,
    wait: Duration,
    grpc: bool,
    reply: &mut Caller<B, E>,
) -> ControlFlow<Option<Response<ResponseBody<B>>>, u64> {
    let kind = config.store.kind();
    let outcome = telemetry::timed("claim", kind, config.store.claim(claim)).await;
    match outcome {
        // Waiting is rare, and its state large: boxed apart.
        Ok(ClaimOutcome::InFlight { .. }) => {
            Box::pin(wait_for_the_first(
                config,
                claim,
                request_headers,
                wait,
                grpc,
                reply,
                outcome,
            ))
            .await
        }
        other => answer(config, claim.record(), request_headers, other, grpc),
    }
}

/// The wait of [`claim_or_answer`] for a key found in flight.
async fn wait_for_the_first<B, E>(
    config: &Config,
    claim: &ClaimRequest,
    request_headers: &HeaderMap,
    wait: Duration,
    grpc: bool,
    reply: &mut Caller<B, E>,
    mut outcome: Result<ClaimOutcome, StoreError>,
) -> ControlFlow<Option<Response<ResponseBody<B>>>, u64> {
    let deadline = Instant::now() + wait;
    let mut watch = None;
    let (prefix, count) = claim.owner().as_u64_pair();
    let mut backoff = Backoff::new(prefix ^ count.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    loop {
        let lease_left = match outcome {
            Ok(ClaimOutcome::InFlight { retry_after }) => retry_after,
            other => return answer(config, claim.record(), request_headers, other, grpc),
        };
        if reply.is_closed() {
            return ControlFlow::Break(None);
        }
        let now = Instant::now();
        if now >= deadline {
            let retry_after = config.shared.durations.retry_after(lease_left);
            let rejection = Rejection::InFlight { retry_after };
            return ControlFlow::Break(Some(respond(
                config,
                rejection,
                Some(claim.record().key()),
                grpc,
            )));
        }
        let watch = watch.get_or_insert_with(|| {
            config.metrics.add(|m| &m.waits);
            telemetry::count("idempotency_waits_total");
            config.shared.waiters.watch(claim.record())
        });
        tokio::select! {
            () = watch.notify().notified() => {}
            () = tokio::time::sleep(backoff.pause().min(deadline - now)) => {}
            () = reply.closed() => return ControlFlow::Break(None),
        }
        outcome = telemetry::timed("claim", config.store.kind(), config.store.claim(claim)).await;
    }
}

/// The fence of an acquired claim, or the answer that replaces running the handler.
fn answer<B>(
    config: &Config,
    record: &RecordKey,
    request_headers: &HeaderMap,
    outcome: Result<ClaimOutcome, StoreError>,
    grpc: bool,
) -> ControlFlow<Option<Response<ResponseBody<B>>>, u64> {
    let rejection = match outcome {
        Ok(ClaimOutcome::Acquired { fence }) => return ControlFlow::Continue(fence),
        Ok(ClaimOutcome::Completed { response, .. }) if response.body().is_some() => {
            match vary_mismatch(&response, request_headers) {
                None => {
                    config.metrics.add(|m| &m.replays);
                    let mut response = replay(*response);
                    report(config, IdempotencyOutcome::Replayed, &mut response);
                    return ControlFlow::Break(Some(response));
                }
                Some(headers) => Rejection::NotAcceptable { headers },
            }
        }
        Ok(ClaimOutcome::Completed { response, .. }) => Rejection::ResponseNotStored {
            status: response.status(),
        },
        Ok(ClaimOutcome::InFlight { retry_after }) => Rejection::InFlight {
            retry_after: config.shared.durations.retry_after(retry_after),
        },
        Ok(ClaimOutcome::Mismatch) => Rejection::Mismatch,
        Ok(ClaimOutcome::Orphaned) => {
            tracing::warn!("key committed but its response was lost");
            Rejection::OutcomeUnknown
        }
        Err(error) => {
            tracing::error!(
                error = &error as &dyn std::error::Error,
                "claim failed; handler not run"
            );
            Rejection::StoreUnavailable
        }
    };
    ControlFlow::Break(Some(respond(config, rejection, Some(record.key()), grpc)))
}

/// The names of the request headers the stored response varies on that this request sends
/// differently, if any: such a retry must not receive a body negotiated for another request.
fn vary_mismatch(stored: &StoredResponse, request: &HeaderMap) -> Option<Vec<HeaderName>> {
    let differing: Vec<HeaderName> = vary_names(stored.headers())
        .filter(|name| {
            !request
                .get_all(name)
                .iter()
                .eq(stored.varied_request_headers().get_all(name))
        })
        .collect();
    (!differing.is_empty()).then_some(differing)
}

/// The request header names a response's `Vary` headers list (`*` names none in particular).
fn vary_names(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(header::VARY)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|list| list.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
}

/// A stored response, as replayed.
fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let (status, mut headers, body, trailers) = stored.into_parts();
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ResponseBody::full(body.unwrap_or_default(), trailers));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// The layer's own answer, counted.
pub(crate) fn respond<B>(
    config: &Config,
    rejection: Rejection,
    key: Option<&IdempotencyKey>,
    grpc: bool,
) -> Response<ResponseBody<B>> {
    config.metrics.add(|m| match rejection {
        Rejection::InvalidKey(_)
        | Rejection::MissingKey
        | Rejection::BodyUnreadable
        | Rejection::BodyTimeout { .. } => &m.bad_requests,
        Rejection::BodyTooLarge { .. } => &m.too_large,
        Rejection::Mismatch | Rejection::NotAcceptable { .. } => &m.mismatches,
        Rejection::InFlight { .. } | Rejection::OutcomeUnknown => &m.in_flight,
        Rejection::ResponseNotStored { .. } => &m.replays,
        Rejection::StoreUnavailable => &m.store_unavailable,
        Rejection::HandlerFailed | Rejection::NoScope => &m.handler_failures,
    });
    let outcome = rejection.outcome();
    let mut response =
        render(config, rejection, key, grpc).map(|body| ResponseBody::full(body, None));
    report(config, outcome, &mut response);
    response
}

/// Tells the outside what the layer did with a request: the span's `outcome`, the metrics, an
/// event when the layer answered instead of the handler, and the response's extension.
pub(crate) fn report<B>(config: &Config, outcome: IdempotencyOutcome, response: &mut Response<B>) {
    tracing::Span::current().record("outcome", outcome.as_str());
    telemetry::answered(outcome, config.store.kind());
    if outcome.answered_by_layer() {
        let status = response.status().as_u16();
        let message = "answered instead of the handler";
        match config.answer_level {
            tracing::Level::ERROR => tracing::error!(%outcome, status, "{message}"),
            tracing::Level::WARN => tracing::warn!(%outcome, status, "{message}"),
            tracing::Level::INFO => tracing::info!(%outcome, status, "{message}"),
            tracing::Level::DEBUG => tracing::debug!(%outcome, status, "{message}"),
            tracing::Level::TRACE => tracing::trace!(%outcome, status, "{message}"),
        }
    }
    response.extensions_mut().insert(outcome);
}

/// The layer's own answer, rendered for its caller: a gRPC status, or the problem through the
/// configured hook.
fn render(
    config: &Config,
    rejection: Rejection,
    key: Option<&IdempotencyKey>,
    grpc: bool,
) -> Response<Bytes> {
    let problem = rejection.problem(key);
    match &config.problem_response {
        _ if grpc => problem.to_grpc_response(),
        Some(hook) => hook(&problem),
        None => problem.to_response(),
    }
}
