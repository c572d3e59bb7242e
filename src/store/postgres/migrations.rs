//! The crate's migrations, compiled in, and the optional partitioning.

use std::sync::LazyLock;

use sqlx::migrate::{Migration, MigrationType, Migrator};

/// The crate's schema migrations (`migrations/` in the crate): the `idempotency_keys` table and
/// the `idempotency_fence` sequence.
///
/// Three ways to apply them:
/// - [`PostgresStore::migrate`](super::PostgresStore::migrate), which records them in a table of their own,
///   `_tower_idempotency_migrations`, so they never get in the way of the application's;
/// - `MIGRATOR.run(&pool)`, recorded in sqlx's `_sqlx_migrations` (an application running its own
///   migrator on the same database then needs `set_ignore_missing(true)`);
/// - copying the files into the application's `migrations/` and running `sqlx migrate run`.
///
/// The objects are created unqualified, in the first schema of the `search_path`; the store and
/// the handlers' transactions find them through the same `search_path`.
///
/// The set is built on first use from the files compiled into the crate (without sqlx's
/// `macros` feature), with the versions, descriptions and checksums `sqlx::migrate!` and
/// `sqlx migrate run` give the same files; it dereferences to a [`Migrator`].
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(
        MIGRATIONS
            .iter()
            .map(|&(version, description, sql)| {
                let no_tx = sql.starts_with("-- no-transaction");
                let sql = sqlx::SqlSafeStr::into_sql_str(sql);
                Migration::new(
                    version,
                    description.into(),
                    MigrationType::Simple,
                    sql,
                    no_tx,
                )
            })
            .collect(),
    )
});

/// The files of `migrations/`: version, description (the file name's rest, `_` read as a
/// space), SQL. A test checks this list against what sqlx resolves from the directory.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        20261129000000,
        "idempotency keys",
        include_str!("../../../migrations/20261129000000_idempotency_keys.sql"),
    ),
    (
        20261129000001,
        "commit with response",
        include_str!("../../../migrations/20261129000001_commit_with_response.sql"),
    ),
    (
        20261129000002,
        "fence function",
        include_str!("../../../migrations/20261129000002_fence_function.sql"),
    ),
    (
        20261201000000,
        "recovery points",
        include_str!("../../../migrations/20261201000000_recovery_points.sql"),
    ),
    (
        20261201000001,
        "fence retention from the fence",
        include_str!("../../../migrations/20261201000001_fence_retention_from_the_fence.sql"),
    ),
    (
        20261202000000,
        "fence in plpgsql",
        include_str!("../../../migrations/20261202000000_fence_in_plpgsql.sql"),
    ),
    (
        20261202000001,
        "units in one transaction",
        include_str!("../../../migrations/20261202000001_units_in_one_transaction.sql"),
    ),
    (
        20261202000002,
        "tombstones",
        include_str!("../../../migrations/20261202000002_tombstones.sql"),
    ),
    (
        20261202000003,
        "units begin when free",
        include_str!("../../../migrations/20261202000003_units_begin_when_free.sql"),
    ),
    (
        20261203000000,
        "units in batches",
        include_str!("../../../migrations/20261203000000_units_in_batches.sql"),
    ),
    (
        20261205000000,
        "completer",
        include_str!("../../../migrations/20261205000000_completer.sql"),
    ),
    (
        20261207000000,
        "waiters",
        include_str!("../../../migrations/20261207000000_waiters.sql"),
    ),
];

/// The optional migration that hash-partitions `idempotency_keys` on (scope, key), 4 ways:
/// `migrations/optional/partition_by_hash.sql`, which says when to use it. Not part of
/// [`MIGRATOR`]: run it once after it (`sqlx::raw_sql(PARTITION_BY_HASH).execute(&pool)`), or
/// copy the file into your migrations. Every statement of the store works on either table;
/// applied to a partitioned table, it changes nothing.
pub const PARTITION_BY_HASH: &str =
    include_str!("../../../migrations/optional/partition_by_hash.sql");

/// The optional migration that distributes `idempotency_keys` on a Citus coordinator, sharded
/// by key, and gives the fence functions the form Citus routes:
/// `migrations/optional/distribute_on_citus.sql`, which says how to shard by scope instead. Not
/// part of [`MIGRATOR`]: run it after it, and again after every migration
/// (`sqlx::raw_sql(DISTRIBUTE_ON_CITUS).execute(&pool)`; idempotent), and build the store with
/// [`PostgresStore::on_citus`](super::PostgresStore::on_citus).
pub const DISTRIBUTE_ON_CITUS: &str =
    include_str!("../../../migrations/optional/distribute_on_citus.sql");
