//! `Idempotency-Key` middleware for [tower]: a retried `POST` runs **once across the whole fleet**,
//! and every retry gets the same response.
//!
//! ```no_run
//! use axum::{Json, Router, routing::post};
//! use tower_idempotency::{IdempotencyClaim, IdempotencyLayer, MemoryStore};
//!
//! async fn pay(claim: IdempotencyClaim, Json(body): Json<serde_json::Value>) -> Json<serde_json::Value> {
//!     // Runs once per key across the fleet while its process is healthy; fence business writes
//!     // (`claim.commit`) for exactly-once commits. Forward the key so the provider deduplicates.
//!     Json(serde_json::json!({ "charged": body["amount_cents"], "key": claim.key().as_str() }))
//! }
//!
//! # async fn run() {
//! // MemoryStore is for tests and one process only; use the Redis/Postgres stores in production.
//! let idempotency = IdempotencyLayer::new(MemoryStore::new()).with_key_required(true);
//! let app: Router = Router::new()
//!     // On the handler: 404s and 405s never reach the layer.
//!     .route("/payments", post(pay).route_layer(idempotency));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! # What a client sees
//!
//! For a guarded request (by default `POST` and `PATCH`) carrying `Idempotency-Key`:
//!
//! | situation | answer |
//! |---|---|
//! | first request with the key | the handler runs; its response is stored and returned |
//! | retry after it completed | the stored response: same status, headers, body and trailers, plus `Idempotent-Replayed: true` |
//! | retry while the first is still running | waits for it (10 s by default) and gets its answer; then 409 with `Retry-After` |
//! | same key, different method, path, query, `Content-Type`, body (or configured headers) | 422 |
//! | same key, different credentials | a record of its own (see [`scope`]) |
//! | malformed, empty, oversize, repeated or listed key | 400 |
//! | body over the request limit, or not received in time | 413, 408 |
//! | store unreachable | 503 with `Retry-After`; the handler did not run |
//!
//! Answers that say nothing was executed (400, 401, 403, 404, 405, 413, 415, 422: router,
//! extractor and authentication rejections) release the key, so the corrected request runs; see
//! [`CompletionPolicy`].
//!
//! Rejections are `application/problem+json` responses (see [`problem`] for the `type` URIs),
//! or gRPC statuses for gRPC callers: never service errors, so the layer's error type is the
//! inner service's and axum needs no `HandleErrorLayer`.
//!
//! # How it works
//!
//! 1. The key is parsed (RFC 8941 string or bare token, 1 to 255 visible ASCII characters) and
//!    scoped: by default to the caller's credentials ([`scope::by_credentials`]).
//! 2. The body is buffered (up to a size and a time limit) and the request fingerprinted with
//!    SHA-256 over method, path and query as the client sent them, `Content-Type`, configured
//!    headers and body.
//! 3. The key is **claimed** in the [`Store`](store::Store) with a fresh owner token, a fence
//!    number and a lease. No request reaches the handler without a claim. A request that finds
//!    its key in flight waits for the first one ([`IdempotencyLayer::with_wait`]).
//! 4. The handler runs in the response future, moved to a task of its own if the client
//!    disconnects, so it finishes; a task renews the lease while it runs, and a panic becomes a
//!    500 that frees the key.
//! 5. The key is **completed** (response stored) or **released** (deleted) according to the
//!    [`CompletionPolicy`], but only if this owner still holds it; then the response is sent, so
//!    a caller holding its answer finds the key final. A response over the cache limit streams
//!    to its caller as it is produced and is stored without its body.
//!
//! The handler finds an [`IdempotencyClaim`] in the request extensions: the key, the scope and
//! the fence. Work that panics outside the handler (a fingerprint hook, a completion policy, a
//! store) is answered like every other answer of the layer: a 500 through
//! [`IdempotencyLayer::with_problem_response`], or `INTERNAL` to a gRPC caller; a key already
//! claimed frees itself when its lease ends.
//!
//! The repository's `ARCHITECTURE.md` names each module and what lives there, in this order.
//!
//! # What is promised
//!
//! Every retry with the same request converges to the same response: the stored one, or after a
//! wait, or a 409 that says when to come back. With the Postgres fence
//! (`IdempotencyClaim::commit` in the handler's own transaction) the business write commits at
//! most once per key across the fleet, whatever stalls, crashes or store outages do. Without it,
//! the handler runs once per key while its process is healthy: a process stalled past its lease
//! loses the key and a retry may run the handler again; forward the key to a downstream that
//! deduplicates on it, or fence. A handler of several steps records a recovery point in each
//! step's own transaction ([`IdempotencyClaim::advance`]), and a retry of an interrupted request
//! resumes from it instead of starting again.
//!
//! # Composing with other layers
//!
//! Install the layer on the handler (`post(handler).route_layer(layer)`), and everything that
//! concerns one exchange **outside** it: authentication (the scope needs its result),
//! compression, CORS, request ids, timeouts, body limits, tracing. Inside, they would make it
//! store per-caller state or cancel the handler it promised to finish; the README's "Composing
//! with other layers" has the tested order and what the layer does when one sits inside.
//!
//! # The caller's half
//!
//! With the `client` feature, [`client::IdempotencyClientLayer`] wraps a tower client (hyper,
//! tonic): one key per logical call on every attempt, retries of what is safe to retry only,
//! `Retry-After`, backoff with full jitter, a deadline and a retry budget. Inside a guarded
//! handler, [`IdempotencyClaim::derived_key`] gives each downstream call a key of its own that
//! every retry of the request repeats.
//!
//! # tonic and hyper
//!
//! The same layer guards gRPC: `tonic::transport::Server::builder().layer(IdempotencyLayer::new(store))`.
//! The key is the `idempotency-key` metadata entry, the completion policy reads `grpc-status`
//! from the trailers, replays carry the trailers, and rejections are gRPC statuses (see
//! [`problem`]). Plain hyper servers wrap their service with `tower::ServiceBuilder` and serve it
//! through `hyper_util::service::TowerToHyperService`; the inner service receives a
//! [`RequestBody`].
//!
//! # Stores
//!
//! | store | use |
//! |---|---|
//! | [`MemoryStore`] | tests and single-process development only: **no protection across instances** |
//! | [`store::RedisStore`] (feature `redis`) | a fast shared store, on one server or a Redis Cluster; alone, a best effort (eviction, failover) |
//! | [`store::PostgresStore`] (feature `postgres`) | the source of truth, with the handler fence ([`IdempotencyClaim::commit`]) |
//! | [`store::TieredStore`] | a fast front before an authority: Redis before Postgres is the production setup |
//!
//! # Limits
//!
//! - Guarded request bodies are buffered in memory (1 MiB by default), and so are response
//!   bodies up to the cache limit (1 MiB by default); larger responses stream through but are
//!   stored without their body. Request trailers are not forwarded on guarded requests.
//! - Guarded requests need a Tokio runtime (`tokio::spawn`). Renewals run on a thread of the
//!   process's own, through connections of their own ([`Store::detached`](store::Store::detached)),
//!   so a handler that blocks every worker of the application's runtime keeps its key.
//!
//! # Features
//!
//! | feature | adds |
//! |---|---|
//! | `axum` | [`IdempotencyClaim`] as an axum extractor |
//! | `redis` | [`store::RedisStore`], and the [`redis`](mod@redis) crate it is built on |
//! | `postgres` | [`store::PostgresStore`], its migrations and sweeper, [`IdempotencyClaim::commit`], and the [`sqlx`] crate it is built on |
//! | `conformance` | [`conformance`], the store conformance suite |
//! | `metrics` | the metrics of [`telemetry`], through the `metrics` facade |
//! | `client` | [`client`]: the caller's half, one key per logical call and safe retries |
//!
//! # Operating it
//!
//! Each guarded request runs in an `idempotency` span (key, scope, fence, outcome; keys and
//! scopes as pseudonyms unless [`IdempotencyLayer::with_clear_keys_in_logs`]), every answer the layer
//! gives instead of the handler is an event, its response carries an [`IdempotencyOutcome`],
//! and [`telemetry`] lists the metrics (latencies as histograms with the crate's buckets,
//! [`telemetry::HISTOGRAMS`]). [`Store::inspect`](store::Store::inspect),
//! [`forget`](store::Store::forget) and [`stuck`](store::Store::stuck) look at and delete keys;
//! [`Store::diagnose`](store::Store::diagnose) checks the servers a store runs on for the
//! settings that break its guarantees. The repository's `contrib/` has a Grafana dashboard and
//! Prometheus alert rules.
//!
//! [tower]: https://github.com/tower-rs/tower

#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]

// In the order a request meets them; each module uses only those declared below it
// (`.ci/layering` checks it; ARCHITECTURE.md says what lives where). The conformance suite
// drives stores from outside, as a user's tests do.
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
#[cfg(feature = "client")]
pub mod client;
mod layer;
pub mod work;
mod service;
mod future;
mod protocol;
mod claim;
mod settings;
mod answers;
pub mod problem;
mod policy;
pub mod scope;
mod body;
pub mod store;
mod response;
mod fingerprint;
mod key;
mod grpc;
mod headers;
pub mod telemetry;
mod outcome;

pub use self::{
    body::{RequestBody, ResponseBody},
    claim::IdempotencyClaim,
    fingerprint::Fingerprint,
    future::ResponseFuture,
    key::{IDEMPOTENCY_KEY, IdempotencyKey, KeyError, MAX_KEY_LEN},
    layer::IdempotencyLayer,
    outcome::IdempotencyOutcome,
    policy::{Completion, CompletionPolicy, ResponseSummary},
    response::{DEFAULT_MAX_RESPONSE_BODY, DecodeError, StoredResponse},
    service::Idempotency,
    settings::{
        DEFAULT_FINALIZE_DEADLINE, DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BODY,
        DEFAULT_REQUEST_BODY_TIMEOUT, DEFAULT_RETENTION, DEFAULT_WAIT,
    },
    store::MemoryStore,
    telemetry::{Counters, CountersSnapshot},
};
#[cfg(feature = "axum")]
pub use claim::MissingClaim;
#[cfg(fuzzing)]
#[doc(hidden)]
pub use fingerprint::fingerprint_input;

/// The `redis` crate [`store::RedisStore`] is built on, so applications build its client with
/// the version this release pairs with (see the README's "Versions").
#[cfg(feature = "redis")]
pub use redis;

/// The `sqlx` crate [`store::PostgresStore`] and [`IdempotencyClaim::commit`] are built on, so
/// applications open pools and transactions with the version this release pairs with (see the
/// README's "Versions").
#[cfg(feature = "postgres")]
pub use sqlx;
