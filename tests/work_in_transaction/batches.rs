//! A batch of units (`Once::run_batch_in_transaction`) as a consumer's window.

use super::*;

type Answers = Vec<Result<tower_idempotency::work::Done<String>, WorkError<sqlx::Error>>>;

/// Runs `keys` (with `{}` as payload, or the one given) as one batch, each unit shipping
/// its key as `<by>-<index>`, counting the runs in `runs`.
async fn batch(
    once: &Once,
    pool: &PgPool,
    keys: &[(&str, &str)],
    by: &str,
    runs: &AtomicUsize,
) -> Answers {
    let units = keys
        .iter()
        .map(|(key, payload)| unit(key, payload))
        .collect();
    let work = |i: usize| {
        async move |tx: &mut PgConnection| ship(tx, keys[i].0, &format!("{by}-{i}"), runs).await
    };
    once.run_batch_in_transaction(units, pool, work).await
}

/// Each answer as `(value, replayed)`, or its error's name.
fn shown(answers: &Answers) -> Vec<String> {
    answers
        .iter()
        .map(|answer| match answer {
            Ok(done) => format!("{} ({})", done.value, done.replayed),
            Err(WorkError::Mismatch) => "mismatch".to_owned(),
            Err(WorkError::Failed(_)) => "failed".to_owned(),
            Err(WorkError::Store(_)) => "store".to_owned(),
            Err(error) => format!("{error:?}"),
        })
        .collect()
}

/// The free units of a batch commit in one transaction with their keys' rows; a unit
/// delivered before gets its outcome, another payload a mismatch, and a key twice in the
/// window runs once. The same window again runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_commits_its_free_units_together_and_answers_the_others_as_one_would() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let runs = &runs;
    for key in ["b-1", "b-5"] {
        let first = async |tx: &mut PgConnection| ship(tx, key, "first", runs).await;
        once.run_in_transaction(unit(key, "{}"), pool, first)
            .await
            .unwrap();
    }
    let window = [
        ("b-1", "{}"),
        ("b-2", "{}"),
        ("b-3", "{}"),
        ("b-2", "{}"),
        ("b-5", r#"{"n":2}"#),
    ];
    let answers = batch(&once, pool, &window, "batch", runs).await;
    let expected = [
        "shipped by first (true)",
        "shipped by batch-1 (false)",
        "shipped by batch-2 (false)",
        "shipped by batch-1 (true)",
        "mismatch",
    ];
    assert_eq!(shown(&answers), expected);
    assert_eq!(runs.load(SeqCst), 4, "b-2 and b-3 once each");
    let (b2, b3) = (writers(pool, "b-2").await, writers(pool, "b-3").await);
    assert_eq!(
        [&b2.1, &b3.0, &b3.1],
        [&b2.0; 3],
        "b-2, b-3 and their keys in one transaction"
    );

    let again = batch(&once, pool, &window, "again", runs).await;
    let replayed = [
        "shipped by first (true)",
        "shipped by batch-1 (true)",
        "shipped by batch-2 (true)",
        "shipped by batch-1 (true)",
        "mismatch",
    ];
    assert_eq!(shown(&again), replayed);
    assert_eq!(runs.load(SeqCst), 4);
    for (key, by) in [("b-1", "first"), ("b-2", "batch-1"), ("b-3", "batch-2")] {
        assert_eq!(shipped(pool, key).await, [by], "{key}");
    }
    schema.drop().await;
}

/// A unit's work that fails rolls its batch back: that unit's answer is its error and
/// nothing of it commits; the others ship, each in a transaction of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_unit_rolls_its_batch_back_and_the_others_ship_on_their_own() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let (pool, runs) = (&schema.pool, AtomicUsize::new(0));
    let keys = ["f-0", "f-1", "f-2", "f-3"];
    let units = keys.iter().map(|key| unit(key, "{}")).collect();
    let runs = &runs;
    let work = |i: usize| {
        async move |tx: &mut PgConnection| {
            let shipped = ship(tx, keys[i], &format!("unit-{i}"), runs).await;
            if i == 2 {
                return Err(sqlx::Error::Protocol("the carrier refused".into()));
            }
            shipped
        }
    };
    let answers = once.run_batch_in_transaction(units, pool, work).await;
    let expected = [
        "shipped by unit-0 (false)",
        "shipped by unit-1 (false)",
        "failed",
        "shipped by unit-3 (false)",
    ];
    assert_eq!(shown(&answers), expected);
    assert_eq!(
        runs.load(SeqCst),
        6,
        "f-0 and f-1 rolled back and ran again"
    );
    for (i, key) in keys.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert_eq!(shipped(pool, key).await, [format!("unit-{i}")]);
    }
    assert!(shipped(pool, "f-2").await.is_empty(), "f-2 rolled back");
    let keys: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(keys, ["f-0", "f-1", "f-3"]);
    schema.drop().await;
}

/// Three consumers, each with a pool and a `Once` of its own, take overlapping windows of
/// thirty orders at once: every order ships exactly once, and every answer is its
/// shipment's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_of_overlapping_windows_ship_each_order_once() {
    let (schema, _) = shipments_schema().await;
    let orders: Vec<String> = (0..30).map(|n| format!("c-{n}")).collect();
    let consumers = (0..3).map(|c| {
        let orders = orders.clone();
        let options = schema.pool.connect_options().as_ref().clone();
        tokio::spawn(async move {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(options)
                .await
                .unwrap();
            let once = Once::new(PostgresStore::new(pool.clone()));
            let runs = AtomicUsize::new(0);
            let mut answers = Vec::new();
            // Each consumer starts its windows at another order, so they overlap.
            let order: Vec<&str> = (0..30)
                .map(|n| orders[(n + c * 10) % 30].as_str())
                .collect();
            for window in order.chunks(10) {
                let keys: Vec<(&str, &str)> = window.iter().map(|key| (*key, "{}")).collect();
                let done = batch(&once, &pool, &keys, &format!("consumer-{c}"), &runs).await;
                let done = done.into_iter().map(|answer| answer.unwrap().value);
                answers.extend(window.iter().map(|key| key.to_string()).zip(done));
            }
            pool.close().await;
            answers
        })
    });
    let answers = futures_util::future::join_all(consumers).await;
    for (key, value) in answers.into_iter().flat_map(Result::unwrap) {
        let shipments = shipped(&schema.pool, &key).await;
        assert_eq!(shipments.len(), 1, "{key} shipped {shipments:?}");
        assert_eq!(value, format!("shipped by {}", shipments[0]), "{key}");
    }
    schema.drop().await;
}

/// A unit another delivery holds under a lease is waited for on its own, after the rest of
/// its batch committed; it gets the holder's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_held_elsewhere_is_waited_for_after_the_rest_of_its_batch_committed() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = &schema.pool;
    let released = Arc::new(tokio::sync::Notify::new());
    let held = tokio::spawn({
        let (once, released) = (once.clone(), Arc::clone(&released));
        async move {
            let work = |_| async move {
                released.notified().await;
                Ok::<_, std::io::Error>("shipped under a lease".to_owned())
            };
            once.run(unit("h-0", "{}"), work).await.unwrap()
        }
    });
    let claimed = "SELECT count(*) FROM idempotency_keys WHERE key = 'h-0'";
    while sqlx::query_scalar::<_, i64>(claimed)
        .fetch_one(pool)
        .await
        .unwrap()
        == 0
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let window = [("h-0", "{}"), ("h-1", "{}"), ("h-2", "{}")];
    let answers = tokio::spawn({
        let (once, pool) = (once.clone(), pool.clone());
        async move { batch(&once, &pool, &window, "batch", &AtomicUsize::new(0)).await }
    });
    // The batch's units commit while h-0 is still held.
    let committed = "SELECT count(*) FROM shipments WHERE order_id IN ('h-1', 'h-2')";
    let deadline = Instant::now() + Duration::from_secs(5);
    while sqlx::query_scalar::<_, i64>(committed)
        .fetch_one(pool)
        .await
        .unwrap()
        < 2
    {
        assert!(Instant::now() < deadline, "h-1 and h-2 did not commit");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!answers.is_finished(), "h-0 is waited for");
    released.notify_one();
    assert!(!held.await.unwrap().replayed);
    let expected = [
        "shipped under a lease (true)",
        "shipped by batch-1 (false)",
        "shipped by batch-2 (false)",
    ];
    assert_eq!(shown(&answers.await.unwrap()), expected);
    assert_eq!(writers(pool, "h-1").await.0, writers(pool, "h-2").await.0);
    schema.drop().await;
}

/// A batch stalled between its statements for longer than its lease (its process paused)
/// loses its session, and with it its keys' locks: another delivery ships meanwhile, and
/// the batch commits nothing when it wakes; its unit then gets that delivery's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_stalled_past_its_lease_commits_nothing_and_the_next_ships() {
    let (schema, store) = shipments_schema().await;
    let lease = Duration::from_millis(500);
    let once = Once::new(store).with_lease(lease);
    let runs = Arc::new(AtomicUsize::new(0));
    let stalled = tokio::spawn({
        let (once, pool, runs) = (once.clone(), schema.pool.clone(), Arc::clone(&runs));
        async move {
            let runs = &runs;
            let work = |_| {
                async move |tx: &mut PgConnection| {
                    let shipped = ship(tx, "s-0", "stalled", runs).await;
                    if runs.load(SeqCst) == 1 {
                        tokio::time::sleep(lease * 3).await;
                    }
                    shipped
                }
            };
            once.run_batch_in_transaction(vec![unit("s-0", "{}")], &pool, work)
                .await
        }
    });
    next_ships_while_stalled(&once, &schema.pool, ("s-0", lease), &runs).await;
    let stalled = stalled.await.unwrap();
    assert_eq!(shown(&stalled), ["shipped by next (true)"]);
    assert_eq!(shipped(&schema.pool, "s-0").await, ["next"]);
    schema.drop().await;
}

/// A batch dropped mid-work (its consumer shut down) leaves nothing behind: its
/// connection is closed, not handed back, so its keys' locks end at once; the next
/// window ships every unit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_dropped_mid_work_commits_nothing_and_the_next_ships() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = pool_of_one(&schema).await;
    let pid = Arc::new(std::sync::Mutex::new(None::<i32>));
    let dropped = tokio::spawn({
        let (once, pool, pid) = (once.clone(), pool.clone(), Arc::clone(&pid));
        async move {
            let units = vec![unit("d-0", "{}"), unit("d-1", "{}")];
            let pid = &pid;
            let work = |i: usize| {
                async move |tx: &mut PgConnection| {
                    ship(tx, ["d-0", "d-1"][i], "dropped", &AtomicUsize::new(0)).await?;
                    if i == 1 {
                        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                            .fetch_one(&mut *tx)
                            .await?;
                        *pid.lock().unwrap() = Some(backend);
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, sqlx::Error>("dropped".to_owned())
                }
            };
            once.run_batch_in_transaction(units, &pool, work).await
        }
    });
    drop_mid_work(dropped, &pid, &schema.pool).await;
    let window = [("d-0", "{}"), ("d-1", "{}")];
    let next = batch(&once, &pool, &window, "next", &AtomicUsize::new(0)).await;
    assert_eq!(
        shown(&next),
        ["shipped by next-0 (false)", "shipped by next-1 (false)"]
    );
    assert_eq!(shipped(&schema.pool, "d-0").await, ["next-0"]);
    assert_eq!(shipped(&schema.pool, "d-1").await, ["next-1"]);
    schema.drop().await;
}

/// A commit that fails (a deferred constraint of one unit's work) commits nothing of the
/// batch: each unit is delivered again on its own, and only the one whose work breaks the
/// constraint fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_commit_fails_delivers_each_unit_on_its_own() {
    let (schema, store) = shipments_schema().await;
    let pool = &schema.pool;
    labels_holding(pool, "l-1").await;
    let once = Once::new(store);
    let keys = ["l-0", "l-1", "l-2"];
    let units = keys.iter().map(|key| unit(key, "{}")).collect();
    let label = |i: usize| {
        async move |tx: &mut PgConnection| {
            ship(tx, keys[i], "labelled", &AtomicUsize::new(0)).await?;
            sqlx::query("INSERT INTO labels VALUES ($1)")
                .bind(keys[i])
                .execute(&mut *tx)
                .await?;
            Ok::<_, sqlx::Error>("labelled".to_owned())
        }
    };
    let answers = once.run_batch_in_transaction(units, pool, label).await;
    assert_eq!(
        shown(&answers),
        ["labelled (false)", "store", "labelled (false)"]
    );
    assert_eq!(shipped(pool, "l-0").await, ["labelled"]);
    assert!(shipped(pool, "l-1").await.is_empty(), "l-1 rolled back");
    assert_eq!(shipped(pool, "l-2").await, ["labelled"]);
    schema.drop().await;
}

/// An owner under a lease claims a key of the batch while the batch works on another (the
/// locks do not hold the other mode back): the batch's rows meet its row, the batch rolls
/// back, and each unit is delivered on its own: that key gets the owner's outcome, the other
/// ships.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_claimed_under_a_lease_meanwhile_rolls_the_batch_back() {
    let (schema, store) = shipments_schema().await;
    let once = Once::new(store);
    let pool = &schema.pool;
    let leased = Arc::new(tokio::sync::Notify::new());
    let runs = AtomicUsize::new(0);
    let units = vec![unit("m-0", "{}"), unit("m-1", "{}")];
    let (once_ref, leased, runs) = (&once, &leased, &runs);
    let work = |i: usize| {
        async move |tx: &mut PgConnection| {
            let key = ["m-0", "m-1"][i];
            ship(tx, key, "batch", runs).await?;
            if i == 1 && runs.load(SeqCst) == 2 {
                let other = tokio::spawn({
                    let (once, pool, leased) = (once_ref.clone(), pool.clone(), Arc::clone(leased));
                    async move {
                        let work = |_| async move {
                            leased.notify_one();
                            let mut tx = pool.begin().await?;
                            ship(&mut tx, "m-0", "leased", &AtomicUsize::new(0)).await?;
                            tx.commit().await?;
                            Ok::<_, sqlx::Error>("shipped by leased".to_owned())
                        };
                        once.run(unit("m-0", "{}"), work).await.unwrap()
                    }
                });
                leased.notified().await;
                drop(other);
            }
            Ok::<_, sqlx::Error>(format!("shipped by batch ({key})"))
        }
    };
    let answers = once.run_batch_in_transaction(units, pool, work).await;
    assert_eq!(
        shown(&answers),
        ["shipped by leased (true)", "shipped by batch (m-1) (false)"]
    );
    assert_eq!(shipped(pool, "m-0").await, ["leased"]);
    assert_eq!(shipped(pool, "m-1").await, ["batch"]);
    schema.drop().await;
}
