//! Floors: the stores' own operations, from this process, with the same concurrency.

use super::*;

pub(crate) async fn measure_floors(
    options: &Options,
    servers: Servers<'_>,
    database_url: &str,
    schema: &str,
    seconds: Duration,
) -> Vec<(&'static str, f64)> {
    let Servers {
        redis,
        cluster,
        valkey,
    } = servers;
    let mut floors = Vec::new();
    let tasks = options.connections;
    redis.flush().await;
    if options.only.iter().any(|s| s == "redis") {
        let store = redis_store(&redis.url(), &format!("floor:{}:", Uuid::new_v4().simple()));
        floors.push(("redis", store_floor(Arc::new(store), tasks, seconds).await));
    }
    if let Some(valkey) = valkey {
        valkey.flush().await;
        if options.only.iter().any(|s| s == "valkey") {
            let prefix = format!("floor:{}:", Uuid::new_v4().simple());
            let store = redis_store(&valkey.url(), &prefix);
            floors.push(("valkey", store_floor(Arc::new(store), tasks, seconds).await));
        }
        if options.only.iter().any(|s| s == "naive-valkey") {
            let floor = naive_floor(&valkey.url(), tasks, seconds).await;
            floors.push(("naive-valkey", floor));
        }
    }
    if let Some(cluster) = cluster {
        cluster.flush().await;
        let prefix = format!("floor:{}:", Uuid::new_v4().simple());
        let store = cluster_store(&cluster.urls(), &prefix);
        let floor = store_floor(Arc::new(store), tasks, seconds).await;
        floors.push(("redis-cluster", floor));
    }
    for setup in ["postgres", "postgres-single"] {
        if options.only.iter().any(|s| s == setup) {
            let store = postgres_store(database_url, schema).await;
            let store = store.with_max_batch(max_batch(setup));
            floors.push((setup, store_floor(Arc::new(store), tasks, seconds).await));
        }
    }
    if options.only.iter().any(|s| s == "postgres-partitioned") {
        let store = postgres_store(database_url, &partitioned(schema)).await;
        floors.push((
            "postgres-partitioned",
            store_floor(Arc::new(store), tasks, seconds).await,
        ));
    }
    for setup in ["tiered", "tiered-single"] {
        if options.only.iter().any(|s| s == setup) {
            let store = TieredStore::new(
                redis_store(&redis.url(), &format!("floor:{}:", Uuid::new_v4().simple())),
                postgres_store(database_url, schema)
                    .await
                    .with_max_batch(max_batch(setup)),
            );
            floors.push((setup, store_floor(Arc::new(store), tasks, seconds).await));
        }
    }
    if options.only.iter().any(|s| s == "naive") {
        floors.push(("naive", naive_floor(&redis.url(), tasks, seconds).await));
    }
    floors
}

/// Claims and completes fresh keys from `tasks` tasks: what the store does per first request.
pub(crate) async fn store_floor(store: Arc<dyn Store>, tasks: usize, seconds: Duration) -> f64 {
    let parts = http::Request::post("/payments")
        .header(header::CONTENT_TYPE, "application/json")
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let fingerprint = Fingerprint::of_request(&parts, &[], &payment_body());
    let response = StoredResponse::new(
        StatusCode::CREATED,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )]
        .into_iter()
        .collect(),
        Some(Bytes::from_static(ANSWER.as_bytes())),
        None,
    );
    let run = Uuid::new_v4().simple().to_string();
    counted(tasks, seconds, move |task, n| {
        let (store, response) = (Arc::clone(&store), response.clone());
        let key = IdempotencyKey::try_from(format!("{run}-{task}-{n}").as_str()).unwrap();
        async move {
            let claim = ClaimRequest::new(
                RecordKey::new("anonymous", key),
                fingerprint,
                Uuid::new_v4(),
                Duration::from_secs(30),
            );
            // A store error (a timeout on a loaded machine) counts as no operation.
            match store.claim(&claim).await {
                Ok(ClaimOutcome::Acquired { fence }) => {
                    let lease = claim.lease_with_fence(fence);
                    let retention = Duration::from_secs(86_400);
                    store.complete(&lease, &response, retention).await.is_ok()
                }
                Ok(other) => panic!("floor: {other:?}"),
                Err(_) => false,
            }
        }
    })
    .await
}

pub(crate) async fn naive_floor(url: &str, tasks: usize, seconds: Duration) -> f64 {
    let redis = ConnectionManager::new(redis::Client::open(url).unwrap())
        .await
        .unwrap();
    let run = Uuid::new_v4().simple().to_string();
    counted(tasks, seconds, move |task, n| {
        let mut redis = redis.clone();
        let key = format!("naive-floor:{run}-{task}-{n}");
        async move {
            naive_claim(&mut redis, &key).await;
            let set: redis::RedisResult<()> = redis.set_ex(&key, ANSWER, 86_400).await;
            set.is_ok()
        }
    })
    .await
}

/// Runs `operation(task, n)` in a loop on `tasks` tasks for `seconds`; operations that
/// succeeded per second (failures are reported, not counted).
pub(crate) async fn counted<F, Fut>(tasks: usize, seconds: Duration, operation: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    let operation = Arc::new(operation);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (operation, stop, done, failed) = (
                Arc::clone(&operation),
                Arc::clone(&stop),
                Arc::clone(&done),
                Arc::clone(&failed),
            );
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Relaxed) {
                    let counter = if operation(task, n).await {
                        &done
                    } else {
                        &failed
                    };
                    counter.fetch_add(1, Relaxed);
                    n += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(seconds).await;
    stop.store(true, Relaxed);
    for handle in handles {
        handle.await.unwrap();
    }
    let failed = failed.load(Relaxed);
    if failed > 0 {
        eprintln!("floor: {failed} operations failed (store errors), not counted");
    }
    done.load(Relaxed) as f64 / started.elapsed().as_secs_f64()
}
