//! Completions in batches: those that queue while earlier ones are on their way go out as one
//! statement, and each key still gets its own answer, the one a single completion gives.

use super::*;

/// A writer that keeps what the `fmt` subscriber writes, to read the store's debug events.
#[derive(Clone, Default)]
struct Written(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A subscriber that keeps the store's debug events, for the test's thread (a current-thread
/// runtime: the lanes run on it too).
fn debug_events() -> (Written, tracing::subscriber::DefaultGuard) {
    let written = Written::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("tower_idempotency=debug")
        .with_writer({
            let written = written.clone();
            move || written.clone()
        })
        .with_ansi(false)
        .finish();
    support::scoped_subscribers_hear_every_callsite();
    (
        written.clone(),
        tracing::subscriber::set_default(subscriber),
    )
}

impl Written {
    /// How many events said `what`.
    fn count(&self, what: &str) -> usize {
        let log = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        log.lines().filter(|line| line.contains(what)).count()
    }
}

/// 120 keys completed at once through a store with one lane: 100 held by their owner, 20 taken
/// over by another owner meanwhile, and one of the held keys' rows locked by a transaction. The
/// 99 free held keys complete and the 20 taken over are lost while the lock is held (one lock
/// never holds up the batch); the locked one completes once it is released; every row is as a
/// single completion would have left it; and the completions went out in batches.
pub(crate) async fn completions_go_out_together_and_each_key_gets_its_own_answer() {
    let (written, _guard) = debug_events();
    let schema = TestSchema::new().await;
    // 4 connections: one lane, so that completions queue behind each other.
    let store = PostgresStore::new(schema.pool.clone()).with_max_connections(4);
    let mut leases = Vec::new();
    for n in 0..20 {
        let stale = claim_request(&format!("k-{n}"), Duration::from_millis(200));
        leases.push(acquire(&store, &stale).await);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    for n in 0..20 {
        acquire(&store, &claim_request(&format!("k-{n}"), LONG)).await;
    }
    for n in 20..120 {
        leases.push(acquire(&store, &claim_request(&format!("k-{n}"), LONG)).await);
    }
    let mut locker = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'k-119' FOR UPDATE")
        .execute(&mut *locker)
        .await
        .unwrap();

    let mut answers: Vec<_> = leases
        .into_iter()
        .map(|lease| {
            let store = store.clone();
            tokio::spawn(async move {
                let stored = response(StatusCode::CREATED);
                let answer = store.complete(&lease, &stored, LONG).await.unwrap();
                (lease.record().key().to_string(), answer)
            })
        })
        .collect();
    let locked = answers.pop().unwrap();
    let mut held = 0;
    for answer in answers {
        let (key, answer) = answer.await.unwrap();
        let n: usize = key.trim_start_matches("k-").parse().unwrap();
        let expected = if n < 20 {
            Ownership::Lost
        } else {
            Ownership::Held
        };
        assert_eq!(answer, expected, "{key}");
        held += usize::from(answer == Ownership::Held);
    }
    assert_eq!(held, 99);
    assert!(
        !locked.is_finished(),
        "the locked key completed under its lock"
    );
    locker.commit().await.unwrap();
    assert_eq!(locked.await.unwrap().1, Ownership::Held);

    // At the destination: the held keys completed with their answer, the others untouched.
    let rows: Vec<(String, String, Option<i16>)> =
        sqlx::query_as("SELECT key, state, status FROM idempotency_keys ORDER BY key")
            .fetch_all(&schema.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), 120);
    for (key, state, status) in rows {
        let n: usize = key.trim_start_matches("k-").parse().unwrap();
        if n < 20 {
            assert_eq!((state.as_str(), status), ("in_flight", None), "{key}");
        } else {
            assert_eq!((state.as_str(), status), ("completed", Some(201)), "{key}");
        }
    }
    let together = written.count("completions sent together");
    assert!(together >= 1, "no completions went out together");
    schema.drop().await;
}

/// Claims of every kind sent at once through one lane: fresh keys, two claims of one fresh
/// key, a completed key, a key in flight, another request with a completed key's key, and an
/// expired key. Each gets the answer a claim sent alone gets, and they went out in batches.
pub(crate) async fn claims_go_out_together_and_each_gets_its_own_answer() {
    use tower_idempotency::conformance::claim_request as claim_of;
    let (written, _guard) = debug_events();
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone()).with_max_connections(4);
    let done = acquire(&store, &claim_request("k-done", LONG)).await;
    let stored = response(StatusCode::CREATED);
    store.complete(&done, &stored, LONG).await.unwrap();
    acquire(&store, &claim_request("k-busy", LONG)).await;
    acquire(&store, &claim_request("k-gone", Duration::from_millis(100))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut requests = vec![
        claim_request("k-done", LONG),
        claim_request("k-busy", LONG),
        claim_of("tenant", "k-done", "another body", LONG),
        claim_request("k-gone", LONG),
        claim_request("k-twice", LONG),
        claim_request("k-twice", LONG),
    ];
    requests.extend((0..60).map(|n| claim_request(&format!("k-fresh-{n}"), LONG)));
    let store = Arc::new(store);
    let claims: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.claim(&request).await.unwrap() })
        })
        .collect();
    let mut outcomes = Vec::new();
    for claim in claims {
        outcomes.push(claim.await.unwrap());
    }
    let kinds: Vec<&str> = outcomes.iter().map(support::outcome_kind).collect();
    assert_eq!(
        kinds[..4],
        ["completed", "in_flight", "mismatch", "acquired"],
        "{outcomes:?}"
    );
    let mut twice = [kinds[4], kinds[5]];
    twice.sort();
    assert_eq!(
        twice,
        ["acquired", "in_flight"],
        "one of two claims of one key"
    );
    assert!(kinds[6..].iter().all(|k| *k == "acquired"), "{kinds:?}");
    match &outcomes[0] {
        ClaimOutcome::Completed { response, .. } => assert_eq!(response.status(), 201),
        other => panic!("{other:?}"),
    }
    // At the destination: one row per key, each fresh one in flight.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(rows, 4 + 60);
    assert!(
        written.count("claims sent together") >= 1,
        "no claims went out together"
    );
    schema.drop().await;
}

/// Keys claimed for `lease` by one owner each (`<prefix>-<n>`); the keys of `taken` are then
/// taken over by another owner once that lease ran out, so their first leases are stale.
async fn held_and_taken(
    store: &PostgresStore,
    prefix: &str,
    count: usize,
    taken: std::ops::Range<usize>,
) -> Vec<Lease> {
    let short = Duration::from_millis(200);
    let mut leases = Vec::new();
    for n in 0..count {
        let lease = if taken.contains(&n) { short } else { LONG };
        leases.push(acquire(store, &claim_request(&format!("{prefix}-{n}"), lease)).await);
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    for n in taken {
        acquire(store, &claim_request(&format!("{prefix}-{n}"), LONG)).await;
    }
    leases
}

/// Locks the row of `key` in a transaction of its own, until it ends.
async fn lock_row(schema: &TestSchema, key: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut locker = schema.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
        .bind(key)
        .execute(&mut *locker)
        .await
        .unwrap();
    locker
}

/// Runs `call` for every lease at once; the answers by key.
async fn at_once<F, Fut>(leases: Vec<Lease>, call: F) -> Vec<(usize, Ownership)>
where
    F: Fn(Lease) -> Fut,
    Fut: Future<Output = Result<Ownership, tower_idempotency::store::StoreError>> + Send + 'static,
{
    let calls: Vec<_> = leases
        .into_iter()
        .map(|lease| {
            let n = lease.record().key().as_str().rsplit('-').next().unwrap();
            let n: usize = n.parse().unwrap();
            let call = call(lease);
            tokio::spawn(async move { (n, call.await.unwrap()) })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    answers
}

/// 60 renewals at once through one lane: 49 held by their owner, 10 taken over by another
/// owner, one whose row another transaction holds. Each gets the answer a renewal alone gets
/// (held, lost, busy: a renewal never waits on a lock), the held leases are renewed at the
/// destination, and the renewals went out in batches.
pub(crate) async fn renewals_go_out_together_and_each_gets_its_own_answer() {
    let (written, _guard) = debug_events();
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone()).with_max_connections(4);
    let leases = held_and_taken(&store, "r", 60, 0..10).await;
    let locker = lock_row(&schema, "r-59").await;
    let renewed = Duration::from_secs(600);
    let answers = at_once(leases, |lease| {
        let store = store.clone();
        async move { store.renew(&lease, renewed).await }
    })
    .await;
    for (n, answer) in answers {
        let expected = match n {
            0..10 => Ownership::Lost,
            59 => Ownership::Busy,
            _ => Ownership::Held,
        };
        assert_eq!(answer, expected, "r-{n}");
    }
    locker.rollback().await.unwrap();
    // At the destination: the 49 held leases run ten minutes from now, the others do not.
    let renewed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE lease_until > now() + interval '5 minutes'",
    )
    .fetch_one(&schema.pool)
    .await
    .unwrap();
    assert_eq!(renewed, 49);
    assert!(
        written.count("renewals sent together") >= 1,
        "no renewals went out together"
    );
    schema.drop().await;
}

/// 60 releases at once through one lane: 40 free keys of their owner, 10 taken over by another
/// owner, 5 committed through the fence, 4 with a recovery point, and one whose row another
/// transaction holds. The free keys are deleted, the taken ones are lost and kept, the
/// committed ones answer committed and are kept, those with progress keep their row with the
/// lease ended; the locked one waits for its lock without holding up the others; and the
/// releases went out in batches.
pub(crate) async fn releases_go_out_together_and_each_gets_its_own_answer() {
    let (written, _guard) = debug_events();
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone()).with_max_connections(4);
    let leases = held_and_taken(&store, "x", 60, 0..10).await;
    for (n, lease) in leases.iter().enumerate().take(19).skip(10) {
        let claim = IdempotencyClaim::new(lease.clone(), LONG);
        let mut tx = schema.pool.begin().await.unwrap();
        if n < 15 {
            claim.commit(&mut tx).await.unwrap();
        } else {
            let payload = serde_json::json!({"step": 1});
            claim.advance(&mut tx, "charged", &payload).await.unwrap();
        }
        tx.commit().await.unwrap();
    }
    let locker = lock_row(&schema, "x-59").await;
    let store = Arc::new(store);
    let mut leases = leases;
    let locked = leases.pop().unwrap();
    let locked = {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.release(&locked).await.unwrap() })
    };
    let answers = at_once(leases, |lease| {
        let store = Arc::clone(&store);
        async move { store.release(&lease).await }
    })
    .await;
    for (n, answer) in answers {
        let expected = match n {
            0..10 => Ownership::Lost,
            10..15 => Ownership::Committed,
            _ => Ownership::Held,
        };
        assert_eq!(answer, expected, "x-{n}");
    }
    assert!(
        !locked.is_finished(),
        "the locked key released under its lock"
    );
    locker.commit().await.unwrap();
    assert_eq!(locked.await.unwrap(), Ownership::Held);

    // At the destination: the taken, committed and resumable keys are left, nothing else.
    let rows: Vec<(String, String, bool)> =
        sqlx::query_as("SELECT key, state, lease_until > now() FROM idempotency_keys ORDER BY key")
            .fetch_all(&schema.pool)
            .await
            .unwrap();
    let left: Vec<(usize, &str, bool)> = rows
        .iter()
        .map(|(key, state, leased)| (key[2..].parse().unwrap(), state.as_str(), *leased))
        .collect();
    let mut expected: Vec<(usize, &str, bool)> = (0..10).map(|n| (n, "in_flight", true)).collect();
    expected.extend((10..15).map(|n| (n, "committed", true)));
    expected.extend((15..19).map(|n| (n, "in_flight", false)));
    let mut left = left;
    left.sort();
    assert_eq!(left, expected);
    assert!(
        written.count("releases sent together") >= 1,
        "no releases went out together"
    );
    schema.drop().await;
}

/// `with_batch_window`: claims that arrive one at a time, 10 ms apart, each finding a lane free,
/// go out alone without a window (a transaction each) and together within one (one
/// transaction for all, counted at the destination by the rows' `xmin`), the first answered
/// only once the window is over.
pub(crate) async fn claims_within_the_batch_window_share_one_transaction() {
    let schema = TestSchema::new().await;
    for (window, transactions) in [(Duration::ZERO, 8), (Duration::from_millis(300), 1)] {
        let store = PostgresStore::new(schema.pool.clone())
            .with_max_connections(4)
            .with_batch_window(window);
        let prefix = format!("window-{}", window.as_millis());
        let started = std::time::Instant::now();
        let mut claims = Vec::new();
        for n in 0..8 {
            let (store, request) = (store.clone(), claim_request(&format!("{prefix}-{n}"), LONG));
            claims.push(tokio::spawn(async move {
                let outcome = store.claim(&request).await.unwrap();
                (outcome, started.elapsed())
            }));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for claim in claims {
            let (outcome, answered) = claim.await.unwrap();
            assert!(
                matches!(outcome, ClaimOutcome::Acquired { .. }),
                "{outcome:?}"
            );
            assert!(
                answered >= window,
                "answered after {answered:?}, window {window:?}"
            );
        }
        let seen: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT xmin::text) FROM idempotency_keys WHERE key LIKE $1",
        )
        .bind(format!("{prefix}-%"))
        .fetch_one(&schema.pool)
        .await
        .unwrap();
        assert_eq!(
            seen, transactions,
            "transactions for 8 claims, window {window:?}"
        );
    }
    schema.drop().await;
}

/// A full batch does not wait out the window: four claims at once through a store of batches
/// of four and a window of 4 s are answered long before it ends, in one transaction.
pub(crate) async fn a_full_batch_goes_before_its_window_ends() {
    let schema = TestSchema::new().await;
    let store = PostgresStore::new(schema.pool.clone())
        .with_max_connections(4)
        .with_timeout(Duration::from_secs(10))
        .with_max_batch(4)
        .with_batch_window(Duration::from_secs(4));
    let started = std::time::Instant::now();
    let claims: Vec<_> = (0..4)
        .map(|n| {
            let (store, request) = (store.clone(), claim_request(&format!("full-{n}"), LONG));
            tokio::spawn(async move { store.claim(&request).await.unwrap() })
        })
        .collect();
    for claim in claims {
        let outcome = claim.await.unwrap();
        assert!(
            matches!(outcome, ClaimOutcome::Acquired { .. }),
            "{outcome:?}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "four claims took {:?} with a full batch",
        started.elapsed()
    );
    let transactions: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT xmin::text) FROM idempotency_keys")
            .fetch_one(&schema.pool)
            .await
            .unwrap();
    assert_eq!(transactions, 1);
    schema.drop().await;
}
