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
#[tokio::test]
async fn completions_go_out_together_and_each_key_gets_its_own_answer() {
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
#[tokio::test]
async fn claims_go_out_together_and_each_gets_its_own_answer() {
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
    let kind = |outcome: &ClaimOutcome| match outcome {
        ClaimOutcome::Acquired { .. } => "acquired",
        ClaimOutcome::Completed { .. } => "completed",
        ClaimOutcome::InFlight { .. } => "in_flight",
        ClaimOutcome::Mismatch => "mismatch",
        other => panic!("{other:?}"),
    };
    let kinds: Vec<&str> = outcomes.iter().map(kind).collect();
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
