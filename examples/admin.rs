//! An operator's command for the stores the payments example uses: inspect a key, forget it, or
//! list the keys stuck in flight.
//!
//! ```sh
//! cargo run --example admin -- inspect order-42        # what each tier holds
//! cargo run --example admin -- forget order-42         # delete it in every tier
//! cargo run --example admin -- stuck 5m                # keys in flight for 5 minutes or more, and why the completer could not finish them
//! cargo run --example admin -- inspect order-42 --scope cred:9f86d081884c7d659a2feaa0c55ad015
//! cargo run --example admin -- doctor                  # the stores' settings that break guarantees
//! ```
//!
//! `doctor` prints a line per check (`Admin::diagnose`) and exits 1 when a guarantee is at risk,
//! so a deployment can run it before it sends traffic. `inspect` prints every tier it could
//! read and exits 1 when one could not be read: a partial answer is not taken for a whole one.
//!
//! It reads `DATABASE_URL` and `REDIS_URL` (or `REDIS_CLUSTER_NODES`) as `payments.rs` does (and `REDIS_PREFIX`, if the
//! records live under another prefix than `idempotency:`). `--scope` is the key's scope:
//! `anonymous` by default, the scope of requests without an `Authorization` header;
//! `cred:` and 32 hex digits for one with (see `tower_idempotency::scope::by_credentials`).
//! `--limit N` bounds the `stuck` list (50).
//!
//! Forgetting a key in flight lets a retry run while the first attempt may still be running;
//! forgetting a completed key lets a retry run again. Inspect first.

use std::{env, process::ExitCode, time::Duration};

use sqlx::postgres::PgPoolOptions;
use tower_idempotency::{
    IdempotencyKey,
    scope::ANONYMOUS_SCOPE,
    store::{Admin, PostgresStore, RecordInfo, RecordKey, RedisStore, StoreError, TieredStore},
};

/// The stores, as the payments example builds them. One value, made once at start-up: that one
/// variant is larger than the others costs nothing.
#[allow(clippy::large_enum_variant)]
enum Stores {
    Tiered(TieredStore<RedisStore, PostgresStore>),
    Postgres(PostgresStore),
    Redis(RedisStore),
}

impl Stores {
    fn open() -> Result<Self, String> {
        let redis = match (env::var("REDIS_CLUSTER_NODES"), env::var("REDIS_URL")) {
            (Ok(nodes), _) => {
                let seeds = nodes
                    .split(',')
                    .map(|node| format!("redis://{}", node.trim()));
                Some(RedisStore::cluster(seeds).map_err(|e| format!("REDIS_CLUSTER_NODES: {e}"))?)
            }
            (_, Ok(url)) => Some(RedisStore::open(&url).map_err(|e| format!("REDIS_URL: {e}"))?),
            _ => None,
        }
        .map(|store| match env::var("REDIS_PREFIX") {
            Ok(prefix) => store.with_prefix(prefix),
            Err(_) => store,
        });
        let postgres = match env::var("DATABASE_URL") {
            Ok(url) => {
                let pool = PgPoolOptions::new()
                    .max_connections(1)
                    .connect_lazy(&url)
                    .map_err(|e| format!("DATABASE_URL: {e}"))?;
                Some(PostgresStore::new(pool).with_max_connections(1))
            }
            Err(_) => None,
        };
        match (redis, postgres) {
            (Some(redis), Some(postgres)) => Ok(Self::Tiered(TieredStore::new(redis, postgres))),
            (None, Some(postgres)) => Ok(Self::Postgres(postgres)),
            (Some(redis), None) => Ok(Self::Redis(redis)),
            (None, None) => Err(
                "set DATABASE_URL and/or REDIS_URL, as for the payments example (the in-memory \
                 store lives and dies with its process: there is nothing to administer)"
                    .into(),
            ),
        }
    }

    fn admin(&self) -> &dyn Admin {
        match self {
            Self::Tiered(store) => store,
            Self::Postgres(store) => store,
            Self::Redis(store) => store,
        }
    }

    /// What each tier holds.
    async fn inspect(
        &self,
        record: &RecordKey,
    ) -> Vec<(&'static str, Result<Option<RecordInfo>, StoreError>)> {
        match self {
            Self::Tiered(store) => {
                let (front, authority) = store.inspect_tiers(record).await;
                vec![("redis", front), ("postgres", authority)]
            }
            Self::Postgres(store) => vec![("postgres", store.inspect(record).await)],
            Self::Redis(store) => vec![("redis", store.inspect(record).await)],
        }
    }
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: admin inspect KEY | forget KEY | stuck DURATION | doctor  [--scope SCOPE] [--limit N]\n\
         DURATION: 90s, 5m, 2h, 1d, 500ms or seconds"
    );
    ExitCode::from(2)
}

/// `90s`, `5m`, `2h`, `1d`, `500ms`, or a number of seconds.
fn parse_duration(text: &str) -> Option<Duration> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    Some(match unit {
        "" | "s" => Duration::from_secs(n),
        "ms" => Duration::from_millis(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => return None,
    })
}

/// A duration for people: `850ms`, `12.3s`, `4m 05s`, `23h 59m`.
fn human(duration: Duration) -> String {
    let secs = duration.as_secs();
    match secs {
        0 => format!("{}ms", duration.as_millis()),
        1..60 => format!("{:.1}s", duration.as_secs_f64()),
        60..3600 => format!("{}m {:02}s", secs / 60, secs % 60),
        _ => format!("{}h {:02}m", secs / 3600, secs % 3600 / 60),
    }
}

fn row(tier: &str, info: &RecordInfo) -> String {
    format!(
        "{tier:<9} {:<9} {:>20} {:<36} {:>10} {:>10} {:>10} {:>6}",
        info.state.as_str(),
        info.fence,
        info.owner,
        info.lease_left.map_or("-".into(), human),
        info.age.map_or("-".into(), human),
        human(info.expires_in),
        info.status.map_or("-".into(), |s| s.as_u16().to_string()),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let option = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|at| args.get(at + 1))
    };
    let scope = option("--scope").map_or(ANONYMOUS_SCOPE, String::as_str);
    let limit: usize = option("--limit").and_then(|l| l.parse().ok()).unwrap_or(50);
    let Some(command) = args.first() else {
        return usage();
    };
    let argument = args.get(1).map_or("", String::as_str);
    let stores = match Stores::open() {
        Ok(stores) => stores,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::FAILURE;
        }
    };
    let record = || -> Result<RecordKey, String> {
        let key = IdempotencyKey::try_from(argument).map_err(|e| e.to_string())?;
        Ok(RecordKey::new(scope, key))
    };
    let result: Result<(), String> = match command.as_str() {
        "inspect" => {
            async {
                let record = record()?;
                println!(
                    "key {:?} in scope {:?}",
                    record.key().as_str(),
                    record.scope()
                );
                println!(
                    "{:<9} {:<9} {:>20} {:<36} {:>10} {:>10} {:>10} {:>6}",
                    "tier", "state", "fence", "owner", "lease left", "age", "expires in", "status"
                );
                let tiers = stores.inspect(&record).await;
                let (all, mut failed) = (tiers.len(), 0);
                for (tier, info) in tiers {
                    match info {
                        Ok(Some(info)) => println!("{}", row(tier, &info)),
                        Ok(None) => println!("{tier:<9} (nothing)"),
                        Err(error) => {
                            failed += 1;
                            println!("{tier:<9} error: {}", chain(&error));
                        }
                    }
                }
                // A partial answer is no answer for a script that checks a key.
                match failed {
                    0 => Ok(()),
                    _ => Err(format!("{failed} of {all} tiers could not be read")),
                }
            }
            .await
        }
        "forget" => {
            async {
                let record = record()?;
                let found = stores
                    .admin()
                    .forget(&record)
                    .await
                    .map_err(|e| chain(&e))?;
                if found {
                    println!(
                        "forgot key {:?} in scope {:?}",
                        record.key().as_str(),
                        record.scope()
                    );
                } else {
                    println!(
                        "nothing to forget for key {:?} in scope {:?}",
                        record.key().as_str(),
                        record.scope()
                    );
                }
                Ok(())
            }
            .await
        }
        "stuck" => {
            async {
                let older_than = parse_duration(argument).ok_or("DURATION: like 90s, 5m, 2h")?;
                let stuck = stores
                    .admin()
                    .stuck(older_than, limit)
                    .await
                    .map_err(|e| chain(&e))?;
                println!(
                    "{} key(s) in flight for {} or more",
                    stuck.len(),
                    human(older_than)
                );
                if !stuck.is_empty() {
                    println!(
                        "{:<40} {:<24} {:<9} {:>10} {:>10} {:>20}  unfinished, because",
                        "scope", "key", "state", "age", "lease left", "fence"
                    );
                }
                for info in &stuck {
                    println!(
                        "{:<40} {:<24} {:<9} {:>10} {:>10} {:>20}  {}",
                        info.record.scope(),
                        info.record.key().as_str(),
                        info.state.as_str(),
                        info.age.map_or("-".into(), human),
                        info.lease_left.map_or("-".into(), human),
                        info.fence,
                        info.unfinished.as_deref().unwrap_or("-"),
                    );
                }
                Ok(())
            }
            .await
        }
        "doctor" => {
            let diagnosis = stores.admin().diagnose().await;
            print!("{diagnosis}");
            let worst = diagnosis.worst();
            println!("worst: {}", worst.as_str());
            if diagnosis.at_risk() {
                return ExitCode::FAILURE;
            }
            Ok(())
        }
        _ => return usage(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes, one after the other.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
