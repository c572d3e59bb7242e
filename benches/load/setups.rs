//! The server side: each setup (a store, a naive guard, or none) served as a process of its own.

use super::*;

/// Serves one setup on `port` until killed. `env` is
/// "redis_url|database_url|schema|cluster|valkey_url|nodes", the cluster the Redis Cluster's node
/// URLs, comma-separated (empty without a cluster; the Valkey URL is empty without one), the
/// nodes the URLs of the run's own Postgres servers ([`Nodes::urls`]; empty without them).
pub(crate) fn serve(setup: &str, port: u16, env: &str) {
    let mut parts = env.split('|');
    let (redis_url, database_url, schema, cluster, valkey_url) = (
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
    );
    let nodes: Vec<String> = parts
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::to_owned)
        .collect();
    let setup = setup.to_owned();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = std::env::var("BENCH_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
    {
        runtime.worker_threads(workers);
    }
    runtime.enable_all().build().unwrap().block_on(async move {
        let handler = post(|_body: Bytes| async {
            (
                StatusCode::CREATED,
                [(header::CONTENT_TYPE, "application/json")],
                ANSWER,
            )
        });
        let prefix = format!("bench:{}:", Uuid::new_v4().simple());
        let layered = |store: Arc<dyn Store>| {
            Router::new().route(
                "/payments",
                handler
                    .clone()
                    .route_layer(IdempotencyLayer::from_shared_store(store)),
            )
        };
        // 1 MiB answers kept 2 s, on a memory store with its default budget or none.
        let big = |store: MemoryStore| {
            let handler = post(|_body: Bytes| async {
                (StatusCode::CREATED, Bytes::from(vec![b'x'; 1024 * 1024]))
            });
            let layer = IdempotencyLayer::new(store)
                .with_max_response_body(2 * 1024 * 1024)
                .with_retention(Duration::from_secs(2));
            Router::new().route("/payments", handler.route_layer(layer))
        };
        let app = match setup.as_str() {
            "bare" => Router::new().route("/payments", handler),
            "memory" => layered(Arc::new(MemoryStore::new())),
            "memory-cached" => layered(Arc::new(CachedStore::new(MemoryStore::new()))),
            "memory-1mib" => big(MemoryStore::new()),
            "memory-1mib-unbounded" => big(MemoryStore::new().with_max_bytes(usize::MAX)),
            "redis" => layered(Arc::new(redis_store(&redis_url, &prefix))),
            "redis-cached" => layered(Arc::new(CachedStore::new(redis_store(&redis_url, &prefix)))),
            "redis-watched" => {
                let store = redis_store(&redis_url, &prefix);
                let watcher = store.watcher();
                layered(Arc::new(CachedStore::new(store).with_watcher(watcher)))
            }
            "tiered-cached" => layered(Arc::new(CachedStore::new(TieredStore::new(
                redis_store(&redis_url, &prefix),
                postgres_store(&database_url, &schema).await,
            )))),
            "valkey" => layered(Arc::new(redis_store(&valkey_url, &prefix))),
            "redis-cluster" => layered(Arc::new(cluster_store(&cluster, &prefix))),
            "redis-cluster-watched" => {
                let store = cluster_store(&cluster, &prefix);
                let watcher = store.watcher();
                layered(Arc::new(CachedStore::new(store).with_watcher(watcher)))
            }
            "postgres" | "postgres-single" | "postgres-window" => layered(Arc::new(
                postgres_store(&database_url, &schema)
                    .await
                    .with_max_batch(max_batch(&setup))
                    .with_batch_window(batch_window(&setup)),
            )),
            "node" | "node-single" => layered(Arc::new(
                PostgresStore::new(pool_in(&nodes[0], "public", 16).await)
                    .with_max_batch(max_batch(&setup)),
            )),
            "citus-1" | "citus-2" => {
                let url = if setup == "citus-1" {
                    &nodes[1]
                } else {
                    &nodes[2]
                };
                let pool = pool_in(url, "public", 16).await;
                layered(Arc::new(PostgresStore::new(pool).on_citus()))
            }
            "postgres-partitioned" => layered(Arc::new(
                postgres_store(&database_url, &partitioned(&schema)).await,
            )),
            "tiered" | "tiered-single" | "tiered-window" => layered(Arc::new(TieredStore::new(
                redis_store(&redis_url, &prefix),
                postgres_store(&database_url, &schema)
                    .await
                    .with_max_batch(max_batch(&setup))
                    .with_batch_window(batch_window(&setup)),
            ))),
            "naive" | "naive-valkey" => {
                let url = if setup == "naive" {
                    redis_url
                } else {
                    valkey_url
                };
                let redis = ConnectionManager::new(redis::Client::open(url).unwrap())
                    .await
                    .unwrap();
                let prefix = format!("naive:{}:", Uuid::new_v4().simple());
                Router::new().route(
                    "/payments",
                    handler.route_layer(middleware::from_fn_with_state(
                        (redis, Arc::<str>::from(prefix)),
                        naive_guard,
                    )),
                )
            }
            "naive-memory" => {
                let answers = moka::sync::Cache::builder()
                    .max_capacity(DEFAULT_MEMORY_MAX_ENTRIES as u64)
                    .time_to_live(Duration::from_secs(86_400))
                    .build();
                Router::new().route(
                    "/payments",
                    handler.route_layer(middleware::from_fn_with_state(answers, naive_in_memory)),
                )
            }
            other => panic!("unknown setup {other}"),
        };
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port))
            .await
            .unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}

/// The naive guard in process, in a bounded cache with expiry (moka, which in-process peers keep
/// their answers in): the key inserted empty if absent, run, the body stored under it; a retry
/// gets the body, or 409 while it is empty. No fingerprint, no owner, no lease: one process only.
pub(crate) async fn naive_in_memory(
    State(answers): State<moka::sync::Cache<String, Bytes>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = request.headers().get("idempotency-key") else {
        return next.run(request).await;
    };
    let key = key.to_str().unwrap_or_default().to_owned();
    let entry = answers.entry(key.clone()).or_insert(Bytes::new());
    if !entry.is_fresh() {
        return naive_replay(entry.into_value());
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    answers.insert(key, body.clone());
    Response::from_parts(parts, Body::from(body))
}

/// A naive guard's answer to a retry: the body the first request stored, or 409 while that
/// request still runs (nothing stored yet).
fn naive_replay(stored: Bytes) -> Response {
    if stored.is_empty() {
        return StatusCode::CONFLICT.into_response();
    }
    let mut response = (StatusCode::CREATED, stored).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

pub(crate) fn redis_store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::open(url).unwrap().with_prefix(prefix)
}

pub(crate) fn cluster_store(seeds: &str, prefix: &str) -> RedisStore {
    RedisStore::cluster(seeds.split(','))
        .unwrap()
        .with_prefix(prefix)
}

/// The schema beside `schema` whose `idempotency_keys` is hash-partitioned.
pub(crate) fn partitioned(schema: &str) -> String {
    format!("{schema}_partitioned")
}

/// A setup's batch window (`with_batch_window`): 1 ms for the "-window" setups, else none.
fn batch_window(setup: &str) -> Duration {
    match setup.ends_with("-window") {
        true => Duration::from_millis(1),
        false => Duration::ZERO,
    }
}

/// How many claims or completions a setup's Postgres store sends in one statement: one for the
/// `-single` setups (each call on its own statement: the store before batches), the store's
/// default otherwise.
pub(crate) fn max_batch(setup: &str) -> usize {
    if setup.ends_with("-single") {
        1
    } else {
        DEFAULT_POSTGRES_BATCH
    }
}

/// A pool of at most `connections` in `schema` of the Postgres at `url`.
pub(crate) async fn pool_in(url: &str, schema: &str, connections: u32) -> sqlx::PgPool {
    let options: PgConnectOptions = url.parse().unwrap();
    PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options.options([("search_path", schema)]))
        .await
        .unwrap()
}

pub(crate) async fn postgres_store(url: &str, schema: &str) -> PostgresStore {
    PostgresStore::new(pool_in(url, schema, 16).await)
}

/// The naive guard's claim: `SET key "" NX EX 86400`; whether it set the key.
pub(crate) async fn naive_claim(redis: &mut ConnectionManager, key: &str) -> bool {
    let claimed: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("")
        .arg("NX")
        .arg("EX")
        .arg(86_400)
        .query_async(redis)
        .await
        .unwrap();
    claimed.is_some()
}

/// What a team writes before it finds this crate: `SET key "" NX EX`, run, `SET key body EX`;
/// a retry `GET`s the body. No owner, no fingerprint, no lease renewal, no fence.
pub(crate) async fn naive_guard(
    State((mut redis, prefix)): State<(ConnectionManager, Arc<str>)>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = request.headers().get("idempotency-key").cloned() else {
        return next.run(request).await;
    };
    let key = format!("{prefix}{}", key.to_str().unwrap_or_default());
    if !naive_claim(&mut redis, &key).await {
        let stored: Vec<u8> = redis.get(&key).await.unwrap();
        return naive_replay(Bytes::from(stored));
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let () = redis.set_ex(&key, body.as_ref(), 86_400).await.unwrap();
    Response::from_parts(parts, Body::from(body))
}
