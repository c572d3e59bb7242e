//! Servers of the tests' own (a Redis) and the machine's shared ones (its Redis and Postgres,
//! and a schema of its own per test).

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

    /// The clients subscribed to something: each one's id and how many channels it listens on
    /// (`sub` and `ssub` of `CLIENT LIST`; a RESP3 subscriber is not of the `pubsub` type).
    pub async fn subscribers(&self) -> Vec<(String, u64)> {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut self.admin().await)
            .await
            .unwrap();
        let field = |line: &str, name: &str| {
            line.split(' ')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .map(str::to_owned)
        };
        let count = |line: &str, name| field(line, name).and_then(|n| n.parse::<u64>().ok());
        clients
            .lines()
            .filter_map(|line| {
                let channels = count(line, "sub").unwrap_or(0) + count(line, "ssub").unwrap_or(0);
                Some((field(line, "id")?, channels)).filter(|_| channels > 0)
            })
            .collect()
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

    /// How many commands the server ran since the last reset, whatever they were, but for the
    /// tests' own looks at it (`INFO`, `CONFIG`): what its clients cost it.
    pub async fn all_calls(&self) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.admin().await)
            .await
            .unwrap();
        info.lines()
            .filter_map(|line| line.trim().strip_prefix("cmdstat_"))
            .filter(|line| !line.starts_with("info:") && !line.starts_with("config"))
            .filter_map(|line| {
                let calls = line.split(':').nth(1)?.split(',').next()?;
                calls.strip_prefix("calls=")?.parse::<u64>().ok()
            })
            .sum()
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
        Self::on(&database_url()).await
    }

    /// A schema of its own on the server at `url`.
    pub async fn on(url: &str) -> Self {
        let name = format!("test_{}", uuid::Uuid::new_v4().simple());
        let pool = pool_in_schema(url, &name).await;
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

/// `url` with `search_path` set to `schema` for every connection.
pub fn url_in_schema(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options[search_path]={schema}")
}
