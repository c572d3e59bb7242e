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
//!   the server layer refuse a call).
//! - It never retries a definitive answer: 2xx, every other 4xx (so a 422 key-mismatch reaches
//!   the caller at once), 500 and 501, a replay (`Idempotent-Replayed: true`).
//! - Pauses: the server's `Retry-After` (or pushback) when it gives one, else exponential
//!   backoff with full jitter; at most 4 attempts within a 30 s deadline, each cut at 10 s; a
//!   retry budget shared by the layer's services ([`tower::retry::budget::TpsBudget`]) so that
//!   retries stay a fraction of the calls when a whole fleet is in trouble.
//! - When it stops, the caller gets the last answer as it was: the last response, or the last
//!   attempt's error (the inner service's own, boxed, or a [`ClientError`]).
//! - Every response carries a [`ClientOutcome`] extension: how many attempts the call took, and
//!   whether the answer was a replay.
//!
//! Requests that are not guarded pass through, sent once.
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
mod service;
mod verdict;

use std::time::Duration;

pub use self::{
    body::ClientBody,
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
