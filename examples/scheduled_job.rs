//! A scheduled job started on every instance that runs once per schedule slot across the
//! fleet; a run that dies is taken over once its lease runs out, and resumes where it stopped.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test SLOT=nightly-cleanup:2026-12-01 \
//!   cargo run --example scheduled_job          # start it on as many instances as you like
//! ```
//!
//! The job is `STEPS` steps (`STEP_MS` each); each step writes its row and advances the slot's
//! recovery point in one transaction, fenced by the claim (`IdempotencyClaim::advance`): a run
//! that lost its lease writes nothing more, and the run that takes over continues from the last
//! step written. Each instance tries the slot every `TRY_EVERY_MS` until it learns the job ran,
//! then exits.
//!
//! | variable | effect |
//! |---|---|
//! | `DATABASE_URL` | the idempotency store and the `job_steps` table |
//! | `SLOT` | the schedule slot (`nightly-cleanup:<today>`) |
//! | `STEPS`, `STEP_MS` | the job's steps (5) and the time each takes (200) |
//! | `TRY_EVERY_MS` | how often an instance tries a slot another runs (200) |
//! | `IDEMPOTENCY_LEASE_MS` | the slot's lease (30000) |

use std::{env, time::Duration};

use sqlx::PgPool;
use tower_idempotency::{
    IdempotencyClaim,
    store::{Admin, FenceError, PostgresStore},
    work::{Once, Slot},
};

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let number = |name: &str, default: u64| {
        env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let slot = env::var("SLOT").unwrap_or_else(|_| "nightly-cleanup:today".into());
    let steps = number("STEPS", 5);
    let step = Duration::from_millis(number("STEP_MS", 200));
    let try_every = Duration::from_millis(number("TRY_EVERY_MS", 200));
    let instance = format!("instance-{}", std::process::id());

    let pool = PgPool::connect(&env::var("DATABASE_URL").expect("DATABASE_URL"))
        .await
        .expect("Postgres");
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.expect("migrations");
    // The start-up check: what puts a guarantee at risk logged, a store that cannot serve the
    // reason to stop.
    let diagnosis = store.diagnose().await;
    diagnosis.log();
    diagnosis
        .ready()
        .expect("the start-up check (see DATABASE_URL)");
    create_table(
        &pool,
        "CREATE TABLE IF NOT EXISTS job_steps (slot text NOT NULL, step bigint NOT NULL, instance text NOT NULL)",
    )
    .await
    .expect("the job_steps table");
    let once = Once::new(store).with_lease(Duration::from_millis(number(
        "IDEMPOTENCY_LEASE_MS",
        30_000,
    )));

    loop {
        let run = |claim| job(&pool, claim, &slot, &instance, steps, step);
        match once.run_slot(&slot, run).await {
            Ok(Slot::Ran) => tracing::info!(%slot, %instance, "ran the job"),
            Ok(Slot::AlreadyRan) => {
                tracing::info!(%slot, %instance, "the job ran for this slot: done");
                return;
            }
            Ok(Slot::RunningElsewhere) => tracing::debug!(%slot, "running elsewhere"),
            Err(error) => tracing::warn!(%slot, %error, "the run failed; trying again"),
        }
        tokio::time::sleep(try_every).await;
    }
}

/// Creates the example's table. Instances starting together would race on `CREATE TABLE IF NOT
/// EXISTS`; an advisory lock lets one at a time in.
async fn create_table(pool: &PgPool, ddl: &'static str) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency examples'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(ddl).execute(&mut *tx).await?;
    tx.commit().await
}

/// The job: its steps from where the slot's last run stopped, each step's row and the recovery
/// point in one fenced transaction.
async fn job(
    pool: &PgPool,
    claim: IdempotencyClaim,
    slot: &str,
    instance: &str,
    steps: u64,
    step: Duration,
) -> Result<(), FenceError> {
    let mut connection = pool.acquire().await.map_err(|e| database(&claim, e))?;
    let resumed = claim.recovery_point(&mut connection).await?;
    drop(connection);
    let done = resumed.map_or(0, |point| point.payload()["done"].as_u64().unwrap_or(0));
    if done > 0 {
        tracing::info!(slot, done, "taking over a run that stopped");
    }
    for n in done..steps {
        tokio::time::sleep(step).await;
        let mut tx = pool.begin().await.map_err(|e| database(&claim, e))?;
        sqlx::query("INSERT INTO job_steps (slot, step, instance) VALUES ($1, $2, $3)")
            .bind(slot)
            .bind(n as i64)
            .bind(instance)
            .execute(&mut *tx)
            .await
            .map_err(|e| database(&claim, e))?;
        let progress = serde_json::json!({ "done": n + 1 });
        claim.advance(&mut tx, "step", &progress).await?;
        tx.commit().await.map_err(|e| database(&claim, e))?;
        tracing::info!(slot, step = n, "step done");
    }
    Ok(())
}

fn database(claim: &IdempotencyClaim, source: sqlx::Error) -> FenceError {
    tracing::warn!(error = %source, key = %claim.key(), "database error");
    FenceError::Database {
        record: claim.lease().record().clone(),
        source,
    }
}
