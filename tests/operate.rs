//! What an operator sees: the request's span, an event for every answer the layer gives, causes
//! of store errors, no key in clear, the metrics, and the outcome on the response. Spans and
//! events are captured by a subscriber of the test's own; metrics by a debugging recorder.

mod support;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode},
    routing::post,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use support::{Answer, Faulty, RedisServer, StoreFault, TestSchema, call};
use tokio::sync::Semaphore;
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer, IdempotencyOutcome, MemoryStore,
    store::{PostgresStore, RedisStore, TieredStore},
};
use tracing::{
    Event, Level, Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id, Record},
};
use tracing_subscriber::{Layer, layer::Context, prelude::*, registry::LookupSpan};

fn main() -> std::process::ExitCode {
    support::run(crate::tests![
        current:
            the_response_carries_the_outcome_for_layers_outside;
        sync:
            a_guarded_request_has_a_span_of_its_own_the_handler_runs_in,
            every_answer_the_layer_gives_is_an_event_at_the_chosen_level,
            logs_never_show_a_key_or_scope_in_clear_unless_asked_to,
            store_errors_are_logged_with_their_causes,
            metrics_count_outcomes_time_the_store_and_follow_keys_held_and_the_breaker,
            an_unknown_outcome_and_an_unstored_response_are_outcomes_of_their_own,
            the_sweeper_logs_why_it_failed,
            units_of_work_count_apart_from_requests,
            every_outcome_is_exported_at_zero_before_it_happens,
            the_breaker_gauge_falls_back_when_the_cooldown_ends_on_an_idle_instance,
            a_store_failure_on_the_request_path_says_refused_unauthenticated_or_silent;
    ])
}

/// What the capturing subscriber saw.
#[derive(Default)]
struct Seen {
    spans: Vec<SpanSeen>,
    events: Vec<EventSeen>,
}

#[derive(Debug, Clone)]
struct SpanSeen {
    id: u64,
    name: &'static str,
    parent: Option<&'static str>,
    fields: HashMap<String, String>,
}

#[derive(Debug, Clone)]
struct EventSeen {
    level: Level,
    /// The names of the spans the event happened in, innermost first.
    scope: Vec<&'static str>,
    /// Ids of those spans, innermost first.
    scope_ids: Vec<u64>,
    fields: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Seen>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let mut text = value.to_string();
        let mut source = value.source();
        while let Some(cause) = source {
            text.push_str(": ");
            text.push_str(&cause.to_string());
            source = cause.source();
        }
        self.0.insert(field.name().to_owned(), text);
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        let parent = ctx
            .span(id)
            .and_then(|span| span.parent().map(|p| p.name()));
        self.0.lock().unwrap().spans.push(SpanSeen {
            id: id.into_u64(),
            name: attrs.metadata().name(),
            parent,
            fields,
        });
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut seen = self.0.lock().unwrap();
        if let Some(span) = seen.spans.iter_mut().rev().find(|s| s.id == id.into_u64()) {
            values.record(&mut Fields(&mut span.fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let spans: Vec<_> = ctx
            .event_scope(event)
            .map(|scope| scope.map(|s| (s.name(), s.id().into_u64())).collect())
            .unwrap_or_default();
        self.0.lock().unwrap().events.push(EventSeen {
            level: *event.metadata().level(),
            scope: spans.iter().map(|(name, _)| *name).collect(),
            scope_ids: spans.iter().map(|(_, id)| *id).collect(),
            fields,
        });
    }
}

impl Capture {
    fn spans(&self, name: &str) -> Vec<SpanSeen> {
        let seen = self.0.lock().unwrap();
        seen.spans
            .iter()
            .filter(|s| s.name == name)
            .cloned()
            .collect()
    }

    fn events(&self) -> Vec<EventSeen> {
        self.0.lock().unwrap().events.clone()
    }

    /// Everything captured, as text: for the test that no key appears in clear.
    fn text(&self) -> String {
        let seen = self.0.lock().unwrap();
        format!("{:?} {:?}", seen.spans, seen.events)
    }
}

/// Runs `test` on a current-thread runtime with `capture` as the subscriber (at every level) and
/// a debugging metrics recorder, so that everything the layer does is seen.
fn observed<F: Future<Output = ()>>(capture: &Capture, test: impl FnOnce(Recorded) -> F) {
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    let recorder = DebuggingRecorder::new();
    let recorded = Recorded {
        snapshotter: recorder.snapshotter(),
        totals: Mutex::default(),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    support::scoped_subscribers_hear_every_callsite();
    tracing::subscriber::with_default(subscriber, || {
        metrics::with_local_recorder(&recorder, || runtime.block_on(test(recorded)))
    });
}

/// What the recorder saw. Its snapshots drain it (counters and gauges swap to zero, histograms
/// empty), so the values are summed over snapshots: right for counters, for histograms' sample
/// counts and for gauges moved by increments, as the layer's are (and for the breaker's gauge,
/// set once per transition).
struct Recorded {
    snapshotter: Snapshotter,
    totals: Mutex<Vec<Total>>,
}

/// A metric's name, labels and value summed over snapshots.
type Total = (String, Vec<(String, String)>, f64);

impl Recorded {
    /// A counter, gauge or histogram's value by name and labels (histograms: how many samples).
    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut totals = self.totals.lock().unwrap();
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let key_labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            let value = match value {
                DebugValue::Counter(n) => n as f64,
                DebugValue::Gauge(g) => g.into_inner(),
                DebugValue::Histogram(samples) => samples.len() as f64,
            };
            match totals
                .iter_mut()
                .find(|(n, l, _)| n == key.name() && *l == key_labels)
            {
                Some((_, _, total)) => *total += value,
                None => totals.push((key.name().to_owned(), key_labels, value)),
            }
        }
        totals
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, total)| *total)
    }
}

fn pay(key: &str, body: &'static str) -> Request<Body> {
    Request::post("/pay")
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

fn app(layer: IdempotencyLayer) -> Router {
    Router::new().route(
        "/pay",
        post(|| async {
            tracing::info!("charging the card");
            (StatusCode::CREATED, "paid")
        })
        .route_layer(layer),
    )
}

/// An app whose handler, for the body `slow`, waits until the returned gate gets a permit.
fn gated_app(layer: IdempotencyLayer) -> (Router, Arc<Semaphore>) {
    let gate = Arc::new(Semaphore::new(0));
    let app = Router::new().route(
        "/pay",
        post({
            let gate = Arc::clone(&gate);
            move |body: String| async move {
                if body == "slow" {
                    let _permit = gate.acquire().await.unwrap();
                }
                (StatusCode::CREATED, "paid")
            }
        })
        .route_layer(layer),
    );
    (app, gate)
}

fn a_guarded_request_has_a_span_of_its_own_the_handler_runs_in() {
    let capture = Capture::default();
    observed(&capture, |_| async {
        let app = app(IdempotencyLayer::new(MemoryStore::new()));
        let caller = tracing::info_span!("caller");
        let answer = tracing::Instrument::instrument(call(&app, pay("k-span", "{}")), caller).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    });
    let spans = capture.spans("idempotency");
    assert_eq!(spans.len(), 1, "{spans:?}");
    let span = &spans[0];
    assert_eq!(
        span.parent,
        Some("caller"),
        "the caller's span is not the parent"
    );
    assert_eq!(span.fields["outcome"], "executed");
    assert!(span.fields["fence"].parse::<u64>().unwrap() > 0);
    assert!(span.fields["key"].starts_with('#'), "{:?}", span.fields);
    let handler = capture
        .events()
        .into_iter()
        .find(|e| {
            e.fields
                .get("message")
                .is_some_and(|m| m == "charging the card")
        })
        .unwrap();
    assert_eq!(handler.scope.first(), Some(&"idempotency"), "{handler:?}");
    assert_eq!(handler.scope_ids[0], span.id);
}

fn every_answer_the_layer_gives_is_an_event_at_the_chosen_level() {
    let capture = Capture::default();
    observed(&capture, |_| async {
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .with_key_required(true)
            .with_max_request_body(8)
            .with_wait(Duration::ZERO)
            .with_answer_log_level(Level::WARN);
        let (app, gate) = gated_app(layer);
        call(&app, pay("k-1", "{}")).await;
        assert!(call(&app, pay("k-1", "{}")).await.replayed());
        assert_eq!(
            call(&app, pay("k-1", "{\"x\"}")).await.status,
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            call(&app, pay("a b", "{}")).await.status,
            StatusCode::BAD_REQUEST
        );
        let unkeyed = Request::post("/pay").body(Body::from("{}")).unwrap();
        assert_eq!(call(&app, unkeyed).await.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            call(&app, pay("k-2", "too long!")).await.status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        let slow = tokio::spawn({
            let app = app.clone();
            async move { call(&app, pay("k-3", "slow")).await }
        });
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            call(&app, pay("k-3", "slow")).await.status,
            StatusCode::CONFLICT
        );
        gate.add_permits(1);
        slow.await.unwrap();
    });
    let answers: Vec<(Level, String)> = capture
        .events()
        .into_iter()
        .filter(|e| {
            e.fields
                .get("message")
                .is_some_and(|m| m == "answered instead of the handler")
        })
        .map(|e| (e.level, e.fields["outcome"].clone()))
        .collect();
    let outcomes: Vec<&str> = answers.iter().map(|(_, o)| o.as_str()).collect();
    assert_eq!(
        outcomes,
        [
            "replayed",
            "mismatch",
            "invalid_key",
            "invalid_key",
            "body_too_large",
            "in_flight"
        ]
    );
    assert!(
        answers.iter().all(|(level, _)| *level == Level::WARN),
        "{answers:?}"
    );
}

fn logs_never_show_a_key_or_scope_in_clear_unless_asked_to() {
    let secret = "order-of-mr-smith-4242";
    let tenant = "tenant-acme-corp";
    let run = |clear: bool| {
        let capture = Capture::default();
        observed(&capture, |_| async move {
            // A front that fails (nothing listens there), so that errors are logged too.
            let front = RedisStore::open("redis://127.0.0.1:1")
                .unwrap()
                .with_timeout(Duration::from_millis(100));
            let layer = IdempotencyLayer::new(TieredStore::new(front, MemoryStore::new()))
                .with_scope(move |_| Some(tenant.to_owned()))
                .with_wait(Duration::ZERO)
                .with_clear_keys_in_logs(clear);
            let app = app(layer);
            call(&app, pay(secret, "{}")).await;
            call(&app, pay(secret, "{}")).await;
            call(&app, pay(secret, "{\"other\":1}")).await;
        });
        capture.text()
    };
    let hidden = run(false);
    assert!(
        hidden.contains("answered instead of the handler"),
        "nothing was logged"
    );
    assert!(!hidden.contains(secret), "a key in clear: {hidden}");
    assert!(!hidden.contains(tenant), "a scope in clear: {hidden}");
    let shown = run(true);
    assert!(
        shown.contains(secret) && shown.contains(tenant),
        "the option did nothing"
    );
}

fn store_errors_are_logged_with_their_causes() {
    let capture = Capture::default();
    observed(&capture, |_| async move {
        let server = RedisServer::start_with(&["--requirepass", "s3cret"]).await;
        // No password: every Redis call fails with NOAUTH.
        let front = RedisStore::open(&server.url()).unwrap();
        let app = app(IdempotencyLayer::new(TieredStore::new(
            front,
            MemoryStore::new(),
        )));
        assert_eq!(
            call(&app, pay("k-auth", "{}")).await.status,
            StatusCode::CREATED
        );
    });
    let warned = capture
        .events()
        .into_iter()
        .find(|e| e.level == Level::WARN && e.fields.contains_key("error"))
        .expect("the front's failure was not logged");
    assert!(
        warned.fields["error"].contains("NOAUTH"),
        "the cause was dropped: {warned:?}"
    );
}

fn metrics_count_outcomes_time_the_store_and_follow_keys_held_and_the_breaker() {
    let capture = Capture::default();
    observed(&capture, |metrics| async move {
        let front = RedisStore::open("redis://127.0.0.1:1")
            .unwrap()
            .with_timeout(Duration::from_millis(100));
        let store = TieredStore::new(front, MemoryStore::new());
        let layer = IdempotencyLayer::new(store).with_wait(Duration::ZERO);
        let (app, gate) = gated_app(layer);
        call(&app, pay("k-1", "{}")).await;
        call(&app, pay("k-1", "{}")).await;
        call(&app, pay("k-1", "{\"x\":1}")).await;
        let slow = tokio::spawn({
            let app = app.clone();
            async move { call(&app, pay("k-2", "slow")).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(metrics.metric("idempotency_claims_held", &[]), Some(1.0));
        call(&app, pay("k-2", "slow")).await;
        gate.add_permits(1);
        slow.await.unwrap();
        assert_eq!(metrics.metric("idempotency_claims_held", &[]), Some(0.0));

        let requests = |outcome| {
            metrics.metric(
                "idempotency_requests_total",
                &[("outcome", outcome), ("store", "tiered")],
            )
        };
        assert_eq!(requests("executed"), Some(2.0));
        assert_eq!(requests("replayed"), Some(1.0));
        assert_eq!(requests("mismatch"), Some(1.0));
        assert_eq!(requests("in_flight"), Some(1.0));
        assert!(
            metrics
                .metric("idempotency_store_call_seconds", &[("operation", "claim")])
                .unwrap()
                >= 5.0
        );
        assert!(
            metrics
                .metric(
                    "idempotency_store_call_seconds",
                    &[("operation", "complete")]
                )
                .unwrap()
                >= 2.0
        );
        assert_eq!(
            metrics.metric("idempotency_handler_seconds", &[("store", "tiered")]),
            Some(2.0)
        );
        // Redis was never there: the breaker opened once, and the calls went on without it.
        assert_eq!(
            metrics.metric(
                "idempotency_front_breaker_transitions_total",
                &[("to", "open")]
            ),
            Some(1.0)
        );
        assert_eq!(
            metrics.metric("idempotency_front_breaker_open", &[]),
            Some(1.0)
        );
        assert!(
            metrics
                .metric(
                    "idempotency_front_fallbacks_total",
                    &[("operation", "claim")]
                )
                .unwrap()
                >= 5.0
        );
    });
}

async fn the_response_carries_the_outcome_for_layers_outside() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = Arc::clone(&seen);
    let app = app(IdempotencyLayer::new(MemoryStore::new()).with_wait(Duration::ZERO)).layer(
        axum::middleware::map_response(move |response: axum::response::Response| {
            let recorded = Arc::clone(&recorded);
            async move {
                let outcome = response.extensions().get::<IdempotencyOutcome>().copied();
                recorded.lock().unwrap().push(outcome);
                response
            }
        }),
    );
    call(&app, pay("k-x", "{}")).await;
    call(&app, pay("k-x", "{}")).await;
    call(&app, pay("k-x", "{\"y\":2}")).await;
    let unguarded = Request::get("/pay").body(Body::empty()).unwrap();
    let _: Answer = call(&app, unguarded).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [
            Some(IdempotencyOutcome::Executed),
            Some(IdempotencyOutcome::Replayed),
            Some(IdempotencyOutcome::Mismatch),
            None,
        ]
    );
}

fn an_unknown_outcome_and_an_unstored_response_are_outcomes_of_their_own() {
    let capture = Capture::default();
    observed(&capture, |metrics| async move {
        // A response over the cache limit: its retry is a 409 of its own kind.
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .with_max_response_body(16)
            .with_wait(Duration::ZERO);
        let app = Router::new().route(
            "/pay",
            post(|| async { "a response longer than sixteen bytes" }).route_layer(layer),
        );
        call(&app, pay("k-big", "{}")).await;
        assert_eq!(
            call(&app, pay("k-big", "{}")).await.status,
            StatusCode::CONFLICT
        );

        // A handler that committed through the fence and then went silent (its renewals stopped,
        // as when its instance dies): once its lease and the grace after it are over, the key's
        // outcome is unknown.
        let schema = TestSchema::new().await;
        let store = Faulty {
            inner: PostgresStore::new(schema.pool.clone()),
            fault: StoreFault::FrozenRenewals,
        };
        let layer = IdempotencyLayer::new(store)
            .with_lease(Duration::from_millis(200))
            .with_wait(Duration::ZERO);
        let pool = schema.pool.clone();
        let app = Router::new().route(
            "/pay",
            post(move |claim: IdempotencyClaim| async move {
                let mut tx = pool.begin().await.unwrap();
                claim.commit(&mut tx).await.unwrap();
                tx.commit().await.unwrap();
                std::future::pending::<&str>().await
            })
            .route_layer(layer),
        );
        let silent = tokio::spawn({
            let app = app.clone();
            async move { call(&app, pay("k-dead", "{}")).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        // The first look past the lease grants the owner half a lease to show it is alive.
        assert_eq!(
            call(&app, pay("k-dead", "{}")).await.status,
            StatusCode::CONFLICT
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let unknown = call(&app, pay("k-dead", "{}")).await;
        assert_eq!(unknown.status, StatusCode::CONFLICT);
        assert!(
            unknown.problem_type().ends_with("outcome-unknown"),
            "{unknown:?}"
        );
        silent.abort();

        // The memory store's layer, then the Postgres one's (wrapped: a wrapper is labelled with
        // the kind of the store it wraps).
        let requests = |outcome, store| {
            let labels = [("outcome", outcome), ("store", store)];
            metrics.metric("idempotency_requests_total", &labels)
        };
        assert_eq!(requests("response_not_stored", "memory"), Some(1.0));
        assert_eq!(requests("outcome_unknown", "postgres"), Some(1.0));
        assert_eq!(requests("in_flight", "postgres"), Some(1.0));
        for store in ["memory", "postgres"] {
            let replays = requests("replayed", store);
            assert_eq!(replays, Some(0.0), "a 409 counted as a replay");
        }
        schema.drop().await;
    });
    let answers: Vec<String> = capture
        .events()
        .into_iter()
        .filter(|e| {
            e.fields
                .get("message")
                .is_some_and(|m| m == "answered instead of the handler")
        })
        .map(|e| e.fields["outcome"].clone())
        .collect();
    assert_eq!(
        answers,
        ["response_not_stored", "in_flight", "outcome_unknown"]
    );
}

fn the_sweeper_logs_why_it_failed() {
    let capture = Capture::default();
    observed(&capture, |metrics| async move {
        // Nothing listens on port 1: every sweep fails to connect.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://postgres@127.0.0.1:1/test")
            .unwrap();
        let store = PostgresStore::new(pool).with_timeout(Duration::from_millis(500));
        let sweeper = store.spawn_sweeper(Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(200)).await;
        sweeper.abort();
        // Registered at zero when the store was built, and nothing swept since.
        assert_eq!(
            metrics.metric("idempotency_swept_rows_total", &[]),
            Some(0.0)
        );
    });
    let failure = capture
        .events()
        .into_iter()
        .find(|e| {
            e.fields
                .get("message")
                .is_some_and(|m| m == "idempotency sweep failed")
        })
        .expect("the sweeper's failure was not logged");
    assert_eq!(failure.level, Level::WARN);
    assert!(
        failure.fields["error"].contains("refused"),
        "the cause was dropped: {failure:?}"
    );
}

/// Units of work count in a family of their own, apart from requests: an operator tells a
/// consumer's redeliveries from an API's retries, and a unit's run time from a handler's.
fn units_of_work_count_apart_from_requests() {
    use tower_idempotency::work::{Once, Unit};
    observed(&Capture::default(), |recorded| async move {
        let once = Once::new(MemoryStore::new());
        let unit = |payload: &str| Unit::new("orders", "o-metrics", payload.as_bytes()).unwrap();
        let work = || |_| async { Ok::<_, std::io::Error>(1) };
        assert!(!once.run(unit("{}"), work()).await.unwrap().replayed);
        assert!(once.run(unit("{}"), work()).await.unwrap().replayed);
        assert!(once.run(unit("other"), work()).await.is_err());
        let units = |outcome| {
            let labels = [("outcome", outcome), ("store", "memory")];
            recorded.metric("idempotency_units_total", &labels)
        };
        assert_eq!(units("executed"), Some(1.0));
        assert_eq!(units("replayed"), Some(1.0));
        assert_eq!(units("mismatch"), Some(1.0));
        assert_eq!(units("outcome_unknown"), Some(0.0), "registered at zero");
        let ran = recorded.metric("idempotency_unit_seconds", &[("store", "memory")]);
        assert_eq!(ran, Some(1.0));
        assert_eq!(recorded.metric("idempotency_requests_total", &[]), None);
        assert_eq!(recorded.metric("idempotency_handler_seconds", &[]), None);
        let seen = once.counters().snapshot();
        assert_eq!((seen.executions, seen.replays, seen.mismatches), (1, 1, 1));
    });
}

/// Every outcome's series exists from the moment a layer is built, at zero: a dashboard panel
/// or an alert on a rare outcome (`outcome_unknown`) has data, not "No data", until it happens.
fn every_outcome_is_exported_at_zero_before_it_happens() {
    observed(&Capture::default(), |recorded| async move {
        let app = app(IdempotencyLayer::new(MemoryStore::new()));
        call(&app, pay("k-zero", "{}")).await;
        let requests = |outcome| {
            let labels = [("outcome", outcome), ("store", "memory")];
            recorded.metric("idempotency_requests_total", &labels)
        };
        assert_eq!(requests("executed"), Some(1.0));
        for outcome in [
            "outcome_unknown",
            "store_unavailable",
            "in_flight",
            "mismatch",
        ] {
            assert_eq!(requests(outcome), Some(0.0), "{outcome}");
        }
    });
}

/// `idempotency_front_breaker_open` says whether the front is skipped right now: on an idle
/// instance whose Redis is back it returns to 0 once the cooldown is over, with no request to
/// probe Redis. It stayed 1, and `IdempotencyFrontBreakerOpen` kept firing.
fn the_breaker_gauge_falls_back_when_the_cooldown_ends_on_an_idle_instance() {
    observed(&Capture::default(), |metrics| async move {
        let mut redis = RedisServer::start().await;
        let front = RedisStore::open(&redis.url())
            .unwrap()
            .with_timeout(Duration::from_millis(100));
        let cooldown = Duration::from_millis(300);
        let store = TieredStore::new(front, MemoryStore::new()).with_breaker_cooldown(cooldown);
        let store = Arc::new(store);
        let app = app(IdempotencyLayer::from_shared_store(store.clone()));
        redis.stop();
        let paid = call(&app, pay("k-breaker", "{}")).await;
        assert_eq!(paid.status, StatusCode::CREATED);
        assert!(store.front_skipped(), "skipped after the failure");
        redis.restart().await;
        // Idle: no request comes to probe the front. (The recorder's snapshots drain gauges,
        // so the gauge is read once, at the end: what was last set.)
        tokio::time::sleep(cooldown * 2).await;
        let gauge = metrics.metric("idempotency_front_breaker_open", &[]);
        assert_eq!(gauge, Some(0.0), "the cooldown is over: nothing is skipped");
        assert!(!store.front_skipped());
    });
}

/// A store failure on the request path says what happened: a Redis that refuses connections is
/// "refused", one that wants a password "NOAUTH", one that is frozen a timeout. Each answers 503
/// and logs the error with its cause.
fn a_store_failure_on_the_request_path_says_refused_unauthenticated_or_silent() {
    let cases: [(&str, &str); 3] = [
        ("refused", "refused"),
        ("unauthenticated", "NOAUTH"),
        ("frozen", "did not answer within"),
    ];
    for (case, expected) in cases {
        let capture = Capture::default();
        observed(&capture, |_| async move {
            let mut server = match case {
                "unauthenticated" => {
                    Some(RedisServer::start_with(&["--requirepass", "s3cret"]).await)
                }
                "frozen" => Some(RedisServer::start().await),
                _ => None,
            };
            let url = server
                .as_ref()
                .map_or("redis://127.0.0.1:1".to_owned(), |s| s.url());
            if case == "frozen" {
                server.as_mut().unwrap().pause();
            }
            let store = RedisStore::open(&url)
                .unwrap()
                .with_timeout(Duration::from_millis(200));
            let app = app(IdempotencyLayer::new(store));
            let answer = call(&app, pay("k-fail", "{}")).await;
            if case == "frozen" {
                server.as_mut().unwrap().resume();
            }
            assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{case}");
        });
        let logged = capture
            .events()
            .into_iter()
            .find(|e| e.fields.contains_key("error"))
            .unwrap_or_else(|| panic!("{case}: the failure was not logged"));
        assert!(
            logged.fields["error"].contains(expected),
            "{case}: {:?}",
            logged.fields["error"]
        );
    }
}
