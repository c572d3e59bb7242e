//! Postgres servers of the run's own, for the Citus rows: a plain node and Citus clusters (a
//! coordinator and workers), every one started with the same settings, so that the plain node
//! is the fair "one Postgres" beside them.

use super::*;

/// One PostgreSQL server (`initdb` + `pg_ctl` from `PG_BINDIR`, else `pg_config --bindir`, run
/// as `postgres` when this program runs as root), stopped and removed when dropped.
pub(crate) struct PgNode {
    dir: std::path::PathBuf,
    port: u16,
}

impl PgNode {
    /// A server on a free port, Citus loaded when `citus`. `None` (with a message) when the
    /// machine cannot run one.
    fn start(citus: bool) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("bench-pg-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).ok()?;
        let node = Self {
            dir,
            port: free_port(),
        };
        if root() {
            run(Command::new("chown").arg("postgres:").arg(&node.dir))?;
        }
        let data = node.dir.join("data");
        run(node
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data))?;
        let preload = if citus { "citus" } else { "" };
        let options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off -c max_connections=300 \
             -c shared_preload_libraries={preload}",
            node.port,
            node.dir.display()
        );
        let log = node.dir.join("log");
        run(node
            .command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(&log)
            .args(["-o", &options, "-w", "start"]))?;
        Some(node)
    }

    fn command(&self, program: &str) -> Command {
        let bin = std::env::var("PG_BINDIR").unwrap_or_else(|_| {
            let out = Command::new("pg_config").arg("--bindir").output();
            out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_default()
        });
        let path = std::path::Path::new(&bin).join(program);
        if root() {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            Command::new(path)
        }
    }

    pub(crate) fn url(&self) -> String {
        // No TLS, on every node alike: `CREATE EXTENSION citus` turns it on for the Citus ones.
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
            self.port
        )
    }

    /// The server's main process (`postmaster.pid`'s first line).
    fn pid(&self) -> Option<u32> {
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid")).ok()?;
        pid.lines().next()?.trim().parse().ok()
    }
}

/// The main process of each Citus cluster's coordinator and of its workers, by setup
/// ("citus-1", "citus-2"), for [`citus_cpu`].
static CITUS_PIDS: std::sync::OnceLock<Vec<(String, u32, Vec<u32>)>> = std::sync::OnceLock::new();

/// CPU used so far by the coordinator and by the workers of `setup`'s cluster (each server's
/// main process and the processes it started that are still there: the store's sessions, and
/// the coordinator's to the workers, which it keeps), or `None` for another setup.
pub(crate) fn citus_cpu(setup: &str) -> Option<(Duration, Duration)> {
    let (_, coordinator, workers) = CITUS_PIDS.get()?.iter().find(|(s, _, _)| s == setup)?;
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let parent = stat
            .rfind(')')
            .and_then(|at| stat[at + 2..].split(' ').nth(1)?.parse::<u32>().ok());
        if let Some(parent) = parent {
            children.entry(parent).or_default().push(pid);
        }
    }
    let tree = |root: &u32| -> Duration {
        let family = children.get(root).into_iter().flatten().chain([root]);
        family.filter_map(|pid| try_process_cpu(*pid)).sum()
    };
    Some((tree(coordinator), workers.iter().map(tree).sum()))
}

impl Drop for PgNode {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let stop = ["-m", "immediate", "-w", "stop"];
        let _ = run(self.command("pg_ctl").arg("-D").arg(&data).args(stop));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout == b"0\n")
}

/// Runs `command` quietly; `None` unless it succeeds.
fn run(command: &mut Command) -> Option<()> {
    let status = command.stdout(Stdio::null()).stderr(Stdio::null()).status();
    status.is_ok_and(|s| s.success()).then_some(())
}

/// The plain node and the Citus clusters of a run: `node` for the plain setups, `citus[n - 1]`
/// the coordinator of the cluster with `n` workers.
pub(crate) struct Nodes {
    pub(crate) node: PgNode,
    pub(crate) citus: Vec<(PgNode, Vec<PgNode>)>,
}

impl Nodes {
    /// A plain node and clusters of one and two workers, migrated (the Citus ones distributed),
    /// or `None` with a message when Citus cannot run here.
    pub(crate) async fn start() -> Option<Self> {
        let node = PgNode::start(false)?;
        migrate(&node.url(), None).await?;
        let mut citus = Vec::new();
        let mut pids = Vec::new();
        for workers in 1..=2 {
            let coordinator = PgNode::start(true)?;
            let workers: Vec<PgNode> = (0..workers).filter_map(|_| PgNode::start(true)).collect();
            add_workers(&coordinator, &workers).await?;
            migrate(&coordinator.url(), Some(workers.len())).await?;
            let worker_pids = workers.iter().filter_map(PgNode::pid).collect();
            pids.push((
                format!("citus-{}", workers.len()),
                coordinator.pid()?,
                worker_pids,
            ));
            citus.push((coordinator, workers));
        }
        let _ = CITUS_PIDS.set(pids);
        Some(Self { node, citus })
    }

    /// "node|citus-1|citus-2": the URLs the setups connect to.
    pub(crate) fn urls(&self) -> String {
        let coordinators = self.citus.iter().map(|(c, _)| c.url());
        std::iter::once(self.node.url())
            .chain(coordinators)
            .collect::<Vec<_>>()
            .join(",")
    }
}

async fn add_workers(coordinator: &PgNode, workers: &[PgNode]) -> Option<()> {
    for node in std::iter::once(coordinator).chain(workers) {
        let pool = sqlx::PgPool::connect(&node.url()).await.ok()?;
        if let Err(error) = sqlx::query("CREATE EXTENSION IF NOT EXISTS citus")
            .execute(&pool)
            .await
        {
            eprintln!("Citus is not installed ({error}): the Citus setups are left out");
            return None;
        }
    }
    let pool = sqlx::PgPool::connect(&coordinator.url()).await.ok()?;
    let port = |node: &PgNode| i32::from(node.port);
    sqlx::query("SELECT citus_set_coordinator_host('127.0.0.1', $1)")
        .bind(port(coordinator))
        .execute(&pool)
        .await
        .ok()?;
    for worker in workers {
        sqlx::query("SELECT citus_add_node('127.0.0.1', $1)")
            .bind(port(worker))
            .execute(&pool)
            .await
            .ok()?;
    }
    Some(())
}

/// The crate's migrations; on a Citus coordinator of `workers` workers, the table distributed
/// too, in 2 shards a worker (the sizing guide's advice), or `CITUS_SHARDS`. `None`, with the
/// error, when a step fails: the setups on these nodes are left out, and the run says why.
async fn migrate(url: &str, workers: Option<usize>) -> Option<()> {
    let failed = |step: &str, error: &dyn std::fmt::Display| {
        eprintln!(
            "{step} on {url} failed ({error}): the setups on the run's own nodes are left out"
        );
    };
    let pool = sqlx::PgPool::connect(url)
        .await
        .map_err(|e| failed("connecting", &e))
        .ok()?;
    let store = PostgresStore::new(pool);
    store
        .migrate()
        .await
        .map_err(|e| failed("the migrations", &e))
        .ok()?;
    if let Some(workers) = workers {
        let shards = std::env::var("CITUS_SHARDS").unwrap_or_else(|_| (2 * workers).to_string());
        let sql = format!("SET citus.shard_count = {shards};{DISTRIBUTE_ON_CITUS}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(store.pool())
            .await
            .map_err(|e| failed("distributing on Citus", &e))
            .ok()?;
    }
    Some(())
}
