//! The layer: how an application configures the middleware.

use std::{future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderName, Method, request::Parts};
use tower_layer::Layer;

use crate::{
    Idempotency, JsonFields,
    completer::{Completer, KeptRequests},
    policy::CompletionPolicy,
    problem::{Problem, Unverified},
    protocol::{Engine, State},
    settings::{self, Settings},
    store::{RecordKey, Store},
    telemetry::{Counters, Family, Telemetry},
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
///     .with_key_required(true)
///     // No tenant means no scope: the request is refused, never put in a shared scope.
///     .with_scope(|parts| parts.extensions.get::<Tenant>().map(|t| t.0.clone()))
///     .with_lease(Duration::from_secs(10));
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyLayer {
    settings: Settings,
    counters: Arc<Counters>,
    /// Shared by every service the layer builds: duplicates on this instance wait for each
    /// other, and one task renews all their leases.
    state: Arc<State>,
}

/// # Defaults: what each setting is until it is set
impl IdempotencyLayer {
    /// The lease: how long a claim survives its instance without renewal
    /// ([`with_lease`](Self::with_lease)): 30 s.
    pub const DEFAULT_LEASE: Duration = settings::DEFAULT_LEASE;
    /// How long a completed key's answer is replayed ([`with_retention`](Self::with_retention)):
    /// 24 hours.
    pub const DEFAULT_RETENTION: Duration = settings::DEFAULT_RETENTION;
    /// How long a duplicate waits for the first request with its key
    /// ([`with_wait`](Self::with_wait)): 10 s.
    pub const DEFAULT_WAIT: Duration = settings::DEFAULT_WAIT;
    /// The longest wait a duplicate may ask for with `Prefer: wait=N`
    /// ([`with_max_wait`](Self::with_max_wait)): 60 s.
    pub const DEFAULT_MAX_WAIT: Duration = settings::DEFAULT_MAX_WAIT;
    /// The limit of a guarded request body ([`with_max_request_body`](Self::with_max_request_body)):
    /// 1 MiB.
    pub const DEFAULT_MAX_REQUEST_BODY: usize = settings::DEFAULT_MAX_REQUEST_BODY;
    /// How long a guarded request body may take to arrive
    /// ([`with_request_body_timeout`](Self::with_request_body_timeout)): 30 s.
    pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = settings::DEFAULT_REQUEST_BODY_TIMEOUT;
    /// The largest response body stored for replay
    /// ([`with_max_response_body`](Self::with_max_response_body)): 1 MiB.
    pub const DEFAULT_MAX_RESPONSE_BODY: usize = crate::response::DEFAULT_MAX_RESPONSE_BODY;
    /// How long a response that could not be stored is retried, its key held
    /// ([`with_finalize_deadline`](Self::with_finalize_deadline)): 10 minutes.
    pub const DEFAULT_FINALIZE_DEADLINE: Duration = settings::DEFAULT_FINALIZE_DEADLINE;
}

/// # Construction
impl IdempotencyLayer {
    /// A layer on `store`, with the defaults: guards POST and PATCH; reads the key from
    /// `Idempotency-Key`; a missing key passes through; keys are scoped by the caller's
    /// credentials ([`scope::by_credentials`](crate::scope::by_credentials)); the fingerprint covers method, path, query,
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
            settings: Settings::new(store),
            counters: Arc::default(),
            state: Arc::default(),
        }
    }
}

/// # Requests: which are guarded, where the key is, whose key it is
impl IdempotencyLayer {
    /// The methods the layer guards; requests with any other method pass through untouched.
    pub fn with_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.settings.methods = methods.into_iter().collect();
        self
    }

    /// The request header that carries the key (`Idempotency-Key` by default), for clients that
    /// send another one, such as `X-Idempotency-Key`.
    pub fn with_key_header(mut self, name: HeaderName) -> Self {
        self.settings.key_header = name;
        self
    }

    /// Reads the key from the JSON request body, at `pointer` (RFC 6901: `/id`,
    /// `/data/object/id`), instead of from a header: for senders that name a delivery only in
    /// its body, such as Stripe's events (`/id`, `evt_…`). The value there is the key as it is:
    /// a string (or an integer) of 1 to 255 visible ASCII characters.
    ///
    /// The key is read from the body the layer buffers anyway (within
    /// [`with_max_request_body`](Self::with_max_request_body)), after the
    /// [verifier](Self::with_verifier) and before the claim. It is required: a body without it
    /// (or not JSON) is answered 400 ([`MISSING_KEY`](crate::problem::MISSING_KEY)), one whose
    /// value there is not a valid key 400 ([`INVALID_KEY`](crate::problem::INVALID_KEY)), and
    /// the handler does not run. The key header is not read.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};
    ///
    /// // Stripe's events: the event's id is the key, Stripe the scope.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_key_from_body("/id")
    ///     .with_scope(scope::fixed("stripe"));
    /// ```
    ///
    /// # Panics
    ///
    /// If `pointer` does not start with `/`.
    pub fn with_key_from_body(mut self, pointer: &str) -> Self {
        crate::key::assert_json_pointer(pointer);
        self.settings.key_in_body = Some(Arc::from(pointer));
        self
    }

    /// Whether a guarded request without a key is refused with 400 (`true`) or passed through
    /// without protection (`false`, the default). A key read from the body
    /// ([`with_key_from_body`](Self::with_key_from_body)) is always required.
    pub fn with_key_required(mut self, required: bool) -> Self {
        self.settings.key_required = required;
        self
    }

    /// Checks each guarded request before its key is claimed: `verify` gets the request head
    /// and the whole buffered body (the bytes as sent, which a signature covers), and refuses a
    /// request with an [`Unverified`]: answered 401 (or the client-error status it names) as a
    /// [`UNVERIFIED`](crate::problem::UNVERIFIED) problem, its key never claimed, the handler
    /// never run.
    ///
    /// This is where a webhook receiver checks the sender's signature and timestamp: a forged
    /// delivery, or one replayed past the sender's tolerance, that names a real event is
    /// refused without touching the event's key, so the genuine delivery still runs; a
    /// genuine redelivery (a fresh timestamp and signature over the same event) is verified,
    /// then answered from the store. Nothing that changes with every attempt (the signature,
    /// the timestamp) takes part in the fingerprint or the scope by default: keep it so.
    ///
    /// It runs after the body is read (within its limits) and before the key is read from it
    /// ([`with_key_from_body`](Self::with_key_from_body)). A request the
    /// [completer](crate::completer) resumes is not checked again: it was when it came. Only
    /// guarded requests are checked: a request without a key passes through unchecked unless
    /// the key is required, so a receiver requires it
    /// ([`with_key_required`](Self::with_key_required), or a key in the body).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, problem::Unverified, scope};
    ///
    /// fn signed(secret: &[u8], body: &[u8], signature: Option<&[u8]>) -> bool {
    ///     // Compute the sender's signature over `body` and compare in constant time.
    /// #   let _ = (secret, body);
    ///     signature.is_some()
    /// }
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_key_header(http::HeaderName::from_static("webhook-id"))
    ///     .with_key_required(true)
    ///     .with_scope(scope::fixed("billing-webhooks"))
    ///     .with_verifier(|parts, body| {
    ///         let signature = parts.headers.get("webhook-signature").map(|v| v.as_bytes());
    ///         match signed(b"secret", body, signature) {
    ///             true => Ok(()),
    ///             false => Err(Unverified::new("no signature matches")),
    ///         }
    ///     });
    /// ```
    pub fn with_verifier(
        mut self,
        verify: impl Fn(&Parts, &Bytes) -> Result<(), Unverified> + Send + Sync + 'static,
    ) -> Self {
        self.settings.verifier = Some(Arc::new(verify));
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
    /// The default, [`scope::by_credentials`](crate::scope::by_credentials), keeps callers with different `Authorization`
    /// headers apart. [`scope::fixed`](crate::scope::fixed) gives one scope to every caller of
    /// the route (a webhook sender's, say).
    pub fn with_scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.settings.scope = Arc::new(scope);
        self
    }
}

/// # Fingerprint: what makes two requests with one key the same request
impl IdempotencyLayer {
    /// Request headers that take part in the fingerprint, besides method, path, query,
    /// `Content-Type` and body (say a header that selects an API version).
    pub fn with_fingerprint_headers(
        mut self,
        headers: impl IntoIterator<Item = HeaderName>,
    ) -> Self {
        self.settings.fingerprint_headers = headers.into_iter().collect();
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
        self.settings.fingerprint_body = Some(Arc::new(body));
        self
    }

    /// What of a JSON body takes part in the fingerprint, declared: only some fields, or all
    /// but some ([`JsonFields`]), in their JSON meaning (neither whitespace nor member order
    /// counts). A [`with_fingerprint_body`](Self::with_fingerprint_body) of its own, for what a
    /// declaration cannot say.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, JsonFields, MemoryStore};
    ///
    /// // A sender that stamps every attempt with its number: the same event all the same.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_fingerprint_json(JsonFields::except(["/delivery_attempt"]));
    /// ```
    pub fn with_fingerprint_json(self, fields: JsonFields) -> Self {
        self.with_fingerprint_body(move |_, body| fields.canonical(body))
    }
}

/// # Limits: what is buffered, and what is stored for replay
impl IdempotencyLayer {
    /// The largest guarded request body buffered for the fingerprint; larger ones get 413 and
    /// never reach the handler.
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.settings.max_request_body = bytes;
        self
    }

    /// How long a guarded request body may take to arrive (30 s by default); a slower one gets a
    /// 408 problem and never reaches the handler. Bounds the memory a stalled upload holds.
    pub fn with_request_body_timeout(mut self, timeout: Duration) -> Self {
        self.settings.request_body_timeout = timeout;
        self
    }

    /// The largest response body stored for replay. A larger response still reaches its first
    /// caller in full and still completes the key (it never runs twice), but is stored without
    /// its body: retries get a `response-not-stored` problem.
    pub fn with_max_response_body(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.settings.store_rules).max_body = bytes;
        self
    }

    /// Response headers never stored nor replayed, besides the hop-by-hop ones (which never are).
    /// Replaces the default: `Date`, `Set-Cookie` (a replay must not re-send a session),
    /// `X-Request-Id`, `Request-Id`, `Traceparent`, `Tracestate` and `Server-Timing` (they
    /// describe the first exchange, not the outcome).
    pub fn with_unstored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        Arc::make_mut(&mut self.settings.store_rules).unstored = headers.into_iter().collect();
        self
    }
}

/// # Timing: leases, retention, waiting duplicates, stubborn stores
impl IdempotencyLayer {
    /// How long a claim survives without renewal. While the handler runs, the layer renews it
    /// every third of this; if the instance dies, the key becomes claimable once it runs out.
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease;
        // Requests of layers with different leases are renewed on different schedules.
        self.state = Arc::default();
        self
    }

    /// How long completed keys (and their responses) are kept.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// How long a request whose key is in flight waits for the first request to finish (10 s by
    /// default), and then gets its answer: the replay, or its own run if the first released the
    /// key. Past it, the answer is 409 with a `Retry-After` drawn from recent handler durations.
    /// `Duration::ZERO` answers 409 at once. A gRPC caller waits at most four fifths of its
    /// `grpc-timeout`.
    ///
    /// A duplicate is woken the moment the first request finalizes, wherever in the fleet it
    /// runs: by this process when the first runs here, by the store's word when it runs on
    /// another instance (Redis, Postgres: [`Wakes`](crate::store::Wakes)); on a store that gives
    /// no word it polls (after 10 ms, doubling up to every 200 ms), each poll a read. The
    /// default covers most handlers' durations while staying under common client and proxy
    /// timeouts (30 to 60 s): keep it below any timeout in front of the layer.
    pub fn with_wait(mut self, wait: Duration) -> Self {
        self.settings.wait = wait;
        self
    }

    /// The longest a duplicate waits when it asks (60 s by default). A request may say how long
    /// it is willing to wait for its answer, `Prefer: wait=N` in seconds (RFC 7240): longer than
    /// [`with_wait`](Self::with_wait), for a long handler whose duplicate would rather follow
    /// it to its answer than loop on 409s, or shorter (`wait=0`: 409 at once). The layer
    /// honors it up to this bound (and four fifths of a gRPC deadline), for as long as the first
    /// request's owner keeps its lease, and says so on its own answers with
    /// `Preference-Applied: wait=N`, the seconds it honored. Keep it below any timeout in front
    /// of the layer. `Duration::ZERO` makes every preference 409 at once.
    pub fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.settings.max_wait = max_wait;
        self
    }

    /// How long the layer keeps retrying to store a response when the store fails (10 minutes by
    /// default). Meanwhile the key stays held, its lease renewed, so no retry runs the handler
    /// again; the caller is answered after the first few attempts. Past it, the layer gives up,
    /// logs an error, and the key frees itself when its lease runs out.
    pub fn with_finalize_deadline(mut self, deadline: Duration) -> Self {
        self.settings.finalize_deadline = deadline;
        self
    }
}

/// # Answers: which responses are stored, how the layer's own are rendered
impl IdempotencyLayer {
    /// Which responses are stored and which release the key.
    pub fn with_completion_policy(mut self, policy: CompletionPolicy) -> Self {
        self.settings.policy = policy;
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
        self.settings.answers.problem_response = Some(Arc::new(render));
        self
    }

    /// Adjusts every replayed response before it leaves: its status, headers and extensions
    /// (the stored body and trailers go as stored). For headers that belong to this exchange
    /// rather than the stored one (a request id, a fresh `Date`, a `Cache-Control`), as
    /// [`with_problem_response`](Self::with_problem_response) does for the layer's own answers.
    /// What the hook changes is not stored: every replay starts from the stored response. The
    /// replay marker (`Idempotent-Replayed: true`) is set again after the hook, so clients can
    /// always tell a replay.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_replayed_response(|parts| {
    ///     parts.headers.insert("cache-control", "no-store".parse().unwrap());
    /// });
    /// ```
    pub fn with_replayed_response(
        mut self,
        adjust: impl Fn(&mut http::response::Parts) + Send + Sync + 'static,
    ) -> Self {
        self.settings.answers.replayed_response = Some(Arc::new(adjust));
        self
    }

    /// Rebuilds the answer of a key whose handler committed through the fence
    /// ([`IdempotencyClaim::commit`](crate::IdempotencyClaim::commit)) and whose instance died
    /// before the layer stored its response: the hook gets the key's record and answers from
    /// the application's own rows (the payment the handler wrote, say). The answer is stored,
    /// owner-checked, and replayed to this and every later retry, instead of
    /// `409 outcome-unknown` for the whole retention. Called only for such keys, once their
    /// owner's lease and grace have run out. Needs a store that can adopt a key (Postgres,
    /// alone or behind Redis); on the others the retries still get `outcome-unknown`.
    ///
    /// `None` means "no answer yet" (the read failed, say): the caller is told the key is in
    /// flight (`409 in-flight`, `Retry-After` one second; a caller within its
    /// [wait](Self::with_wait) is not answered yet, and the hook is asked again), and so is a
    /// caller whose rebuilt answer the store could not keep. A key is never `outcome-unknown`
    /// while a hook is installed: one that knows the outcome cannot be rebuilt answers with a
    /// response of its own saying so, which is stored and replayed like any other.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_recovery(|record| async move {
    ///     // Look the payment up by `record.key()` in the application's tables…
    ///     let found = Some(format!(r#"{{"payment_for":"{}"}}"#, record.key()));
    ///     found.map(|body| http::Response::builder().status(201).body(Bytes::from(body)).unwrap())
    /// });
    /// ```
    pub fn with_recovery<F, Fut>(mut self, recover: F) -> Self
    where
        F: Fn(RecordKey) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<http::Response<Bytes>>> + Send + 'static,
    {
        self.settings.recovery = Some(Arc::new(move |record| Box::pin(recover(record))));
        self
    }

    /// Says on every answer that stands for the key's outcome until when that key is
    /// protected: `Idempotency-Key-Protected-Until`, an HTTP date
    /// ([`IDEMPOTENCY_KEY_PROTECTED_UNTIL`](crate::headers::IDEMPOTENCY_KEY_PROTECTED_UNTIL)). Off by
    /// default.
    ///
    /// Until then, a retry with the key gets the outcome (the replay, or past the retention the
    /// store's tombstone, `410 answer-expired`); after it, the key is new and the request runs
    /// again. The date is the key's completion plus its retention
    /// ([`with_retention`](Self::with_retention)), or plus the store's tombstone horizon when
    /// that is longer. It is sent on:
    ///
    /// - the answer that completed the key, once it is stored;
    /// - a replay;
    /// - the `410 answer-expired` of a tombstone.
    ///
    /// Never on an answer that released the key (a 5xx, say), on a 409 while the key is in
    /// flight, or on a response streamed before it was stored.
    ///
    /// The client layer (`client` feature) learns from it how long the server protects a key,
    /// and stops retrying a logical call past that.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_protected_until_header(true);
    /// ```
    pub fn with_protected_until_header(mut self, send: bool) -> Self {
        self.settings.protected_until_header = send;
        self
    }
}

/// # The completer: what nobody retries, finished
impl IdempotencyLayer {
    /// Keeps the request a key was claimed for, with its first recovery point, so that the
    /// [completer](crate::completer) can resume the handler when its instance dies and nobody
    /// retries. Off by default. What is kept, and up to which size, is `kept`'s; credentials
    /// never are. Install it on the routes whose handlers record recovery points.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, completer::KeptRequests};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_kept_requests(KeptRequests::new().with_max_body(16 * 1024));
    /// ```
    pub fn with_kept_requests(mut self, kept: KeptRequests) -> Self {
        self.settings.kept_requests = Some(Arc::new(kept));
        self
    }

    /// The [completer](crate::completer) of this layer's keys: it resumes kept requests
    /// through `service` (the service this layer guards, inside any layer that authenticates:
    /// kept requests carry no credentials), and answers keys committed without an answer
    /// with this layer's recovery hook. Run it with [`Completer::spawn`] on every instance.
    pub fn completer<S>(&self, service: S) -> Completer<S> {
        Completer::new(self.engine(), service)
    }

    /// The engine of a service (or a completer) this layer builds: its settings, its counters,
    /// the state every one of them shares.
    fn engine(&self) -> Arc<Engine> {
        let (counters, store) = (Arc::clone(&self.counters), self.settings.store.kind());
        let telemetry = Telemetry::new(counters, store, Family::Requests);
        Arc::new(Engine::new(
            self.settings.clone(),
            telemetry,
            Arc::clone(&self.state),
        ))
    }
}

/// # Tasks: where the layer's own run
impl IdempotencyLayer {
    /// Runs the layer's own tasks (lease renewals, and a request's work once its caller has
    /// gone) through `spawn` instead of where they run by default: renewals on a thread of
    /// their own with a runtime of its own, so that a handler blocking the application's
    /// runtime never stops them, and a caller's work on the runtime it was called on.
    ///
    /// For a runtime you control the clock of: a test with paused time
    /// (`#[tokio::test(start_paused = true)]`, where leases run out in its time, not the
    /// wall's), or a simulation that blocks, crashes and restarts instances deterministically.
    /// Renewals then stop while that runtime is blocked. The layer still never acts on a grant
    /// that lapsed meanwhile, but a handler that blocks its runtime for longer than the lease
    /// loses its key; in production, keep the default.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_spawner(tokio::spawn);
    /// ```
    #[cfg(feature = "simulation")]
    #[cfg_attr(docsrs, doc(cfg(feature = "simulation")))]
    pub fn with_spawner(
        mut self,
        spawn: impl Fn(crate::store::BoxFuture<'static, ()>) -> tokio::task::JoinHandle<()>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.settings.spawner = Some(Arc::new(spawn));
        self.state = Arc::default();
        self
    }

    /// Makes the layer's randomness a function of `seed`: its owner tokens (the seed and a
    /// counter of the layer's own, instead of random bits each thread draws once) and so the
    /// jitter of its duplicates' polls. For a test or a simulation that must replay exactly
    /// from a seed. Owner tokens must be unique across every process sharing a store: give
    /// each instance a seed of its own, and never set one in production.
    #[cfg(feature = "simulation")]
    #[cfg_attr(docsrs, doc(cfg(feature = "simulation")))]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.settings.seed = Some(settings::Seed::new(seed));
        self
    }
}

/// # Observability: logs and counters
impl IdempotencyLayer {
    /// Whether logs and spans show keys and scopes as they are (`true`) or, by default, as
    /// pseudonyms: `#` and 12 hex digits of their SHA-256, the same on every instance, so one key
    /// can be followed through the logs without customers' order numbers or tenants' names in
    /// them. A pseudonym is not encryption: a guessable key can be found by hashing guesses.
    pub fn with_clear_keys_in_logs(mut self, clear: bool) -> Self {
        self.settings.keys_in_clear = clear;
        self
    }

    /// The level of the event logged for every answer the layer gives instead of the handler
    /// (a replay, a 409, a 422, a 400…): `INFO` by default. Store failures are logged at
    /// `ERROR` whatever this says.
    pub fn with_answer_log_level(mut self, level: tracing::Level) -> Self {
        self.settings.answers.level = level;
        self
    }

    /// The process-local counters of every service this layer builds (see
    /// [`telemetry`](crate::telemetry) for the metrics exported through the facade).
    pub fn counters(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }
}
impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        crate::telemetry::register_layer_metrics(self.settings.store.kind());
        Idempotency::new(inner, self.engine())
    }
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, feature = "simulation"))]
mod tests {
    use super::*;
    use crate::MemoryStore;

    /// The engine a layer builds its services on.
    fn engine(layer: &IdempotencyLayer) -> Engine {
        let telemetry = Telemetry::new(Arc::default(), "memory", Family::Requests);
        Engine::new(layer.settings.clone(), telemetry, Arc::clone(&layer.state))
    }

    /// Layers derived from one seeded layer never draw the same owner token, though a later
    /// setting (the lease) gives each its own runtime state: two owners with one token would
    /// pass each other's ownership checks.
    #[test]
    fn layers_derived_from_one_seed_draw_distinct_owner_tokens() {
        let base = IdempotencyLayer::new(MemoryStore::new()).with_seed(7);
        let one = engine(&base.clone().with_lease(Duration::from_secs(5)));
        let other = engine(&base.with_lease(Duration::from_secs(9)));
        let mut tokens: Vec<_> = (0..3)
            .flat_map(|_| [one.owner_token(), other.owner_token()])
            .collect();
        tokens.sort();
        tokens.dedup();
        assert_eq!(tokens.len(), 6, "a token was drawn twice: {tokens:?}");
    }
}
