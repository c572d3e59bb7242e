//! One guarded request, from its body to its finalized key. Runs in a task of its own.

use std::{
    convert::Infallible,
    future::Future,
    ops::ControlFlow,
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    sync::Arc,
    time::Duration,
};

use bytes::{Buf, Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, LengthLimitError};
use tokio::sync::{mpsc, oneshot};
use tower_service::Service;
use uuid::Uuid;

use crate::{
    Completion, Fingerprint, IdempotencyClaim, IdempotencyKey, StoredResponse,
    body::{LiveFrame, RequestBody, ResponseBody},
    fingerprint::FingerprintHasher,
    future::Reply,
    layer::Config,
    policy::{ResponseSummary, is_grpc},
    problem::Rejection,
    store::{BoxError, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, StoreError},
};

/// The header that marks a replayed response.
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// How many response frames may wait for a slow caller before the handler's body is paused.
const RELAY_FRAMES: usize = 16;

/// Attempts at finalizing a key before giving up (its lease then frees it).
const FINALIZE_ATTEMPTS: u32 = 3;

/// Where the answer to the caller goes.
type Caller<B, E> = oneshot::Sender<Reply<B, E>>;

/// What the handler's run left to store.
struct Outcome {
    response: StoredResponse,
    completion: Completion,
}

/// Runs one guarded request: buffer and fingerprint, claim, run the handler while renewing the
/// lease, finalize the key, then answer.
pub(crate) async fn run<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    record: RecordKey,
    request: Request<ReqBody>,
    reply: Caller<ResBody, S::Error>,
) where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let grpc = is_grpc(request.headers());
    let (parts, body) = request.into_parts();
    let (body, fingerprint) = match read_body(&config, &parts, body).await {
        Ok(read) => read,
        Err(rejection) => {
            let _ = reply.send(Ok(respond(&config, rejection, Some(record.key()), grpc)));
            return;
        }
    };
    let claim = ClaimRequest::new(record, fingerprint, Uuid::new_v4(), config.lease);
    let outcome = config.store.claim(&claim).await;
    let fence = match fence_or_answer(&config, claim.record(), &parts.headers, outcome, grpc) {
        ControlFlow::Continue(fence) => fence,
        ControlFlow::Break(answer) => {
            let _ = reply.send(Ok(answer));
            return;
        }
    };
    config.metrics.add(|m| &m.executions);
    let lease = claim.lease_with_fence(fence);
    tracing::debug!(record = %lease.record(), fence, owner = %lease.owner(), "claimed; running handler");

    // The response may vary on request headers (`Vary`): keep them to store with it.
    let request_headers = parts.headers.clone();
    let mut request = Request::from_parts(parts, RequestBody::buffered(body));
    request
        .extensions_mut()
        .insert(IdempotencyClaim::new(lease.clone(), config.retention));
    let handled = {
        let work = pin!(handle(
            &config,
            inner,
            request,
            &request_headers,
            reply,
            lease.record().key(),
            grpc
        ));
        let renewal = pin!(keep_lease(&config, &lease));
        tokio::select! {
            biased;
            handled = work => handled,
            never = renewal => match never {},
        }
    };
    finalize(&config, &lease, handled.outcome).await;
    // Answered only now, so that a caller who has its answer finds the key final: a retry sent
    // the moment it arrives is replayed (or runs again, if released), never refused as in flight.
    if let Some((reply, answer)) = handled.answer {
        let _ = reply.send(answer);
    }
}

/// The fence of an acquired claim, or the answer that replaces running the handler: a replay,
/// or why not.
fn fence_or_answer<B>(
    config: &Config,
    record: &RecordKey,
    request_headers: &HeaderMap,
    outcome: Result<ClaimOutcome, StoreError>,
    grpc: bool,
) -> ControlFlow<Response<ResponseBody<B>>, u64> {
    let rejection = match outcome {
        Ok(ClaimOutcome::Acquired { fence }) => return ControlFlow::Continue(fence),
        Ok(ClaimOutcome::Completed { response, .. }) if response.body().is_some() => {
            match vary_mismatch(&response, request_headers) {
                None => {
                    tracing::debug!(record = %record, "replaying stored response");
                    config.metrics.add(|m| &m.replays);
                    return ControlFlow::Break(replay(*response));
                }
                Some(headers) => Rejection::NotAcceptable { headers },
            }
        }
        Ok(ClaimOutcome::Completed { response, .. }) => Rejection::ResponseNotStored {
            status: response.status(),
        },
        Ok(ClaimOutcome::InFlight { retry_after }) => Rejection::InFlight { retry_after },
        Ok(ClaimOutcome::Mismatch) => Rejection::Mismatch,
        Ok(ClaimOutcome::Orphaned) => {
            tracing::warn!(record = %record, "key committed but its response was lost");
            Rejection::OutcomeUnknown
        }
        Err(error) => {
            tracing::error!(record = %record, error = %Chain(&error), "claim failed; handler not run");
            Rejection::StoreUnavailable
        }
    };
    ControlFlow::Break(respond(config, rejection, Some(record.key()), grpc))
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

/// Buffers a guarded request body, up to the size and time limits, and fingerprints the request
/// (hashing the body as it arrives, unless a hook must see all of it).
async fn read_body<B>(
    config: &Config,
    parts: &http::request::Parts,
    body: B,
) -> Result<(Bytes, Fingerprint), Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = config.max_request_body;
    // A declared length over the limit is refused before a byte is read.
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::BodyTooLarge { limit: Some(limit) });
    }
    let mut hasher = FingerprintHasher::new(parts, &config.fingerprint_headers);
    let hashing = config.fingerprint_body.is_none();
    let mut chunks = Vec::new();
    let mut len = 0;
    let read = async {
        let mut body = pin!(body);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|error| {
                let error: BoxError = error.into();
                if caused_by::<LengthLimitError>(&*error) {
                    // A limit outside this layer (tower-http's RequestBodyLimitLayer, say).
                    Rejection::BodyTooLarge { limit: None }
                } else {
                    tracing::debug!(error = %Chain(&*error), "request body failed");
                    Rejection::BodyUnreadable
                }
            })?;
            if let Ok(mut data) = frame.into_data() {
                let data = data.copy_to_bytes(data.remaining());
                len += data.len();
                if len > limit {
                    return Err(Rejection::BodyTooLarge { limit: Some(limit) });
                }
                if hashing {
                    hasher.update(&data);
                }
                chunks.push(data);
            }
        }
        Ok(())
    };
    let timeout = config.request_body_timeout;
    match tokio::time::timeout(timeout, read).await {
        Ok(read) => read?,
        Err(_elapsed) => return Err(Rejection::BodyTimeout { after: timeout }),
    }
    let body = concat(chunks);
    let fingerprint = match &config.fingerprint_body {
        None => hasher.finish(),
        Some(hook) => {
            let mut hasher = FingerprintHasher::new(parts, &config.fingerprint_headers);
            hasher.update(&hook(parts, &body));
            hasher.finish()
        }
    };
    Ok((body, fingerprint))
}

/// Whether `error`, or any error in its chain of sources, is an `E`.
fn caused_by<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<E>() {
            return true;
        }
        next = error.source();
    }
    false
}

/// What running the handler left: the outcome to store, and the answer still owed to the
/// caller, to send once the key is finalized (`None` when the response was streamed already).
struct Handled<B, E> {
    outcome: Outcome,
    answer: Option<(Caller<B, E>, Reply<B, E>)>,
}

/// Calls the handler and reads its response. A response within the cache limit is kept whole
/// and answered after finalizing; a larger one streams to the caller as it is produced and is
/// stored without its body. Panics and service errors become a 500 that releases the key.
async fn handle<S, ReqBody, ResBody>(
    config: &Config,
    mut inner: S,
    request: Request<RequestBody<ReqBody>>,
    request_headers: &HeaderMap,
    reply: Caller<ResBody, S::Error>,
    key: &IdempotencyKey,
    grpc: bool,
) -> Handled<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    // The call itself runs inside the guarded future, so a panic in `call` is caught too.
    let called = AssertUnwindSafe(async { inner.call(request).await })
        .catch_unwind()
        .await;
    let response = match called {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            tracing::warn!(key = %key, "handler returned a service error; releasing the key");
            return failed(config, key, grpc, reply, Some(error));
        }
        Err(_panic) => {
            tracing::error!(key = %key, "handler panicked; releasing the key");
            return failed(config, key, grpc, reply, None);
        }
    };

    let (parts, body) = response.into_parts();
    if parts.status == StatusCode::REQUEST_TIMEOUT && !grpc {
        warn_inner_timeout(config);
    }
    let mut headers = HeaderMap::with_capacity(parts.headers.len());
    for (name, value) in &parts.headers {
        if config.stores_header(name) {
            headers.append(name, value.clone());
        }
    }
    let mut varied = HeaderMap::new();
    for name in vary_names(&parts.headers) {
        for value in request_headers.get_all(&name) {
            varied.append(name.clone(), value.clone());
        }
    }
    let hint = body.size_hint();
    let mut body = pin!(body);
    let mut chunks = Vec::new();
    let mut len = 0;
    let mut trailers = None;
    let overflow = loop {
        match next_frame(body.as_mut(), key).await {
            Next::Data(data) if len + data.len() > config.max_response_body => break data,
            Next::Data(data) => {
                len += data.len();
                chunks.push(data);
            }
            Next::Trailers(t) => trailers = Some(t),
            Next::End => {
                let data = concat(chunks);
                let completion = config.policy.decide(&ResponseSummary {
                    status: parts.status,
                    headers: &parts.headers,
                    trailers: trailers.as_ref(),
                });
                let stored = StoredResponse::new(
                    parts.status,
                    headers,
                    Some(data.clone()),
                    trailers.clone(),
                )
                .with_varied_request_headers(varied);
                let answer = Response::from_parts(parts, ResponseBody::full(data, trailers));
                return Handled {
                    outcome: Outcome {
                        response: stored,
                        completion,
                    },
                    answer: Some((reply, Ok(answer))),
                };
            }
            // Nothing reached the caller yet: it gets a clean 500 instead of a torn body.
            Next::Failed(_) => return failed(config, key, grpc, reply, None),
        }
    };

    // Over the cache limit: stream what was read and the rest, and store the outcome bodiless.
    let (frames, receiver) = mpsc::channel::<LiveFrame>(RELAY_FRAMES);
    let (status, all_headers) = (parts.status, parts.headers.clone());
    let _ = reply.send(Ok(Response::from_parts(
        parts,
        ResponseBody::live(receiver, &hint),
    )));
    let mut caller = Some(frames);
    for data in chunks.into_iter().chain([overflow]) {
        len += data.len();
        relay(&mut caller, Ok(Frame::data(data))).await;
    }
    loop {
        match next_frame(body.as_mut(), key).await {
            Next::Data(data) => {
                len += data.len();
                relay(&mut caller, Ok(Frame::data(data))).await;
            }
            Next::Trailers(t) => {
                trailers = Some(t.clone());
                relay(&mut caller, Ok(Frame::trailers(t))).await;
            }
            Next::End => break,
            Next::Failed(error) => {
                relay(&mut caller, Err(error)).await;
                config.metrics.add(|m| &m.handler_failures);
                return Handled {
                    outcome: Outcome {
                        response: StoredResponse::new(status, headers, None, None),
                        completion: Completion::Release,
                    },
                    answer: None,
                };
            }
        }
    }
    config.metrics.add(|m| &m.responses_not_stored);
    tracing::warn!(key = %key, bytes = len, limit = config.max_response_body, "response over the cache limit; storing the outcome without its body");
    let completion = config.policy.decide(&ResponseSummary {
        status,
        headers: &all_headers,
        trailers: trailers.as_ref(),
    });
    Handled {
        outcome: Outcome {
            response: StoredResponse::new(status, headers, None, trailers),
            completion,
        },
        answer: None,
    }
}

/// A timeout layer inside this one answers 408 and drops (cancels) the handler this layer promised
/// to run to completion; a released key then runs again on every retry. Said once per layer.
fn warn_inner_timeout(config: &Config) {
    if !config
        .shared
        .warned_inner_timeout
        .swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            "the inner service answered 408 Request Timeout: if a timeout layer sits inside \
             IdempotencyLayer it cancels handlers mid-way and every retry starts them again; \
             install it outside (see \"Composing with other layers\")"
        );
    }
}

/// One step of reading the handler's response body.
enum Next {
    Data(Bytes),
    Trailers(HeaderMap),
    End,
    Failed(BoxError),
}

/// Reads the next data or trailers frame, catching a panic of the body.
async fn next_frame<B>(mut body: Pin<&mut B>, key: &IdempotencyKey) -> Next
where
    B: Body,
    B::Error: Into<BoxError>,
{
    loop {
        let polled = AssertUnwindSafe(body.as_mut().frame()).catch_unwind().await;
        return match polled {
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(mut data) => Next::Data(data.copy_to_bytes(data.remaining())),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => Next::Trailers(trailers),
                    // A frame kind this crate does not know: nothing to store or relay.
                    Err(_) => continue,
                },
            },
            Ok(None) => Next::End,
            Ok(Some(Err(error))) => {
                let error: BoxError = error.into();
                tracing::warn!(key = %key, error = %error, "handler's response body failed");
                Next::Failed(error)
            }
            Err(_panic) => {
                tracing::error!(key = %key, "handler panicked while producing its body");
                Next::Failed("the handler panicked while producing its body".into())
            }
        };
    }
}

/// A handler that panicked or failed: a 500 problem that releases the key (and is stored if the
/// handler had committed). The caller gets the service's error if there is one, else the problem.
fn failed<B, E>(
    config: &Config,
    key: &IdempotencyKey,
    grpc: bool,
    reply: Caller<B, E>,
    error: Option<E>,
) -> Handled<B, E> {
    config.metrics.add(|m| &m.handler_failures);
    let (parts, body) = render(config, Rejection::HandlerFailed, Some(key), grpc).into_parts();
    let stored = StoredResponse::new(
        parts.status,
        parts.headers.clone(),
        Some(body.clone()),
        None,
    );
    let answer = match error {
        Some(error) => Err(error),
        None => Ok(Response::from_parts(parts, ResponseBody::full(body, None))),
    };
    Handled {
        outcome: Outcome {
            response: stored,
            completion: Completion::Release,
        },
        answer: Some((reply, answer)),
    }
}

/// Sends a frame to the caller, forgetting the caller once it has gone.
async fn relay(caller: &mut Option<mpsc::Sender<LiveFrame>>, frame: LiveFrame) {
    if let Some(sender) = caller {
        if sender.send(frame).await.is_err() {
            *caller = None;
        }
    }
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    match <[Bytes; 1]>::try_from(chunks) {
        Ok([single]) => single,
        Err(chunks) => {
            let mut all = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
            chunks.iter().for_each(|c| all.extend_from_slice(c));
            all.freeze()
        }
    }
}

/// Renews the lease every third of its length while the handler runs. Never returns.
async fn keep_lease(config: &Config, lease: &Lease) -> Infallible {
    // A zero lease would make this loop spin.
    let period = (config.lease / 3).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(period).await;
        match config.store.renew(lease, config.lease).await {
            Ok(Ownership::Held) => {}
            Ok(_) => {
                config.metrics.add(|m| &m.leases_lost);
                tracing::warn!(record = %lease.record(), owner = %lease.owner(), "lease lost while the handler runs; its outcome will not be stored");
                return std::future::pending().await;
            }
            Err(error) => {
                tracing::warn!(record = %lease.record(), error = %Chain(&error), "lease renewal failed; retrying");
            }
        }
    }
}

/// Completes or releases the key, owner-checked; a committed key is completed whatever the policy.
async fn finalize(config: &Config, lease: &Lease, outcome: Outcome) {
    let store = &config.store;
    let complete = || store.complete(lease, &outcome.response, config.retention);
    let result = match outcome.completion {
        Completion::Complete => retrying(lease, complete).await,
        Completion::Release => match retrying(lease, || store.release(lease)).await {
            Ok(Ownership::Committed) => retrying(lease, complete).await,
            Ok(Ownership::Held) => {
                config.metrics.add(|m| &m.releases);
                tracing::debug!(record = %lease.record(), "key released");
                return;
            }
            other => other,
        },
    };
    match result {
        Ok(Ownership::Held) => {
            config.metrics.add(|m| &m.completions);
            tracing::debug!(record = %lease.record(), status = outcome.response.status().as_u16(), "key completed");
        }
        Ok(_) => {
            config.metrics.add(|m| &m.leases_lost);
            tracing::warn!(record = %lease.record(), owner = %lease.owner(), fence = lease.fence(), "lease lost before finalizing: nothing stored (another attempt holds the key)");
        }
        Err(error) => {
            config.metrics.add(|m| &m.finalize_errors);
            tracing::error!(record = %lease.record(), error = %Chain(&error), "could not finalize; the key frees itself when its lease ends");
        }
    }
}

/// Retries a finalizing write on store errors, with a short backoff, within the lease.
async fn retrying<F, Fut>(lease: &Lease, mut write: F) -> Result<Ownership, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Ownership, StoreError>>,
{
    let mut delay = Duration::from_millis(50);
    let mut attempt = 1;
    loop {
        match write().await {
            Err(error) if attempt < FINALIZE_ATTEMPTS => {
                tracing::warn!(record = %lease.record(), attempt, error = %Chain(&error), "finalize failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 4;
                attempt += 1;
            }
            result => return result,
        }
    }
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
    render(config, rejection, key, grpc).map(|body| ResponseBody::full(body, None))
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

/// Displays an error with its chain of sources: "a: b: c".
struct Chain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(error) = source {
            write!(f, ": {error}")?;
            source = error.source();
        }
        Ok(())
    }
}
