//! The payment example, run as its own process on the memory store and driven over HTTP.

mod support;

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use support::{
    Answer, MockProvider, Proc, ProviderFault, RedisServer, TestSchema, database_url, free_port,
    post_json, send, url_in_schema,
};

use tower_idempotency::problem;

fn main() -> std::process::ExitCode {
    support::run(crate::tests![
        current:
            payments_example_creates_replays_and_refuses,
            payments_example_lets_a_duplicate_wait_as_asked_and_refuses_a_late_retry_until_the_horizon,
            payments_example_lets_a_corrected_request_run_and_keeps_callers_apart,
            hyper_example_runs_an_order_once,
            payments_example_serves_its_metrics_to_prometheus,
            admin_inspect_fails_when_a_tier_cannot_be_read,
            a_store_that_cannot_serve_stops_the_example_at_start;
        multi(2):
            admin_command_finds_a_stuck_key_and_forgets_it_so_the_next_request_runs,
            the_dashboard_and_the_alert_rules_name_only_metrics_the_crate_emits,
            payments_example_charges_a_faulty_provider_once_per_payment;
    ])
}

const PAYMENT: &str = r#"{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}"#;

async fn payments_example_creates_replays_and_refuses() {
    let app = Proc::example("payments", &[]).await;
    let url = app.url("/payments");

    let created = post_json(&url, "order-42", PAYMENT).await.unwrap();
    assert_eq!(created.status, StatusCode::CREATED);
    let payment = created.json();
    let id = payment["id"].as_str().unwrap().to_owned();
    assert_eq!(payment["amount_cents"], 4900);
    assert_eq!(payment["customer"], "cus_1");
    assert_eq!(created.headers["location"], format!("/payments/{id}"));

    let replay = post_json(&url, "order-42", PAYMENT).await.unwrap();
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.json()["id"], id.as_str());

    let fetched = send(Method::GET, &app.url(&format!("/payments/{id}")), &[], "")
        .await
        .unwrap();
    assert_eq!(fetched.status, StatusCode::OK);
    assert_eq!(fetched.json(), payment);

    let changed = post_json(&url, "order-42", &PAYMENT.replace("4900", "5000"))
        .await
        .unwrap();
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);

    let unkeyed = send(
        Method::POST,
        &url,
        &[("content-type", "application/json")],
        PAYMENT,
    )
    .await
    .unwrap();
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);

    let missing = send(Method::GET, &app.url("/payments/pay_nope"), &[], "")
        .await
        .unwrap();
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
}

/// What the payments example takes from its environment about waiting, retention and
/// tombstones, tried as a user would with curl: a duplicate that asks to wait (`Prefer: wait=N`)
/// for a slow payment gets it, one that does not gets 409; a retry after
/// `IDEMPOTENCY_RETENTION_MS` is refused (410, answer expired) and charges nothing, until
/// `IDEMPOTENCY_TOMBSTONE_HORIZON_MS` after the payment; past it, it is a new request.
async fn payments_example_lets_a_duplicate_wait_as_asked_and_refuses_a_late_retry_until_the_horizon()
 {
    let env = [
        ("PAYMENTS_WORK_MS", "1500".to_owned()),
        ("IDEMPOTENCY_WAIT_MS", "100".to_owned()),
        ("IDEMPOTENCY_RETENTION_MS", "1000".to_owned()),
        ("IDEMPOTENCY_TOMBSTONE_HORIZON_MS", "3000".to_owned()),
    ];
    let app = Proc::example("payments", &env).await;
    let url = app.url("/payments");
    let post = |prefer: Option<&'static str>| {
        let url = url.clone();
        async move {
            let mut headers = vec![
                ("content-type", "application/json"),
                ("idempotency-key", "order-wait"),
            ];
            headers.extend(prefer.map(|value| ("prefer", value)));
            send(Method::POST, &url, &headers, PAYMENT).await.unwrap()
        }
    };
    let first = tokio::spawn(post(None));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let impatient = post(None).await;
    assert_eq!(impatient.status, StatusCode::CONFLICT);
    let patient = post(Some("wait=10")).await;
    assert_eq!(patient.status, StatusCode::CREATED, "{patient:?}");
    assert!(patient.replayed());
    assert_eq!(patient.headers["preference-applied"], "wait=10");
    let first = first.await.unwrap();
    assert_eq!(patient.json()["id"], first.json()["id"]);

    let completed = Instant::now();

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = post(None).await;
    assert_eq!(late.status, StatusCode::GONE, "{late:?}");
    assert_eq!(late.json()["type"], problem::ANSWER_EXPIRED);
    assert!(!late.headers.contains_key("retry-after"));
    // Both say the same end of the key's protection: the horizon after the payment.
    let until = |answer: &Answer| {
        let until = &answer.headers["idempotency-key-protected-until"];
        httpdate::parse_http_date(until.to_str().unwrap()).unwrap()
    };
    let (first_until, late_until) = (until(&first), until(&late));
    let apart = late_until
        .duration_since(first_until)
        .unwrap_or_else(|early| early.duration());
    assert!(
        apart <= Duration::from_secs(1),
        "{first_until:?} {late_until:?}"
    );

    tokio::time::sleep_until((completed + Duration::from_millis(3500)).into()).await;
    let later = post(None).await;
    assert_eq!(later.status, StatusCode::CREATED);
    assert!(!later.replayed(), "a retry past the horizon runs again");
    assert_ne!(later.json()["id"], first.json()["id"]);
}

/// Payment rows the example wrote for `key`: counted where they are, in Postgres.
async fn rows(schema: &TestSchema, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE idempotency_key = $1")
        .bind(key)
        .fetch_one(&schema.pool)
        .await
        .unwrap()
}

async fn payments_example_lets_a_corrected_request_run_and_keeps_callers_apart() {
    let schema = TestSchema::new().await;
    let app = Proc::example(
        "payments",
        &[("DATABASE_URL", url_in_schema(&database_url(), &schema.name))],
    )
    .await;
    let json = ("content-type", "application/json");

    // A mistyped path (404), a method the route does not serve (405), no content type (415),
    // an invalid payment (422): nothing ran, and the corrected request with the same key runs.
    let key = ("idempotency-key", "order-fixed");
    let typo = send(Method::POST, &app.url("/paymnts"), &[key, json], PAYMENT).await;
    assert_eq!(typo.unwrap().status, StatusCode::NOT_FOUND);
    let wrong = send(
        Method::POST,
        &app.url("/payments/p1"),
        &[key, json],
        PAYMENT,
    )
    .await;
    assert_eq!(wrong.unwrap().status, StatusCode::METHOD_NOT_ALLOWED);
    let untyped = send(Method::POST, &app.url("/payments"), &[key], PAYMENT).await;
    assert_eq!(untyped.unwrap().status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let invalid = PAYMENT.replace("4900", "-1");
    let refused = send(Method::POST, &app.url("/payments"), &[key, json], &invalid).await;
    assert_eq!(refused.unwrap().status, StatusCode::UNPROCESSABLE_ENTITY);
    let corrected = post_json(&app.url("/payments"), "order-fixed", PAYMENT)
        .await
        .unwrap();
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert!(!corrected.replayed());
    let retry = post_json(&app.url("/payments"), "order-fixed", PAYMENT)
        .await
        .unwrap();
    assert!(retry.replayed());
    assert_eq!(rows(&schema, "order-fixed").await, 1);

    // Two callers with different credentials, the same key and body: two payments.
    let as_caller = |token: &'static str| {
        let url = app.url("/payments");
        async move {
            let authorization = format!("Bearer {token}");
            send(
                Method::POST,
                &url,
                &[
                    ("idempotency-key", "order-shared"),
                    json,
                    ("authorization", &authorization),
                ],
                PAYMENT,
            )
            .await
            .unwrap()
        }
    };
    let alice = as_caller("alice").await;
    let bob = as_caller("bob").await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.json()["id"], bob.json()["id"]);
    assert_eq!(as_caller("alice").await.json()["id"], alice.json()["id"]);
    assert_eq!(rows(&schema, "order-shared").await, 2);
    drop(app);
    schema.drop().await;
}

async fn hyper_example_runs_an_order_once() {
    let app = Proc::example("hyper_server", &[]).await;
    let url = app.url("/orders");
    let order = |key: &'static str, body: &'static str| {
        let url = url.clone();
        async move {
            send(Method::POST, &url, &[("idempotency-key", key)], body)
                .await
                .unwrap()
        }
    };

    let first = order("order-1", "two coffees").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["location"], "/orders/1");
    assert_eq!(first.body, "order 1: two coffees (key order-1)\n");

    let replay = order("order-1", "two coffees").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["location"], "/orders/1");

    assert_eq!(
        order("order-1", "three coffees").await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    let second = order("order-2", "a tea").await;
    assert_eq!(second.body, "order 2: a tea (key order-2)\n");
    let unkeyed = send(Method::POST, &url, &[], "x").await.unwrap();
    assert_eq!(unkeyed.status, StatusCode::BAD_REQUEST);

    // Only `POST /orders` takes an order: `curl localhost:3000/metrics` took one.
    let elsewhere = send(Method::GET, &app.url("/metrics"), &[], "")
        .await
        .unwrap();
    assert_eq!(elsewhere.status, StatusCode::NOT_FOUND);
    let listed = send(Method::GET, &url, &[], "").await.unwrap();
    assert_eq!(listed.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(listed.headers["allow"], "POST");
    let third = order("order-3", "a cake").await;
    assert_eq!(
        third.body, "order 3: a cake (key order-3)\n",
        "no order taken meanwhile"
    );
}

async fn payments_example_serves_its_metrics_to_prometheus() {
    let app = Proc::example("payments", &[]).await;
    let url = app.url("/payments");
    post_json(&url, "order-m", PAYMENT).await.unwrap();
    assert!(
        post_json(&url, "order-m", PAYMENT)
            .await
            .unwrap()
            .replayed()
    );
    let changed = PAYMENT.replace("4900", "5000");
    assert_eq!(
        post_json(&url, "order-m", &changed).await.unwrap().status,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let scraped = send(Method::GET, &app.url("/metrics"), &[], "")
        .await
        .unwrap();
    assert_eq!(scraped.status, StatusCode::OK);
    let text = String::from_utf8(scraped.body.to_vec()).unwrap();
    let value = |series: &str| -> f64 {
        let line = text
            .lines()
            .find(|line| line.starts_with(series))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    for outcome in ["executed", "replayed", "mismatch"] {
        let series =
            format!(r#"idempotency_requests_total{{outcome="{outcome}",store="memory"}} "#);
        assert_eq!(value(&series), 1.0, "{outcome}");
    }
    assert_eq!(value("idempotency_handler_seconds_count"), 1.0);
    // Histograms with buckets (which add up across instances), not summaries.
    assert!(!text.contains("quantile="), "a summary in\n{text}");
    assert!(text.contains(r#"idempotency_handler_seconds_bucket{store="memory",le="0.005"}"#));
    assert!(text.contains(
        r#"idempotency_store_call_seconds_bucket{operation="claim",store="memory",le="0.0001"}"#
    ));
    assert!(
        value(r#"idempotency_store_call_seconds_count{operation="claim",store="memory"}"#) >= 3.0
    );
    assert_eq!(value("idempotency_claims_held "), 0.0);
}

/// The admin command, run as an operator would.
fn admin(env: &[(&str, String)], args: &[&str]) -> String {
    let output = support::example_command("admin", env)
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "admin {args:?} failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

async fn admin_command_finds_a_stuck_key_and_forgets_it_so_the_next_request_runs() {
    let schema = TestSchema::new().await;
    let redis = RedisServer::start().await;
    let stores = [
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("REDIS_URL", redis.url()),
    ];
    // An instance whose payment takes a minute, under a ten-minute lease; it dies mid-payment.
    let mut env = stores.to_vec();
    env.push(("PAYMENTS_WORK_MS", "60000".into()));
    env.push(("IDEMPOTENCY_LEASE_MS", "600000".into()));
    let doomed = Proc::example("payments", &env).await;
    let url = doomed.url("/payments");
    let hanging = tokio::spawn(async move { post_json(&url, "order-stuck", PAYMENT).await });
    let listed = support::eventually(
        Duration::from_secs(10),
        "the key to be in flight",
        || async {
            let out = admin(&stores, &["stuck", "0s"]);
            if out.contains("order-stuck") {
                Ok(out)
            } else {
                Err(out)
            }
        },
    )
    .await;
    assert!(listed.starts_with("1 key(s) in flight"), "{listed}");
    assert!(listed.contains("anonymous"), "{listed}");
    support::signal_pid(doomed.pid(), "-KILL");
    assert!(
        hanging.await.unwrap().is_err(),
        "the dying instance answered"
    );

    // Another instance: the key is held by the dead one for ten minutes.
    let mut env = stores.to_vec();
    env.push(("IDEMPOTENCY_WAIT_MS", "200".into()));
    let survivor = Proc::example("payments", &env).await;
    let url = survivor.url("/payments");
    let blocked = post_json(&url, "order-stuck", PAYMENT).await.unwrap();
    assert_eq!(blocked.status, StatusCode::CONFLICT);

    let inspected = admin(&stores, &["inspect", "order-stuck"]);
    println!("{listed}\n{inspected}");
    let tier = |name: &str| {
        inspected
            .lines()
            .find(|line| line.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row in\n{inspected}"))
            .to_owned()
    };
    assert!(tier("postgres").contains("in_flight"), "{inspected}");
    assert!(tier("redis").contains("in_flight"), "{inspected}");
    // Ten minutes of lease, a few seconds gone.
    assert!(
        tier("postgres").contains(" 9m 5"),
        "no lease left shown: {inspected}"
    );
    assert!(admin(&stores, &["stuck", "1h"]).starts_with("0 key(s)"));

    let forgotten = admin(&stores, &["forget", "order-stuck"]);
    assert!(forgotten.starts_with("forgot key"), "{forgotten}");
    let inspected = admin(&stores, &["inspect", "order-stuck"]);
    assert_eq!(inspected.matches("(nothing)").count(), 2, "{inspected}");

    let paid = post_json(&url, "order-stuck", PAYMENT).await.unwrap();
    assert_eq!(paid.status, StatusCode::CREATED);
    assert!(!paid.replayed());
    assert_eq!(rows(&schema, "order-stuck").await, 1);
    let completed = admin(&stores, &["inspect", "order-stuck"]);
    assert!(
        completed.contains("completed") && completed.contains("201"),
        "{completed}"
    );
    drop(survivor);
    schema.drop().await;
}

/// Every metric the shipped dashboard and alert rules name (`contrib/`) is one the crate emits:
/// the payments example on Redis in front of Postgres is scraped, and each name must be there.
async fn the_dashboard_and_the_alert_rules_name_only_metrics_the_crate_emits() {
    let schema = TestSchema::new().await;
    let redis = RedisServer::start().await;
    let env = [
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("REDIS_URL", redis.url()),
    ];
    let app = Proc::example("payments", &env).await;
    let url = app.url("/payments");
    let key = format!("order-{}", uuid::Uuid::new_v4());
    post_json(&url, &key, PAYMENT).await.unwrap();
    assert!(post_json(&url, &key, PAYMENT).await.unwrap().replayed());
    let scraped = send(Method::GET, &app.url("/metrics"), &[], "")
        .await
        .unwrap();
    let text = String::from_utf8(scraped.body.to_vec()).unwrap();
    let emitted: std::collections::HashSet<&str> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();

    let root = env!("CARGO_MANIFEST_DIR");
    let mut named = std::collections::BTreeSet::new();
    for file in [
        "contrib/grafana/tower-idempotency.json",
        "contrib/prometheus/alerts.yml",
    ] {
        let contents = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
        let mut rest = contents.as_str();
        while let Some(at) = rest.find("idempotency_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            named.insert(name);
        }
    }
    assert!(named.len() >= 10, "{named:?}");
    for name in &named {
        assert!(
            emitted.contains(name.as_str()),
            "{name} is not emitted:\n{text}"
        );
    }
    println!("{} metric names in contrib/, all emitted", named.len());
    schema.drop().await;
}

/// The payments example calls its provider through the client layer with a key derived from the
/// payment's: a provider that fails, answers past the timeout (having charged) or says 409 is
/// retried with the same key, and every payment is charged once.
async fn payments_example_charges_a_faulty_provider_once_per_payment() {
    let plan = vec![
        ProviderFault::Unavailable,
        ProviderFault::Slow(Duration::from_millis(700)),
        ProviderFault::InFlight,
        ProviderFault::None,
    ];
    let provider = MockProvider::with_faults(Duration::ZERO, plan).await;
    let env = [
        ("PROVIDER_URL", provider.url.clone()),
        ("PROVIDER_TIMEOUT_MS", "250".into()),
    ];
    let app = Proc::example("payments", &env).await;
    let url = app.url("/payments");
    let run = uuid::Uuid::new_v4().simple().to_string();
    let keys: Vec<String> = (0..4).map(|n| format!("pay-{run}-{n}")).collect();
    let mut charge_ids = Vec::new();
    for key in &keys {
        let paid = post_json(&url, key, PAYMENT).await.unwrap();
        assert_eq!(paid.status, StatusCode::CREATED, "{key}: {:?}", paid.body);
        charge_ids.push(paid.json()["charge_id"].as_str().unwrap().to_owned());
        let again = post_json(&url, key, PAYMENT).await.unwrap();
        assert!(again.replayed());
    }
    let (calls, charges) = (provider.calls(), provider.charges());
    for (n, key) in keys.iter().enumerate() {
        assert_eq!(charges.get(key), Some(&1), "{key}: charges {charges:?}");
        // The faulted first call and its retry; the last payment met no fault.
        let expected = if n == 3 { 1 } else { 2 };
        assert_eq!(calls.get(key), Some(&expected), "{key}: calls {calls:?}");
    }
    let distinct: std::collections::HashSet<_> = charge_ids.iter().collect();
    assert_eq!(distinct.len(), keys.len(), "one charge per payment");
    println!("provider calls {calls:?}, charges {charges:?}");
}

/// `admin inspect` exits non-zero when a tier could not be read (Redis down here): a script
/// that checks a key must not take a partial answer for a whole one. It printed the error and
/// exited 0.
async fn admin_inspect_fails_when_a_tier_cannot_be_read() {
    let schema = TestSchema::new().await;
    let stores = [
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("REDIS_URL", "redis://127.0.0.1:1".to_owned()),
    ];
    let output = support::example_command("admin", &stores)
        .args(["inspect", "order-unread"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(stdout.contains("redis     error"), "{stdout}{stderr}");
    assert!(stdout.contains("postgres  (nothing)"), "{stdout}{stderr}");
    assert!(!output.status.success(), "{stdout}{stderr}");
    assert!(stderr.contains("1 of 2 tiers"), "{stderr}");
    schema.drop().await;
}

/// A store that cannot serve at all stops the example at start, with the finding and the
/// variables to look at: a Redis refusing connections, or one wanting a password. Before, it
/// served, and answered every guarded request 503. The same Redis in front of Postgres is only a
/// warning: requests go on through Postgres.
async fn a_store_that_cannot_serve_stops_the_example_at_start() {
    let guarded = RedisServer::start_with(&["--requirepass", "s3cret"]).await;
    for (redis, why) in [
        ("redis://127.0.0.1:1".to_owned(), "refused"),
        (guarded.url(), "NOAUTH"),
    ] {
        let output = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::process::Command::from(support::example_command(
                "payments",
                &[("REDIS_URL", redis), ("PORT", free_port().to_string())],
            ))
            .output(),
        )
        .await
        .expect("the example went on serving")
        .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{why}: it started");
        assert!(stderr.contains("start-up check"), "{why}: {stderr}");
        assert!(stderr.contains("REDIS_URL"), "{why}: {stderr}");
        assert!(stderr.contains("reachable"), "{why}: {stderr}");
        assert!(
            stderr.to_lowercase().contains(&why.to_lowercase()),
            "{why}: {stderr}"
        );
    }
    let schema = TestSchema::new().await;
    let tiered = Proc::example(
        "payments",
        &[
            ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
            ("REDIS_URL", "redis://127.0.0.1:1".to_owned()),
        ],
    )
    .await;
    drop(tiered);
    schema.drop().await;
}
