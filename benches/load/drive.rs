//! The driver: runs each setup's server, loads it over HTTP, and reads the CPU and memory each process used.

use super::*;

pub(crate) async fn drive(mut options: Options) {
    let redis = RedisServer::start();
    let cluster = options
        .only
        .iter()
        .any(|s| s.starts_with("redis-cluster"))
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
    let own_nodes = ["node", "node-single", "citus-1", "citus-2"];
    let nodes = match options.only.iter().any(|s| own_nodes.contains(&s.as_str())) {
        true => Nodes::start().await,
        false => None,
    };
    if nodes.is_none() {
        options.only.retain(|s| !own_nodes.contains(&s.as_str()));
    }
    let node_urls = nodes.as_ref().map(Nodes::urls).unwrap_or_default();
    let env = format!(
        "{}|{database_url}|{schema}|{seeds}|{valkey_url}|{node_urls}",
        redis.url()
    );
    let seconds = Duration::from_secs(options.seconds);
    let broker = match options.only.iter().any(|s| s == "consumers") {
        true => consumers::broker().await,
        false => None,
    };

    eprintln!(
        "load: {} connections, {} s per run, {} rounds, {}, setups {:?}",
        options.connections,
        options.seconds,
        options.rounds,
        options.rate.map_or_else(
            || "closed loop".to_owned(),
            |r| format!("{r} req/s offered")
        ),
        options.only
    );
    let mut runs: Runs = BTreeMap::new();
    let mut floors: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut routes: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    let mut consumed: BTreeMap<&str, Vec<Consumed>> = BTreeMap::new();
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
                ("redis-cluster" | "redis-cluster-watched", Some(cluster), _) => cluster,
                ("valkey" | "naive-valkey", _, Some(valkey)) => valkey,
                _ => &redis,
            };
            for &workload in workloads {
                let stores = (server, &admin);
                let clients = (options.connections, options.rate);
                let run = measure(setup, workload, &env, stores, clients, seconds).await;
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
        let routing = options.only.iter().any(|s| s == "redis-cluster");
        if let Some(cluster) = cluster.as_ref().filter(|_| routing) {
            cluster.flush().await;
            let servers = (&redis, cluster);
            for (name, measured) in cluster_routes(servers, options.connections, seconds).await {
                eprintln!("round {round} cluster route {name}: {measured:?}");
                routes.entry(name).or_default().push(measured);
            }
        }
        let floors_now = measure_floors(&options, servers, &database_url, &schema, seconds);
        for (name, floor) in floors_now.await {
            eprintln!("round {round} floor {name}: {floor:.0}/s");
            floors.entry(name).or_default().push(floor);
        }
        for (name, units, taking) in broker.iter().flat_map(|_| CONSUMER_KINDS) {
            let url = broker.as_deref().unwrap_or_default();
            let store = (database_url.as_str(), schema.as_str());
            let run = measure_consumers(url, store, (units, taking), seconds).await;
            eprintln!("round {round} consumer {name}: {run:?}");
            consumed.entry(name).or_default().push(run);
        }
    }
    print_report(&options, &runs, &floors);
    print_routes(&routes);
    print_citus(&runs);
    print_consumers(&consumed);
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

pub(crate) async fn measure(
    setup: &str,
    workload: &'static str,
    env: &str,
    (redis, admin): (&RedisServer, &sqlx::PgPool),
    (connections, rate): (usize, Option<f64>),
    seconds: Duration,
) -> Run {
    let on_postgres = setup.starts_with("postgres") || setup.starts_with("tiered");
    // The run's own servers (`nodes.rs`): their CPU counts, the commits and WAL read on the
    // machine's server do not.
    let on_own_nodes = setup.starts_with("node") || setup.starts_with("citus");
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
        (connections, None),
        Duration::from_secs(1),
        &warm_up,
        "warm-up",
    )
    .await;
    let replay_keys = format!("{run_id}-replay");
    load(
        address,
        (connections, None),
        Duration::from_millis(300),
        &replay_keys,
        "prime",
    )
    .await;

    let cpu_before = process_cpu(server.id());
    let redis_before = redis.cpu();
    let postgres_before = postgres_cpu();
    let citus_before = citus_cpu(setup);
    let position_before = match on_postgres {
        true => Some(PostgresPosition::read(admin).await),
        false => None,
    };
    let started = Instant::now();
    let mut latencies = match workload {
        "fresh" => load(address, (connections, rate), seconds, &run_id, "fresh").await,
        _ => {
            load(
                address,
                (connections, rate),
                seconds,
                &replay_keys,
                "replay",
            )
            .await
        }
    };
    let elapsed = started.elapsed();
    let cpu = process_cpu(server.id()) - cpu_before;
    let peak_rss_mib = peak_rss_kib(server.id()) as f64 / 1024.0;
    let redis_cpu = redis.cpu() - redis_before;
    let postgres_cpu = postgres_cpu().saturating_sub(postgres_before);
    let citus = citus_before.zip(citus_cpu(setup)).map(|(before, after)| {
        let per_request = |d: Duration| d.as_secs_f64() * 1e6 / latencies.len().max(1) as f64;
        (
            per_request(after.0.saturating_sub(before.0)),
            per_request(after.1.saturating_sub(before.1)),
        )
    });
    let written = match &position_before {
        Some(before) => Some(PostgresPosition::read(admin).await.since(before)),
        None => None,
    };
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
        redis_us_per_req: (matches!(
            setup,
            "redis"
                | "redis-cached"
                | "redis-watched"
                | "redis-cluster"
                | "redis-cluster-watched"
                | "naive"
                | "valkey"
                | "naive-valkey"
        ) || setup.starts_with("tiered"))
        .then(|| redis_cpu.as_secs_f64() * 1e6 / requests as f64),
        postgres_us_per_req: (on_postgres || on_own_nodes)
            .then(|| postgres_cpu.as_secs_f64() * 1e6 / requests as f64),
        postgres_written_per_req: written.map(|(transactions, wal)| {
            let n = requests.max(1) as f64;
            (transactions as f64 / n, wal as f64 / n)
        }),
        citus_us_per_req: citus,
    }
}

/// Sends requests on `connections` keep-alive connections for `duration`, each as soon as its
/// last answer came or, with a `rate`, at its share of `rate` a second (late rather than skipped
/// when behind); returns each one's latency in µs. Keys are `{prefix}-{connection}-{n}`, except
/// for "replay" and "prime", which use one key per connection.
pub(crate) async fn load(
    address: SocketAddr,
    (connections, rate): (usize, Option<f64>),
    duration: Duration,
    prefix: &str,
    workload: &'static str,
) -> Vec<u64> {
    let body = Bytes::from(payment_body());
    let stop = Arc::new(AtomicBool::new(false));
    // Failed requests by what failed them (a status, or the client's error), to tell the
    // server's refusals from a connection the client lost.
    let errors: Arc<Mutex<BTreeMap<String, u64>>> = Arc::default();
    let tasks: Vec<_> = (0..connections)
        .map(|c| {
            let (body, stop, errors) = (body.clone(), Arc::clone(&stop), Arc::clone(&errors));
            let prefix = prefix.to_owned();
            tokio::spawn(async move {
                let mut sender = connect(address).await;
                let mut latencies = Vec::with_capacity(8192);
                let mut n = 0u64;
                // The connections' sends spread evenly over one interval.
                let pace = rate.map(|rate| Duration::from_secs_f64(connections as f64 / rate));
                let offset =
                    pace.map_or(Duration::ZERO, |p| p.mul_f64(c as f64 / connections as f64));
                let mut next = tokio::time::Instant::now() + offset;
                while !stop.load(Relaxed) {
                    if let Some(pace) = pace {
                        tokio::time::sleep_until(next).await;
                        next += pace;
                    }
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
                    let failed = match sender.send_request(request).await {
                        Ok(response) => {
                            let status = response.status();
                            match response.into_body().collect().await {
                                Ok(_) if status == StatusCode::CREATED => None,
                                Ok(_) => Some(format!("answered {status}")),
                                Err(error) => Some(format!("body: {error}")),
                            }
                        }
                        Err(error) => Some(format!("request: {error}")),
                    };
                    match failed {
                        None => latencies.push(started.elapsed().as_micros() as u64),
                        Some(failed) => *errors.lock().unwrap().entry(failed).or_default() += 1,
                    }
                    // A connection lost is one failure, not one per request sent on it after.
                    if sender.is_closed() && !stop.load(Relaxed) {
                        sender = connect(address).await;
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
    let errors = std::mem::take(&mut *errors.lock().unwrap());
    let failed: u64 = errors.values().sum();
    assert!(
        failed * 1000 <= all.len() as u64 + 1000,
        "{workload}: {failed} failed requests against {} answered: {errors:?}",
        all.len()
    );
    all
}

/// A keep-alive HTTP/1 connection to `address`, without Nagle's delay.
async fn connect(address: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.set_nodelay(true).unwrap();
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

/// A 1 KiB JSON body.
pub(crate) fn payment_body() -> Vec<u8> {
    let mut body =
        br#"{"amount_cents":4900,"currency":"usd","customer":"cus_1","metadata":""#.to_vec();
    while body.len() < 1024 - 2 {
        body.push(b'x');
    }
    body.extend_from_slice(br#""}"#);
    body
}

/// The CPU time a process has used so far (all its threads).
pub(crate) fn process_cpu(pid: u32) -> Duration {
    try_process_cpu(pid).unwrap_or_else(|| panic!("no process {pid}"))
}

/// The CPU time a process has used so far, if it is still there.
pub(crate) fn try_process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat[stat.rfind(')')? + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64))
}

/// Where the Postgres cluster stands: the next transaction id it will assign (a write
/// transaction takes one, so the difference counts commits and rollbacks) and the end of its WAL.
pub(crate) struct PostgresPosition {
    next_xid: i64,
    wal: i64,
}

impl PostgresPosition {
    pub(crate) async fn read(pool: &sqlx::PgPool) -> Self {
        let (next_xid, wal) = sqlx::query_as(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8,
                    (pg_current_wal_lsn() - '0/0')::int8",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        Self { next_xid, wal }
    }

    /// Write transactions and WAL bytes since `earlier`.
    pub(crate) fn since(&self, earlier: &Self) -> (i64, i64) {
        (self.next_xid - earlier.next_xid, self.wal - earlier.wal)
    }
}

/// The CPU time of every `postgres` process so far (backends come and go: a process that
/// ends between two readings takes its time with it, so measure with a pool that stays up).
pub(crate) fn postgres_cpu() -> Duration {
    programs_cpu("postgres")
}

/// The CPU time so far of every process whose command is `program`.
pub(crate) fn programs_cpu(program: &str) -> Duration {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == program)
        })
        .filter_map(try_process_cpu)
        .sum()
}

/// A process's peak resident set (`VmHWM`), in KiB.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

pub(crate) fn clock_ticks() -> u64 {
    let out = Command::new("getconf").arg("CLK_TCK").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(100)
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
