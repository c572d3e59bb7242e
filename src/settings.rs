//! What an application configured on its layer: plain data, copied into every service the layer
//! builds. The engine's live state (waiters, leases, durations) lives with the engine.

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderName, Method, request::Parts};

use crate::{
    answers::Answers,
    fingerprint::BodyFingerprintFn,
    kept::KeptRequests,
    policy::CompletionPolicy,
    problem::Unverified,
    response::StoreRules,
    scope,
    store::{BoxFuture, RecordKey, Store},
    telemetry::{Pseudonym, ShownRecord},
};

/// Default limit of a guarded request body: 1 MiB.
pub(crate) const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// Default time a guarded request body may take to arrive: 30 s.
pub(crate) const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Default lease: how long a claim survives its instance without renewal.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Default retention of completed keys: 24 hours.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
/// Default time a duplicate waits for the first request with its key: 10 s.
pub(crate) const DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// Default longest wait a duplicate may ask for (`Prefer: wait=N`): 60 s.
pub(crate) const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(60);
/// Default time a response that could not be stored is retried, with its key held: 10 minutes.
pub(crate) const DEFAULT_FINALIZE_DEADLINE: Duration = Duration::from_secs(10 * 60);

/// The scope function of [`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope).
pub(crate) type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The check of [`IdempotencyLayer::with_verifier`](crate::IdempotencyLayer::with_verifier).
pub(crate) type VerifyFn = dyn Fn(&Parts, &Bytes) -> Result<(), Unverified> + Send + Sync;

/// The hook of [`IdempotencyLayer::with_recovery`](crate::IdempotencyLayer::with_recovery).
pub(crate) type RecoveryFn =
    dyn Fn(RecordKey) -> BoxFuture<'static, Option<http::Response<Bytes>>> + Send + Sync;

/// The spawner of [`IdempotencyLayer::with_spawner`](crate::IdempotencyLayer::with_spawner).
pub(crate) type SpawnFn =
    dyn Fn(BoxFuture<'static, ()>) -> tokio::task::JoinHandle<()> + Send + Sync;

/// Everything a layer was configured with, grouped as its builder documents it.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) store: Arc<dyn Store>,
    // Requests.
    pub(crate) methods: Vec<Method>,
    pub(crate) key_header: HeaderName,
    /// Where in a JSON body the key is, when it is not in `key_header`: a JSON pointer.
    pub(crate) key_in_body: Option<Arc<str>>,
    pub(crate) key_required: bool,
    pub(crate) scope: Arc<ScopeFn>,
    pub(crate) verifier: Option<Arc<VerifyFn>>,
    // Fingerprint.
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) fingerprint_body: Option<Arc<BodyFingerprintFn>>,
    // Limits (the response limit and unstored headers are in `store_rules`).
    pub(crate) max_request_body: usize,
    pub(crate) request_body_timeout: Duration,
    pub(crate) store_rules: Arc<StoreRules>,
    // Timing.
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    pub(crate) wait: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) finalize_deadline: Duration,
    // Answers.
    pub(crate) policy: CompletionPolicy,
    pub(crate) answers: Answers,
    pub(crate) recovery: Option<Arc<RecoveryFn>>,
    pub(crate) protected_until_header: bool,
    /// What of a request is kept for the completer, if anything.
    pub(crate) kept_requests: Option<Arc<KeptRequests>>,
    // Observability.
    pub(crate) keys_in_clear: bool,
    // Tasks and randomness.
    pub(crate) spawner: Option<Arc<SpawnFn>>,
    pub(crate) seed: Option<Arc<Seed>>,
}

/// A seed for owner tokens, and how many were drawn from it: shared by every layer (and clone)
/// configured with it, so that tokens stay unique whatever a later setting replaces.
#[derive(Debug)]
pub(crate) struct Seed {
    value: u64,
    drawn: std::sync::atomic::AtomicU64,
}

impl Seed {
    #[cfg(feature = "simulation")]
    pub(crate) fn new(value: u64) -> Arc<Self> {
        Arc::new(Self {
            value,
            drawn: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The next owner token of this seed.
    pub(crate) fn token(&self) -> uuid::Uuid {
        let drawn = self
            .drawn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        uuid::Uuid::from_u64_pair(self.value, drawn)
    }
}

impl Settings {
    /// The defaults, on `store` (the layer's constructor documents them).
    pub(crate) fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            methods: vec![Method::POST, Method::PATCH],
            key_header: crate::headers::IDEMPOTENCY_KEY.clone(),
            key_in_body: None,
            key_required: false,
            scope: Arc::new(scope::by_credentials),
            verifier: None,
            fingerprint_headers: Vec::new(),
            fingerprint_body: None,
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            store_rules: Arc::default(),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            wait: DEFAULT_WAIT,
            max_wait: DEFAULT_MAX_WAIT,
            finalize_deadline: DEFAULT_FINALIZE_DEADLINE,
            policy: CompletionPolicy::default(),
            answers: Answers::default(),
            recovery: None,
            protected_until_header: false,
            kept_requests: None,
            keys_in_clear: false,
            spawner: None,
            seed: None,
        }
    }

    /// How long after its completion a key stays protected (its retention, or the store's
    /// tombstone horizon when longer), if the layer says so on its answers.
    pub(crate) fn protection(&self) -> Option<Duration> {
        let horizon = self.store.tombstone_horizon();
        self.protected_until_header
            .then(|| self.retention.max(horizon))
    }

    /// A record as this layer's logs show it, outside a request's span (which names it).
    pub(crate) fn shown_record<'a>(&self, record: &'a RecordKey) -> ShownRecord<'a> {
        ShownRecord {
            scope: self.shown(record.scope()),
            key: self.shown(record.key().as_str()),
        }
    }

    /// A key or scope as this layer's logs show it.
    pub(crate) fn shown<'a>(&self, value: &'a str) -> Pseudonym<'a> {
        Pseudonym {
            value,
            clear: self.keys_in_clear,
        }
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("store", &self.store.kind())
            .field("methods", &self.methods)
            .field("key_header", &self.key_header)
            .field("key_in_body", &self.key_in_body)
            .field("key_required", &self.key_required)
            .field("verifier", &self.verifier.is_some())
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("max_request_body", &self.max_request_body)
            .field("request_body_timeout", &self.request_body_timeout)
            .field("max_response_body", &self.store_rules.max_body)
            .field("unstored_headers", &self.store_rules.unstored)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("wait", &self.wait)
            .field("finalize_deadline", &self.finalize_deadline)
            .field("answer_level", &self.answers.level)
            .field("recovery", &self.recovery.is_some())
            .field("keys_in_clear", &self.keys_in_clear)
            .finish_non_exhaustive()
    }
}
