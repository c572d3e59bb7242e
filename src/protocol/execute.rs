//! Running the handler: its response kept for storing, or streamed when too large; its panics
//! and failures turned into answers.

use std::{
    panic::AssertUnwindSafe,
    pin::{Pin, pin},
    sync::{Arc, atomic::Ordering::Relaxed},
};

use bytes::{Buf, Bytes};
use futures_util::FutureExt;
use http::{HeaderMap, Request, Response, StatusCode, request, response::Parts};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::{sync::mpsc, time::Instant};
use tower_service::Service;

use super::{Caller, Engine, Outcome, Reply};
use crate::{
    IdempotencyClaim, IdempotencyKey, IdempotencyOutcome,
    body::{Chunks, LiveFrame, RequestBody, ResponseBody},
    grpc::Wire,
    headers::varied_request_headers,
    policy::Completion,
    policy::ResponseSummary,
    problem::Rejection,
    response::StoredResponse,
    store::{BoxError, Lease},
};

/// How many response frames may wait for a slow caller before the handler's body is paused.
const RELAY_FRAMES: usize = 16;

/// What running the handler left: the outcome to store, and the answer still owed to the
/// caller, to send once the key is finalized (`None` when the response was streamed already).
pub(super) struct Handled<B, E> {
    pub(super) outcome: Outcome,
    pub(super) answer: Option<(Caller<B, E>, Reply<B, E>)>,
}

/// Runs the handler on the buffered request, with its claim in the extensions; what it left, and
/// the request's headers.
pub(super) async fn execute<S, ReqBody, ResBody>(
    engine: &Engine,
    inner: S,
    parts: request::Parts,
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
    let handled = handle(engine, inner, request, &request_headers, reply, key, wire).await;
    let took = started.elapsed();
    engine.state.durations.record(took);
    engine.telemetry.handler_took(took);
    (handled, request_headers)
}

/// Calls the handler and reads its response. A response within the cache limit is kept whole
/// and answered after finalizing; a larger one streams to the caller as it is produced and is
/// stored without its body. Panics and service errors become a 500 that releases the key.
async fn handle<S, ReqBody, ResBody>(
    engine: &Engine,
    mut inner: S,
    request: Request<RequestBody<ReqBody>>,
    request_headers: &HeaderMap,
    reply: Caller<ResBody, S::Error>,
    key: &IdempotencyKey,
    wire: Wire,
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
            tracing::warn!("handler returned a service error; releasing the key");
            return failed(engine, key, wire, reply, Some(error));
        }
        Err(_panic) => {
            tracing::error!("handler panicked; releasing the key");
            return failed(engine, key, wire, reply, None);
        }
    };
    let (parts, body) = response.into_parts();
    if parts.status == StatusCode::REQUEST_TIMEOUT && wire != Wire::Grpc {
        warn_inner_timeout(engine);
    }
    let hint = body.size_hint();
    let mut body = pin!(body);
    match read_within_limit(engine, body.as_mut()).await {
        Read::Whole { data, trailers } => {
            let (outcome, answer) = stored_whole(engine, parts, request_headers, data, trailers);
            Handled {
                outcome,
                answer: Some((reply, Ok(answer))),
            }
        }
        // Nothing reached the caller yet: it gets a clean 500 instead of a torn body.
        Read::Failed => failed(engine, key, wire, reply, None),
        // Over the cache limit: rare, and a large state of its own, so boxed apart.
        Read::PastLimit(past) => {
            Box::pin(stream_past_limit(engine, parts, hint, body, past, reply)).await
        }
    }
}

/// What reading a response up to the cache limit found.
enum Read {
    /// The whole body, within the limit.
    Whole {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// The body went past the limit.
    PastLimit(PastLimit),
    /// The body failed or panicked.
    Failed,
}

/// What was read of a response when it went past the cache limit.
struct PastLimit {
    read: Chunks,
    overflow: Bytes,
    trailers: Option<HeaderMap>,
    len: usize,
}

/// Reads the response body until its end or the cache limit.
async fn read_within_limit<B>(engine: &Engine, mut body: Pin<&mut B>) -> Read
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = engine.settings.store_rules.max_body;
    let (mut read, mut len, mut trailers) = (Chunks::default(), 0, None);
    loop {
        match next_frame(body.as_mut()).await {
            Next::Data(overflow) if len + overflow.len() > limit => {
                let past = PastLimit {
                    read,
                    overflow,
                    trailers,
                    len,
                };
                return Read::PastLimit(past);
            }
            Next::Data(data) => {
                len += data.len();
                read.push(data);
            }
            Next::Trailers(t) => trailers = Some(t),
            Next::End => {
                let data = read.concat();
                return Read::Whole { data, trailers };
            }
            Next::Failed(_) => return Read::Failed,
        }
    }
}

/// The outcome of a response read whole, and the answer to send its caller.
fn stored_whole<B>(
    engine: &Engine,
    parts: Parts,
    request_headers: &HeaderMap,
    data: Bytes,
    trailers: Option<HeaderMap>,
) -> (Outcome, Response<ResponseBody<B>>) {
    let settings = &engine.settings;
    let completion = settings.policy.decide(&ResponseSummary {
        status: parts.status,
        headers: &parts.headers,
        trailers: trailers.as_ref(),
    });
    let headers = settings.store_rules.headers(&parts.headers);
    let varied = varied_request_headers(&parts.headers, request_headers);
    let stored = StoredResponse::new(parts.status, headers, Some(data.clone()), trailers.clone())
        .with_varied_request_headers(varied);
    let mut answer = Response::from_parts(parts, ResponseBody::full(data, trailers));
    engine.report(IdempotencyOutcome::Executed, &mut answer);
    let outcome = Outcome {
        response: stored,
        completion,
    };
    (outcome, answer)
}

/// Streams a response over the cache limit to the caller as it is produced (what was read, then
/// the rest), and stores its outcome without the body.
async fn stream_past_limit<B, E>(
    engine: &Engine,
    parts: Parts,
    hint: SizeHint,
    body: Pin<&mut B>,
    past: PastLimit,
    reply: Caller<B, E>,
) -> Handled<B, E>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let settings = &engine.settings;
    let status = parts.status;
    let all_headers = parts.headers.clone();
    let headers = settings.store_rules.headers(&parts.headers);
    let (frames, receiver) = mpsc::channel::<LiveFrame>(RELAY_FRAMES);
    let mut head = Response::from_parts(parts, ResponseBody::live(receiver, &hint));
    engine.report(IdempotencyOutcome::Executed, &mut head);
    let _ = reply.send(Ok(head));
    let Some((len, trailers)) = relay_all(body, past, frames).await else {
        engine.telemetry.body_failed();
        let response = StoredResponse::new(status, headers, None, None);
        return without_answer(response, Completion::Release);
    };
    engine.telemetry.response_not_stored();
    tracing::warn!(
        bytes = len,
        limit = settings.store_rules.max_body,
        "response over the cache limit; storing the outcome without its body"
    );
    let completion = settings.policy.decide(&ResponseSummary {
        status,
        headers: &all_headers,
        trailers: trailers.as_ref(),
    });
    without_answer(
        StoredResponse::new(status, headers, None, trailers),
        completion,
    )
}

/// Relays what was read and the rest of the body to the caller: the body's length and
/// trailers, or `None` if it failed (the caller then gets the error in place of the rest).
async fn relay_all<B>(
    mut body: Pin<&mut B>,
    past: PastLimit,
    frames: mpsc::Sender<LiveFrame>,
) -> Option<(usize, Option<HeaderMap>)>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let PastLimit {
        read,
        overflow,
        mut trailers,
        mut len,
    } = past;
    let mut caller = Some(frames);
    for data in read.into_iter().chain([overflow]) {
        len += data.len();
        relay(&mut caller, Ok(Frame::data(data))).await;
    }
    loop {
        match next_frame(body.as_mut()).await {
            Next::Data(data) => {
                len += data.len();
                relay(&mut caller, Ok(Frame::data(data))).await;
            }
            Next::Trailers(t) => {
                trailers = Some(t.clone());
                relay(&mut caller, Ok(Frame::trailers(t))).await;
            }
            Next::End => return Some((len, trailers)),
            Next::Failed(error) => {
                relay(&mut caller, Err(error)).await;
                return None;
            }
        }
    }
}

/// What a handler whose caller has its answer already left to store.
fn without_answer<B, E>(response: StoredResponse, completion: Completion) -> Handled<B, E> {
    Handled {
        outcome: Outcome {
            response,
            completion,
        },
        answer: None,
    }
}

/// A timeout layer inside this one answers 408 and drops (cancels) the handler this layer promised
/// to run to completion; a released key then runs again on every retry. Said once per layer.
fn warn_inner_timeout(engine: &Engine) {
    if !engine.state.warned_inner_timeout.swap(true, Relaxed) {
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
async fn next_frame<B>(mut body: Pin<&mut B>) -> Next
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
                tracing::warn!(
                    error = &*error as &dyn std::error::Error,
                    "handler's response body failed"
                );
                Next::Failed(error)
            }
            Err(_panic) => {
                tracing::error!("handler panicked while producing its body");
                Next::Failed("the handler panicked while producing its body".into())
            }
        };
    }
}

/// A handler that panicked or failed: a 500 problem that releases the key (and is stored if the
/// handler had committed). The caller gets the service's error if there is one, else the problem.
fn failed<B, E>(
    engine: &Engine,
    key: &IdempotencyKey,
    wire: Wire,
    reply: Caller<B, E>,
    error: Option<E>,
) -> Handled<B, E> {
    let answers = &engine.settings.answers;
    let rendered = answers.render(Rejection::HandlerFailed, Some(key), wire);
    let (parts, body) = rendered.into_parts();
    let stored = StoredResponse::new(
        parts.status,
        parts.headers.clone(),
        Some(body.clone()),
        None,
    );
    let answer = match error {
        Some(error) => {
            answers.record(&engine.telemetry, IdempotencyOutcome::HandlerFailed);
            Err(error)
        }
        None => {
            let mut answer = Response::from_parts(parts, ResponseBody::full(body, None));
            engine.report(IdempotencyOutcome::HandlerFailed, &mut answer);
            Ok(answer)
        }
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
    if let Some(sender) = caller
        && sender.send(frame).await.is_err()
    {
        *caller = None;
    }
}
