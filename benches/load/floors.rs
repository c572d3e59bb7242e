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

/// How a command reaches a cluster's node: through redis-rs's cluster driver (the store's
/// connection), or by this process choosing the key's master from the slot map itself; or a
/// single server's, on one connection.
enum Route {
    Single(redis::aio::MultiplexedConnection),
    Driver(redis::cluster_async::ClusterConnection),
    Direct(
        Vec<redis::aio::MultiplexedConnection>,
        std::collections::HashMap<redis::cluster_routing::Slot, usize>,
    ),
}

/// What the cluster driver adds to each command: `SET`s of fresh keys from `tasks` tasks,
/// through the driver and then straight to each key's master, on the same cluster; and on
/// one server, for what three of them cost without a driver. Each route's operations per
/// second, and this process's CPU per operation.
pub(crate) async fn cluster_routes(
    (redis, cluster): (&RedisServer, &RedisServer),
    tasks: usize,
    seconds: Duration,
) -> [(&'static str, (f64, f64)); 3] {
    let urls: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
    let driver = redis::cluster::ClusterClient::new(urls)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let (masters, slots) = slot_map(cluster).await;
    let mut direct = Vec::new();
    for url in masters {
        let client = redis::Client::open(url).unwrap();
        direct.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    let driver = routed(Route::Driver(driver), tasks, seconds).await;
    let direct = routed(Route::Direct(direct, slots), tasks, seconds).await;
    let single = routed(Route::Single(redis.connection().await), tasks, seconds).await;
    [
        ("driver", driver),
        ("direct", direct),
        ("one server", single),
    ]
}

/// The cluster's masters (their URLs) and which of them serves each slot (`CLUSTER SLOTS`).
async fn slot_map(
    cluster: &RedisServer,
) -> (
    Vec<String>,
    std::collections::HashMap<redis::cluster_routing::Slot, usize>,
) {
    let mut connection = cluster.connection().await;
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut connection)
        .await
        .unwrap();
    let (mut masters, mut slots) = (Vec::new(), std::collections::HashMap::new());
    for range in ranges {
        // [start, end, [host, port, id, …], replicas…]
        let mut range = range.into_iter();
        let start: u16 = redis::from_redis_value(range.next().unwrap()).unwrap();
        let end: u16 = redis::from_redis_value(range.next().unwrap()).unwrap();
        let master: Vec<redis::Value> = redis::from_redis_value(range.next().unwrap()).unwrap();
        let mut master = master.into_iter();
        let host: String = redis::from_redis_value(master.next().unwrap()).unwrap();
        let port: u16 = redis::from_redis_value(master.next().unwrap()).unwrap();
        let url = format!("redis://{host}:{port}");
        let node = masters.iter().position(|m| *m == url).unwrap_or_else(|| {
            masters.push(url);
            masters.len() - 1
        });
        let range = (start..=end).filter_map(redis::cluster_routing::Slot::new);
        slots.extend(range.map(|slot| (slot, node)));
    }
    (masters, slots)
}

/// `SET`s of fresh keys through `route` for `seconds`: operations per second, and this
/// process's CPU (µs) per operation.
async fn routed(route: Route, tasks: usize, seconds: Duration) -> (f64, f64) {
    let route = Arc::new(route);
    let run = Uuid::new_v4().simple().to_string();
    let (cpu, started) = (process_cpu(std::process::id()), Instant::now());
    let rate = counted(tasks, seconds, move |task, n| {
        let (route, key) = (Arc::clone(&route), format!("route:{run}-{task}-{n}"));
        async move {
            let set = redis::cmd("SET").arg(&key).arg(ANSWER).clone();
            let done: redis::RedisResult<()> = match &*route {
                Route::Single(connection) => set.query_async(&mut connection.clone()).await,
                Route::Driver(connection) => set.query_async(&mut connection.clone()).await,
                Route::Direct(connections, slots) => {
                    let node = slots[&redis::cluster_routing::Slot::for_key(&key)];
                    set.query_async(&mut connections[node].clone()).await
                }
            };
            done.is_ok()
        }
    })
    .await;
    let operations = rate * started.elapsed().as_secs_f64();
    let cpu = process_cpu(std::process::id()) - cpu;
    (rate, cpu.as_secs_f64() * 1e6 / operations)
}
