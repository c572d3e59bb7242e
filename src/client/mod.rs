//! The client half of the protocol (feature `client`): a tower layer for the caller that mints
//! one idempotency key per logical call, sends it on every attempt, and retries only what is
//! safe to retry.
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tower_idempotency::client::{ClientBody, ClientOutcome, IdempotencyClientLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let http = Client::builder(TokioExecutor::new()).build_http::<ClientBody<Full<Bytes>>>();
//! let mut client = ServiceBuilder::new()
//!     .layer(IdempotencyClientLayer::new())
//!     .service(http);
//! let request = http::Request::post("http://127.0.0.1:3000/payments")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from(r#"{"amount_cents":4900}"#)))?;
//! let response = client.ready().await?.call(request).await?;
//! let outcome = response.extensions().get::<ClientOutcome>().unwrap();
//! println!("{} after {} attempt(s), replayed: {}", response.status(), outcome.attempts, outcome.replayed);
//! # Ok(()) }
//! ```
//!
//! # What it does
//!
//! - A guarded request (POST and PATCH by default) without a key gets a fresh random one (a
//!   UUID), the same on every attempt of this call; a caller's own key (say one derived with
//!   [`IdempotencyClaim::derived_key`](crate::IdempotencyClaim::derived_key) inside a guarded
//!   handler) is kept.
//! - The body is buffered (1 MiB by default) so that every attempt sends the same bytes; a
//!   larger one is sent once, without retries.
//! - It retries, with the same key and body: a lost connection or any error of the inner
//!   service, an attempt that timed out (the outcome of both is *unknown*, not failed: the
//!   server may have run it, and answers the retry with the same outcome), 408, 409 in flight
//!   (a 409 with `Retry-After`), 429 with `Retry-After`, 502, 503, 504, and gRPC UNAVAILABLE or
//!   ABORTED with `grpc-retry-pushback-ms` (trailers-only answers, which is how servers and
//!   the server layer refuse a call), or a gRPC status of either kind sent in the trailers of a
//!   full answer: a gRPC answer without a status in its headers is read to its trailers (within
//!   the body limit) before the client decides, and handed on as it was read.
//! - It never retries a definitive answer: 2xx, every other 4xx (so a 422 key-mismatch reaches
//!   the caller at once), 500 and 501, a replay (`Idempotent-Replayed: true`).
//! - Pauses: the server's `Retry-After` (seconds or an HTTP date) or pushback when it gives one, else exponential
//!   backoff with full jitter; at most 4 attempts within a 30 s deadline, each cut at 10 s; a
//!   retry budget shared by the layer's services ([`tower::retry::budget::TpsBudget`]) so that
//!   retries stay a fraction of the calls when a whole fleet is in trouble.
//! - When it stops, the caller gets the last answer as it was: the last response, or a
//!   [`CallError`] carrying the call's key (to retry the same logical call with later) and the
//!   last attempt's error (the inner service's own, or a [`ClientError`]) as its source.
//! - `Retry-After` is read as seconds or as an HTTP date (against the response's `Date`).
//! - Every response carries a [`ClientOutcome`] extension: how many attempts the call took, and
//!   whether the answer was a replay.
//! - It never sends a logical call past the time the server protects its key: a server built
//!   with [`with_protected_until_header`](crate::IdempotencyLayer::with_protected_until_header)
//!   says on its answers how long that is, and the client remembers it per origin (or is told,
//!   [`with_key_protection`](IdempotencyClientLayer::with_key_protection)). Past it, a retry
//!   with the same key could run the call again: the client stops with [`ProtectionEnded`]
//!   instead of sending it. See [Resuming a call](#resuming-a-call-later).
//!
//! Requests that are not guarded pass through, sent once.
//!
//! # Resuming a call later
//!
//! A call that gave up ([`CallError`]) has an unknown outcome. To try it again later (from a
//! queue, an outbox, after a restart), send the same request with the error's
//! [`key`](CallError::key) in the key header and its [`started`](CallError::started) time as a
//! [`CallStarted`] extension. The server answers with the first run's outcome, or runs it if
//! none did, for as long as it protects the key after the first run: that protection is counted
//! from the call's start, which is never later than the first run's completion. Once it may
//! have ended, the client refuses to send the call and answers [`ProtectionEnded`]: find out
//! whether the call ran (look its result up) before sending it again with a new key.
//!
//! ```no_run
//! # async fn run(client: impl tower::Service<http::Request<http_body_util::Full<bytes::Bytes>>, Response = http::Response<()>, Error = tower_idempotency::store::BoxError> + Clone, key: String, started: std::time::SystemTime) -> Result<(), tower_idempotency::store::BoxError> {
//! use tower::ServiceExt;
//! use tower_idempotency::client::{CallStarted, ProtectionEnded};
//!
//! // `key` and `started` kept from the CallError, with the pending work.
//! let mut request = http::Request::post("http://127.0.0.1:3000/payments").body(Default::default())?;
//! request.headers_mut().insert("idempotency-key", key.parse()?);
//! request.extensions_mut().insert(CallStarted(started));
//! match client.oneshot(request).await {
//!     Ok(response) => { /* the call's answer, run or replayed */ }
//!     Err(error) if error.is::<ProtectionEnded>() => { /* look the payment up instead */ }
//!     Err(error) => return Err(error),
//! }
//! # Ok(()) }
//! ```
//!
//! # tonic
//!
//! A tonic channel takes `tonic::body::Body`: map the client's body to it.
//!
//! ```no_run
//! # async fn run(channel: tonic::transport::Channel) {
//! use tonic::body::Body;
//! use tower::ServiceBuilder;
//! use tower_idempotency::client::{ClientBody, IdempotencyClientLayer};
//!
//! let service = ServiceBuilder::new()
//!     .layer(IdempotencyClientLayer::new())
//!     .map_request(|request: http::Request<ClientBody<Body>>| request.map(Body::new))
//!     .service(channel);
//! // PaymentsClient::new(service), as with any channel.
//! # }
//! ```

mod body;
mod layer;
mod protection;
mod service;
mod verdict;

use std::time::{Duration, SystemTime};

pub use self::{
    body::{ClientBody, ClientResponseBody},
    layer::{
        DEFAULT_ATTEMPT_TIMEOUT, DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_CAP,
        DEFAULT_CLIENT_ATTEMPTS, DEFAULT_CLIENT_DEADLINE, DEFAULT_CLIENT_MAX_BODY,
        IdempotencyClientLayer,
    },
    service::{ClientFuture, IdempotencyClient},
};

/// What a logical call took: inserted into the extensions of every response the client returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientOutcome {
    /// The attempts made, the first included.
    pub attempts: u32,
    /// Whether the answer was the server's stored one (`Idempotent-Replayed: true`): an earlier
    /// attempt of this call (or another caller with the key) ran it.
    pub replayed: bool,
}

/// A guarded call that ended without an answer: the idempotency key every attempt carried, and
/// the last attempt's error ([`source`](std::error::Error::source): the inner service's own, or
/// a [`ClientError`]).
///
/// Its outcome is **unknown**, not failed: the server may have run it. To try the same
/// logical call again later (a retry from a queue, a user pressing "pay" again after a
/// reconnect), send the request with [`key`](Self::key) in the key header and
/// [`started`](Self::started) as a [`CallStarted`]: the layer keeps a caller's own key, and the
/// server answers with the first run's outcome, or runs it if none did, while it protects the
/// key (the client answers [`ProtectionEnded`] once that may be over). A new key would be a new
/// call: its effect could happen twice.
///
/// ```no_run
/// # async fn run(client: impl tower::Service<http::Request<http_body_util::Full<bytes::Bytes>>, Response = http::Response<()>, Error = tower_idempotency::store::BoxError> + Clone) -> Result<(), tower_idempotency::store::BoxError> {
/// use tower::ServiceExt;
/// use tower_idempotency::client::{CallError, CallStarted};
///
/// let request = || http::Request::post("http://127.0.0.1:3000/payments").body(Default::default());
/// let (key, started) = match client.clone().oneshot(request()?).await {
///     Ok(response) => return Ok(()),
///     Err(error) => match error.downcast_ref::<CallError>() {
///         // Keep both with the pending work.
///         Some(gave_up) => (gave_up.key().to_owned(), gave_up.started()),
///         None => return Err(error),
///     },
/// };
/// // Later, the same logical call:
/// let mut again = request()?;
/// again.headers_mut().insert("idempotency-key", key.parse()?);
/// again.extensions_mut().insert(CallStarted(started));
/// client.oneshot(again).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, thiserror::Error)]
#[error(
    "the call with idempotency key {key} ended without an answer after {attempts} attempt(s); \
     its outcome is unknown: retry it with the same key"
)]
pub struct CallError {
    key: String,
    attempts: u32,
    started: SystemTime,
    #[source]
    source: crate::store::BoxError,
}

impl CallError {
    pub(crate) fn new(
        key: String,
        (attempts, started): (u32, SystemTime),
        source: crate::store::BoxError,
    ) -> Self {
        Self {
            key,
            attempts,
            started,
            source,
        }
    }

    /// The idempotency key the call's attempts carried: send it again to retry the call.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// When the logical call started: its first attempt, or the [`CallStarted`] it was resumed
    /// with. Keep it with the key, and send it again as a [`CallStarted`] to resume the call.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// The attempts made (0 when the request's body failed before any was sent).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The last attempt's error.
    pub fn into_source(self) -> crate::store::BoxError {
        self.source
    }
}

/// When a logical call started, for a request that resumes it (with its key, after a
/// [`CallError`]): a request extension. The client counts the server's protection of the key
/// from it, and refuses to send the call once that may have ended ([`ProtectionEnded`]).
/// Without it, a request is a call that starts now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallStarted(pub SystemTime);

/// The client did not send a logical call (again) because the server may no longer protect its
/// key: the call started longer ago than the server keeps a key after its request completes, so
/// a request with the key could run the call a second time.
///
/// Its outcome is unknown: the call may have run. Find out (look its result up) before sending
/// it again, with a new key. [`source`](std::error::Error::source) is the last attempt's error,
/// when this call made attempts before the protection ended.
#[derive(Debug, thiserror::Error)]
#[error(
    "the call with idempotency key {key} started {:?} ago and the server protects a key for \
     {protection:?} after its request completes: not sent again, since it could run twice; \
     its outcome is unknown: look it up before sending it with a new key",
    .started.elapsed().unwrap_or_default()
)]
pub struct ProtectionEnded {
    key: String,
    attempts: u32,
    started: SystemTime,
    protection: Duration,
    #[source]
    source: Option<crate::store::BoxError>,
}

impl ProtectionEnded {
    pub(crate) fn new(
        key: String,
        (attempts, started): (u32, SystemTime),
        protection: Duration,
        source: Option<crate::store::BoxError>,
    ) -> Self {
        Self {
            key,
            attempts,
            started,
            protection,
            source,
        }
    }

    /// The idempotency key of the call.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The attempts this call made before the protection ended (0 when it was resumed too late).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// When the logical call started.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// How long the server protects a key after its request completes, as the client knew it.
    pub fn protection(&self) -> Duration {
        self.protection
    }
}

/// Why the client gave up an attempt (the inner service's own errors are passed on as they are).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The attempt took longer than the attempt timeout; it was retried while attempts, the
    /// deadline and the budget allowed.
    #[error("the attempt did not finish within {after:?}; its outcome is unknown")]
    AttemptTimedOut {
        /// The timeout.
        after: Duration,
    },
    /// The logical call's deadline passed during an attempt.
    #[error("the call did not finish within its {after:?} deadline; its outcome is unknown")]
    DeadlineExceeded {
        /// The deadline.
        after: Duration,
    },
}
