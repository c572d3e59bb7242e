//! Units of work claimed in their own transaction (`Once::run_in_transaction`): the work, the
//! claim and the outcome commit together or not at all. Effects are counted in the shipments
//! table, where the work writes them.

#[path = "../support/mod.rs"]
mod support;

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

use sqlx::{PgConnection, PgPool};
use support::TestSchema;
use tower_idempotency::{
    store::{Admin, PostgresStore, RecordState},
    work::{Once, Unit, WorkError},
};

fn unit(key: &str, payload: &str) -> Unit {
    Unit::new("orders", key, payload.as_bytes()).unwrap()
}

/// A schema with a `shipments` table without a key of its own, so a second shipment of an
/// order would show; and the store on it.
async fn shipments_schema() -> (TestSchema, PostgresStore) {
    let schema = TestSchema::new().await;
    sqlx::query("CREATE TABLE shipments (order_id text NOT NULL, by text NOT NULL)")
        .execute(&schema.pool)
        .await
        .unwrap();
    let store = PostgresStore::new(schema.pool.clone());
    (schema, store)
}

/// A pool of one connection on `schema`, so that a test knows which connection a delivery had.
async fn pool_of_one(schema: &TestSchema) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(schema.pool.connect_options().as_ref().clone())
        .await
        .unwrap()
}

/// The state of the server process `pid` once it is `wanted` (`None`: gone), or after 5 s.
async fn backend_becomes(pool: &PgPool, pid: i32, wanted: Option<&str>) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(pool)
                .await
                .unwrap();
        if state.as_deref() == wanted || Instant::now() > deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The shipments of `key`, by whom.
async fn shipped(pool: &PgPool, key: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT by FROM shipments WHERE order_id = $1")
        .bind(key)
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Ships `key` as `by`, counting the runs in `runs`.
async fn ship(
    tx: &mut PgConnection,
    key: &str,
    by: &str,
    runs: &AtomicUsize,
) -> Result<String, sqlx::Error> {
    runs.fetch_add(1, SeqCst);
    sqlx::query("INSERT INTO shipments (order_id, by) VALUES ($1, $2)")
        .bind(key)
        .bind(by)
        .execute(&mut *tx)
        .await?;
    Ok(format!("shipped by {by}"))
}

/// The transaction that wrote `key`'s shipment and the one that wrote its key's row.
async fn writers(pool: &PgPool, key: &str) -> (String, String) {
    let shipment = "SELECT xmin::text FROM shipments WHERE order_id = $1";
    let record = "SELECT xmin::text FROM idempotency_keys WHERE key = $1";
    let read = async |sql| {
        sqlx::query_scalar(sql)
            .bind(key)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    (read(shipment).await, read(record).await)
}

/// Once a stalled delivery's work ran (`runs` above 0), a delivery of `key` as "next": it
/// ships, before the stalled one wakes (`lease * 3` after it stalled).
async fn next_ships_while_stalled(
    once: &Once,
    pool: &PgPool,
    (key, lease): (&str, Duration),
    runs: &AtomicUsize,
) {
    while runs.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    let next = once
        .run_in_transaction(unit(key, "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, key, "next", runs).await
        })
        .await
        .unwrap();
    assert_eq!(
        (next.value.as_str(), next.replayed),
        ("shipped by next", false)
    );
    assert!(
        started.elapsed() < lease * 3,
        "not after the stalled one woke"
    );
}

/// Aborts `dropped` once its work wrote its connection's server process into `pid`: that
/// process, which must then be gone.
async fn drop_mid_work<T>(
    dropped: tokio::task::JoinHandle<T>,
    pid: &std::sync::Mutex<Option<i32>>,
    pool: &PgPool,
) {
    let backend = loop {
        if let Some(backend) = *pid.lock().unwrap() {
            break backend;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    dropped.abort();
    let _ = dropped.await;
    assert_eq!(
        backend_becomes(pool, backend, None).await,
        None,
        "the dropped delivery's connection is still open"
    );
}

/// A `labels` table whose `order_id` is unique, checked at the commit (deferred), holding
/// `taken` already.
async fn labels_holding(pool: &PgPool, taken: &str) {
    let deferred = "CREATE TABLE labels (order_id text NOT NULL \
                    UNIQUE DEFERRABLE INITIALLY DEFERRED)";
    sqlx::query(deferred).execute(pool).await.unwrap();
    sqlx::query("INSERT INTO labels VALUES ($1)")
        .bind(taken)
        .execute(pool)
        .await
        .unwrap();
}

/// The first delivery ships, in one transaction with its key's row; later deliveries, in this
/// mode or through `Once::run`, get its outcome without running; another payload is a
/// mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_in_its_transaction_commits_with_its_key_and_later_deliveries_get_its_outcome() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store.clone());
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;

    let first = once
        .run_in_transaction(unit("o-1", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-1", "first", runs).await
        })
        .await
        .unwrap();
    assert_eq!(
        (first.value.as_str(), first.replayed),
        ("shipped by first", false)
    );
    let (shipment, record) = writers(pool, "o-1").await;
    assert_eq!(
        shipment, record,
        "the shipment and the key committed together"
    );

    let again = once
        .run_in_transaction(unit("o-1", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-1", "again", runs).await
        })
        .await
        .unwrap();
    assert_eq!(
        (again.value.as_str(), again.replayed),
        ("shipped by first", true)
    );
    let leased = once
        .run(unit("o-1", "{}"), |_| async {
            Ok::<_, std::io::Error>("ran".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(
        (leased.value.as_str(), leased.replayed),
        ("shipped by first", true)
    );
    let other = once
        .run_in_transaction(
            unit("o-1", "{\"n\":2}"),
            pool,
            async |tx: &mut PgConnection| ship(tx, "o-1", "other", runs).await,
        )
        .await;
    assert!(matches!(other, Err(WorkError::Mismatch)), "{other:?}");

    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(shipped(pool, "o-1").await, ["first"]);
    let record = unit("o-1", "{}").record().clone();
    let info = store.inspect(&record).await.unwrap().unwrap();
    assert_eq!(info.state, RecordState::Completed);
    schema.drop().await;
}

/// Work that fails rolls back its writes and leaves no key behind: the next delivery runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_unit_in_its_transaction_leaves_nothing_and_the_next_delivery_runs_it() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;
    let failed = once
        .run_in_transaction(unit("o-2", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-2", "failing", runs).await?;
            Err::<String, _>(sqlx::Error::Protocol("the carrier refused".into()))
        })
        .await;
    assert!(matches!(failed, Err(WorkError::Failed(_))), "{failed:?}");
    assert!(
        shipped(pool, "o-2").await.is_empty(),
        "its write rolled back"
    );
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(keys, 0, "no key left behind");

    let done = once
        .run_in_transaction(unit("o-2", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-2", "second", runs).await
        })
        .await
        .unwrap();
    assert!(!done.replayed);
    assert_eq!(shipped(pool, "o-2").await, ["second"]);
    schema.drop().await;
}

/// Five deliveries of one order at once: one ships, the others wait for its lock and get its
/// outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_deliveries_in_their_transactions_ship_once() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let deliveries = (0..5).map(|n| {
        let (once, pool, runs) = (once.clone(), schema.pool.clone(), Arc::clone(&runs));
        tokio::spawn(async move {
            let by = format!("delivery-{n}");
            let work = async |tx: &mut PgConnection| {
                let shipped = ship(tx, "o-3", &by, &runs).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
                shipped
            };
            once.run_in_transaction(unit("o-3", "{}"), &pool, work)
                .await
                .unwrap()
        })
    });
    let done = futures_util::future::join_all(deliveries).await;
    let done: Vec<_> = done.into_iter().map(Result::unwrap).collect();
    assert_eq!(runs.load(SeqCst), 1);
    assert_eq!(done.iter().filter(|d| d.replayed).count(), 4);
    let shipments = shipped(&schema.pool, "o-3").await;
    assert_eq!(shipments.len(), 1);
    assert!(
        done.iter()
            .all(|d| d.value == format!("shipped by {}", shipments[0]))
    );
    schema.drop().await;
}

/// A delivery stalled inside its transaction for longer than its lease (its process paused)
/// loses its session: the waiting delivery ships, and the stalled one commits nothing when it
/// wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_stalled_past_its_lease_commits_nothing_and_the_next_ships() {
    let (schema, store) = shipments_schema().await;
    let lease = Duration::from_millis(500);
    let once = Once::new(store)
        .with_lease(lease)
        .with_wait(Duration::from_secs(10));
    let runs = Arc::new(AtomicUsize::new(0));
    let stalled = tokio::spawn({
        let (once, pool, runs) = (once.clone(), schema.pool.clone(), Arc::clone(&runs));
        async move {
            let work = async |tx: &mut PgConnection| {
                let shipped = ship(tx, "o-4", "stalled", &runs).await;
                tokio::time::sleep(lease * 3).await;
                shipped
            };
            once.run_in_transaction(unit("o-4", "{}"), &pool, work)
                .await
        }
    });
    next_ships_while_stalled(&once, &schema.pool, ("o-4", lease), &runs).await;
    let stalled = stalled.await.unwrap();
    assert!(matches!(stalled, Err(WorkError::Store(_))), "{stalled:?}");
    assert_eq!(shipped(&schema.pool, "o-4").await, ["next"]);
    schema.drop().await;
}

/// Across modes: a delivery in its transaction waits for a key `Once::run` holds and gets its
/// outcome; and one that finds a key `Once::run` left in flight past its lease (its process
/// gone) takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_in_its_transaction_waits_for_a_leased_owner_and_takes_over_a_lapsed_one() {
    let (schema, store) = shipments_schema().await;
    let lease = Duration::from_millis(300);
    let once = Once::new(store).with_lease(lease);
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;
    let held = tokio::spawn({
        let once = once.clone();
        async move {
            let work = |_| async {
                tokio::time::sleep(Duration::from_millis(600)).await;
                Ok::<_, std::io::Error>("shipped under a lease".to_owned())
            };
            once.run(unit("o-5", "{}"), work).await.unwrap()
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waited = once
        .run_in_transaction(unit("o-5", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-5", "in-transaction", runs).await
        })
        .await
        .unwrap();
    assert_eq!(
        (waited.value.as_str(), waited.replayed),
        ("shipped under a lease", true)
    );
    assert!(!held.await.unwrap().replayed);

    // A lease-mode delivery whose task is gone mid-work: no renewals, no release.
    let gone = tokio::spawn({
        let once = once.clone();
        async move {
            let work = |_| std::future::pending::<Result<String, std::io::Error>>();
            once.run(unit("o-6", "{}"), work).await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    gone.abort();
    let taken = once
        .run_in_transaction(unit("o-6", "{}"), pool, async |tx: &mut PgConnection| {
            ship(tx, "o-6", "taker", runs).await
        })
        .await
        .unwrap();
    assert_eq!(
        (taken.value.as_str(), taken.replayed),
        ("shipped by taker", false)
    );
    assert_eq!(shipped(pool, "o-6").await, ["taker"]);
    assert_eq!(runs.load(SeqCst), 1, "o-5 did not run in this mode");
    schema.drop().await;
}

/// A delivery under a lease claims the key while one in its transaction works on it (the lock
/// does not hold the other mode back, and the row is written last): the key's primary key
/// decides, the one in its transaction rolls back and gets the other's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_claimed_under_a_lease_meanwhile_rolls_the_transaction_back() {
    leased_owner_meanwhile("o-7", false).await;
}

/// The same over an expired row: the delivery read it, and means to write in its place; an
/// owner under a lease takes it over first. The row is no longer the one read, so nothing of
/// this delivery commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_row_taken_over_under_a_lease_meanwhile_rolls_the_transaction_back() {
    leased_owner_meanwhile("o-13", true).await;
}

/// While a delivery in its transaction works on `key`, an owner under a lease claims it and
/// ships; the delivery's transaction rolls back, and it gets that owner's outcome. With
/// `expired`, the key starts with an expired row of an earlier run.
async fn leased_owner_meanwhile(key: &str, expired: bool) {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = &schema.pool;
    if expired {
        let old = async |_: &mut PgConnection| Ok::<_, sqlx::Error>("long ago".to_owned());
        once.run_in_transaction(unit(key, "{}"), pool, old)
            .await
            .unwrap();
        sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
            .execute(pool)
            .await
            .unwrap();
    }
    let leased = Arc::new(tokio::sync::Notify::new());
    let work = async |tx: &mut PgConnection| {
        ship(tx, key, "in-transaction", &AtomicUsize::new(0)).await?;
        let other = tokio::spawn({
            let (once, pool, leased) = (once.clone(), pool.clone(), Arc::clone(&leased));
            let (key, unit) = (key.to_owned(), unit(key, "{}"));
            async move {
                let work = |_| async move {
                    leased.notify_one();
                    let mut tx = pool.begin().await?;
                    ship(&mut tx, &key, "leased", &AtomicUsize::new(0)).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>("shipped by leased".to_owned())
                };
                once.run(unit, work).await.unwrap()
            }
        });
        leased.notified().await;
        drop(other);
        Ok::<_, sqlx::Error>("shipped by in-transaction".to_owned())
    };
    let done = once
        .run_in_transaction(unit(key, "{}"), pool, work)
        .await
        .unwrap();
    assert_eq!(
        (done.value.as_str(), done.replayed),
        ("shipped by leased", true)
    );
    assert_eq!(shipped(pool, key).await, ["leased"]);
    schema.drop().await;
}

/// With tombstones, a unit past its outcome's retention is never run again, in either mode,
/// before or after the sweeper buried it, until the horizon after it ran; then it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_past_its_retention_is_refused_until_the_horizon() {
    let (schema, store) = shipments_schema().await;
    let horizon = Duration::from_millis(2000);
    let store = store.with_tombstones(horizon);
    let once = Once::new(store.clone()).with_retention(Duration::from_millis(300));
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;
    let ship_as =
        |by: &'static str| async move |tx: &mut PgConnection| ship(tx, "o-8", by, runs).await;
    let ran = Instant::now();
    once.run_in_transaction(unit("o-8", "{}"), pool, ship_as("first"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let late = once
        .run_in_transaction(unit("o-8", "{}"), pool, ship_as("late"))
        .await;
    assert!(matches!(late, Err(WorkError::AnswerExpired)), "{late:?}");
    let leased = once
        .run(unit("o-8", "{}"), |_| async {
            Ok::<_, std::io::Error>("ran".to_owned())
        })
        .await;
    assert!(
        matches!(leased, Err(WorkError::AnswerExpired)),
        "{leased:?}"
    );
    store.sweep().await.unwrap();
    let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = 'o-8'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(state, "tombstone", "the sweeper buried it");
    let buried = once
        .run_in_transaction(unit("o-8", "{}"), pool, ship_as("buried"))
        .await;
    assert!(
        matches!(buried, Err(WorkError::AnswerExpired)),
        "{buried:?}"
    );
    let other = once
        .run_in_transaction(unit("o-8", "{\"n\":2}"), pool, ship_as("other"))
        .await;
    assert!(matches!(other, Err(WorkError::Mismatch)), "{other:?}");
    assert_eq!(shipped(pool, "o-8").await, ["first"]);

    tokio::time::sleep_until((ran + horizon + Duration::from_millis(300)).into()).await;
    let again = once
        .run_in_transaction(unit("o-8", "{}"), pool, ship_as("after"))
        .await
        .unwrap();
    assert!(!again.replayed);
    assert_eq!(shipped(pool, "o-8").await, ["first", "after"]);
    schema.drop().await;
}

/// Scopes and keys with quotes and backslashes: a fresh key's `BEGIN` carries them as
/// literals, and they are the key they say, in both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_and_keys_with_quotes_and_backslashes_are_the_keys_they_say() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store.clone());
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;
    let (scope, key) = (r"it's \' scope'); DROP TABLE shipments; --", r"o'9\");
    let tricky = || Unit::new(scope, key, b"{}").unwrap();
    let ship_as =
        |by: &'static str| async move |tx: &mut PgConnection| ship(tx, "o-9", by, runs).await;
    let first = once
        .run_in_transaction(tricky(), pool, ship_as("first"))
        .await
        .unwrap();
    let again = once
        .run_in_transaction(tricky(), pool, ship_as("again"))
        .await
        .unwrap();
    assert_eq!((first.replayed, again.replayed), (false, true));
    let stored: (String, String) = sqlx::query_as("SELECT scope, key FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(stored, (scope.to_owned(), key.to_owned()));
    let info = store.inspect(tricky().record()).await.unwrap().unwrap();
    assert_eq!(info.state, RecordState::Completed);
    assert_eq!(shipped(pool, "o-9").await, ["first"]);
    schema.drop().await;
}

/// A delivery dropped while its transaction is open (its consumer shut down mid-work) leaves
/// nothing behind: its shipment rolls back, its connection is closed rather than handed back to
/// the pool half-open, and the next delivery ships.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_dropped_mid_work_closes_its_connection_and_the_next_ships() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = pool_of_one(&schema).await;
    let pid = Arc::new(std::sync::Mutex::new(None::<i32>));
    let dropped = tokio::spawn({
        let (once, pool, pid) = (once.clone(), pool.clone(), Arc::clone(&pid));
        async move {
            let work = async |tx: &mut PgConnection| {
                ship(tx, "o-10", "dropped", &AtomicUsize::new(0)).await?;
                let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(&mut *tx)
                    .await?;
                *pid.lock().unwrap() = Some(backend);
                std::future::pending::<Result<String, sqlx::Error>>().await
            };
            once.run_in_transaction(unit("o-10", "{}"), &pool, work)
                .await
        }
    });
    drop_mid_work(dropped, &pid, &schema.pool).await;
    let next = once
        .run_in_transaction(unit("o-10", "{}"), &pool, async |tx: &mut PgConnection| {
            ship(tx, "o-10", "next", &AtomicUsize::new(0)).await
        })
        .await
        .unwrap();
    assert!(!next.replayed);
    assert_eq!(shipped(&schema.pool, "o-10").await, ["next"]);
    schema.drop().await;
}

/// A constraint of the work's own that fails only at the commit (deferred) is the delivery's
/// error, not another delivery's row: nothing committed, no key left, and the next delivery
/// runs the work (a unique violation at the commit is not the key's row taken by another).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_constraint_failing_at_the_commit_is_the_works_error() {
    let (schema, store) = shipments_schema().await;
    let pool = &schema.pool;
    labels_holding(pool, "o-11").await;
    let once = Once::new(store);
    let label = async |tx: &mut PgConnection| {
        ship(tx, "o-11", "labelled", &AtomicUsize::new(0)).await?;
        sqlx::query("INSERT INTO labels VALUES ('o-11')")
            .execute(&mut *tx)
            .await?;
        Ok::<_, sqlx::Error>("labelled".to_owned())
    };
    let failed = once
        .run_in_transaction(unit("o-11", "{}"), pool, label)
        .await;
    assert!(matches!(failed, Err(WorkError::Store(_))), "{failed:?}");
    assert!(shipped(pool, "o-11").await.is_empty(), "nothing committed");
    let keys: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(keys, 0, "no key left behind");

    sqlx::query("DELETE FROM labels")
        .execute(pool)
        .await
        .unwrap();
    let done = once
        .run_in_transaction(unit("o-11", "{}"), pool, label)
        .await
        .unwrap();
    assert_eq!((done.value.as_str(), done.replayed), ("labelled", false));
    assert_eq!(shipped(pool, "o-11").await, ["labelled"]);
    schema.drop().await;
}

/// A delivery that committed, and one that found its key taken and rolled back, hand their
/// connection back to the pool idle, outside any transaction (the fresh path's `BEGIN` carries
/// the key's lock, and the replay's path rolls that back on the same connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_delivery_leaves_its_connection_outside_any_transaction() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = pool_of_one(&schema).await;
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    for by in ["first", "again"] {
        once.run_in_transaction(unit("o-12", "{}"), &pool, async |tx: &mut PgConnection| {
            ship(tx, "o-12", by, &AtomicUsize::new(0)).await
        })
        .await
        .unwrap();
        let state = backend_becomes(&schema.pool, backend, Some("idle")).await;
        assert_eq!(state.as_deref(), Some("idle"), "after the delivery by {by}");
    }
    assert_eq!(shipped(&schema.pool, "o-12").await, ["first"]);
    schema.drop().await;
}

mod batches;
