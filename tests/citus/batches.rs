//! A batch's claims and completions grouped by shard: one statement for each group, each key
//! its own answer.

use super::*;

/// `count` keys starting with `prefix`, all on one shard.
pub(crate) async fn keys_of_one_shard(admin: &PgPool, prefix: &str, count: usize) -> Vec<String> {
    let candidates: Vec<String> = (0..count * 96).map(|n| format!("{prefix}-{n}")).collect();
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT k FROM unnest($1::text[]) WITH ORDINALITY AS c(k, n)
         WHERE get_shard_id_for_distribution_column('idempotency_keys', k)
             = get_shard_id_for_distribution_column('idempotency_keys', $1[1])
         ORDER BY n LIMIT $2",
    )
    .bind(&candidates)
    .bind(count as i64)
    .fetch_all(admin)
    .await
    .unwrap();
    assert_eq!(keys.len(), count, "too few keys of one shard");
    keys
}

/// How many transactions wrote the rows of `keys` as they are now (their `xmin`s).
pub(crate) async fn transactions_of(admin: &PgPool, keys: &[String]) -> i64 {
    sqlx::query_scalar(
        "SELECT count(DISTINCT xmin::text) FROM idempotency_keys
         WHERE scope = 'tenant' AND key = ANY($1)",
    )
    .bind(keys)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Claims and completions of keys of one shard, sent at once through a store with one lane of
/// each, on sessions where any multi-shard statement is an error: they go out together, as
/// statements of that one shard (counted at the destination: the rows of 40 fresh keys were
/// written by fewer than 40 transactions, on claiming and on completing), and each gets the
/// answer it gets alone: fresh keys, two claims of one key, a completed key, one in flight,
/// another request with a completed key's key, an expired key taken over, and the completion
/// of the owner it was taken from. Renewals and releases of one shard sent at once go call by
/// call, each held.
pub(crate) async fn citus_claims_and_completions_of_one_shard_share_a_statement_each_with_its_own_answer()
 {
    use tower_idempotency::conformance::claim_request as claim_of;
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    let routed = pool(&cluster.single_shard_url()).await;
    let store = PostgresStore::new(routed)
        .on_citus()
        .with_clock_skew(Duration::ZERO)
        .with_max_connections(4);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let keys = keys_of_one_shard(&admin, &prefix, 53).await;
    let (done, busy, gone, twice, fresh) = (&keys[0], &keys[1], &keys[2], &keys[3], &keys[5..45]);
    let long = Duration::from_secs(60);
    let answer = answer_done();
    let lease = acquire(&store, &claim_request(done, long)).await;
    store.complete(&lease, &answer, long).await.unwrap();
    acquire(&store, &claim_request(busy, long)).await;
    let stale = acquire(&store, &claim_request(gone, Duration::from_millis(100))).await;
    // Until the shard map is read, statements go to the coordinator, one by one.
    let worker = cluster.shard_of("idempotency_keys", done).await.1;
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut requests = vec![
        claim_request(done, long),
        claim_request(busy, long),
        claim_of("tenant", done, "another body", long),
        claim_request(gone, long),
        claim_request(twice, long),
        claim_request(twice, long),
    ];
    requests.extend(fresh.iter().map(|key| claim_request(key, long)));
    let claims: Vec<_> = requests
        .into_iter()
        .map(|request| {
            let store = store.clone();
            tokio::spawn(async move {
                let outcome = store.claim(&request).await.unwrap();
                (request, outcome)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for claim in claims {
        outcomes.push(claim.await.unwrap());
    }
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|(_, outcome)| support::outcome_kind(outcome))
        .collect();
    assert_eq!(
        kinds[..4],
        ["completed", "in_flight", "mismatch", "acquired"]
    );
    let mut two = [kinds[4], kinds[5]];
    two.sort();
    assert_eq!(
        two,
        ["acquired", "in_flight"],
        "one of two claims of one key"
    );
    assert!(kinds[6..].iter().all(|k| *k == "acquired"), "{kinds:?}");
    let claimed = transactions_of(&admin, fresh).await;
    assert!(
        claimed < 40,
        "40 fresh keys claimed in {claimed} transactions"
    );

    // Every acquired key completed at once, with the owner the expired key was taken from.
    let mut leases: Vec<_> = outcomes
        .iter()
        .filter_map(|(request, outcome)| match outcome {
            ClaimOutcome::Acquired { fence } => Some(request.lease_with_fence(*fence)),
            _ => None,
        })
        .collect();
    leases.push(stale);
    let completions: Vec<_> = leases
        .into_iter()
        .map(|lease| {
            let (store, answer) = (store.clone(), answer.clone());
            tokio::spawn(async move { store.complete(&lease, &answer, long).await.unwrap() })
        })
        .collect();
    let mut answers = Vec::new();
    for completion in completions {
        answers.push(completion.await.unwrap());
    }
    let stale = answers.pop().unwrap();
    assert_eq!(stale, Ownership::Lost, "the owner the key was taken from");
    assert!(answers.iter().all(|a| *a == Ownership::Held), "{answers:?}");
    let completed = transactions_of(&admin, fresh).await;
    assert!(
        completed < 40,
        "40 keys completed in {completed} transactions"
    );
    let rows: Vec<(String, Option<i16>)> = sqlx::query_as(
        "SELECT state, status FROM idempotency_keys WHERE scope = 'tenant' AND key = ANY($1)",
    )
    .bind(&keys)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(rows.len(), 45 - 1, "a row for each key claimed");
    let completed = rows
        .iter()
        .filter(|row| **row == ("completed".into(), Some(201)));
    // The fresh ones, the one taken over, one of the two claims of one key, the first done.
    assert_eq!(completed.count(), 40 + 3);

    // Renewals and releases of one shard sent at once: each its own, held.
    let mut spare = Vec::new();
    for key in &keys[45..] {
        spare.push(acquire(&store, &claim_request(key, long)).await);
    }
    let at_once = |release: bool| {
        let (spare, store) = (spare.clone(), store.clone());
        async move {
            let calls: Vec<_> = spare
                .into_iter()
                .map(|lease| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        match release {
                            true => store.release(&lease).await.unwrap(),
                            false => store.renew(&lease, long).await.unwrap(),
                        }
                    })
                })
                .collect();
            let mut answers = Vec::new();
            for call in calls {
                answers.push(call.await.unwrap());
            }
            answers
        }
    };
    assert_eq!(at_once(false).await, vec![Ownership::Held; 8], "renewals");
    assert_eq!(at_once(true).await, vec![Ownership::Held; 8], "releases");
}
