//! Helpers shared by the tests that drive real processes over HTTP.

#![allow(dead_code, unreachable_pub)]

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower_idempotency::store::{self, Store};

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A server program a test starts: the path in the environment variable `var` if it is set,
/// else the first `name` on `PATH`, else one of `fallbacks`. Panics with what is missing and how
/// to provide it.
pub fn program(name: &str, var: &str, fallbacks: &[PathBuf], install: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{var}={} does not name a file: set it to the path of `{name}`",
            path.display()
        );
        return path;
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .iter()
        .chain(fallbacks)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "this test starts its own `{name}`, which is not on PATH: {install}, \
                 or set {var} to its path"
            )
        })
}

/// `redis-server`, for tests that start, stop or pause a Redis of their own (`REDIS_SERVER`).
pub fn redis_server() -> PathBuf {
    program(
        "redis-server",
        "REDIS_SERVER",
        &[],
        "install Redis (Debian: `apt install redis-server`; macOS: `brew install redis`)",
    )
}

/// The directory of Postgres' server programs (`initdb`, `pg_ctl`), for tests that run a
/// cluster of their own: `PG_BINDIR`, else `initdb` on `PATH`, else `pg_config --bindir`, else
/// Debian's `/usr/lib/postgresql/<version>/bin` (newest first).
pub fn postgres_bindir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BINDIR") {
        let dir = PathBuf::from(dir);
        assert!(
            dir.join("initdb").is_file() && dir.join("pg_ctl").is_file(),
            "PG_BINDIR={} holds no `initdb` and `pg_ctl`",
            dir.display()
        );
        return dir;
    }
    let pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    let mut debian: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .collect();
    debian.sort_by_key(|dir| std::cmp::Reverse(postgres_major(dir)));
    let fallbacks: Vec<PathBuf> = pg_config.into_iter().chain(debian).collect();
    let initdb = program(
        "initdb",
        "PG_BINDIR",
        &fallbacks,
        "install the PostgreSQL server (Debian: `apt install postgresql`; macOS: `brew install \
         postgresql`) and put its bin directory on PATH",
    );
    initdb.parent().unwrap().to_owned()
}

/// The major version in a `/usr/lib/postgresql/<major>/bin` path (0 when there is none).
fn postgres_major(bin: &std::path::Path) -> u32 {
    bin.parent()
        .and_then(|dir| dir.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// The path of an example binary; `cargo test` builds the examples before the tests.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = target.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo test`, which builds examples",
        path.display()
    );
    path
}

/// A child process killed when dropped, so a failing test leaves nothing running. Its output
/// goes to a log file, removed on drop unless the test is failing.
pub struct Proc {
    pub child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Proc {
    /// Starts an example serving on a fresh port, with extra environment, and waits until it
    /// accepts connections.
    pub async fn example(name: &str, env: &[(&str, String)]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("{name}-{port}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(example(name));
        command
            .env("PORT", port.to_string())
            .env(
                "RUST_LOG",
                std::env::var("EXAMPLE_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().unwrap();
        let proc = Self { child, port, log };
        proc.wait_until_listening().await;
        proc
    }

    async fn wait_until_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "nothing listens on port {}: {}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process has written so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A frozen process must thaw to die cleanly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// An answer read in full.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The `type` of a problem answer (which must be `application/problem+json`).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

/// Sends one request through a service in process and reads the whole answer.
pub async fn call<S, B>(service: &S, request: Request<axum::body::Body>) -> Answer
where
    S: tower::Service<Request<axum::body::Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let response = service.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// Sends one request; `Err` when the connection fails.
pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        trailers: None,
    })
}

/// `POST` a JSON body with an idempotency key.
pub async fn post_json(url: &str, key: &str, body: &str) -> Result<Answer, String> {
    send(
        Method::POST,
        url,
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
}

/// A `redis-server` of the test's own, on a free port, for tests that stop, pause or flush it.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    paused: bool,
    extra: Vec<String>,
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
        };
        server.spawn().await;
        server
    }

    async fn spawn(&mut self) {
        let program = redis_server();
        let child = Command::new(&program)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(std::env::temp_dir())
            .args(&self.extra)
            .stdout(Stdio::null())
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        self.child = Some(child);
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
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends a signal with kill(1).
pub fn signal_pid(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid} failed");
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
}

impl PgCluster {
    pub async fn start() -> Self {
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
        let mut cluster = Self {
            dir,
            port: free_port(),
            bin,
            running: false,
        };
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

    fn command(&self, name: &str) -> Command {
        let path = self.bin.join(name);
        if running_as_root() {
            let runuser = program(
                "runuser",
                "RUNUSER",
                &[],
                "running as root, the test's Postgres runs as PG_USER through `runuser` \
                 (util-linux); install it or run the tests as an unprivileged user",
            );
            let mut command = Command::new(runuser);
            command.args(["-u", &cluster_user(), "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    pub async fn start_server(&mut self) {
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off",
            self.port,
            self.dir.display()
        );
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-l"])
            .arg(self.dir.join("log"))
            .args(["-o", &options, "-w", "start"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "pg_ctl start failed");
        self.running = true;
    }

    /// Stops the server at once, as a crash would (`-m immediate`).
    pub fn stop_server(&mut self) {
        let status = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "pg_ctl stop failed");
        self.running = false;
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

/// The unprivileged user a root test run starts its Postgres as.
fn cluster_user() -> String {
    std::env::var("PG_USER").unwrap_or_else(|_| "postgres".into())
}

fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().unwrap().stdout == b"0\n"
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.running {
            self.stop_server();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A store whose renewals never arrive, like an instance frozen by a long pause: its leases run
/// out while its handlers still run.
#[derive(Clone)]
pub struct FrozenRenewals<S>(pub S);

impl<S: Store> Store for FrozenRenewals<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        self.0.claim(request)
    }

    fn renew<'a>(
        &'a self,
        _: &'a store::Lease,
        _: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        Box::pin(async { Ok(store::Ownership::Held) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.0.complete(lease, response, retention)
    }

    fn release<'a>(
        &'a self,
        lease: &'a store::Lease,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.0.release(lease)
    }
}

/// A store whose `complete` fails while `failing` is set, as a store that cannot take a write
/// would; every other operation goes through.
#[derive(Clone)]
pub struct FailingCompletes<S> {
    pub inner: S,
    pub failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<S: Store> Store for FailingCompletes<S> {
    fn claim<'a>(
        &'a self,
        request: &'a store::ClaimRequest,
    ) -> store::BoxFuture<'a, Result<store::ClaimOutcome, store::StoreError>> {
        self.inner.claim(request)
    }

    fn renew<'a>(
        &'a self,
        lease: &'a store::Lease,
        duration: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.renew(lease, duration)
    }

    fn complete<'a>(
        &'a self,
        lease: &'a store::Lease,
        response: &'a tower_idempotency::StoredResponse,
        retention: Duration,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async {
                Err(store::StoreError::Backend {
                    store: "failing",
                    source: "the store refuses writes".into(),
                })
            });
        }
        self.inner.complete(lease, response, retention)
    }

    fn release<'a>(
        &'a self,
        lease: &'a store::Lease,
    ) -> store::BoxFuture<'a, Result<store::Ownership, store::StoreError>> {
        self.inner.release(lease)
    }
}

/// A payment provider for the fleet: counts every charge per idempotency key, the number that
/// must never exceed one. Serves `POST /charges` on a free port of this process.
pub struct MockProvider {
    pub url: String,
    charges: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    task: tokio::task::JoinHandle<()>,
}

impl MockProvider {
    /// Starts the provider; each charge takes `latency`.
    pub async fn start(latency: Duration) -> Self {
        use axum::{extract::State, http::HeaderMap, routing::post};

        type Charges = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;
        async fn charge(
            State((charges, latency)): State<(Charges, Duration)>,
            headers: HeaderMap,
        ) -> (http::StatusCode, String) {
            tokio::time::sleep(latency).await;
            let key = headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let mut charges = charges.lock().unwrap();
            let count = charges.entry(key.clone()).or_default();
            *count += 1;
            (
                http::StatusCode::CREATED,
                format!(r#"{{"id":"ch_{key}_{count}"}}"#),
            )
        }

        let charges = Charges::default();
        let app = axum::Router::new()
            .route("/charges", post(charge))
            .with_state((charges.clone(), latency));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url, charges, task }
    }

    /// Charges per idempotency key.
    pub fn charges(&self) -> std::collections::HashMap<String, u32> {
        self.charges.lock().unwrap().clone()
    }
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `url` with `search_path` set to `schema` for every connection.
pub fn url_in_schema(url: &str, schema: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options[search_path]={schema}")
}

/// A claim of `key` in scope "tenant" for a fixed request, by a fresh owner.
pub fn claim_request(key: &str, lease: Duration) -> store::ClaimRequest {
    let parts = http::Request::post("/x").body(()).unwrap().into_parts().0;
    store::ClaimRequest::new(
        store::RecordKey::new(
            "tenant",
            tower_idempotency::IdempotencyKey::try_from(key).unwrap(),
        ),
        tower_idempotency::Fingerprint::of_request(&parts, &[], b"body"),
        uuid::Uuid::new_v4(),
        lease,
    )
}

/// Claims and expects to acquire; returns the lease.
pub async fn acquire(store: &impl Store, request: &store::ClaimRequest) -> store::Lease {
    match store.claim(request).await.unwrap() {
        store::ClaimOutcome::Acquired { fence } => request.lease_with_fence(fence),
        other => panic!("expected to acquire {}, got {other:?}", request.record()),
    }
}

/// Retries `attempt` every 100 ms until it succeeds; fails the test after `within`.
pub async fn eventually<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    within: Duration,
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let started = Instant::now();
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(error) => {
                assert!(
                    started.elapsed() < within,
                    "{what}: still failing after {within:?}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A port below 55536 whose cluster bus port (+10000) is free too, as Redis Cluster needs.
pub fn free_cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55536 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

/// A Redis Cluster of the test's own: three masters and three replicas, each a `redis-server`
/// with `--cluster-enabled yes` on a loopback port, joined by `redis-cli --cluster create`.
///
/// Its methods block (they run `redis-cli` and wait on the cluster): from async code, call them
/// in `tokio::task::spawn_blocking`.
pub struct RedisCluster {
    nodes: std::sync::Mutex<Vec<Child>>,
    pub ports: Vec<u16>,
    dir: PathBuf,
}

impl RedisCluster {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("cluster-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let server = redis_server();
        let mut nodes = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..6 {
            let port = free_cluster_port();
            let child = Command::new(&server)
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(&dir)
                .stdout(Stdio::null())
                .stdin(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
            nodes.push(child);
            ports.push(port);
        }
        let cluster = Self {
            nodes: std::sync::Mutex::new(nodes),
            ports,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while cluster.nodes_alive().len() < cluster.ports.len() {
            assert!(
                Instant::now() < deadline,
                "redis-server nodes did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let addresses: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let out = Command::new(redis_cli())
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        cluster.wait_until_settled();
        cluster
    }

    /// One cluster for the whole test binary, for tests that only read and write keys (each
    /// under a prefix of its own). A watchdog process stops its nodes once the binary exits.
    pub fn shared() -> &'static Self {
        static SHARED: std::sync::OnceLock<RedisCluster> = std::sync::OnceLock::new();
        SHARED.get_or_init(|| {
            let cluster = Self::start();
            let pids: Vec<String> = cluster
                .nodes
                .lock()
                .unwrap()
                .iter()
                .map(|child| child.id().to_string())
                .collect();
            let script = format!(
                "while kill -0 {} 2>/dev/null; do sleep 1; done; kill -9 {}; rm -rf '{}'",
                std::process::id(),
                pids.join(" "),
                cluster.dir.display()
            );
            // Outlives this process by design: it is what stops the nodes after it.
            let watchdog = Command::new("sh")
                .args(["-c", &script])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .expect("sh, for the cluster's watchdog");
            std::mem::forget(watchdog);
            cluster
        })
    }

    /// `host:port,host:port,…`, as the payments example's `REDIS_CLUSTER_NODES` takes them.
    pub fn seeds(&self) -> String {
        let seeds: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        seeds.join(",")
    }

    /// The seed nodes' URLs.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// `redis-cli -p port args…`, its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new(redis_cli())
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "redis-cli {args:?} failed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// (port, node id, its master's id for a replica) of every live node, each as the node
    /// itself says (its `myself` line of `CLUSTER NODES`).
    pub fn roles(&self) -> Vec<(u16, String, Option<String>)> {
        self.nodes_alive()
            .into_iter()
            .map(|i| {
                let port = self.ports[i];
                let nodes = self.cli(port, &["cluster", "nodes"]);
                let line = nodes.lines().find(|l| l.contains("myself")).unwrap();
                let fields: Vec<&str> = line.split(' ').collect();
                let master = (fields[3] != "-").then(|| fields[3].to_owned());
                (port, fields[0].to_owned(), master)
            })
            .collect()
    }

    /// The ports of the masters.
    pub fn masters(&self) -> Vec<u16> {
        let roles = self.roles().into_iter();
        roles.filter(|r| r.2.is_none()).map(|r| r.0).collect()
    }

    fn nodes_alive(&self) -> Vec<usize> {
        (0..self.ports.len())
            .filter(|&i| std::net::TcpStream::connect(("127.0.0.1", self.ports[i])).is_ok())
            .collect()
    }

    fn cluster_ok(&self) -> bool {
        self.nodes_alive().iter().all(|&i| {
            self.cli(self.ports[i], &["cluster", "info"])
                .contains("cluster_state:ok")
        })
    }

    /// Waits until every live node reports `cluster_state:ok`, all agree about the slots
    /// (`redis-cli --cluster check`), and every replica is linked to its master (so a
    /// coordinated failover loses nothing).
    pub fn wait_until_settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let alive = self.nodes_alive();
            let synced = alive.iter().all(|&i| {
                let info = self.cli(self.ports[i], &["info", "replication"]);
                !info.contains("role:slave") || info.contains("master_link_status:up")
            });
            let check = Command::new(redis_cli())
                .args(["--cluster", "check"])
                .arg(format!("127.0.0.1:{}", self.ports[alive[0]]))
                .output()
                .unwrap();
            let agree = check.status.success()
                && String::from_utf8_lossy(&check.stdout).contains("All nodes agree");
            if synced && agree && self.cluster_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not settle");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Promotes a replica with `CLUSTER FAILOVER` (coordinated: its master hands over only once
    /// the replica has every write) and waits until it serves as a master. Returns its port.
    pub fn failover(&self) -> u16 {
        let (port, _, _) = self
            .roles()
            .into_iter()
            .find(|(_, _, master)| master.is_some())
            .expect("a replica");
        assert!(self.cli(port, &["cluster", "failover"]).contains("OK"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.cli(port, &["role"]).starts_with("master") {
            assert!(Instant::now() < deadline, "the failover did not happen");
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_until_settled();
        port
    }

    /// Kills a master (SIGKILL) and waits until its replica has taken over (after the node
    /// timeout, 1 s). Writes the master had not yet replicated are lost, as in production.
    /// Returns the port of the promoted replica.
    pub fn kill_a_master(&self) -> u16 {
        let roles = self.roles();
        let (port, id, _) = roles
            .iter()
            .find(|(_, _, master)| master.is_none())
            .expect("a master");
        let (replica, _, _) = roles
            .iter()
            .find(|(_, _, master)| master.as_deref() == Some(id.as_str()))
            .expect("a replica of the master");
        let index = self.ports.iter().position(|p| p == port).unwrap();
        {
            let mut nodes = self.nodes.lock().unwrap();
            let _ = nodes[index].kill();
            let _ = nodes[index].wait();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(self.cli(*replica, &["role"]).starts_with("master") && self.cluster_ok()) {
            assert!(
                Instant::now() < deadline,
                "no replica took over from {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_until_settled();
        *replica
    }

    /// Moves `slots` slots from one master to another with `redis-cli --cluster reshard`: keys
    /// migrate (`MIGRATE`) while clients keep writing, and clients follow `ASK` and `MOVED`.
    pub fn reshard(&self, slots: usize) {
        let roles = self.roles();
        let masters: Vec<&(u16, String, Option<String>)> =
            roles.iter().filter(|r| r.2.is_none()).collect();
        let (from, to) = (masters[0], masters[1]);
        let out = Command::new(redis_cli())
            .args(["--cluster", "reshard", &format!("127.0.0.1:{}", from.0)])
            .args(["--cluster-from", &from.1, "--cluster-to", &to.1])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster reshard failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in self.nodes.get_mut().unwrap() {
            let _ = node.kill();
            let _ = node.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `redis-cli`, for the tests that build a Redis Cluster (`REDIS_CLI`).
pub fn redis_cli() -> PathBuf {
    program(
        "redis-cli",
        "REDIS_CLI",
        &[],
        "install Redis (Debian: `apt install redis-tools`; macOS: `brew install redis`)",
    )
}
