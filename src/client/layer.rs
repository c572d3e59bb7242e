//! The client layer: how a caller configures its retries.

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use http::{HeaderName, Method};
use tower::retry::budget::{Budget, TpsBudget};
use tower_layer::Layer;

use super::{IdempotencyClient, protection::Learned};

/// Default number of attempts of one logical call, the first included: 4.
pub const DEFAULT_CLIENT_ATTEMPTS: u32 = 4;
/// Default time a logical call may take, its attempts and pauses included: 30 s.
pub const DEFAULT_CLIENT_DEADLINE: Duration = Duration::from_secs(30);
/// Default time one attempt may take before it counts as lost (and is retried): 10 s.
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default ceiling of the first pause (it doubles on each retry): 100 ms.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(100);
/// Default longest pause between attempts: 5 s.
pub const DEFAULT_BACKOFF_CAP: Duration = Duration::from_secs(5);
/// Default largest request body buffered for retries: 1 MiB.
pub const DEFAULT_CLIENT_MAX_BODY: usize = 1024 * 1024;

/// Applies [`IdempotencyClient`] to a client service (hyper-util's client, a tonic channel,
/// anything that is a `Service<http::Request<ClientBody<B>>>`): one `Idempotency-Key` per
/// logical call, sent on every attempt, and retries of what is safe to retry.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::IdempotencyClientLayer;
///
/// let layer = IdempotencyClientLayer::new()
///     .with_max_attempts(5)
///     .with_deadline(Duration::from_secs(20))
///     .with_attempt_timeout(Duration::from_secs(5));
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyClientLayer {
    settings: Arc<ClientSettings>,
}

/// What a client was configured with, shared by every service the layer builds.
#[derive(Clone)]
pub(crate) struct ClientSettings {
    pub(crate) methods: Vec<Method>,
    pub(crate) key_header: HeaderName,
    pub(crate) max_attempts: u32,
    pub(crate) deadline: Duration,
    pub(crate) attempt_timeout: Duration,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_cap: Duration,
    pub(crate) max_body: usize,
    pub(crate) budget: Arc<dyn Budget + Send + Sync>,
    pub(crate) protection: Option<Duration>,
    pub(crate) learned: Arc<Learned>,
    pub(crate) seed: Option<u64>,
    /// UUIDs drawn from the seed.
    pub(crate) drawn: Arc<AtomicU64>,
}

impl ClientSettings {
    /// How long the server of `uri` protects a key after its request completes: what its
    /// answers said last, else what the layer was told.
    pub(crate) fn protection(&self, uri: &http::Uri) -> Option<Duration> {
        self.learned.of(uri).or(self.protection)
    }

    /// A fresh UUID (a call's key, the seed of its jitter): random, or for a layer with a seed,
    /// the seed and a counter.
    pub(crate) fn uuid(&self) -> uuid::Uuid {
        match self.seed {
            Some(seed) => uuid::Uuid::from_u64_pair(seed, self.drawn.fetch_add(1, Relaxed)),
            None => uuid::Uuid::new_v4(),
        }
    }
}

impl Default for IdempotencyClientLayer {
    fn default() -> Self {
        Self::new()
    }
}

/// # Construction
impl IdempotencyClientLayer {
    /// A layer with the defaults: guards POST and PATCH; sends the key in `Idempotency-Key`
    /// (the caller's own if it set one, else a fresh random key per logical call); up to 4
    /// attempts within 30 s, each cut at 10 s; pauses with full jitter from 100 ms doubling to
    /// 5 s, or as long as the server's `Retry-After` says; request bodies up to 1 MiB buffered
    /// for retries; a retry budget of tower's defaults (20 % of calls, at least 10 a second); a
    /// key's protection as each server says it (`Idempotency-Key-Protected-Until`), else none
    /// assumed.
    pub fn new() -> Self {
        let settings = ClientSettings {
            methods: vec![Method::POST, Method::PATCH],
            key_header: crate::headers::IDEMPOTENCY_KEY.clone(),
            max_attempts: DEFAULT_CLIENT_ATTEMPTS,
            deadline: DEFAULT_CLIENT_DEADLINE,
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            backoff_base: DEFAULT_BACKOFF_BASE,
            backoff_cap: DEFAULT_BACKOFF_CAP,
            max_body: DEFAULT_CLIENT_MAX_BODY,
            budget: Arc::new(TpsBudget::default()),
            protection: None,
            learned: Arc::default(),
            seed: None,
            drawn: Arc::default(),
        };
        Self {
            settings: Arc::new(settings),
        }
    }

    fn set(mut self, change: impl FnOnce(&mut ClientSettings)) -> Self {
        change(Arc::make_mut(&mut self.settings));
        self
    }
}

/// # Requests: which are guarded, and where the key goes
impl IdempotencyClientLayer {
    /// The methods that get a key and retries; other requests pass through, sent once.
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.set(|s| s.methods = methods.into_iter().collect())
    }

    /// The header (or gRPC metadata entry) that carries the key: `Idempotency-Key` by default.
    pub fn with_key_header(self, name: HeaderName) -> Self {
        self.set(|s| s.key_header = name)
    }

    /// The largest request body buffered so that every attempt sends the same bytes (1 MiB by
    /// default). A larger one is sent once, without retries.
    pub fn with_max_body(self, bytes: usize) -> Self {
        self.set(|s| s.max_body = bytes)
    }
}

/// # Retries: how many, how long, how far apart
impl IdempotencyClientLayer {
    /// How many attempts one logical call may make, the first included (at least 1).
    pub fn with_max_attempts(self, attempts: u32) -> Self {
        self.set(|s| s.max_attempts = attempts.max(1))
    }

    /// How long a logical call may take, attempts and pauses included: no attempt starts, and
    /// no pause is taken, past it.
    pub fn with_deadline(self, deadline: Duration) -> Self {
        self.set(|s| s.deadline = deadline)
    }

    /// How long one attempt may take before it is given up and retried (its outcome unknown:
    /// the server may have run it, and answers the retry with the same outcome).
    pub fn with_attempt_timeout(self, timeout: Duration) -> Self {
        self.set(|s| s.attempt_timeout = timeout)
    }

    /// Exponential backoff with full jitter: the pause before the n-th retry is drawn from zero
    /// to `base × 2^(n-1)`, at most `cap`. A server's `Retry-After` (or gRPC pushback) replaces
    /// it.
    pub fn with_backoff(self, base: Duration, cap: Duration) -> Self {
        self.set(|s| (s.backoff_base, s.backoff_cap) = (base, cap))
    }

    /// The retry budget, shared by every service this layer builds (and by every layer given
    /// the same `Arc`): each logical call deposits, each retry withdraws, and a retry the
    /// budget refuses is not made, so a fleet in trouble does not multiply its own load.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use tower::retry::budget::TpsBudget;
    /// use tower_idempotency::client::IdempotencyClientLayer;
    ///
    /// // Retries of at most 10 % of the calls of the last 10 s, and 1 a second at least.
    /// let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.1));
    /// let layer = IdempotencyClientLayer::new().with_budget(budget);
    /// ```
    pub fn with_budget(self, budget: Arc<dyn Budget + Send + Sync>) -> Self {
        self.set(|s| s.budget = budget)
    }
}

/// # Protection: how long a server keeps a key
impl IdempotencyClientLayer {
    /// How long the servers protect a key after its request completes (the retention of their
    /// answers, or of their tombstones when longer), for servers that do not say so on their
    /// answers: a server that sends `Idempotency-Key-Protected-Until` is taken at its word, per
    /// origin, from its latest answer that completed a key.
    ///
    /// The client never sends a logical call (a retry, or a call resumed with [`CallStarted`])
    /// once this much has passed since it started, since the server could run it again: it
    /// answers [`ProtectionEnded`] instead. With neither, it assumes nothing.
    ///
    /// [`CallStarted`]: super::CallStarted
    /// [`ProtectionEnded`]: super::ProtectionEnded
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::client::IdempotencyClientLayer;
    ///
    /// // A provider that keeps keys for 24 hours.
    /// let layer = IdempotencyClientLayer::new().with_key_protection(Duration::from_secs(24 * 3600));
    /// ```
    pub fn with_key_protection(self, protection: Duration) -> Self {
        self.set(|s| s.protection = Some(protection))
    }
}

/// # Randomness
impl IdempotencyClientLayer {
    /// Makes the client's randomness a function of `seed`: the keys it mints and the jitter of
    /// its pauses. For a test or a simulation that must replay exactly; keys minted from a seed
    /// are unique only among this layer's calls, so never set one in production.
    #[cfg(feature = "simulation")]
    #[cfg_attr(docsrs, doc(cfg(feature = "simulation")))]
    pub fn with_seed(self, seed: u64) -> Self {
        self.set(|s| s.seed = Some(seed))
    }
}

impl<S> Layer<S> for IdempotencyClientLayer {
    type Service = IdempotencyClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyClient::new(inner, Arc::clone(&self.settings))
    }
}

impl fmt::Debug for IdempotencyClientLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.settings;
        f.debug_struct("IdempotencyClientLayer")
            .field("methods", &s.methods)
            .field("key_header", &s.key_header)
            .field("max_attempts", &s.max_attempts)
            .field("deadline", &s.deadline)
            .field("attempt_timeout", &s.attempt_timeout)
            .field("backoff_base", &s.backoff_base)
            .field("backoff_cap", &s.backoff_cap)
            .field("max_body", &s.max_body)
            .field("protection", &s.protection)
            .finish_non_exhaustive()
    }
}
