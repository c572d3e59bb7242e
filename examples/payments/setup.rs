//! What the environment selects: the stores (memory, Redis, Postgres, Redis in front of
//! Postgres), the metrics recorder, and the knobs the fleet tests turn.

use super::*;

/// The idempotency store and where payments are kept, from `DATABASE_URL`, `REDIS_URL` and
/// `REDIS_CLUSTER_NODES`: Postgres runs its migrations, gets the `payments` table and a sweeper.
pub(crate) async fn stores_from_env() -> (Arc<dyn Store>, Ledger) {
    // Keys past their answer's retention are refused for 7 days after their payment.
    let horizon = env_millis("IDEMPOTENCY_TOMBSTONE_HORIZON_MS", 7 * 86_400_000);
    let postgres = match env::var("DATABASE_URL") {
        Ok(url) => Some(postgres_store(&url, horizon).await),
        Err(_) => None,
    };
    let redis = match (env::var("REDIS_CLUSTER_NODES"), env::var("REDIS_URL")) {
        (Ok(nodes), _) => {
            let seeds = nodes
                .split(',')
                .map(|node| format!("redis://{}", node.trim()));
            let store = RedisStore::cluster(seeds);
            Some(store.unwrap_or_else(|e| fail("REDIS_CLUSTER_NODES", e)))
        }
        (_, Ok(url)) => Some(RedisStore::open(&url).unwrap_or_else(|e| fail("REDIS_URL", e))),
        _ => None,
    };
    match (redis, postgres) {
        (Some(redis), Some(postgres)) => {
            tracing::info!("idempotency: Redis in front of Postgres");
            let ledger = Ledger::Postgres(postgres.clone());
            (Arc::new(TieredStore::new(redis, postgres)), ledger)
        }
        (None, Some(postgres)) => {
            tracing::info!("idempotency: Postgres");
            let ledger = Ledger::Postgres(postgres.clone());
            (Arc::new(postgres), ledger)
        }
        (Some(redis), None) => {
            tracing::warn!("idempotency: Redis alone (best effort); payments kept in memory");
            (
                Arc::new(redis.with_tombstones(horizon)),
                Ledger::Memory(Mutex::default()),
            )
        }
        (None, None) => {
            tracing::warn!(
                "no REDIS_URL / DATABASE_URL: running on the in-memory store, which protects this \
                 single process only"
            );
            (
                Arc::new(MemoryStore::new().with_tombstones(horizon)),
                Ledger::Memory(Mutex::default()),
            )
        }
    }
}

/// The start-up check: what the doctor would say about the stores, logged, and the process
/// stopped with the findings (a Redis refusing connections or wanting a password, a database
/// never migrated) when the store cannot serve requests at all, rather than answering 503s.
pub(crate) async fn check_store(store: &dyn Store) {
    let diagnosis = Diagnosis::of_store(store).await;
    diagnosis.log();
    if let Err(error) = diagnosis.ready() {
        fail(
            "the start-up check (see REDIS_URL, REDIS_CLUSTER_NODES, DATABASE_URL)",
            error,
        );
    }
}

/// The Postgres store on `url`, migrated, with the example's table and a sweeper, keeping
/// tombstones for `horizon`.
async fn postgres_store(url: &str, horizon: Duration) -> PostgresStore {
    // The connection budget: at most 4 + 6 + 4 = 14 connections per instance (the pool for the
    // payment's own transactions, the store's, its renewals'), so that four instances and a
    // client fit a stock max_connections = 100 with room to spare.
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(url)
        .unwrap_or_else(|e| fail("DATABASE_URL", e));
    let store = PostgresStore::new(pool.clone())
        .with_timeout(Duration::from_secs(3))
        .with_max_connections(6)
        .with_tombstones(horizon);
    store
        .migrate()
        .await
        .unwrap_or_else(|e| fail("migrations", e));
    let citus = on_citus(&pool)
        .await
        .unwrap_or_else(|e| fail("DATABASE_URL", e));
    create_payments_table(&pool, citus)
        .await
        .unwrap_or_else(|e| fail("creating the payments table", e));
    let store = if citus {
        tracing::info!("on a Citus coordinator: the keys and the payments are sharded by key");
        store.on_citus()
    } else {
        store
    };
    store.spawn_sweeper(Duration::from_secs(60));
    store
}

/// Whether `DATABASE_URL` is a Citus coordinator (the extension is there, with workers).
async fn on_citus(pool: &sqlx::PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')")
        .fetch_one(pool)
        .await
}

/// A Prometheus recorder for the crate's metrics, latencies as histograms with the crate's
/// buckets, so a fleet's quantiles add up.
pub(crate) fn prometheus() -> PrometheusHandle {
    tower_idempotency::telemetry::HISTOGRAMS
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
            builder.set_buckets_for_metric(Matcher::Full(name.into()), buckets)
        })
        .and_then(PrometheusBuilder::install_recorder)
        .unwrap_or_else(|e| fail("installing the metrics recorder", e))
}

/// The crate's metrics (and any other recorded through the `metrics` facade), for Prometheus.
pub(crate) async fn metrics(prometheus: PrometheusHandle) -> impl IntoResponse {
    prometheus.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        prometheus.render(),
    )
}

pub(crate) fn env_millis(name: &str, default: u64) -> Duration {
    Duration::from_millis(
        env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default),
    )
}

pub(crate) fn fail(what: &str, error: impl std::fmt::Display) -> ! {
    eprintln!("{what}: {error}");
    std::process::exit(1)
}
