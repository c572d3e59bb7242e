//! Units of work beyond HTTP: `Once::run` and `Once::run_slot` in process, and real processes
//! consuming one Redis stream (a consumer group that redelivers) and running one schedule,
//! killed mid-work. Effects are counted in Postgres, where they are written.

mod support;

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use support::{Faulty, Proc, RedisServer, StoreFault, TestSchema, database_url, url_in_schema};
use tower_idempotency::{
    MemoryStore,
    work::{Once, Slot, Unit, WorkError},
};

fn main() -> std::process::ExitCode {
    support::run(crate::tests![
        current:
            a_unit_runs_once_and_later_deliveries_get_its_outcome,
            a_service_behind_the_once_layer_runs_each_job_once,
            a_failed_unit_is_released_for_the_next_delivery;
        multi(2):
            a_superseded_delivery_gets_the_units_outcome_not_its_own,
            a_delivery_granted_while_its_runtime_is_blocked_never_runs,
            a_unit_committed_with_its_outcome_then_killed_is_replayed_at_once,
            the_recovery_hook_gives_a_unit_committed_then_killed_its_outcome,
            concurrent_deliveries_run_once_and_share_the_outcome,
            a_slot_runs_once_however_many_instances_start_it,
            consumers_that_die_or_stall_ship_each_order_once,
            a_schedule_on_four_instances_runs_once_and_a_killed_run_is_taken_over;
    ])
}

fn unit(key: &str, payload: &str) -> Unit {
    Unit::new("orders", key, payload.as_bytes()).unwrap()
}

async fn a_unit_runs_once_and_later_deliveries_get_its_outcome() {
    let once = Once::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let work = || {
        let runs = Arc::clone(&runs);
        move |claim: tower_idempotency::IdempotencyClaim| async move {
            let run = runs.fetch_add(1, SeqCst) + 1;
            Ok::<_, std::io::Error>((run, claim.fence()))
        }
    };
    let first = once.run(unit("o-1", "{}"), work()).await.unwrap();
    let again = once.run(unit("o-1", "{}"), work()).await.unwrap();
    assert!(!first.replayed);
    assert!(again.replayed);
    assert_eq!(again.value, first.value, "the stored outcome, as it was");
    assert_eq!(runs.load(SeqCst), 1);
    // Another payload under the key: a mismatch, not a run.
    let other = once.run(unit("o-1", r#"{"other":1}"#), work()).await;
    assert!(matches!(other, Err(WorkError::Mismatch)), "{other:?}");
    assert_eq!(runs.load(SeqCst), 1);
}

/// The same through a tower layer, for job frameworks and consumer loops built on services: the
/// unit is read from the request, the inner service finds the claim, its response is stored.
async fn a_service_behind_the_once_layer_runs_each_job_once() {
    use tower::{ServiceBuilder, ServiceExt};
    use tower_idempotency::work::{OnceLayer, current_claim};

    struct Job {
        id: &'static str,
        args: &'static str,
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = OnceLayer::new(Once::new(MemoryStore::new()), |job: &Job| {
        Unit::new("emails", job.id, job.args.as_bytes())
    });
    let service = ServiceBuilder::new().layer(layer).service_fn({
        let runs = Arc::clone(&runs);
        move |job: Job| {
            let runs = Arc::clone(&runs);
            async move {
                let claim = current_claim().expect("the unit's claim, for the fence");
                runs.fetch_add(1, SeqCst);
                Ok::<_, std::io::Error>(format!("sent {} (fence {})", job.args, claim.fence()))
            }
        }
    });
    let job = || Job {
        id: "job-1",
        args: "welcome",
    };
    let first = service.clone().oneshot(job()).await.unwrap();
    let again = service.clone().oneshot(job()).await.unwrap();
    assert!(!first.replayed && again.replayed);
    assert_eq!(again.value, first.value);
    assert_eq!(runs.load(SeqCst), 1);
    let reused = service
        .clone()
        .oneshot(Job {
            id: "job-1",
            args: "other",
        })
        .await;
    assert!(matches!(reused, Err(WorkError::Mismatch)));
    let bad = service.oneshot(Job { id: "", args: "x" }).await;
    assert!(matches!(bad, Err(WorkError::InvalidKey(_))));
    assert!(current_claim().is_none(), "only inside a unit");
}

async fn a_failed_unit_is_released_for_the_next_delivery() {
    let once = Once::new(MemoryStore::new());
    let failed = once
        .run(unit("o-2", "{}"), |_| async {
            Err::<u32, _>("provider down")
        })
        .await;
    assert!(
        matches!(failed, Err(WorkError::Failed("provider down"))),
        "{failed:?}"
    );
    let ran = once
        .run(unit("o-2", "{}"), |_| async { Ok::<_, &str>(7) })
        .await
        .unwrap();
    assert_eq!((ran.value, ran.replayed), (7, false));
}

/// A delivery whose lease ran out while its work ran (its renewals froze) and whose unit another
/// delivery took over and finished gets the unit's outcome, the other's: never its own value,
/// which was not stored.
async fn a_superseded_delivery_gets_the_units_outcome_not_its_own() {
    let lease = Duration::from_millis(200);
    let memory = MemoryStore::new();
    let frozen = Faulty {
        inner: memory.clone(),
        fault: StoreFault::FrozenRenewals,
    };
    let stalled = Once::new(frozen).with_lease(lease);
    let healthy = Once::new(memory).with_lease(lease);
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let first = tokio::spawn({
        let (started, release) = (Arc::clone(&started), Arc::clone(&release));
        async move {
            let work = |_| async move {
                started.notify_one();
                release.notified().await;
                Ok::<_, std::io::Error>("first".to_owned())
            };
            stalled.run(unit("o-superseded", "{}"), work).await
        }
    });
    started.notified().await;
    tokio::time::sleep(lease * 2).await;
    // Its lease ran out: the next delivery takes the unit over and runs it.
    let work = |_| async { Ok::<_, std::io::Error>("second".to_owned()) };
    let second = healthy.run(unit("o-superseded", "{}"), work).await.unwrap();
    assert_eq!((second.value.as_str(), second.replayed), ("second", false));
    release.notify_one();
    let first = first.await.unwrap().unwrap();
    assert_eq!(
        (first.value.as_str(), first.replayed),
        ("second", true),
        "the superseded delivery answers with the unit's outcome"
    );
}

/// A delivery the store granted while the thread running it was blocked (2 s, lease 800 ms)
/// sees its grant only after the lease ran out and another delivery took the unit: it does not
/// run the work on it, and gets the other's outcome.
async fn a_delivery_granted_while_its_runtime_is_blocked_never_runs() {
    let lease = Duration::from_millis(800);
    let memory = MemoryStore::new();
    let blocked = Faulty {
        inner: memory.clone(),
        fault: StoreFault::BlockedAfterGrant {
            armed: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            pause: Duration::from_secs(2),
        },
    };
    let runs = Arc::new(AtomicUsize::new(0));
    let work = |name: &'static str| {
        let runs = Arc::clone(&runs);
        move |_| async move {
            runs.fetch_add(1, SeqCst);
            Ok::<_, std::io::Error>(name.to_owned())
        }
    };
    // The blocked delivery, on a runtime of its own (the block stops nothing else).
    let first = std::thread::spawn({
        let (once, work) = (Once::new(blocked).with_lease(lease), work("blocked"));
        move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(once.run(unit("o-lapsed", "{}"), work))
        }
    });
    tokio::time::sleep(lease + Duration::from_millis(400)).await;
    let healthy = Once::new(memory).with_lease(lease);
    let second = healthy.run(unit("o-lapsed", "{}"), work("healthy")).await;
    assert_eq!(second.unwrap().value, "healthy");
    let first = first.join().unwrap().unwrap();
    assert_eq!((first.value.as_str(), first.replayed), ("healthy", true));
    assert_eq!(runs.load(SeqCst), 1, "the work ran once");
}

/// A delivery that commits its work through the fence, then is gone (its task aborted, as a
/// process killed right after the commit: no renewals, no outcome stored by the engine).
/// `with_outcome`: the work stores its outcome with the fence.
async fn committed_then_gone(once: &Once, pool: &sqlx::PgPool, key: &str, with_outcome: bool) {
    let committed = Arc::new(tokio::sync::Notify::new());
    let delivery = tokio::spawn({
        let (once, pool, key) = (once.clone(), pool.clone(), key.to_owned());
        let committed = Arc::clone(&committed);
        async move {
            let work = |claim: tower_idempotency::IdempotencyClaim| async move {
                let mut tx = pool.begin().await?;
                claim.commit(&mut tx).await?;
                sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
                    .bind(claim.key().as_str())
                    .execute(&mut *tx)
                    .await?;
                let shipment = format!("shipment for {}", claim.key());
                if with_outcome {
                    claim.commit_with_outcome(&mut tx, &shipment).await?;
                }
                tx.commit().await?;
                committed.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(shipment)
            };
            once.run(unit(&key, "{}"), work).await
        }
    });
    committed.notified().await;
    delivery.abort();
    let _ = delivery.await;
}

/// A schema with a `shipments` table, and the store on it.
async fn shipments_schema() -> (TestSchema, tower_idempotency::store::PostgresStore) {
    let schema = TestSchema::new().await;
    sqlx::query("CREATE TABLE shipments (order_id text PRIMARY KEY)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let store = tower_idempotency::store::PostgresStore::new(schema.pool.clone());
    (schema, store)
}

async fn shipments(pool: &sqlx::PgPool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM shipments WHERE order_id = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A unit whose work stored its outcome with the fence and whose process died right after the
/// commit: the next delivery gets that outcome at once, without waiting for the dead one's
/// lease (a plain commit leaves `OutcomeUnknown` for the whole retention, as shown last).
async fn a_unit_committed_with_its_outcome_then_killed_is_replayed_at_once() {
    let (schema, store) = shipments_schema().await;
    let lease = Duration::from_millis(300);
    let once = Once::new(store).with_lease(lease).with_wait(Duration::ZERO);
    let never = |_| async { Ok::<String, std::io::Error>("ran again".to_owned()) };

    committed_then_gone(&once, &schema.pool, "o-with-outcome", true).await;
    let started = Instant::now();
    let done = once.run(unit("o-with-outcome", "{}"), never).await.unwrap();
    assert_eq!(done.value, "shipment for o-with-outcome");
    assert!(done.replayed);
    assert!(started.elapsed() < lease, "at once, not after the lease");
    assert_eq!(shipments(&schema.pool, "o-with-outcome").await, 1);

    committed_then_gone(&once, &schema.pool, "o-plain", false).await;
    // Waiting out the dead owner's lease and grace.
    let waiting = once.clone().with_wait(Duration::from_secs(5));
    let unknown = waiting.run(unit("o-plain", "{}"), never).await;
    assert!(
        matches!(unknown, Err(WorkError::OutcomeUnknown)),
        "{unknown:?}"
    );
    assert_eq!(shipments(&schema.pool, "o-plain").await, 1);
    schema.drop().await;
}

/// A unit committed with a plain fence, then killed: with a recovery hook, the next delivery
/// after the dead one's lease gets the outcome the hook rebuilt from the work's own rows,
/// stored once and replayed to every later delivery.
async fn the_recovery_hook_gives_a_unit_committed_then_killed_its_outcome() {
    let (schema, store) = shipments_schema().await;
    let recovered = Arc::new(AtomicUsize::new(0));
    let once = Once::new(store)
        .with_lease(Duration::from_millis(300))
        .with_wait(Duration::from_secs(5))
        .with_recovery({
            let (pool, recovered) = (schema.pool.clone(), Arc::clone(&recovered));
            move |record: tower_idempotency::store::RecordKey| {
                let (pool, recovered) = (pool.clone(), Arc::clone(&recovered));
                async move {
                    recovered.fetch_add(1, SeqCst);
                    let key = record.key().as_str().to_owned();
                    let found: Option<String> =
                        sqlx::query_scalar("SELECT order_id FROM shipments WHERE order_id = $1")
                            .bind(&key)
                            .fetch_optional(&pool)
                            .await
                            .ok()?;
                    found.map(|order| format!("shipment for {order}"))
                }
            }
        });
    let never = |_| async { Ok::<String, std::io::Error>("ran again".to_owned()) };
    committed_then_gone(&once, &schema.pool, "o-recovered", false).await;
    for _ in 0..2 {
        let done = once.run(unit("o-recovered", "{}"), never).await.unwrap();
        assert_eq!(done.value, "shipment for o-recovered");
        assert!(done.replayed);
    }
    assert_eq!(recovered.load(SeqCst), 1, "stored once, then replayed");
    assert_eq!(shipments(&schema.pool, "o-recovered").await, 1);
    schema.drop().await;
}

async fn concurrent_deliveries_run_once_and_share_the_outcome() {
    let once = Once::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut deliveries = Vec::new();
    for _ in 0..5 {
        let (once, runs) = (once.clone(), Arc::clone(&runs));
        deliveries.push(tokio::spawn(async move {
            once.run(unit("o-3", "{}"), |_| async move {
                runs.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, std::io::Error>("shipped".to_owned())
            })
            .await
            .unwrap()
        }));
    }
    let mut replayed = 0;
    for delivery in deliveries {
        let done = delivery.await.unwrap();
        assert_eq!(done.value, "shipped");
        replayed += usize::from(done.replayed);
    }
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(
        replayed, 4,
        "the others waited for the first and got its outcome"
    );
}

async fn a_slot_runs_once_however_many_instances_start_it() {
    let once = Once::new(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let mut starts = Vec::new();
    for _ in 0..4 {
        let (once, runs) = (once.clone(), Arc::clone(&runs));
        starts.push(tokio::spawn(async move {
            once.run_slot("cleanup:2026-12-01", |_| async move {
                runs.fetch_add(1, SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, std::io::Error>(())
            })
            .await
            .unwrap()
        }));
    }
    let mut found = HashMap::new();
    for start in starts {
        *found
            .entry(format!("{:?}", start.await.unwrap()))
            .or_insert(0) += 1;
    }
    assert_eq!(found.get("Ran"), Some(&1), "{found:?}");
    assert_eq!(found.get("RunningElsewhere"), Some(&3), "{found:?}");
    let later = once
        .run_slot("cleanup:2026-12-01", |_| async {
            Ok::<_, std::io::Error>(())
        })
        .await;
    assert_eq!(later.unwrap(), Slot::AlreadyRan);
    assert_eq!(runs.load(SeqCst), 1);
}

/// Redis Streams redelivers a message another consumer holds for `CLAIM_IDLE_MS` (`XAUTOCLAIM`):
/// here shorter than the work, so deliveries are taken over mid-work by live consumers, and one
/// consumer is killed (SIGKILL) mid-run. Every order ships once (fenced), all are acknowledged.
async fn consumers_that_die_or_stall_ship_each_order_once() {
    let schema = TestSchema::new().await;
    let redis = RedisServer::start().await;
    let stream = format!("orders-{}", uuid::Uuid::new_v4().simple());
    let env = [
        ("REDIS_URL", redis.url()),
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("STREAM", stream.clone()),
        ("WORK_MS", "600".into()),
        ("CLAIM_IDLE_MS", "300".into()),
        ("IDEMPOTENCY_LEASE_MS", "1000".into()),
        ("RUST_LOG", "info".into()),
    ];
    let mut consumers: Vec<Proc> = (0..3)
        .map(|_| Proc::worker("stream_consumer", &env))
        .collect();
    let mut connection = redis.admin().await;
    let orders = 12;
    for n in 0..orders {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("order_id")
            .arg(format!("order-{n}"))
            .arg("payload")
            .arg(format!(r#"{{"sku":"item-{n}"}}"#))
            .query_async(&mut connection)
            .await
            .unwrap();
    }
    let shipped = |schema: &TestSchema| {
        let pool = schema.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM shipments")
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
        }
    };
    let started = Instant::now();
    while shipped(&schema).await < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "nothing shipped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumers[0].child.kill().unwrap();
    // Until every order shipped and the group has nothing pending.
    loop {
        let pending: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
            .arg(&stream)
            .arg("shipping")
            .query_async(&mut connection)
            .await
            .unwrap();
        let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT order_id) FROM shipments")
            .fetch_one(&schema.pool)
            .await
            .unwrap();
        if distinct == orders && pending.0 == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{distinct} shipped, {} pending",
            pending.0
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, count(*) FROM shipments GROUP BY order_id")
            .fetch_all(&schema.pool)
            .await
            .unwrap();
    assert_eq!(rows.len() as i64, orders);
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "an order shipped twice: {rows:?}"
    );
    let logs: String = consumers.iter().map(Proc::log).collect();
    let taken_over = logs.matches("took over pending messages").count();
    let replayed = logs.matches("replayed=true").count();
    assert!(taken_over > 0, "no message was redelivered:\n{logs}");
    println!(
        "{orders} orders, 3 consumers (one killed), redelivery after 300 ms of 600 ms work: \
         {taken_over} takeovers, {replayed} deliveries answered with the stored outcome, every order shipped once"
    );
    drop(consumers);
    schema.drop().await;
}

/// The same schedule started on four instances: one run per slot; the instance running it is
/// killed (SIGKILL) mid-way, another takes it over after the lease and resumes, and no step is
/// written twice.
async fn a_schedule_on_four_instances_runs_once_and_a_killed_run_is_taken_over() {
    let schema = TestSchema::new().await;
    let slot = format!("nightly-cleanup:{}", uuid::Uuid::new_v4().simple());
    let steps = 6;
    let env = [
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("SLOT", slot.clone()),
        ("STEPS", steps.to_string()),
        ("STEP_MS", "250".into()),
        ("TRY_EVERY_MS", "100".into()),
        ("IDEMPOTENCY_LEASE_MS", "1000".into()),
        ("RUST_LOG", "info".into()),
    ];
    let mut instances: Vec<Proc> = (0..4)
        .map(|_| Proc::worker("scheduled_job", &env))
        .collect();
    let started = Instant::now();
    let first_writer = loop {
        let writer: Option<String> = sqlx::query_scalar(
            "SELECT instance FROM job_steps WHERE slot = $1 GROUP BY instance HAVING count(*) >= 2",
        )
        .bind(&slot)
        .fetch_optional(&schema.pool)
        .await
        .unwrap_or(None);
        if let Some(writer) = writer {
            break writer;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the job never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let doomed = instances
        .iter()
        .position(|i| first_writer == format!("instance-{}", i.child.id()))
        .expect("the writer is one of the instances");
    instances[doomed].child.kill().unwrap();
    let killed_at = Instant::now();
    // Every other instance learns the job ran, and exits.
    for (n, instance) in instances.iter_mut().enumerate() {
        if n == doomed {
            continue;
        }
        loop {
            if let Some(status) = instance.child.try_wait().unwrap() {
                assert!(status.success(), "{}", instance.log());
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{}",
                instance.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT step, instance FROM job_steps WHERE slot = $1 ORDER BY step")
            .bind(&slot)
            .fetch_all(&schema.pool)
            .await
            .unwrap();
    let written: Vec<i64> = rows.iter().map(|(step, _)| *step).collect();
    assert_eq!(
        written,
        (0..steps).collect::<Vec<_>>(),
        "each step once, in order: {rows:?}"
    );
    let writers: std::collections::BTreeSet<&str> = rows.iter().map(|(_, i)| i.as_str()).collect();
    assert_eq!(
        writers.len(),
        2,
        "the killed run and the one that took over: {rows:?}"
    );
    let logs: String = instances.iter().map(Proc::log).collect();
    assert_eq!(
        logs.matches("ran the job").count(),
        1,
        "one run finished the slot:\n{logs}"
    );
    assert_eq!(
        logs.matches("taking over a run that stopped").count(),
        1,
        "{logs}"
    );
    println!(
        "4 instances, one slot of {steps} steps; the runner killed after 2 steps, the job finished \
         {:?} after the kill by one other instance; every step written once",
        killed_at.elapsed()
    );
    schema.drop().await;
}
