//! Postgres clusters of the tests' own (initdb + pg_ctl), started, stopped, restarted, failed
//! over; and a Citus cluster (a coordinator and its workers) of the same.

use super::*;

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

    /// What the server has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
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
