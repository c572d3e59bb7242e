//! The handler's transaction on the key's worker: a business table elsewhere committed by
//! two-phase commit, still once; and the completer finishing a key abandoned on Citus.

use super::*;

/// Commits of the two-phase protocol the coordinator has recorded and not yet cleaned up.
pub(crate) async fn two_phase_commits(admin: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_dist_transaction")
        .fetch_one(admin)
        .await
        .unwrap()
}

/// A handler whose business row is on another worker than its key: its transaction spans two
/// workers, and Citus commits it with two-phase commit. Still exactly once: a stale owner's transaction,
/// whose key another took over, is stopped by the fence and rolled back on both shards; the
/// owner's commits, on both. Prints what a fenced commit costs either way, side by side.
pub(crate) async fn citus_a_business_table_elsewhere_commits_by_two_phase_commit_still_once() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let store = PostgresStore::new(admin.clone()).on_citus();
    let lease = Duration::from_millis(100);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let fenced = async |request: &tower_idempotency::store::ClaimRequest| {
        let Ok(ClaimOutcome::Acquired { fence }) = store.claim(request).await else {
            panic!("not acquired");
        };
        let lease =
            tower_idempotency::store::Lease::new(request.record().clone(), request.owner(), fence);
        IdempotencyClaim::new(lease, Duration::from_secs(60))
    };
    // A ledger id whose shard is on the other worker than `key`'s.
    let elsewhere = async |key: &str| {
        let worker = cluster.shard_of("idempotency_keys", key).await.1;
        for n in 0.. {
            let id = format!("{key}-{n}");
            if cluster.shard_of("ledger", &id).await.1 != worker {
                return id;
            }
        }
        unreachable!()
    };
    // The business row (in `orders` with the key, or in `ledger` with the id given) and the
    // fence, in one transaction.
    let write = async |claim: &IdempotencyClaim, ledger_id: Option<&str>| {
        let key = claim.key().as_str();
        let (statement, second) = match ledger_id {
            Some(id) => ("INSERT INTO ledger (id, key) VALUES ($2, $1)", id),
            None => ("INSERT INTO orders (key, step) VALUES ($1, $2)", "paid"),
        };
        let mut tx = admin.begin().await.unwrap();
        sqlx::query(statement)
            .bind(key)
            .bind(second)
            .execute(&mut *tx)
            .await
            .unwrap();
        let outcome = claim.commit(&mut tx).await;
        if outcome.is_ok() {
            tx.commit().await.unwrap();
        }
        outcome
    };
    let request = |key: &str| {
        tower_idempotency::conformance::claim_request("t", &format!("{prefix}-{key}"), "b", lease)
    };

    // A stale owner and the one that took its key over, across two shards.
    let stale_request = request("taken");
    let stale = fenced(&stale_request).await;
    tokio::time::sleep(lease * 2).await;
    let owner = fenced(&request("taken")).await;
    let id = elsewhere(owner.key().as_str()).await;
    let before = two_phase_commits(&admin).await;
    assert!(
        write(&stale, Some(&id)).await.is_err(),
        "the stale owner fenced"
    );
    write(&owner, Some(&id)).await.unwrap();
    assert!(
        two_phase_commits(&admin).await > before,
        "the owner's commit was not two-phase"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE key = $1")
        .bind(owner.key().as_str())
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(rows, 1, "one ledger row for the key");

    // What a fenced commit costs, co-located or not, alternating; and co-located on the key's
    // worker (`pool_for`), where it commits with no coordinator.
    let mut took = [Duration::ZERO; 3];
    let commits = 100;
    for n in 0..commits {
        for (i, table) in ["orders", "ledger", "worker"].into_iter().enumerate() {
            let claim = fenced(&request(&format!("{table}-{n}"))).await;
            let started = std::time::Instant::now();
            match table {
                "ledger" => {
                    let id = elsewhere(claim.key().as_str()).await;
                    let started = std::time::Instant::now();
                    write(&claim, Some(&id)).await.unwrap();
                    took[i] += started.elapsed();
                    continue;
                }
                "worker" => pay_on_its_worker(&store, &claim).await,
                _ => write(&claim, None).await.unwrap(),
            }
            took[i] += started.elapsed();
        }
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(commits);
    println!(
        "citus: a fenced commit with the business row co-located {:.0} µs, on another worker \
         (two-phase commit) {:.0} µs: {:.2}x; co-located on the key's worker (pool_for) {:.0} \
         µs: {:.2}x; {commits} of each, alternating",
        per(took[0]),
        per(took[1]),
        per(took[1]) / per(took[0]),
        per(took[2]),
        per(took[2]) / per(took[0]),
    );
}

/// The completer on a distributed table: its scan over every shard finds a key abandoned after
/// its first step (the attempt gave up with 502, its progress kept), and resumes it through the
/// layer with the kept request; the handler runs its last step once.
pub(crate) async fn citus_the_completer_finishes_a_key_abandoned_after_its_first_step() {
    let cluster = cluster().await;
    let pool = pool(&cluster.url()).await;
    let store = PostgresStore::new(pool.clone()).on_citus();
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (pool, runs) = (pool.clone(), Arc::clone(&runs));
        move |claim: IdempotencyClaim, _: String| async move {
            let mut connection = pool.acquire().await.unwrap();
            let resumed = claim.recovery_point(&mut connection).await.unwrap();
            drop(connection);
            if resumed.is_none() {
                let mut tx = pool.begin().await.unwrap();
                claim
                    .advance(&mut tx, "placed", &serde_json::Value::Null)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                return StatusCode::BAD_GATEWAY;
            }
            runs.fetch_add(1, SeqCst);
            StatusCode::CREATED
        }
    };
    let layer = IdempotencyLayer::new(store.clone())
        .with_lease(Duration::from_millis(300))
        .with_kept_requests(KeptRequests::new());
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(layer.clone());
    let key = format!("{}-given-up", uuid::Uuid::new_v4().simple());
    let request = Request::post("/orders")
        .header("idempotency-key", key.as_str())
        .body(Body::from("order"))
        .unwrap();
    let given_up = app.clone().oneshot(request).await.unwrap();
    assert_eq!(given_up.status(), StatusCode::BAD_GATEWAY);

    let mut completer = layer.completer(app);
    let started = std::time::Instant::now();
    loop {
        let round = completer.run_once().await.unwrap();
        if round.finished > 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{round:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(runs.load(SeqCst), 1, "the last step ran once");
    let record = RecordKey::new(ANONYMOUS_SCOPE, key.as_str().try_into().unwrap());
    let info = store.inspect(&record).await.unwrap().unwrap();
    assert_eq!(info.state, RecordState::Completed);
}
