//! The layer's own CPU work, in process: key parsing, fingerprints, the stored-response codec,
//! and whole requests through an axum route without the layer, with it (fresh keys and
//! replays, on the memory store; fresh keys again behind the replay cache and with a Prometheus
//! recorder), and with a 64 KiB
//! body next to the SHA-256 of 64 KiB; then fresh keys sent by two workers at once.
//!
//! ```sh
//! cargo bench --bench cpu
//! ```

use std::{
    hint::black_box,
    sync::atomic::{AtomicU64, Ordering::Relaxed},
};

use axum::http::StatusCode;
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Request, header};
use sha2::{Digest, Sha256};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MemoryStore, store::CachedStore, store::Fingerprint,
    store::StoredResponse,
};

#[path = "common/route.rs"]
mod route;

use route::{ANSWER, app, send};

fn keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("key");
    group.bench_function("bare token", |b| {
        b.iter(|| IdempotencyKey::parse(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")))
    });
    group.bench_function("string with parameters", |b| {
        b.iter(|| {
            IdempotencyKey::parse(black_box(br#""8e03978e-40d5-43e8-bc93-6894a57f9324";v=1"#))
        })
    });
    group.finish();
}

fn fingerprints(c: &mut Criterion) {
    let parts = Request::post("/v1/payments?expand=customer")
        .header(header::CONTENT_TYPE, "application/json")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let mut group = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024, 1024 * 1024] {
        let body = vec![b'x'; size];
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("request", size), &body, |b, body| {
            b.iter(|| Fingerprint::of_request(&parts, &[], black_box(body)))
        });
        group.bench_with_input(BenchmarkId::new("sha-256 alone", size), &body, |b, body| {
            b.iter(|| Sha256::digest(black_box(body)))
        });
    }
    group.finish();
}

fn stored_response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("203"));
    headers.insert(
        header::LOCATION,
        HeaderValue::from_static("/payments/pay_1"),
    );
    headers.insert("x-ratelimit-remaining", HeaderValue::from_static("99"));
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Some(Bytes::from_static(ANSWER.as_bytes())),
        None,
    )
}

fn codec(c: &mut Criterion) {
    let response = stored_response();
    let encoded = response.encode();
    let mut group = c.benchmark_group("stored response");
    group.bench_function("encode", |b| b.iter(|| black_box(&response).encode()));
    group.bench_function("decode", |b| {
        b.iter(|| StoredResponse::decode(black_box(encoded.clone())))
    });
    group.finish();
}

fn requests(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut group = c.benchmark_group("request");
    for size in [1024, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        let bare = app(None);
        group.bench_function(BenchmarkId::new("no layer", size), |b| {
            b.to_async(&runtime).iter(|| send(&bare, "k".into(), &body))
        });
        // A store that forgets fast enough not to grow without bound over the run.
        let layered = app(Some(IdempotencyLayer::new(
            MemoryStore::new().with_max_entries(100_000),
        )));
        let fresh = AtomicU64::new(0);
        group.bench_function(BenchmarkId::new("fresh key", size), |b| {
            b.to_async(&runtime).iter(|| {
                let key = format!("fresh-{}", fresh.fetch_add(1, Relaxed));
                send(&layered, key, &body)
            })
        });
        if size == 1024 {
            // The same behind the replay cache, which keeps every answer a fresh key stores.
            let cached = app(Some(IdempotencyLayer::new(CachedStore::new(
                MemoryStore::new().with_max_entries(100_000),
            ))));
            group.bench_function(BenchmarkId::new("fresh key, cached", size), |b| {
                b.to_async(&runtime).iter(|| {
                    let key = format!("fresh-{}", fresh.fetch_add(1, Relaxed));
                    send(&cached, key, &body)
                })
            });
            // The same with a Prometheus recorder, as in an app that exports the crate's metrics.
            let recorder = prometheus();
            group.bench_function(BenchmarkId::new("fresh key, recorded", size), |b| {
                b.iter(|| {
                    let key = format!("fresh-{}", fresh.fetch_add(1, Relaxed));
                    metrics::with_local_recorder(&recorder, || {
                        runtime.block_on(send(&layered, key, &body))
                    })
                })
            });
        }
        runtime.block_on(send(&layered, "replayed".into(), &body));
        group.bench_function(BenchmarkId::new("replay", size), |b| {
            b.to_async(&runtime)
                .iter(|| send(&layered, "replayed".into(), &body))
        });
    }
    group.finish();
}

/// A Prometheus recorder with the crate's histogram buckets, as the payments example builds it.
fn prometheus() -> metrics_exporter_prometheus::PrometheusRecorder {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in tower_idempotency::telemetry::HISTOGRAMS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full(name.into()), buckets)
            .unwrap();
    }
    builder.build_recorder()
}

/// Fresh keys sent by two workers at once, each its own stream of requests (what the load bench
/// serves, without the network): the time per request includes what the workers make each
/// other wait for, such as cache lines both write.
fn two_workers(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let body = Bytes::from(vec![b'x'; 1024]);
    let layered = app(Some(IdempotencyLayer::new(
        MemoryStore::new().with_max_entries(100_000),
    )));
    let batches = AtomicU64::new(0);
    let mut group = c.benchmark_group("two workers");
    for (name, app) in [("no layer", app(None)), ("fresh key", layered)] {
        group.bench_function(name, |b| {
            b.iter_custom(|requests| {
                let batch = batches.fetch_add(1, Relaxed);
                let started = std::time::Instant::now();
                runtime.block_on(async {
                    let workers: Vec<_> = (0..2)
                        .map(|worker| {
                            let (app, body) = (app.clone(), body.clone());
                            tokio::spawn(async move {
                                for i in (worker..requests).step_by(2) {
                                    send(&app, format!("fresh-{batch}-{i}"), &body).await;
                                }
                            })
                        })
                        .collect();
                    for worker in workers {
                        worker.await.unwrap();
                    }
                });
                started.elapsed()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, keys, fingerprints, codec, requests, two_workers);
criterion_main!(benches);
