//! [`Admin::diagnose`](crate::store::Admin::diagnose) for Redis: on each master, the server
//! version and the compare-and-set commands it has, `maxmemory-policy`, persistence and
//! replicas; on a cluster, slot coverage.

use ::redis::{Pipeline, Value};

use super::{Node, RedisStore, STORE, compare::Offers};
use crate::store::{Diagnosis, Severity, StoreError};

impl RedisStore {
    pub(super) async fn diagnosis(&self) -> Diagnosis {
        let mut diagnosis = Diagnosis::default();
        let masters = match self.call(async |c| c.masters().await).await {
            Ok(masters) => masters,
            Err(error) => {
                let message = self.unreachable(&error).await;
                diagnosis.push(Severity::Risk, STORE, "reachable", message);
                return diagnosis;
            }
        };
        if masters.first().is_some_and(Option::is_some) {
            self.check_slots(&masters, &mut diagnosis).await;
        }
        for node in &masters {
            self.check_node(node, &mut diagnosis).await;
        }
        diagnosis
    }

    /// One command's reply on `node`.
    async fn ask(&self, node: &Node, args: &[&str]) -> Result<Value, StoreError> {
        let mut pipe = Pipeline::new();
        let command = pipe.cmd(args[0]);
        for arg in &args[1..] {
            command.arg(*arg);
        }
        let mut replies = self
            .call(async |connection| connection.pipeline_on(node, &pipe).await)
            .await?;
        Ok(replies.pop().unwrap_or(Value::Nil))
    }

    /// `INFO section` on `node`, as its `field:value` lines.
    async fn info(&self, node: &Node, section: &str) -> Result<Info, StoreError> {
        let reply = self.ask(node, &["INFO", section]).await?;
        let text: String = super::from_value(reply)?;
        Ok(Info(text))
    }

    async fn check_node(&self, node: &Node, diagnosis: &mut Diagnosis) {
        let on = match node {
            Some((host, port)) => format!("{host}:{port}: "),
            None => String::new(),
        };
        match self.info(node, "server").await {
            Ok(server) => {
                let offers = self.offers(node).await.unwrap_or_default();
                let (severity, message) = version(&server, offers, !self.horizon.is_zero());
                diagnosis.push(severity, STORE, "version", format!("{on}{message}"));
            }
            Err(error) => {
                let message = format!("{on}{}", self.unreachable(&error).await);
                diagnosis.push(Severity::Risk, STORE, "reachable", message);
                return;
            }
        }
        let policy = self.ask(node, &["CONFIG", "GET", "maxmemory-policy"]).await;
        let (severity, message) = eviction(policy.and_then(super::from_value));
        diagnosis.push(
            severity,
            STORE,
            "maxmemory-policy",
            format!("{on}{message}"),
        );
        let save = self.ask(node, &["CONFIG", "GET", "save"]).await;
        let persistence = self.info(node, "persistence").await;
        let replication = self.info(node, "replication").await;
        let (severity, message) = durability(
            save.and_then(super::from_value),
            persistence.ok(),
            replication.ok(),
        );
        diagnosis.push(severity, STORE, "persistence", format!("{on}{message}"));
    }

    async fn check_slots(&self, masters: &[Node], diagnosis: &mut Diagnosis) {
        let info = self.ask(&masters[0], &["CLUSTER", "INFO"]).await;
        let (severity, message) = match info.and_then(super::from_value::<String>) {
            Ok(text) => {
                let info = Info(text);
                let state = info.get("cluster_state").unwrap_or("?").to_owned();
                let assigned = info.get("cluster_slots_assigned").unwrap_or("?").to_owned();
                let failing = info.get("cluster_slots_fail").unwrap_or("0").to_owned();
                let message = format!(
                    "{} masters, state {state}, {assigned} of 16384 slots assigned, {failing} failing",
                    masters.len()
                );
                let covered = state == "ok" && assigned == "16384" && failing == "0";
                if covered {
                    (Severity::Ok, message)
                } else {
                    let fix = "keys of uncovered slots cannot be claimed: fix the cluster";
                    (Severity::Risk, format!("{message}: {fix}"))
                }
            }
            Err(error) => (Severity::Risk, self.unreachable(&error).await),
        };
        diagnosis.push(severity, STORE, "cluster", message);
    }
}

/// The lines of an `INFO` reply.
struct Info(String);

impl Info {
    fn get(&self, field: &str) -> Option<&str> {
        self.0.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            (name == field).then_some(value.trim())
        })
    }
}

impl RedisStore {
    /// Why the store could not be reached: a call bounded by the store's timeout says only
    /// that it timed out (the connection is made again and again until then), so one server is
    /// asked again on a connection of this check's own, which tells a refused connection, a
    /// server that wants a password (or refused the one given) and one that does not answer.
    async fn unreachable(&self, error: &StoreError) -> String {
        let cause = match &self.backend {
            super::Backend::Server { client, .. } => why_unreachable(client).await,
            super::Backend::Cluster(_) => None,
        };
        let cause = cause.unwrap_or_else(|| {
            let error: &dyn std::error::Error = error;
            match error.source() {
                Some(source) => format!("{error}: {source}"),
                None => error.to_string(),
            }
        });
        format!("could not be reached ({cause}): claims fail while it is so")
    }
}

/// How long the doctor waits for a server that does not answer at all.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// What connecting to the server afresh, and a `PING`, say: `None` if it answers.
async fn why_unreachable(client: &::redis::Client) -> Option<String> {
    let probe = async {
        let mut connection = client.get_multiplexed_async_connection().await?;
        ::redis::cmd("PING")
            .query_async::<Value>(&mut connection)
            .await
    };
    match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
        Ok(Ok(_)) => None,
        Ok(Err(error)) => Some(refusal(&error)),
        Err(_) => Some(format!(
            "no answer in time ({PROBE_TIMEOUT:?}): a frozen server, a firewall, or the wrong \
             address"
        )),
    }
}

/// A connection's refusal, as an operator reads it: what to fix.
fn refusal(error: &::redis::RedisError) -> String {
    if error.is_timeout() {
        return "no answer in time: a frozen server, a firewall, or the wrong address".into();
    }
    if error.is_connection_refusal() {
        return format!(
            "connection refused ({error}): is the server running, at this host and port?"
        );
    }
    let auth = matches!(error.code(), Some("NOAUTH" | "WRONGPASS"))
        || error.kind() == ::redis::ErrorKind::AuthenticationFailed;
    if auth {
        return format!(
            "authentication refused ({error}): give the server's user and password in the URL \
             (redis://user:password@host:port)"
        );
    }
    error.to_string()
}

/// `major.minor.patch` of a version string.
fn triple(version: &str) -> (u32, u32, u32) {
    let mut parts = version.split('.').map(|p| p.parse().unwrap_or(0));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// The server's name and version, and which of the commands it `offers` (as the server says,
/// not from its version) the store uses, which for a claim depends on whether it keeps
/// `tombstones`.
fn version(server: &Info, offers: Offers, tombstones: bool) -> (Severity, String) {
    let (name, version) = match server.get("valkey_version") {
        Some(version) => ("Valkey", version),
        None => ("Redis", server.get("redis_version").unwrap_or("unknown")),
    };
    let v = triple(version);
    let finalizes = match (offers.has(Offers::SET_IFEQ), offers.has(Offers::DELIFEQ)) {
        (true, true) => "completion and renewal use SET IFEQ, release DELIFEQ",
        (true, false) => "completion and renewal use SET IFEQ",
        (false, true) => "release uses DELIFEQ",
        (false, false) => "completion, renewal and release run scripts",
    };
    let claims = match (offers.has(Offers::SET_NX_GET), tombstones) {
        (true, false) => "a claim is one SET NX GET, pipelined",
        (true, true) => {
            "a claim runs claim.lua (it reads the tombstone), in front of an authority one SET NX \
             GET, pipelined"
        }
        (false, _) => "a claim runs claim.lua, in front of an authority too",
    };
    let names = offers.names();
    let offers = match names.is_empty() {
        true => "none".to_owned(),
        false => names.join(", "),
    };
    let message =
        format!("{name} {version}; compare-and-set commands: {offers}; {finalizes}; {claims}");
    if name == "Redis" && v < (6, 2, 0) {
        let fix = "the store needs Redis 6.2 or newer";
        return (Severity::Risk, format!("{message}: {fix}"));
    }
    (Severity::Ok, message)
}

/// What `maxmemory-policy` does to records: every record has an expiry, so a `volatile-*`
/// policy evicts them as surely as an `allkeys-*` one.
fn eviction(policy: Result<Vec<String>, StoreError>) -> (Severity, String) {
    match policy.as_deref() {
        Ok([_, policy]) if policy == "noeviction" => (Severity::Ok, "noeviction".into()),
        Ok([_, policy]) => (
            Severity::Risk,
            format!(
                "{policy} evicts records under memory pressure (keys in flight included): a \
                 retry may run again; set maxmemory-policy noeviction"
            ),
        ),
        Ok(_) | Err(_) => (
            Severity::Warning,
            "could not be read (CONFIG GET refused?): make sure it is noeviction".into(),
        ),
    }
}

/// Whether completed records survive a restart: append-only file, snapshots, replicas.
fn durability(
    save: Result<Vec<String>, StoreError>,
    persistence: Option<Info>,
    replication: Option<Info>,
) -> (Severity, String) {
    let aof = persistence
        .as_ref()
        .and_then(|info| info.get("aof_enabled"))
        .is_some_and(|on| on == "1");
    // `None`: `CONFIG` is refused or renamed away (as on managed Redis); INFO does not say
    // whether snapshots are configured, so the doctor says it could not tell.
    let snapshots = match save.as_deref() {
        Ok([_, rules]) => Some(!rules.is_empty()),
        _ => None,
    };
    let replicas: u32 = replication
        .as_ref()
        .and_then(|info| info.get("connected_slaves"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let found = format!(
        "append-only file {}, snapshots {}, replicas {replicas}",
        if aof { "on" } else { "off" },
        match snapshots {
            Some(true) => "on",
            Some(false) => "off",
            None => "unknown (CONFIG GET refused)",
        }
    );
    match (aof || replicas > 0, snapshots) {
        (true, _) => (Severity::Ok, found),
        (false, Some(true)) => {
            let why = "a restart loses the records written since the last snapshot: turn on \
                       appendonly, or add a replica";
            (Severity::Warning, format!("{found}: {why}"))
        }
        (false, Some(false)) => {
            let why = "a restart loses every record, and retries of completed keys run again: \
                       turn on appendonly, or add a replica";
            (Severity::Risk, format!("{found}: {why}"))
        }
        (false, None) => {
            let why = "without snapshots a restart loses every record: check the server's \
                       persistence where it is managed, or turn on appendonly";
            (Severity::Warning, format!("{found}: {why}"))
        }
    }
}
