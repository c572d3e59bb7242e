//! A Redis Cluster of the tests' own.

use super::*;

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
        let (nodes, ports) = (0..6).map(|_| Self::node(&dir)).unzip();
        let cluster = Self {
            nodes: std::sync::Mutex::new(nodes),
            ports,
            dir,
        };
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

    /// One node, listening on its port and its bus port. A port found free can be taken before the node binds it (by another
    /// test's server, or by an outgoing connection: both it and its bus port are in the
    /// ephemeral range), and then the node exits at once: it is started again on another port.
    fn node(dir: &std::path::Path) -> (Child, u16) {
        let server = redis_server();
        for _ in 0..20 {
            let port = free_cluster_port();
            let mut child = Command::new(&server)
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(dir)
                .stdout(Stdio::null())
                .stdin(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
                let listens = |p: u16| std::net::TcpStream::connect(("127.0.0.1", p)).is_ok();
                if listens(port) && listens(port + 10000) {
                    return (child, port);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("a redis-server cluster node did not start in 20 tries");
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
        self.wait_until_settled_within(Duration::from_secs(30));
    }

    /// [`wait_until_settled`](Self::wait_until_settled), for as long as `patience`; the panic
    /// says what was still unsettled.
    pub fn wait_until_settled_within(&self, patience: Duration) {
        if let Err(unsettled) = self.settled_within(patience) {
            panic!("{unsettled}");
        }
    }

    /// Waits for the cluster to settle (see [`wait_until_settled`](Self::wait_until_settled))
    /// for as long as `patience`; `Err` says what was still unsettled.
    pub fn settled_within(&self, patience: Duration) -> Result<(), String> {
        let deadline = Instant::now() + patience;
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
            let report = String::from_utf8_lossy(&check.stdout);
            let agree = check.status.success() && report.contains("All nodes agree");
            let ok = self.cluster_ok();
            if synced && agree && ok {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the cluster did not settle within {patience:?}: replicas synced {synced}, \
                     cluster_state ok {ok}, nodes agree {agree}:\n{report}"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What an operator runs on a cluster left with a slot nobody serves or one half moved:
    /// `redis-cli --cluster fix`, answering yes.
    pub fn repair(&self) {
        let alive = self.nodes_alive();
        let fix = Command::new(redis_cli())
            .args(["--cluster", "fix"])
            .arg(format!("127.0.0.1:{}", self.ports[alive[0]]))
            .arg("--cluster-yes")
            .output()
            .unwrap();
        println!(
            "redis-cli --cluster fix: {}\n{}",
            fix.status,
            String::from_utf8_lossy(&fix.stdout)
        );
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

    /// The process id of the node on `port`.
    pub fn pid_of(&self, port: u16) -> u32 {
        let index = self.ports.iter().position(|&p| p == port).unwrap();
        self.nodes.lock().unwrap()[index].id()
    }

    /// Kills a master (SIGKILL) and waits until its replica has taken over (after the node
    /// timeout, 1 s). Writes the master had not yet replicated are lost, as in production.
    /// Returns the port of the promoted replica.
    pub fn kill_a_master(&self) -> u16 {
        let (port, replica) = self.a_master_and_its_replica();
        let index = self.ports.iter().position(|&p| p == port).unwrap();
        {
            let mut nodes = self.nodes.lock().unwrap();
            let _ = nodes[index].kill();
            let _ = nodes[index].wait();
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(self.cli(replica, &["role"]).starts_with("master") && self.cluster_ok()) {
            assert!(
                Instant::now() < deadline,
                "no replica took over from {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_until_settled();
        replica
    }

    /// A master with a replica, and that replica. Right after a failover a node's view of who
    /// replicates whom may lag (seen on Valkey 8.1): it is read again until one has a replica.
    fn a_master_and_its_replica(&self) -> (u16, u16) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let roles = self.roles();
            let pair = roles.iter().find_map(|(port, id, master)| {
                let (replica, _, _) = roles
                    .iter()
                    .find(|(_, _, of)| master.is_none() && of.as_deref() == Some(id.as_str()))?;
                Some((*port, *replica))
            });
            if let Some(pair) = pair {
                return pair;
            }
            assert!(
                Instant::now() < deadline,
                "no master has a replica: {roles:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
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
    Need::RedisCli.path()
}
