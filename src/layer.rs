//! The layer and its configuration.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method, header, request::Parts};
use tower_layer::Layer;

use crate::{CompletionPolicy, Idempotency, Metrics, store::Store};

/// Applies [`Idempotency`] to a service. Build it once, with a store, and add it like any layer.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .require_key(true)
///     .with_scope(|parts| {
///         parts.headers.get("x-tenant").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
///     })
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
    pub(crate) require_key: bool,
    pub(crate) scope: Option<Arc<ScopeFn>>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) policy: CompletionPolicy,
    pub(crate) unstored_headers: Vec<HeaderName>,
    pub(crate) metrics: Arc<Metrics>,
}

type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;

/// Default limit of a guarded request body: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// Default limit of a response body kept for replay: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;
/// Default lease: how long a claim survives its instance without renewal.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default retention of completed keys: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// Hop-by-hop headers describe one connection, not the response: never stored, never replayed.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl IdempotencyLayer {
    /// A layer on `store`, with the defaults: guards POST and PATCH; a missing key passes through;
    /// one global scope; fingerprint of method, path, query and body; 1 MiB request and cached
    /// response limits; a 30 s lease renewed while the handler runs; 24 h retention; the default
    /// [`CompletionPolicy`]; `Date` and `Set-Cookie` not stored.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared_store(Arc::new(store))
    }

    /// A layer on a store already shared behind an `Arc` (to pick one at run time, say).
    pub fn from_shared_store(store: Arc<dyn Store>) -> Self {
        Self {
            config: Config {
                store,
                methods: vec![Method::POST, Method::PATCH],
                require_key: false,
                scope: None,
                fingerprint_headers: Vec::new(),
                max_request_body: DEFAULT_MAX_REQUEST_BODY,
                max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                lease: DEFAULT_LEASE,
                retention: DEFAULT_RETENTION,
                policy: CompletionPolicy::default(),
                unstored_headers: vec![header::DATE, header::SET_COOKIE],
                metrics: Arc::default(),
            },
        }
    }

    /// The methods the layer guards; requests with any other method pass through untouched.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Whether a guarded request without an `Idempotency-Key` is refused with 400 (`true`) or
    /// passed through without protection (`false`, the default).
    pub fn require_key(mut self, required: bool) -> Self {
        self.config.require_key = required;
        self
    }

    /// The scope of a request's key: typically the tenant, account or authenticated subject, read
    /// from headers or from extensions an authentication layer (installed outside this one) set.
    /// Keys in different scopes never see each other. Without it, every key shares one scope.
    pub fn with_scope(mut self, scope: impl Fn(&Parts) -> String + Send + Sync + 'static) -> Self {
        self.config.scope = Some(Arc::new(scope));
        self
    }

    /// Request headers that take part in the fingerprint, besides method, path, query and body
    /// (say `content-type`, or a header that selects an API version).
    pub fn with_fingerprint_headers(
        mut self,
        headers: impl IntoIterator<Item = HeaderName>,
    ) -> Self {
        self.config.fingerprint_headers = headers.into_iter().collect();
        self
    }

    /// The largest guarded request body buffered for the fingerprint; larger ones get 413 and
    /// never reach the handler.
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest response body stored for replay. A larger response still reaches its first
    /// caller in full and still completes the key (it never runs twice), but is stored without
    /// its body: retries get a `response-not-stored` problem.
    pub fn with_max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// How long a claim survives without renewal. While the handler runs, the layer renews it
    /// every third of this; if the instance dies, the key becomes claimable once it runs out.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How long completed keys (and their responses) are kept.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// Which responses are stored and which release the key.
    pub fn with_completion_policy(mut self, policy: CompletionPolicy) -> Self {
        self.config.policy = policy;
        self
    }

    /// Response headers never stored nor replayed, besides the hop-by-hop ones (which never are).
    /// Replaces the default, `Date` and `Set-Cookie`: a replay should not re-send a session.
    pub fn with_unstored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.unstored_headers = headers.into_iter().collect();
        self
    }

    /// The counters of every service this layer builds.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.config.metrics)
    }
}

impl Config {
    pub(crate) fn scope_of(&self, parts: &Parts) -> String {
        self.scope
            .as_ref()
            .map_or_else(String::new, |scope| scope(parts))
    }

    pub(crate) fn stores_header(&self, name: &HeaderName) -> bool {
        !HOP_BY_HOP.contains(&name.as_str()) && !self.unstored_headers.contains(name)
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
            .field("require_key", &self.config.require_key)
            .field("scoped", &self.config.scope.is_some())
            .field("fingerprint_headers", &self.config.fingerprint_headers)
            .field("max_request_body", &self.config.max_request_body)
            .field("max_response_body", &self.config.max_response_body)
            .field("lease", &self.config.lease)
            .field("retention", &self.config.retention)
            .field("unstored_headers", &self.config.unstored_headers)
            .finish_non_exhaustive()
    }
}
