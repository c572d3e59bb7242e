//! The layer and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderName, Method, request::Parts};
use tower_layer::Layer;

use crate::{
    CompletionPolicy, Idempotency, Metrics,
    fingerprint::BodyFingerprintFn,
    problem::Problem,
    protocol::{Durations, Leases, Waiters},
    response::StoreRules,
    scope,
    store::{RecordKey, Store},
};

/// Applies [`Idempotency`] to a service. Build it once, with a store, and add it like any layer.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// #[derive(Clone)]
/// struct Tenant(String); // set by an authentication layer installed outside this one
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .require_key(true)
///     // No tenant means no scope: the request is refused, never put in a shared scope.
///     .with_scope(|parts| parts.extensions.get::<Tenant>().map(|t| t.0.clone()))
///     .with_lease(Duration::from_secs(10));
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    config: Config,
}

/// Everything the service needs, shared by every clone.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) methods: Vec<Method>,
    pub(crate) header: HeaderName,
    pub(crate) require_key: bool,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) fingerprint_body: Option<Arc<BodyFingerprintFn>>,
    pub(crate) max_request_body: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) store_rules: Arc<StoreRules>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) wait: Duration,
    pub(crate) finalize_deadline: Duration,
    pub(crate) policy: CompletionPolicy,
    pub(crate) problem_response: Option<Arc<ProblemFn>>,
    pub(crate) log_keys_in_clear: bool,
    pub(crate) answer_level: tracing::Level,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) shared: Arc<Shared>,
}

/// What the services of one layer learn at run time and share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Requests waiting for a duplicate of theirs to finish.
    pub(crate) waiters: Waiters,
    /// The leases this layer's requests hold, and the task that renews them.
    pub(crate) leases: Leases,
    /// Recent handler durations, for `Retry-After` hints.
    pub(crate) durations: Durations,
    /// Whether the warning about a timeout layer inside this one was logged.
    pub(crate) warned_inner_timeout: std::sync::atomic::AtomicBool,
}

type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type ProblemFn = dyn Fn(&Problem) -> http::Response<Bytes> + Send + Sync;

/// Default limit of a guarded request body: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// Default time a guarded request body may take to arrive: 30 s.
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Default limit of a response body kept for replay: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;
/// Default lease: how long a claim survives its instance without renewal.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default retention of completed keys: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// Default time a duplicate waits for the first request with its key: 10 s.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// Default time a response that could not be stored is retried, with its key held: 10 minutes.
pub const DEFAULT_FINALIZE_DEADLINE: Duration = Duration::from_secs(10 * 60);

impl IdempotencyLayer {
    /// A layer on `store`, with the defaults: guards POST and PATCH; reads the key from
    /// `Idempotency-Key`; a missing key passes through; keys are scoped by the caller's
    /// credentials ([`scope::by_credentials`]); the fingerprint covers method, path, query,
    /// `Content-Type` and body; 1 MiB request and cached response limits; the request body must
    /// arrive within 30 s; a 30 s lease renewed while the handler runs; 24 h retention; the
    /// default [`CompletionPolicy`]; per-exchange headers (`Date`, `Set-Cookie`, request ids,
    /// trace context) not stored; problems rendered as `application/problem+json`.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared_store(Arc::new(store))
    }

    /// A layer on a store already shared behind an `Arc` (to pick one at run time, say).
    pub fn from_shared_store(store: Arc<dyn Store>) -> Self {
        Self {
            config: Config {
                store,
                methods: vec![Method::POST, Method::PATCH],
                header: crate::IDEMPOTENCY_KEY.clone(),
                require_key: false,
                scope: Arc::new(scope::by_credentials),
                fingerprint_headers: Vec::new(),
                fingerprint_body: None,
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
                store_rules: Arc::default(),
                lease: DEFAULT_LEASE,
                retention: DEFAULT_RETENTION,
                wait: DEFAULT_WAIT,
                finalize_deadline: DEFAULT_FINALIZE_DEADLINE,
                policy: CompletionPolicy::default(),
                problem_response: None,
                log_keys_in_clear: false,
                answer_level: tracing::Level::INFO,
                metrics: Arc::default(),
                shared: Arc::default(),
            },
        }
    }

    /// The methods the layer guards; requests with any other method pass through untouched.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// The request header that carries the key (`Idempotency-Key` by default), for clients that
    /// send another one, such as `X-Idempotency-Key`.
    pub fn with_header(mut self, name: HeaderName) -> Self {
        self.config.header = name;
        self
    }

    /// Whether a guarded request without a key is refused with 400 (`true`) or passed through
    /// without protection (`false`, the default).
    pub fn require_key(mut self, required: bool) -> Self {
        self.config.require_key = required;
        self
    }

    /// The scope of a request's key: keys in different scopes never see each other's records or
    /// responses. Typically the tenant, account or authenticated subject, read from the request
    /// extensions an authentication layer set.
    ///
    /// Returning `None` refuses the request with a 500 problem ([`NO_SCOPE`](crate::problem::NO_SCOPE))
    /// before anything is claimed: a request that cannot be attributed to a caller never falls
    /// back to a scope shared with others. The usual cause is layer order: the authentication
    /// layer must sit **outside** (be added after) the idempotency layer, so that it has run
    /// when the scope is read.
    ///
    /// The default, [`scope::by_credentials`], keeps callers with different `Authorization`
    /// headers apart. Return a constant (`|_| Some(String::new())`) for one scope shared by
    /// every caller.
    pub fn with_scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.scope = Arc::new(scope);
        self
    }

    /// Request headers that take part in the fingerprint, besides method, path, query,
    /// `Content-Type` and body (say a header that selects an API version).
    pub fn with_fingerprint_headers(
        mut self,
        headers: impl IntoIterator<Item = HeaderName>,
    ) -> Self {
        self.config.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// What of the body takes part in the fingerprint: the function gets the request head and
    /// the whole buffered body and returns the bytes that stand for it. Use it to canonicalize
    /// (JSON key order, whitespace) or to leave out fields that change between retries of one
    /// request (a client timestamp). The handler still receives the body as sent.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // JSON bodies count by their content, not their spelling; anything else as sent.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fingerprint_body(|_, body| {
    ///     match serde_json::from_slice::<serde_json::Value>(body) {
    ///         Ok(mut json) => {
    ///             if let Some(fields) = json.as_object_mut() {
    ///                 fields.remove("sent_at");
    ///             }
    ///             Bytes::from(json.to_string()) // serde_json sorts object keys
    ///         }
    ///         Err(_) => body.clone(),
    ///     }
    /// });
    /// ```
    ///
    /// Without it, the body is hashed as it arrives and never copied for the fingerprint.
    pub fn with_fingerprint_body(
        mut self,
        body: impl Fn(&Parts, &Bytes) -> Bytes + Send + Sync + 'static,
    ) -> Self {
        self.config.fingerprint_body = Some(Arc::new(body));
        self
    }

    /// The largest guarded request body buffered for the fingerprint; larger ones get 413 and
    /// never reach the handler.
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// How long a guarded request body may take to arrive (30 s by default); a slower one gets a
    /// 408 problem and never reaches the handler. Bounds the memory a stalled upload holds.
    pub fn with_request_body_timeout(mut self, timeout: Duration) -> Self {
        self.config.request_body_timeout = timeout;
        self
    }

    /// The largest response body stored for replay. A larger response still reaches its first
    /// caller in full and still completes the key (it never runs twice), but is stored without
    /// its body: retries get a `response-not-stored` problem.
    pub fn with_max_response_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.config.store_rules).max_body = bytes;
        self
    }

    /// How long a claim survives without renewal. While the handler runs, the layer renews it
    /// every third of this; if the instance dies, the key becomes claimable once it runs out.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        // Requests of layers with different leases are renewed on different schedules.
        self.config.shared = Arc::default();
        self
    }

    /// How long completed keys (and their responses) are kept.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// How long a request whose key is in flight waits for the first request to finish (10 s by
    /// default), and then gets its answer: the replay, or its own run if the first released the
    /// key. Past it, the answer is 409 with a `Retry-After` drawn from recent handler durations.
    /// `Duration::ZERO` answers 409 at once. A gRPC caller waits at most four fifths of its
    /// `grpc-timeout`.
    ///
    /// A duplicate on the same instance is woken the moment the first request finalizes; one on
    /// another instance polls the store (after 10 ms, doubling up to every 200 ms), each poll a
    /// read. The default covers most handlers' durations while staying under common client and
    /// proxy timeouts (30 to 60 s): keep it below any timeout in front of the layer.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// How long the layer keeps retrying to store a response when the store fails (10 minutes by
    /// default). Meanwhile the key stays held, its lease renewed, so no retry runs the handler
    /// again; the caller is answered after the first few attempts. Past it, the layer gives up,
    /// logs an error, and the key frees itself when its lease runs out.
    pub fn with_finalize_deadline(mut self, deadline: Duration) -> Self {
        self.config.finalize_deadline = deadline;
        self
    }

    /// Which responses are stored and which release the key.
    pub fn with_completion_policy(mut self, policy: CompletionPolicy) -> Self {
        self.config.policy = policy;
        self
    }

    /// Response headers never stored nor replayed, besides the hop-by-hop ones (which never are).
    /// Replaces the default: `Date`, `Set-Cookie` (a replay must not re-send a session),
    /// `X-Request-Id`, `Request-Id`, `Traceparent`, `Tracestate` and `Server-Timing` (they
    /// describe the first exchange, not the outcome).
    pub fn with_unstored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Arc::make_mut(&mut self.config.store_rules).unstored = headers.into_iter().collect();
        self
    }

    /// Renders the layer's own answers to HTTP callers (gRPC callers always get a status):
    /// an application's error envelope instead of `application/problem+json`.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_problem_response(|problem| {
    ///     let body = serde_json::json!({
    ///         "error": { "code": problem.type_uri(), "message": problem.detail() }
    ///     });
    ///     // Start from the default to keep its status, Retry-After and replay marker.
    ///     let mut response = problem.to_response();
    ///     *response.body_mut() = Bytes::from(body.to_string());
    ///     response
    ///         .headers_mut()
    ///         .insert("content-type", "application/json".parse().unwrap());
    ///     response
    /// });
    /// ```
    pub fn with_problem_response(
        mut self,
        render: impl Fn(&Problem) -> http::Response<Bytes> + Send + Sync + 'static,
    ) -> Self {
        self.config.problem_response = Some(Arc::new(render));
        self
    }

    /// Whether logs and spans show keys and scopes as they are (`true`) or, by default, as
    /// pseudonyms: `#` and 12 hex digits of their SHA-256, the same on every instance, so one key
    /// can be followed through the logs without customers' order numbers or tenants' names in
    /// them. A pseudonym is not encryption: a guessable key can be found by hashing guesses.
    pub fn log_keys_in_clear(mut self, clear: bool) -> Self {
        self.config.log_keys_in_clear = clear;
        self
    }

    /// The level of the event logged for every answer the layer gives instead of the handler
    /// (a replay, a 409, a 422, a 400…): `INFO` by default. Store failures are logged at
    /// `ERROR` whatever this says.
    pub fn with_answer_log_level(mut self, level: tracing::Level) -> Self {
        self.config.answer_level = level;
        self
    }

    /// The counters of every service this layer builds.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.config.metrics)
    }
}

impl Config {
    /// A record as this layer's logs show it, outside a request's span (which names it).
    pub(crate) fn shown_record<'a>(
        &self,
        record: &'a RecordKey,
    ) -> crate::telemetry::ShownRecord<'a> {
        crate::telemetry::ShownRecord {
            scope: self.shown(record.scope()),
            key: self.shown(record.key().as_str()),
        }
    }

    /// A key or scope as this layer's logs show it.
    pub(crate) fn shown<'a>(&self, value: &'a str) -> crate::telemetry::Pseudonym<'a> {
        crate::telemetry::Pseudonym {
            value,
            clear: self.log_keys_in_clear,
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, Arc::new(self.config.clone()))
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("methods", &self.config.methods)
            .field("header", &self.config.header)
            .field("require_key", &self.config.require_key)
            .field("fingerprint_headers", &self.config.fingerprint_headers)
            .field("max_request_body", &self.config.max_request_body)
            .field("request_body_timeout", &self.config.request_body_timeout)
            .field("max_response_body", &self.config.store_rules.max_body)
            .field("lease", &self.config.lease)
            .field("retention", &self.config.retention)
            .field("wait", &self.config.wait)
            .field("finalize_deadline", &self.config.finalize_deadline)
            .field("unstored_headers", &self.config.store_rules.unstored)
            .field("log_keys_in_clear", &self.config.log_keys_in_clear)
            .field("answer_level", &self.config.answer_level)
            .finish_non_exhaustive()
    }
}
