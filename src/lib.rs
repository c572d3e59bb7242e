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
//! A retry after completion gets the stored response (`Idempotent-Replayed: true`); a retry
//! while the first still runs waits for it, then gets 409 with `Retry-After`; the same key with
//! another request gets 422; a malformed key 400; an unreachable store 503, the handler not run.
//! Every situation and its answer is in one table:
//! [what clients see](guide::how_it_works#what-clients-see).
//!
//! Answers that say nothing was executed (400, 401, 403, 404, 405, 413, 415, 422: router,
//! extractor and authentication rejections) release the key, so the corrected request runs; see
//! [`CompletionPolicy`](policy::CompletionPolicy).
//!
//! Rejections are `application/problem+json` responses (see [`problem`] for the `type` URIs),
//! or gRPC statuses for gRPC callers: never service errors, so the layer's error type is the
//! inner service's and axum needs no `HandleErrorLayer`.
//!
//! # Guides
//!
//! The [`guide`] module is the manual, one page per topic, with examples compiled as doctests:
//! [how it works and what is promised](guide::how_it_works), [configuration and the order of
//! layers](guide::configuration), [the stores](guide::stores), [multi-step handlers and
//! recovery](guide::recovery), [the client half](guide::client), [units of
//! work](guide::units_of_work), [gRPC and hyper](guide::grpc), [operating it](guide::operating),
//! [the failure matrix](guide::failure_matrix), and [sizing and limits](guide::sizing_and_limits).
//!
//! In short: the handler finds an [`IdempotencyClaim`] in the request extensions (the key, the
//! scope and the fence). With the Postgres fence ([`IdempotencyClaim::commit`] in the handler's
//! own transaction) the business write commits at most once per key across the fleet, whatever
//! stalls, crashes or store outages do; without it, the handler runs once per key while its
//! process is healthy. Install the layer on the handler (`post(handler).route_layer(layer)`),
//! and authentication, compression, CORS, request ids, timeouts and body limits outside it.
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
pub mod guide;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
#[cfg(feature = "client")]
pub mod client;
mod layer;
pub mod completer;
pub mod work;
mod service;
mod future;
mod protocol;
mod claim;
mod settings;
mod kept;
mod answers;
pub mod problem;
pub mod policy;
pub mod scope;
pub mod body;
pub mod store;
mod response;
mod fingerprint;
mod key;
mod grpc;
pub mod headers;
pub mod telemetry;
mod outcome;
mod stripes;

pub use self::{
    claim::IdempotencyClaim,
    fingerprint::JsonFields,
    future::ResponseFuture,
    key::{IdempotencyKey, KeyError},
    layer::IdempotencyLayer,
    outcome::IdempotencyOutcome,
    service::Idempotency,
    store::MemoryStore,
};
#[cfg(feature = "axum")]
pub use claim::MissingClaim;
#[cfg(fuzzing)]
#[doc(hidden)]
pub use fingerprint::fingerprint_input;

/// The `redis` crate [`store::RedisStore`] is built on, so applications build its client with
/// the version this release pairs with (see [versions](guide::sizing_and_limits#versions)).
#[cfg(feature = "redis")]
pub use redis;

/// The `sqlx` crate [`store::PostgresStore`] and [`IdempotencyClaim::commit`] are built on, so
/// applications open pools and transactions with the version this release pairs with (see
/// [versions](guide::sizing_and_limits#versions)).
#[cfg(feature = "postgres")]
pub use sqlx;
