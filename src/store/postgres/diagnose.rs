//! [`Admin::diagnose`](crate::store::Admin::diagnose) for Postgres: the server version, the
//! crate's migrations, whether acknowledged commits survive a crash, the session timeouts of the application's pool (on which the handlers'
//! fence transactions run), on Citus how the table is distributed, whether the sweeper keeps
//! up, and the table's size.

use std::time::Duration;

use sqlx::{Connection, Row};

use super::{MIGRATOR, PostgresStore, STORE};
use crate::store::{Diagnosis, Severity, StoreError};

/// Whether `error` is the server refusing the connection: nothing listens at that address.
fn refused(error: &StoreError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(error) = source {
        let io = match error.downcast_ref::<sqlx::Error>() {
            Some(sqlx::Error::Io(io)) => Some(io),
            _ => error.downcast_ref::<std::io::Error>(),
        };
        if io.is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        source = error.source();
    }
    false
}

/// An expired row older than this says the sweeper is not running (or not keeping up).
const SWEEPER_LAG: Duration = Duration::from_secs(3600);

/// How long after its lease ran out an abandoned key is worth a warning: a completer running
/// every few seconds has finished it long before.
const COMPLETER_LAG: Duration = Duration::from_secs(600);

impl PostgresStore {
    pub(super) async fn diagnosis(&self) -> Diagnosis {
        let mut diagnosis = Diagnosis::default();
        match self.server_version().await {
            Ok(version) => diagnosis.push(Severity::Ok, STORE, "version", version),
            Err(error) => {
                let cause =
                    std::error::Error::source(&error).map_or(String::new(), |s| format!(": {s}"));
                let hint = if refused(&error) {
                    ": is the server running, at this host and port?"
                } else {
                    ""
                };
                let message = format!(
                    "could not be reached ({error}{cause}{hint}): claims fail while it is so"
                );
                diagnosis.push(Severity::Risk, STORE, "reachable", message);
                return diagnosis;
            }
        }
        let migrated = self.migrations().await;
        let table = migrated.as_ref().is_ok_and(|(table, _)| *table);
        let (severity, message) = migrated.map_or_else(could_not, |(_, found)| found);
        diagnosis.push(severity, STORE, "migrations", message);
        let (severity, message) = self.commit_durability().await.unwrap_or_else(could_not);
        diagnosis.push(severity, STORE, "synchronous_commit", message);
        let (severity, message) = self.connection_headroom().await.unwrap_or_else(could_not);
        diagnosis.push(severity, STORE, "connections", message);
        for (check, setting, severity_if_off, why) in TIMEOUTS {
            let (severity, message) = self
                .timeout_setting(setting, severity_if_off, why)
                .await
                .unwrap_or_else(could_not);
            diagnosis.push(severity, STORE, check, message);
        }
        if !table {
            return diagnosis;
        }
        match self.distribution().await {
            Ok(Some((severity, message))) => diagnosis.push(severity, STORE, "citus", message),
            Ok(None) => {}
            Err(error) => {
                let (severity, message) = could_not(error);
                diagnosis.push(severity, STORE, "citus", message);
            }
        }
        if self.distributed {
            let (severity, message) = self.clocks().await.unwrap_or_else(could_not);
            diagnosis.push(severity, STORE, "clocks", message);
        }
        let (severity, message) = self.sweeper().await.unwrap_or_else(could_not);
        diagnosis.push(severity, STORE, "sweeper", message);
        let (severity, message) = self.abandoned_keys().await.unwrap_or_else(could_not);
        diagnosis.push(severity, STORE, "completer", message);
        let (severity, message) = self.size().await.unwrap_or_else(could_not);
        diagnosis.push(severity, STORE, "size", message);
        diagnosis.push(Severity::Ok, STORE, "tombstones", self.tombstones());
        diagnosis
    }

    /// Whether the store keeps tombstones, and for how long.
    fn tombstones(&self) -> String {
        if self.horizon.is_zero() {
            return "off: a retry after its answer's retention runs again (with_tombstones)".into();
        }
        format!(
            "kept until {:?} after each key's completion: a retry after its answer's retention \
             is refused (410) until then",
            self.horizon
        )
    }

    /// On a Citus coordinator: whether `idempotency_keys` is distributed, by what, with which
    /// tables co-located, whether the fence functions are the form Citus routes, and whether the
    /// store was built for it ([`on_citus`](PostgresStore::on_citus)). `None` on a plain
    /// Postgres with a store built for one.
    async fn distribution(&self) -> Result<Option<(Severity, String)>, StoreError> {
        let citus = "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')";
        let citus: bool = self
            .bounded(sqlx::query_scalar(citus).fetch_one(&self.pool))
            .await?;
        if !citus {
            return Ok(self.distributed.then(|| {
                let message = "built with on_citus, on a server without Citus: it works, \
                               without batches";
                (Severity::Warning, message.into())
            }));
        }
        let layout = sqlx::query_as(
            "SELECT column_to_column_name(p.logicalrelid, p.partkey),
                    (SELECT count(*) FROM pg_dist_shard s WHERE s.logicalrelid = p.logicalrelid),
                    (SELECT string_agg(o.logicalrelid::text, ', ' ORDER BY o.logicalrelid::text)
                     FROM pg_dist_partition o
                     WHERE o.colocationid = p.colocationid AND o.logicalrelid <> p.logicalrelid),
                    (SELECT CASE
                         WHEN bool_and('citus.multi_task_query_log_level=error' = ANY (f.proconfig))
                             THEN 'routed'
                         WHEN bool_and('plan_cache_mode=force_custom_plan' = ANY (f.proconfig))
                             THEN 'planned each call'
                         ELSE 'one Postgres' END
                     FROM pg_proc f
                     WHERE f.proname IN ('idempotency_commit', 'idempotency_advance'))
             FROM pg_dist_partition p WHERE p.logicalrelid = 'idempotency_keys'::regclass",
        );
        let layout: Option<(String, i64, Option<String>, String)> =
            self.bounded(layout.fetch_optional(&self.pool)).await?;
        let Some((column, shards, colocated, fence)) = layout else {
            let message = "a Citus coordinator, with idempotency_keys a local table on it: run \
                           DISTRIBUTE_ON_CITUS to shard it over the workers";
            return Ok(Some((Severity::Warning, message.into())));
        };
        let colocated = colocated.unwrap_or_else(|| "no other table".into());
        let layout =
            format!("distributed by {column} in {shards} shards, co-located with {colocated}");
        Ok(Some(if fence == "one Postgres" {
            let message = format!(
                "{layout}; the fence functions are not the form Citus routes, so fences fail: \
                 run DISTRIBUTE_ON_CITUS again after the migrations"
            );
            (Severity::Risk, message)
        } else if fence == "planned each call" {
            let message = format!(
                "{layout}; the fence functions are an earlier Citus form, which plans every \
                 call (twice the cost of a fence): run DISTRIBUTE_ON_CITUS again"
            );
            (Severity::Warning, message)
        } else if !self.distributed {
            let message = format!(
                "{layout}; the store is not built with on_citus: its batches span shards \
                 (multi-shard statements on every request)"
            );
            (Severity::Warning, message)
        } else {
            (Severity::Ok, layout)
        }))
    }

    /// On Citus: how far each worker's clock is from the coordinator's (read between two reads
    /// of the coordinator's, so within half that round trip), against the skew the store allows
    /// for ([`with_clock_skew`](PostgresStore::with_clock_skew)). Past it, a fence drawn on a
    /// node behind may not grow, and a key may be taken over before its retention ends.
    async fn clocks(&self) -> Result<(Severity, String), StoreError> {
        let now = "SELECT extract(epoch FROM clock_timestamp())::float8";
        let workers = "SELECT nodename || ':' || nodeport, result::float8
                       FROM run_command_on_workers(
                           'SELECT extract(epoch FROM clock_timestamp())::float8')
                       WHERE success";
        let (before, workers, after): (f64, Vec<(String, f64)>, f64) = self
            .bounded(async {
                let mut connection = self.pool.acquire().await?;
                let before = sqlx::query_scalar(now).fetch_one(&mut *connection).await?;
                let workers = sqlx::query_as(workers).fetch_all(&mut *connection).await?;
                let after = sqlx::query_scalar(now).fetch_one(&mut *connection).await?;
                Ok((before, workers, after))
            })
            .await?;
        let (middle, error) = ((before + after) / 2.0, (after - before) / 2.0);
        let farthest = workers
            .iter()
            .map(|(node, clock)| (node, (clock - middle).abs() + error))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let bound = self.skew();
        let Some((node, apart)) = farthest else {
            return Ok((Severity::Warning, "no worker answered".into()));
        };
        let apart_ms = apart * 1000.0;
        if apart > bound.as_secs_f64() {
            let message = format!(
                "{node}'s clock is up to {apart_ms:.0} ms from the coordinator's, past the skew                  the store allows for ({bound:?}, with_clock_skew): fences drawn there may not                  grow, and keys may be taken over before their retention ends; synchronise the                  clocks, or raise the bound (and keep leases above twice it)"
            );
            return Ok((Severity::Risk, message));
        }
        let message = format!(
            "every worker's clock within {apart_ms:.0} ms of the coordinator's, inside the skew              the store allows for ({bound:?}); keep leases above twice it"
        );
        Ok((Severity::Ok, message))
    }

    /// On a connection of its own, not the pool's: a pool keeps trying a server that refuses
    /// its connections until its acquire timeout, so a wrong address read as a slow database
    /// ("did not answer within 5s"); a connection says "refused" at once.
    async fn server_version(&self) -> Result<String, StoreError> {
        let options = self.pool.connect_options();
        let row = self
            .bounded(async {
                let mut connection = sqlx::PgConnection::connect_with(&options).await?;
                let row = sqlx::query("SELECT version()")
                    .fetch_one(&mut connection)
                    .await?;
                let _ = connection.close().await;
                Ok(row)
            })
            .await?;
        let version: String = row.try_get(0).map_err(super::backend)?;
        Ok(version.split(" on ").next().unwrap_or(&version).to_owned())
    }

    /// Whether the table exists, and the crate's migrations applied, as recorded by
    /// `PostgresStore::migrate` or by sqlx's own migrator (`MIGRATOR.run`, `sqlx migrate run`).
    async fn migrations(&self) -> Result<(bool, (Severity, String)), StoreError> {
        let tables = sqlx::query(
            "SELECT to_regclass('idempotency_keys') IS NOT NULL, \
                    to_regclass('_tower_idempotency_migrations') IS NOT NULL, \
                    to_regclass('_sqlx_migrations') IS NOT NULL",
        );
        let row = self.bounded(tables.fetch_one(&self.pool)).await?;
        let get = |i| row.try_get::<bool, _>(i).map_err(super::backend);
        let (table, ours, sqlx_own) = (get(0)?, get(1)?, get(2)?);
        let mut applied: Vec<i64> = Vec::new();
        let logs = [
            (
                ours,
                "SELECT version FROM _tower_idempotency_migrations WHERE success",
            ),
            (
                sqlx_own,
                "SELECT version FROM _sqlx_migrations WHERE success",
            ),
        ];
        for (present, query) in logs {
            if present {
                let rows = self
                    .bounded(sqlx::query(query).fetch_all(&self.pool))
                    .await?;
                for row in rows {
                    applied.push(row.try_get(0).map_err(super::backend)?);
                }
            }
        }
        let missing: Vec<i64> = MIGRATOR
            .iter()
            .map(|migration| migration.version)
            .filter(|version| !applied.contains(version))
            .collect();
        let total = MIGRATOR.iter().count();
        Ok((
            table,
            match (table, missing.as_slice()) {
                (true, []) => (Severity::Ok, format!("{total} of {total} applied")),
                (false, _) => (
                    Severity::Risk,
                    "no idempotency_keys table on the search_path: every claim fails; run \
                 PostgresStore::migrate"
                        .into(),
                ),
                (true, missing) => (
                    Severity::Risk,
                    format!(
                        "{} of {total} applied, missing {missing:?}: claims or fences fail; run \
                     PostgresStore::migrate",
                        total - missing.len()
                    ),
                ),
            },
        ))
    }

    /// Whether a commit the server acknowledged survives its crash (and, with synchronous
    /// standbys, a failover): a claim lost that way can be granted again.
    async fn commit_durability(&self) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query(
            "SELECT current_setting('synchronous_commit'), \
             current_setting('synchronous_standby_names')",
        );
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let commit: String = row.try_get(0).map_err(super::backend)?;
        let standbys: String = row.try_get(1).map_err(super::backend)?;
        Ok(synchronous_commit(&commit, &standbys))
    }

    /// The server's connection slots against what this process may open: the store's own, its
    /// renewals' (per layer) and the pool's. Short of them, connections are waited for (a
    /// server out of slots is backpressure), but every instance that shares the server waits.
    async fn connection_headroom(&self) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query(
            "SELECT current_setting('max_connections')::int8, \
                    current_setting('superuser_reserved_connections')::int8, \
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')",
        );
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let max: i64 = row.try_get(0).map_err(super::backend)?;
        let reserved: i64 = row.try_get(1).map_err(super::backend)?;
        let used: i64 = row.try_get(2).map_err(super::backend)?;
        let pool = self.pool.options().get_max_connections() as usize;
        let own = self.max_connections + super::RENEWAL_CONNECTIONS;
        let budget = own + pool;
        let free = max - reserved - used;
        let message = format!(
            "{used} of {max} in use ({reserved} reserved for superusers), {free} free; this \
             process opens up to {budget}: the store {}, its renewals {} per layer, the pool \
             {pool}",
            self.max_connections,
            super::RENEWAL_CONNECTIONS,
        );
        Ok(if free < i64::try_from(own).unwrap_or(i64::MAX) {
            let advice = "connections are waited for, not refused, but every instance sharing \
                          the server waits: raise max_connections, or lower the store's \
                          (with_max_connections) and the pool's";
            let short = format!("{message}: fewer free than the store alone may open; {advice}");
            (Severity::Warning, short)
        } else {
            (Severity::Ok, message)
        })
    }

    /// A session timeout of the application's pool, where zero means none.
    async fn timeout_setting(
        &self,
        setting: &str,
        severity_if_off: Severity,
        why: &str,
    ) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query("SELECT current_setting($1)").bind(setting);
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let value: String = row.try_get(0).map_err(super::backend)?;
        Ok(if value == "0" {
            (severity_if_off, format!("{setting} is 0 (none): {why}"))
        } else {
            (Severity::Ok, format!("{setting} {value}"))
        })
    }

    /// How long the oldest expired row has waited for the sweeper.
    async fn sweeper(&self) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query(
            "SELECT extract(epoch FROM now() - min(expires_at))::float8 FROM idempotency_keys \
             WHERE expires_at < now()",
        );
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let oldest: Option<f64> = row.try_get(0).map_err(super::backend)?;
        Ok(match oldest.map(Duration::from_secs_f64) {
            None => (Severity::Ok, "no expired rows waiting".into()),
            Some(age) if age < SWEEPER_LAG => (
                Severity::Ok,
                format!("oldest expired row {} s old", age.as_secs()),
            ),
            Some(age) => (
                Severity::Warning,
                format!(
                    "oldest expired row {} min old: is a sweeper running \
                     (PostgresStore::spawn_sweeper)? the table grows without one",
                    age.as_secs() / 60
                ),
            ),
        })
    }

    /// Keys abandoned with work recorded, as the completer finds them: how many, how long ago
    /// the oldest lease ran out, and how many the completer noted it could not finish.
    async fn abandoned_keys(&self) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query(super::sql::ABANDONED_SUMMARY);
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let found: i64 = row.try_get(0).map_err(super::backend)?;
        let oldest: Option<f64> = row.try_get(1).map_err(super::backend)?;
        let unfinished: i64 = row.try_get(2).map_err(super::backend)?;
        let oldest = Duration::from_secs_f64(oldest.unwrap_or(0.0).max(0.0));
        Ok(match found {
            0 => (Severity::Ok, "no keys abandoned mid-way".into()),
            _ if oldest < COMPLETER_LAG && unfinished == 0 => (
                Severity::Ok,
                format!(
                    "{found} keys abandoned mid-way, the oldest lease ran out {} s ago: a \
                     completer finishes them",
                    oldest.as_secs()
                ),
            ),
            _ => (
                Severity::Warning,
                format!(
                    "{found} keys abandoned mid-way, the oldest lease ran out {} min ago, \
                     {unfinished} noted unfinished: is a completer running \
                     (IdempotencyLayer::completer)? the admin listing of stuck keys says why",
                    oldest.as_secs() / 60
                ),
            ),
        })
    }

    /// The table's rows (the planner's estimate) and bytes, partitions included.
    async fn size(&self) -> Result<(Severity, String), StoreError> {
        let query = sqlx::query(
            "SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::int8, \
                    coalesce(sum(greatest(c.reltuples, 0)), 0)::int8 \
             FROM pg_partition_tree('idempotency_keys') p JOIN pg_class c ON c.oid = p.relid",
        );
        let row = self.bounded(query.fetch_one(&self.pool)).await?;
        let bytes: i64 = row.try_get(0).map_err(super::backend)?;
        let rows: i64 = row.try_get(1).map_err(super::backend)?;
        let mib = bytes as f64 / (1024.0 * 1024.0);
        Ok((
            Severity::Ok,
            format!("idempotency_keys: about {rows} rows, {mib:.1} MiB"),
        ))
    }
}

/// The timeouts checked on the application's pool (the check's name, the setting's): what their
/// absence costs.
const TIMEOUTS: [(&str, &str, Severity, &str); 2] = [
    (
        "idle_in_transaction",
        "idle_in_transaction_session_timeout",
        Severity::Risk,
        "an owner frozen inside its fence transaction holds its key's row lock for as long as it \
         is frozen, and its key never converges; set it (say 60s) for the application's role",
    ),
    (
        "statement_timeout",
        "statement_timeout",
        Severity::Warning,
        "the handlers' statements are unbounded (the store bounds its own); consider one",
    ),
];

/// A check that could not run.
/// What `synchronous_commit` (and the synchronous standbys named) mean for acknowledged
/// claims.
fn synchronous_commit(commit: &str, standbys: &str) -> (Severity, String) {
    let standbys = standbys.trim();
    match commit {
        "off" => (
            Severity::Risk,
            "synchronous_commit is off: the server acknowledges commits before they are on disk, \
             and a crash loses claims it granted: a key may run twice; set it on"
                .into(),
        ),
        "local" if !standbys.is_empty() => (
            Severity::Warning,
            format!(
                "synchronous_commit is local with synchronous standbys ({standbys}): commits do \
                 not wait for them, and a failover can lose claims it acknowledged; set it on"
            ),
        ),
        _ if standbys.is_empty() => (
            Severity::Ok,
            format!(
                "synchronous_commit {commit}; no synchronous standby (a failover to an \
                 asynchronous one can lose acknowledged claims)"
            ),
        ),
        _ => (
            Severity::Ok,
            format!("synchronous_commit {commit}; synchronous standbys {standbys}"),
        ),
    }
}

fn could_not(error: StoreError) -> (Severity, String) {
    let cause = std::error::Error::source(&error).map_or(String::new(), |s| format!(": {s}"));
    (
        Severity::Warning,
        format!("could not be checked: {error}{cause}"),
    )
}
