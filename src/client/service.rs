//! The client service: one logical call, its attempts, and what it tells the caller.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, request::Parts};
use http_body::Body;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_service::Service;
use tracing::Instrument;

use super::{
    CallError, CallStarted, ClientError, ClientOutcome, ProtectionEnded,
    body::{self, ClientBody, ClientResponseBody, Read},
    layer::ClientSettings,
    verdict::{self, Verdict},
};
use crate::{grpc::Wire, headers::IDEMPOTENT_REPLAYED, store::BoxError};

/// Middleware that sends one idempotency key per logical call on every attempt, and retries
/// what is safe to retry. Built by [`IdempotencyClientLayer`](super::IdempotencyClientLayer).
#[derive(Clone)]
pub struct IdempotencyClient<S> {
    inner: S,
    settings: Arc<ClientSettings>,
}

/// The future of a call through [`IdempotencyClient`].
pub type ClientFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

impl<S> IdempotencyClient<S> {
    pub(crate) fn new(inner: S, settings: Arc<ClientSettings>) -> Self {
        Self { inner, settings }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyClient<S>
where
    S: Service<Request<ClientBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ClientResponseBody<ResBody>>;
    type Error = BoxError;
    type Future = ClientFuture<Self::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service driven to readiness is the one called (tower-service's "Be careful when
        // cloning inner services"); a clone stays here.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let settings = Arc::clone(&self.settings);
        Box::pin(call(settings, inner, request))
    }
}

/// One logical call: a key, the body buffered, attempts until a final answer, the attempts,
/// the deadline or the budget run out.
async fn call<S, B, ResBody>(
    settings: Arc<ClientSettings>,
    mut inner: S,
    request: Request<B>,
) -> Result<Response<ClientResponseBody<ResBody>>, BoxError>
where
    S: Service<Request<ClientBody<B>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body + Unpin,
    B::Error: Into<BoxError>,
    ResBody: Body + Unpin,
    ResBody::Error: Into<BoxError>,
{
    let (mut parts, body) = request.into_parts();
    if !settings.methods.contains(&parts.method) {
        let request = Request::from_parts(parts, ClientBody::once(body));
        let answer = inner.call(request).await.map_err(Into::into)?;
        return Ok(answer.map(ClientResponseBody::live));
    }
    let key = ensure_key(&settings, &mut parts);
    let started = match started(&settings, &parts) {
        Ok(started) => started,
        Err((started, protection)) => {
            tracing::debug!("a call resumed past its key's protection: not sent");
            return Err(ProtectionEnded::new(key, (0, started), protection, None).into());
        }
    };
    let shown = crate::telemetry::Pseudonym {
        value: &key,
        clear: false,
    };
    let span =
        tracing::debug_span!("idempotency_client", key = %shown, attempts = tracing::field::Empty);
    let call = async {
        let body = match body::read(body, settings.max_body).await {
            Ok(Read::Whole(bytes)) => bytes,
            Ok(Read::TooLarge(body)) => {
                tracing::debug!("request body over the buffer limit: sent once, not retried");
                let answer = inner.call(Request::from_parts(parts, body)).await;
                let answer = answer.map(|response| response.map(ClientResponseBody::live));
                return (answer.map_err(Into::into), 1, None);
            }
            Err(error) => return (Err(error), 0, None),
        };
        Retrying::new(&settings, parts, body, started)
            .run(&mut inner)
            .await
    };
    let (answer, attempts, ended) = call.instrument(span).await;
    match (answer, ended) {
        (Err(error), Some(protection)) => {
            let ended = ProtectionEnded::new(key, (attempts, started), protection, Some(error));
            Err(ended.into())
        }
        (answer, _) => finish(answer, attempts)
            .map_err(|error| CallError::new(key, (attempts, started), error).into()),
    }
}

/// When the call started: now, or the [`CallStarted`] it resumes with; or, for a call resumed
/// past its key's protection, that start and the protection.
fn started(settings: &ClientSettings, parts: &Parts) -> Result<SystemTime, (SystemTime, Duration)> {
    let Some(&CallStarted(started)) = parts.extensions.get() else {
        return Ok(SystemTime::now());
    };
    match settings.protection(&parts.uri) {
        Some(protection) if past(started, protection, Duration::ZERO) => Err((started, protection)),
        _ => Ok(started),
    }
}

/// Whether a call that started at `started` is past a key's `protection` at `after` from now.
fn past(started: SystemTime, protection: Duration, after: Duration) -> bool {
    let at = SystemTime::now() + after;
    at.duration_since(started).unwrap_or_default() >= protection
}

/// The key of this logical call: the caller's, or a fresh random one.
fn ensure_key(settings: &ClientSettings, parts: &mut Parts) -> String {
    if let Some(key) = parts.headers.get(&settings.key_header)
        && let Ok(key) = key.to_str()
    {
        return key.to_owned();
    }
    let key = settings.uuid().to_string();
    let value = HeaderValue::from_str(&key).expect("a UUID is a valid header value");
    parts.headers.insert(settings.key_header.clone(), value);
    key
}

/// The attempts of one logical call with a buffered body.
struct Retrying<'a> {
    settings: &'a ClientSettings,
    /// The request head; its extensions go with the first attempt only.
    parts: Option<Parts>,
    head: (http::Method, http::Uri, http::Version, http::HeaderMap),
    body: Bytes,
    wire: Wire,
    deadline: Instant,
    random: u64,
    /// When the logical call started, for the key's protection.
    started: SystemTime,
    /// The key's protection, once retries stopped because the next would start past it.
    ended: Option<Duration>,
}

impl<'a> Retrying<'a> {
    fn new(settings: &'a ClientSettings, parts: Parts, body: Bytes, started: SystemTime) -> Self {
        let head = (
            parts.method.clone(),
            parts.uri.clone(),
            parts.version,
            parts.headers.clone(),
        );
        Self {
            settings,
            wire: Wire::of(&parts.headers),
            parts: Some(parts),
            head,
            body,
            deadline: Instant::now() + settings.deadline,
            random: {
                let (high, low) = settings.uuid().as_u64_pair();
                (high ^ low.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1
            },
            started,
            ended: None,
        }
    }

    /// The attempts until the answer for the caller: that answer, how many were made, and the
    /// key's protection if it is why they stopped.
    async fn run<S, B, ResBody>(
        mut self,
        inner: &mut S,
    ) -> (
        Result<Response<ClientResponseBody<ResBody>>, BoxError>,
        u32,
        Option<Duration>,
    )
    where
        S: Service<Request<ClientBody<B>>, Response = Response<ResBody>>,
        S::Error: Into<BoxError>,
        ResBody: Body + Unpin,
        ResBody::Error: Into<BoxError>,
    {
        self.settings.budget.deposit();
        let mut attempt = 1;
        loop {
            let answer = self.attempt(inner).await;
            let Some(pause) = self.pause_after(&answer, attempt) else {
                tracing::Span::current().record("attempts", attempt);
                return (answer, attempt, self.ended);
            };
            if !self.settings.budget.withdraw() {
                tracing::debug!(
                    attempt,
                    "retry budget exhausted: the answer goes to the caller"
                );
                crate::telemetry::client_retry_denied();
                tracing::Span::current().record("attempts", attempt);
                return (answer, attempt, None);
            }
            crate::telemetry::client_retry();
            tracing::debug!(attempt, ?pause, "retrying with the same key");
            tokio::time::sleep(pause).await;
            attempt += 1;
        }
    }

    /// One attempt, cut at the attempt timeout and the deadline. A gRPC answer without a
    /// status in its headers is read to its trailers, where the status is.
    async fn attempt<S, B, ResBody>(
        &mut self,
        inner: &mut S,
    ) -> Result<Response<ClientResponseBody<ResBody>>, BoxError>
    where
        S: Service<Request<ClientBody<B>>, Response = Response<ResBody>>,
        S::Error: Into<BoxError>,
        ResBody: Body + Unpin,
        ResBody::Error: Into<BoxError>,
    {
        let request = self.request();
        let left = self.deadline.saturating_duration_since(Instant::now());
        let limit = self.settings.attempt_timeout.min(left);
        let (wire, max_body) = (self.wire, self.settings.max_body);
        let sent = async {
            let ready = inner.ready().await.map_err(Into::into)?;
            let response = ready.call(request).await.map_err(Into::into)?;
            if wire != Wire::Grpc || response.headers().contains_key("grpc-status") {
                return Ok(response.map(ClientResponseBody::live));
            }
            let (parts, body) = response.into_parts();
            let body = body::read_to_trailers(body, max_body).await?;
            Ok(Response::from_parts(parts, body))
        };
        match tokio::time::timeout(limit, sent).await {
            Ok(answer) => answer,
            Err(_elapsed) if limit < self.settings.attempt_timeout => {
                Err(ClientError::DeadlineExceeded {
                    after: self.settings.deadline,
                }
                .into())
            }
            Err(_elapsed) => Err(ClientError::AttemptTimedOut { after: limit }.into()),
        }
    }

    /// The next attempt's request: the same head and body every time.
    fn request<B>(&mut self) -> Request<ClientBody<B>> {
        let body = ClientBody::buffered(self.body.clone());
        if let Some(parts) = self.parts.take() {
            return Request::from_parts(parts, body);
        }
        let (method, uri, version, headers) = self.head.clone();
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.version_mut() = version;
        *request.headers_mut() = headers;
        request
    }

    /// How long to pause before another attempt, or `None` when `answer` goes to the caller.
    fn pause_after<T>(
        &mut self,
        answer: &Result<Response<ClientResponseBody<T>>, BoxError>,
        attempt: u32,
    ) -> Option<Duration> {
        let hint = match answer {
            Ok(response) => {
                let (status, headers) = (response.status(), response.headers());
                self.settings.learned.learn(&self.head.1, headers);
                let trailers = response.body().trailers();
                match verdict::of_response(status, headers, trailers, self.wire) {
                    Verdict::Final => return None,
                    Verdict::Retry { after } => after,
                }
            }
            // The call's outcome is unknown (a lost connection, a timeout), never "failed":
            // the same key makes another attempt safe.
            Err(error) if is_deadline(error) => return None,
            Err(_) => None,
        };
        if attempt >= self.settings.max_attempts {
            return None;
        }
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        let (base, cap) = (self.settings.backoff_base, self.settings.backoff_cap);
        let pause = hint.unwrap_or_else(|| verdict::backoff(attempt, base, cap, self.random));
        // A pause that ends past the deadline would only end in the deadline's error.
        if Instant::now() + pause >= self.deadline {
            return None;
        }
        // One that ends past the key's protection could run the call twice.
        if let Some(protection) = self.settings.protection(&self.head.1)
            && past(self.started, protection, pause)
        {
            tracing::debug!(
                ?protection,
                "the key's protection ends before the next attempt"
            );
            self.ended = Some(protection);
            return None;
        }
        Some(pause)
    }
}

/// Whether an attempt failed because the logical call's deadline passed.
fn is_deadline(error: &BoxError) -> bool {
    matches!(
        error.downcast_ref::<ClientError>(),
        Some(ClientError::DeadlineExceeded { .. })
    )
}

/// The answer for the caller, with what the call took.
fn finish<T>(
    answer: Result<Response<T>, BoxError>,
    attempts: u32,
) -> Result<Response<T>, BoxError> {
    let mut response = answer?;
    let replayed = response
        .headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true");
    response
        .extensions_mut()
        .insert(ClientOutcome { attempts, replayed });
    Ok(response)
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyClient<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyClient")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}
