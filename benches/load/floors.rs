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
    if options.only.iter().any(|s| s == "postgres") {
        let store = postgres_store(database_url, schema).await;
        floors.push((
            "postgres",
            store_floor(Arc::new(store), tasks, seconds).await,
        ));
    }
    if options.only.iter().any(|s| s == "postgres-partitioned") {
        let store = postgres_store(database_url, &partitioned(schema)).await;
        floors.push((
            "postgres-partitioned",
            store_floor(Arc::new(store), tasks, seconds).await,
        ));
    }
    if options.only.iter().any(|s| s == "tiered") {
        let store = TieredStore::new(
            redis_store(&redis.url(), &format!("floor:{}:", Uuid::new_v4().simple())),
            postgres_store(database_url, schema).await,
        );
        floors.push(("tiered", store_floor(Arc::new(store), tasks, seconds).await));
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
            match store.claim(&claim).await.unwrap() {
                ClaimOutcome::Acquired { fence } => {
                    let lease = claim.lease_with_fence(fence);
                    store
                        .complete(&lease, &response, Duration::from_secs(86_400))
                        .await
                        .unwrap();
                }
                other => panic!("floor: {other:?}"),
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
            let () = redis.set_ex(&key, ANSWER, 86_400).await.unwrap();
        }
    })
    .await
}

/// Runs `operation(task, n)` in a loop on `tasks` tasks for `seconds`; operations per second.
pub(crate) async fn counted<F, Fut>(tasks: usize, seconds: Duration, operation: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let operation = Arc::new(operation);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (operation, stop, done) =
                (Arc::clone(&operation), Arc::clone(&stop), Arc::clone(&done));
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Relaxed) {
                    operation(task, n).await;
                    n += 1;
                    done.fetch_add(1, Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(seconds).await;
    stop.store(true, Relaxed);
    for handle in handles {
        handle.await.unwrap();
    }
    done.load(Relaxed) as f64 / started.elapsed().as_secs_f64()
}
