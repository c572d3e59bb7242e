//! Servers of the tests' own (a Redis, a Postgres cluster) and the machine's shared ones.

use super::*;

/// `redis-server`, for tests that start, stop or pause a Redis of their own (`REDIS_SERVER`).
pub fn redis_server() -> PathBuf {
    Need::RedisServer.path()
}

/// The directory of Postgres' server programs (`initdb`, `pg_ctl`), for tests that run a
/// cluster of their own (see [`Need::PostgresServer`]).
pub fn postgres_bindir() -> PathBuf {
    Need::PostgresServer.path()
}

/// A `redis-server` of the test's own, on a free port, for tests that stop, pause or flush it.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    paused: bool,
    extra: Vec<String>,
    /// The working directory of the running server: its own, so that what one server writes
    /// (an append-only file, say) is never read by another (a Valkey's by a Redis).
    dir: Option<PathBuf>,
}

impl RedisServer {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A server started with extra arguments (`--requirepass`, say).
    pub async fn start_with(extra: &[&str]) -> Self {
        let mut server = Self {
            child: None,
            port: free_port(),
            paused: false,
            extra: extra.iter().map(|&a| a.to_owned()).collect(),
            dir: None,
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        let program = redis_server();
        let dir = std::env::temp_dir().join(format!("redis-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new(&program)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir)
            .args(&self.extra)
            .stdout(Stdio::null())
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        self.child = Some(child);
        self.dir = Some(dir);
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "redis-server did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (everything it held is gone).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            self.resume();
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Starts a fresh, empty server on the same port.
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn().await;
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&mut self) {
        self.signal("-STOP");
        self.paused = true;
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&mut self) {
        if self.paused {
            self.signal("-CONT");
            self.paused = false;
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server is running").id();
        signal_pid(pid, signal);
    }

    /// A connection of the test's own to this server.
    pub async fn admin(&self) -> redis::aio::MultiplexedConnection {
        redis_connection(&self.url()).await
    }

    /// Whether the server has `SET … IFEQ` (Valkey 8.1, Redis 8.4), asked of a key that does
    /// not exist, so nothing is written either way.
    pub async fn has_set_ifeq(&self) -> bool {
        redis::cmd("SET")
            .arg("probe:set-ifeq")
            .arg("v")
            .arg("IFEQ")
            .arg("w")
            .query_async::<redis::Value>(&mut self.admin().await)
            .await
            .is_ok()
    }

    /// Whether the server has `DELIFEQ` (Valkey 9.0), asked of a key that does not exist, so
    /// nothing is deleted either way.
    pub async fn has_delifeq(&self) -> bool {
        redis::cmd("DELIFEQ")
            .arg("probe:delifeq")
            .arg("v")
            .query_async::<redis::Value>(&mut self.admin().await)
            .await
            .is_ok()
    }

    /// Zeroes the server's command counts (`CONFIG RESETSTAT`).
    pub async fn reset_stats(&self) {
        let () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut self.admin().await)
            .await
            .unwrap();
    }

    /// How many times the server ran `command` (lower case) since the last reset, the calls
    /// that failed left out (`INFO commandstats`).
    pub async fn calls(&self, command: &str) -> u64 {
        let stats = self.command_stats(command).await;
        stats("calls") - stats("failed_calls")
    }

    /// How many claims and scripts the server ran since the last reset: `EVALSHA`s, and the
    /// claims made without a script (one `PTTL` each; claim.lua's own, where it finds the key
    /// held, counts too). A replay the store answers by command is one.
    pub async fn claims_and_scripts(&self) -> u64 {
        self.calls("evalsha").await + self.calls("pttl").await
    }

    /// How many calls of `command` (lower case) the server answered with an error since the last
    /// reset: refused before running (a syntax error) or failed while running.
    pub async fn errors(&self, command: &str) -> u64 {
        let stats = self.command_stats(command).await;
        stats("rejected_calls") + stats("failed_calls")
    }

    /// `command`'s line of `INFO commandstats`, as a lookup of its fields (0 where absent).
    async fn command_stats(&self, command: &str) -> impl Fn(&str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.admin().await)
            .await
            .unwrap();
        let prefix = format!("cmdstat_{command}:");
        let stats = info
            .lines()
            .find_map(|line| line.trim().strip_prefix(&prefix).map(str::to_owned))
            .unwrap_or_default();
        move |name: &str| {
            stats
                .split(',')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .map_or(0, |value| value.parse().unwrap())
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A connection to the Redis at `url`, for a test to look or reach into it.
pub async fn redis_connection(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The machine's Redis, for tests that share it (under a unique prefix).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// The machine's Postgres, for tests that share it (each in a schema of its own).
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A pool whose connections live in `schema` (created if missing, with the crate's migrations
/// applied), with a short acquire timeout so a dead database fails fast.
pub async fn pool_in_schema(url: &str, schema: &str) -> sqlx::PgPool {
    use sqlx::{Connection, Executor};

    let options = schema_options(url, schema);
    // Concurrent `CREATE SCHEMA IF NOT EXISTS` can race; one advisory lock serializes set-up.
    let mut setup = sqlx::PgConnection::connect_with(&options).await.unwrap();
    setup
        .execute("SELECT pg_advisory_lock(727274)")
        .await
        .unwrap();
    setup
        .execute(sqlx::AssertSqlSafe(format!(
            r#"CREATE SCHEMA IF NOT EXISTS "{schema}""#
        )))
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(2))
        .connect_with(options)
        .await
        .unwrap();
    store::PostgresStore::new(pool.clone())
        .migrate()
        .await
        .unwrap();
    setup
        .execute("SELECT pg_advisory_unlock(727274)")
        .await
        .unwrap();
    pool
}

/// Connection options for `url` whose connections resolve names in `schema`.
pub fn schema_options(url: &str, schema: &str) -> sqlx::postgres::PgConnectOptions {
    use std::str::FromStr;
    sqlx::postgres::PgConnectOptions::from_str(url)
        .unwrap()
        .options([("search_path", schema)])
}

/// A schema of the test's own on the machine's Postgres, dropped by [`TestSchema::drop`].
pub struct TestSchema {
    pub name: String,
    pub pool: sqlx::PgPool,
}

impl TestSchema {
    pub async fn new() -> Self {
        let name = format!("test_{}", uuid::Uuid::new_v4().simple());
        let pool = pool_in_schema(&database_url(), &name).await;
        Self { name, pool }
    }

    /// Drops the schema (call at the end of a test; a failed test leaves it for inspection).
    pub async fn drop(self) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            r#"DROP SCHEMA "{}" CASCADE"#,
            self.name
        )))
        .execute(&self.pool)
        .await
        .unwrap();
        self.pool.close().await;
    }
}

/// A Postgres cluster of the test's own (initdb + pg_ctl), for tests that stop it.
pub struct PgCluster {
    dir: PathBuf,
    pub port: u16,
    bin: PathBuf,
    running: bool,
    /// Server settings beyond the defaults, `-c name=value` each.
    settings: Vec<String>,
}

impl PgCluster {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A cluster started with `settings` (`name=value`) beyond the defaults.
    pub async fn start_with(settings: &[&str]) -> Self {
        let mut cluster = Self::unstarted();
        cluster.settings = settings.iter().map(|s| format!("-c {s}")).collect();
        let initdb = cluster
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(cluster.dir.join("data"))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(initdb.success(), "initdb failed");
        cluster.start_server().await;
        cluster
    }

    /// A streaming replica of this cluster, started on a port of its own. This cluster then
    /// waits for it on every commit (synchronous replication), so a failover to it loses no
    /// commit a client was told of.
    pub async fn start_standby(&self) -> Self {
        use sqlx::Connection;
        let mut standby = Self::unstarted();
        let backup = self
            .command("pg_basebackup")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-X", "stream", "-R", "-D"])
            .arg(standby.dir.join("data"))
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(backup.success(), "pg_basebackup failed");
        standby.start_server().await;
        let mut primary = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        sqlx::query("ALTER SYSTEM SET synchronous_standby_names = '*'")
            .execute(&mut primary)
            .await
            .unwrap();
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut primary)
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let sync = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'";
        while sqlx::query_scalar::<_, i64>(sync)
            .fetch_one(&mut primary)
            .await
            .unwrap()
            == 0
        {
            assert!(
                Instant::now() < deadline,
                "the standby never became synchronous"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        standby
    }

    /// Makes this standby the primary (`pg_ctl promote`), once it accepts writes.
    pub fn promote(&self) {
        self.pg_ctl(&["-w", "promote"]);
    }

    /// Restarts the server as an operator does (`-m fast`: every session is terminated), and
    /// returns once it accepts connections again.
    pub async fn restart_server(&mut self) {
        self.pg_ctl(&["-m", "fast", "-w", "stop"]);
        self.running = false;
        self.start_server().await;
    }

    /// A directory (owned by the cluster's user) and a port, nothing in them yet.
    fn unstarted() -> Self {
        let bin = postgres_bindir();
        let dir = std::env::temp_dir().join(format!("pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        if running_as_root() {
            // initdb refuses to run as root: the cluster belongs to an unprivileged user.
            let user = cluster_user();
            let status = Command::new("chown")
                .arg(format!("{user}:"))
                .arg(&dir)
                .status();
            assert!(
                status.is_ok_and(|status| status.success()),
                "cannot give {} to the user {user}: running as root, the test's Postgres \
                 runs as PG_USER (default `postgres`), which must exist",
                dir.display()
            );
        }
        Self {
            dir,
            port: free_port(),
            bin,
            running: false,
            settings: Vec::new(),
        }
    }

    fn command(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if running_as_root() {
            let runuser = find_program(
                "runuser",
                "RUNUSER",
                &[],
                "running as root, the test's Postgres runs as PG_USER through `runuser` \
                 (util-linux); install it or run the tests as an unprivileged user",
            )
            .unwrap_or_else(|why| panic!("{why}"));
            let mut command = Command::new(runuser);
            command.args(["-u", &cluster_user(), "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    pub async fn start_server(&mut self) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off {}",
            self.port,
            self.dir.display(),
            self.settings.join(" ")
        );
        let log = self.dir.join("log");
        self.pg_ctl(&["-l", log.to_str().unwrap(), "-o", &options, "-w", "start"]);
        self.running = true;
    }

    /// Stops the server at once, as a crash would (`-m immediate`).
    pub fn stop_server(&mut self) {
        self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
        self.running = false;
    }

    /// `pg_ctl -D <data> args…`, which must succeed.
    fn pg_ctl(&self, args: &[&str]) {
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(args)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "pg_ctl {args:?} failed");
    }

    pub fn url(&self) -> String {
        postgres_url(self.port)
    }

    /// Where the server listens.
    pub fn address(&self) -> std::net::SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }
}

/// The `postgres` database as the `postgres` user on a loopback port: a cluster of a test's
/// own, or a proxy in front of one.
pub fn postgres_url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

/// The unprivileged user a root test run starts its Postgres as.
fn cluster_user() -> String {
    std::env::var("PG_USER").unwrap_or_else(|_| "postgres".into())
}

fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().unwrap().stdout == b"0\n"
}

impl PgCluster {
    /// Stops the server and removes its directory once this test process has exited, however
    /// it exits: for a cluster kept in a `static`, which is never dropped.
    pub fn stop_when_this_process_exits(&self) {
        let stop = format!(
            "while [ -e /proc/{pid} ]; do sleep 0.5; done; \
             {pg_ctl} -D {data} -m immediate -w stop >/dev/null 2>&1; rm -rf {dir}",
            pid = std::process::id(),
            pg_ctl = self.bin.join("pg_ctl").display(),
            data = self.dir.join("data").display(),
            dir = self.dir.display(),
        );
        let mut watchdog = if running_as_root() {
            let mut command = Command::new("runuser");
            command.args(["-u", &cluster_user(), "--", "sh", "-c", &stop]);
            command
        } else {
            let mut command = Command::new("sh");
            command.args(["-c", &stop]);
            command
        };
        // Never waited for: it outlives this process, which is the point.
        #[allow(clippy::zombie_processes)]
        watchdog
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("the watchdog that stops the cluster");
    }
}

/// A Citus cluster of the test's own: a coordinator and workers, each a [`PgCluster`] with
/// Citus loaded, the workers added to the coordinator. Citus must be installed in the
/// machine's PostgreSQL ([`Need::Citus`]).
pub struct CitusCluster {
    pub coordinator: PgCluster,
    pub workers: Vec<PgCluster>,
}

impl CitusCluster {
    /// A coordinator and `workers` workers.
    pub async fn start(workers: usize) -> Self {
        let settings = [
            "shared_preload_libraries=citus",
            "max_connections=300",
            // Shards are moved by logical replication.
            "wal_level=logical",
        ];
        let coordinator = PgCluster::start_with(&settings).await;
        let mut nodes = Vec::new();
        for _ in 0..workers {
            nodes.push(PgCluster::start_with(&settings).await);
        }
        for node in std::iter::once(&coordinator).chain(&nodes) {
            let created = node.execute("CREATE EXTENSION IF NOT EXISTS citus").await;
            assert!(
                created.is_ok(),
                "Citus is not installed in this machine's PostgreSQL ({:?}): see \
                 docs/testing.md#citus",
                created.err()
            );
        }
        let port = coordinator.port;
        coordinator
            .execute(&format!(
                "SELECT citus_set_coordinator_host('127.0.0.1', {port})"
            ))
            .await
            .unwrap();
        for worker in &nodes {
            let port = worker.port;
            coordinator
                .execute(&format!("SELECT citus_add_node('127.0.0.1', {port})"))
                .await
                .unwrap();
        }
        Self {
            coordinator,
            workers: nodes,
        }
    }

    /// The coordinator, where the store and the applications connect.
    pub fn url(&self) -> String {
        self.coordinator.url()
    }

    /// [`url`](Self::url) for sessions that refuse any statement Citus would run on more than
    /// one shard (`citus.multi_task_query_log_level = error`).
    pub fn single_shard_url(&self) -> String {
        format!(
            "{}?options[citus.multi_task_query_log_level]=error",
            self.url()
        )
    }

    /// The shard of `table` that holds `key`, and the port of the worker it is on.
    pub async fn shard_of(&self, table: &str, key: &str) -> (i64, i32) {
        use sqlx::Connection;
        let mut admin = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        sqlx::query_as(
            "SELECT shardid, nodeport FROM citus_shards
             WHERE table_name = $1::regclass
               AND shardid = get_shard_id_for_distribution_column($1::regclass, $2)",
        )
        .bind(table)
        .bind(key)
        .fetch_one(&mut admin)
        .await
        .unwrap()
    }

    /// Moves the shard of `table` that holds `key` (with the shards co-located with it) to
    /// another worker, as an operator rebalancing does, in `mode` (Citus's
    /// `shard_transfer_mode`: `block_writes` blocks writes to it while it copies,
    /// `force_logical` copies by logical replication while writes go on and blocks them only
    /// to switch over). Returns the port of the worker it is on now.
    pub async fn move_shard_of(&self, table: &str, key: &str, mode: &str) -> i32 {
        use sqlx::Connection;
        let (shard, from) = self.shard_of(table, key).await;
        let to = self
            .workers
            .iter()
            .map(|w| i32::from(w.port))
            .find(|port| *port != from)
            .expect("another worker");
        let mut admin = sqlx::PgConnection::connect(&self.url()).await.unwrap();
        sqlx::query(
            "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3,
                                               shard_transfer_mode => $4::citus.shard_transfer_mode)",
        )
        .bind(shard)
        .bind(from)
        .bind(to)
        .bind(mode)
        .execute(&mut admin)
        .await
        .unwrap();
        assert_eq!(
            self.shard_of(table, key).await,
            (shard, to),
            "the shard moved"
        );
        to
    }

    /// See [`PgCluster::stop_when_this_process_exits`], for every node.
    pub fn stop_when_this_process_exits(&self) {
        self.coordinator.stop_when_this_process_exits();
        for worker in &self.workers {
            worker.stop_when_this_process_exits();
        }
    }
}

impl PgCluster {
    /// Runs `sql` (one or more statements) on this cluster's `postgres` database.
    pub async fn execute(&self, sql: &str) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        let mut connection = sqlx::PgConnection::connect(&self.url()).await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut connection)
            .await?;
        connection.close().await
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.running {
            self.stop_server();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `url` with `search_path` set to `schema` for every connection.
pub fn url_in_schema(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options[search_path]={schema}")
}

/// A TCP proxy in front of a server (Redis, Postgres) that, once armed, lets the next request
/// through but drops the server's reply and closes that connection: a store's statement or
/// script is applied, and its answer lost in transit.
pub struct ReplyCutter {
    pub port: u16,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ReplyCutter {
    /// A proxy on a free port of 127.0.0.1 to `host:port`.
    pub async fn start(host: &str, port: u16) -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = (host.to_owned(), port);
        let port = listener.local_addr().unwrap().port();
        let (armed, cut) = (
            std::sync::Arc::new(AtomicBool::new(false)),
            std::sync::Arc::new(AtomicUsize::new(0)),
        );
        let (armed_, cut_) = (armed.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream.clone()).await else {
                    continue;
                };
                tokio::spawn(Self::relay(client, server, armed_.clone(), cut_.clone()));
            }
        });
        Self { port, armed, cut }
    }

    /// Cuts the next reply any connection gets.
    pub fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many replies were cut.
    pub fn cut(&self) -> usize {
        self.cut.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
        cut: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        let requests = async {
            let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
        };
        let replies = async {
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let Ok(n @ 1..) = from_server.read(&mut buffer).await else {
                    return;
                };
                if armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    cut.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    return;
                }
                if to_client.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        };
        // Whichever way ends first closes both: the client sees its connection cut.
        tokio::select! {
            () = requests => {}
            () = replies => {}
        }
    }
}

/// A TCP proxy in front of a Redis server that passes each command on by itself, as the server
/// would run it, and, once told to, holds the next command of a given name (and all that
/// follow it on that connection) for a while before passing it on: a server that stalls in the
/// middle of a pipeline, between two of its commands.
pub struct CommandHolder {
    pub port: u16,
    hold: std::sync::Arc<std::sync::Mutex<Option<(String, Duration)>>>,
    holding: std::sync::Arc<tokio::sync::Notify>,
}

impl CommandHolder {
    /// A proxy on a free port of 127.0.0.1 to the Redis on `port` of 127.0.0.1.
    pub async fn start(port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Self {
            port: listener.local_addr().unwrap().port(),
            hold: Default::default(),
            holding: Default::default(),
        };
        let (hold, holding) = (proxy.hold.clone(), proxy.holding.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                tokio::spawn(Self::relay(client, server, hold.clone(), holding.clone()));
            }
        });
        proxy
    }

    /// The proxy's URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Holds the next `command` (by name, any case) any connection sends for `pause`: the
    /// commands before it have reached the server, it and those after it reach it `pause`
    /// later. The future returned is ready once the hold has begun.
    pub fn hold(&self, command: &str, pause: Duration) -> tokio::sync::futures::OwnedNotified {
        let begun = std::sync::Arc::clone(&self.holding).notified_owned();
        *self.hold.lock().unwrap() = Some((command.to_ascii_uppercase(), pause));
        begun
    }

    async fn relay(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        hold: std::sync::Arc<std::sync::Mutex<Option<(String, Duration)>>>,
        holding: std::sync::Arc<tokio::sync::Notify>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        let requests = async {
            let mut pending = Vec::new();
            let mut buffer = vec![0; 64 * 1024];
            loop {
                let Ok(n @ 1..) = from_client.read(&mut buffer).await else {
                    return;
                };
                pending.extend_from_slice(&buffer[..n]);
                while let Some((name, length)) = resp_command(&pending) {
                    let pause = {
                        let mut hold = hold.lock().unwrap();
                        let due = hold.as_ref().is_some_and(|(command, _)| *command == name);
                        due.then(|| hold.take().unwrap().1)
                    };
                    if let Some(pause) = pause {
                        holding.notify_waiters();
                        tokio::time::sleep(pause).await;
                    }
                    if to_server.write_all(&pending[..length]).await.is_err() {
                        return;
                    }
                    pending.drain(..length);
                }
            }
        };
        let replies = async {
            let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        };
        tokio::select! {
            () = requests => {}
            () = replies => {}
        }
    }
}

/// The name (upper case) and length in bytes of the whole RESP command at the start of
/// `bytes` (an array of bulk strings, as clients send them), or `None` until it is all there.
fn resp_command(bytes: &[u8]) -> Option<(String, usize)> {
    fn line(bytes: &[u8], at: usize) -> Option<(usize, usize)> {
        let end = at + bytes.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
        let number = std::str::from_utf8(&bytes[at + 1..end])
            .ok()?
            .parse()
            .ok()?;
        Some((number, end + 2))
    }
    let (count, mut at) = line(bytes, 0)?;
    let mut name = None;
    for _ in 0..count {
        let (length, start) = line(bytes, at)?;
        at = start + length + 2;
        if bytes.len() < at {
            return None;
        }
        name.get_or_insert_with(|| {
            String::from_utf8_lossy(&bytes[start..start + length]).to_ascii_uppercase()
        });
    }
    Some((name.unwrap_or_default(), at))
}
