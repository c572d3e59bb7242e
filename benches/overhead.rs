//! What the layer costs per request, side by side in one run: an axum route without the layer,
//! with it on the memory store, and on the real stores (the machine's Redis and Postgres, as
//! `REDIS_URL` and `DATABASE_URL` say). Requests go through `tower::ServiceExt::oneshot`, in
//! process, so the figures are the layer's and the stores' cost, not the network stack's.
//!
//! ```sh
//! cargo bench --bench overhead
//! ```
//!
//! Prints a Markdown table: mean latency of sequential requests, and throughput with 64 requests
//! in flight, each as a ratio to the route without the layer.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::{Router, body::Body, http::StatusCode, routing::post};
use http::Request;
use http_body_util::BodyExt;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer, MemoryStore,
    store::{PostgresStore, RedisStore, Store, TieredStore},
};

const PAYMENT: &str = r#"{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}"#;

fn app(layer: Option<IdempotencyLayer>) -> Router {
    let router = Router::new().route(
        "/payments",
        post(|body: String| async move { (StatusCode::CREATED, body) }),
    );
    match layer {
        Some(layer) => router.layer(layer),
        None => router,
    }
}

async fn send(app: &Router, key: &str) {
    let request = Request::post("/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(PAYMENT))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED, "{key}");
    response.into_body().collect().await.unwrap();
}

/// Mean latency of `count` sequential requests; `key(i)` picks each request's key.
async fn latency(app: &Router, count: usize, key: impl Fn(usize) -> String) -> Duration {
    let started = Instant::now();
    for i in 0..count {
        send(app, &key(i)).await;
    }
    started.elapsed() / count as u32
}

/// Requests per second with `concurrency` requests in flight.
async fn throughput(
    app: &Router,
    count: usize,
    concurrency: usize,
    key: impl Fn(usize) -> String + Send + Sync + 'static,
) -> f64 {
    let key = Arc::new(key);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (app, key, next) = (app.clone(), Arc::clone(&key), Arc::clone(&next));
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    send(&app, &key(i)).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    count as f64 / started.elapsed().as_secs_f64()
}

struct Row {
    name: String,
    latency: Duration,
    throughput: f64,
}

async fn measure(
    name: impl Into<String>,
    app: &Router,
    count: usize,
    replay: bool,
    run: &str,
) -> Row {
    let name = name.into();
    // Keys are visible ASCII: no spaces from the row's name.
    let prefix = format!("{run}-{}", name.replace([' ', ','], "_"));
    let key = move |i: usize| {
        if replay {
            format!("{prefix}-same")
        } else {
            format!("{prefix}-{i}")
        }
    };
    // Warm up (and, for replays, complete the one key they all use).
    latency(app, count / 10 + 1, {
        let key = key.clone();
        move |i| format!("{}-warm", key(i))
    })
    .await;
    if replay {
        send(app, &key(0)).await;
    }
    let latency = latency(app, count, &key).await;
    let throughput_key = {
        let key = key.clone();
        move |i: usize| format!("{}-t", key(i))
    };
    if replay {
        send(app, &throughput_key(0)).await;
    }
    let throughput = throughput(app, count, 64, throughput_key).await;
    Row {
        name,
        latency,
        throughput,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let run = uuid::Uuid::new_v4().simple().to_string();
    let memory = || IdempotencyLayer::new(MemoryStore::new());
    let mut rows = vec![
        measure("no layer", &app(None), 20_000, false, &run).await,
        measure(
            "memory store, first requests",
            &app(Some(memory())),
            20_000,
            false,
            &run,
        )
        .await,
        measure(
            "memory store, replays",
            &app(Some(memory())),
            20_000,
            true,
            &run,
        )
        .await,
    ];

    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("bench_{run}");
    let admin = PgPoolOptions::new().connect(&database_url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let separator = if database_url.contains('?') { '&' } else { '?' };
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&format!(
            "{database_url}{separator}options[search_path]={schema}"
        ))
        .await
        .unwrap();
    let postgres = PostgresStore::new(pool.clone());
    postgres.migrate().await.unwrap();
    let redis = RedisStore::open(&redis_url)
        .unwrap()
        .with_prefix(format!("bench:{run}:"));
    let stores: [(&str, Arc<dyn Store>); 3] = [
        ("Postgres", Arc::new(postgres.clone())),
        ("Redis", Arc::new(redis.clone())),
        (
            "Redis + Postgres",
            Arc::new(TieredStore::new(redis, postgres)),
        ),
    ];
    for (name, store) in stores {
        let app = app(Some(IdempotencyLayer::from_shared_store(store)));
        for (what, replay) in [("first requests", false), ("replays", true)] {
            rows.push(measure(format!("{name}, {what}"), &app, 2_000, replay, &run).await);
        }
    }

    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();

    let base = &rows[0];
    println!("| setup | mean latency | × no layer | req/s (64 in flight) | × no layer |");
    println!("|---|---|---|---|---|");
    for row in &rows {
        println!(
            "| {} | {:.1} µs | {:.1} | {:.0} | {:.3} |",
            row.name,
            row.latency.as_secs_f64() * 1e6,
            row.latency.as_secs_f64() / base.latency.as_secs_f64(),
            row.throughput,
            row.throughput / base.throughput,
        );
    }
}
