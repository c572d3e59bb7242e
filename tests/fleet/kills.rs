//! Instances killed (SIGKILL) mid-request, after the commit and between the steps of a payment, and clients that disconnect: the retry gets the payment, charged once.

use super::*;

pub async fn an_instance_killed_mid_request_frees_its_key_when_the_lease_ends() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let lease = Duration::from_millis(1000);
    let mut instances = fleet(2, &env(&redis, &schema, &provider, 1000, 1500)).await;
    let urls = urls(&instances);

    let doomed = tokio::spawn({
        let url = urls[0].clone();
        async move { post_json(&url, "killed-1", PAYMENT).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _ = instances[0].child.kill(); // SIGKILL, mid-request
    let killed_at = Instant::now();
    assert!(
        doomed.await.unwrap().is_err(),
        "the killed instance answered"
    );

    let tally = Tally::default();
    let answer = deliver(&urls[1..], 0, "killed-1", Duration::from_secs(10), &tally).await;
    let waited = killed_at.elapsed();
    assert!(!answer.replayed());
    // The retry was sent within the dead instance's lease: it waited for the lease to end.
    assert!(
        waited > Duration::from_millis(500),
        "the retry came after the lease: nothing was tested ({waited:?})"
    );
    // Claimable once the lease (renewed up to a third of it before the kill) runs out: about a
    // second here, never the retention.
    assert!(
        waited < lease * 2 + Duration::from_millis(1500) + Duration::from_secs(2),
        "took {waited:?}"
    );
    let answers = HashMap::from([(
        "killed-1".to_owned(),
        vec![answer.json()["id"].as_str().unwrap().to_owned()],
    )]);
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!(
        "instance-killed: key claimable again after the kill; answered {waited:?} after it \
         (lease {lease:?}, handler 1.5 s); {} x 409 meanwhile; executions {}, duplicate commits {}",
        Tally::get(&tally.conflicts),
        figures.charges,
        figures.duplicate_rows
    );
    drop(instances);
    schema.drop().await;
}

pub async fn a_client_that_disconnects_mid_request_gets_the_replay() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let instances = fleet(2, &env(&redis, &schema, &provider, 2000, 800)).await;
    let urls = urls(&instances);

    let impatient = tokio::spawn({
        let url = urls[0].clone();
        async move { post_json(&url, "hung-up-1", PAYMENT).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    impatient.abort(); // the connection closes mid-request

    let tally = Tally::default();
    let answer = deliver(&urls[1..], 0, "hung-up-1", Duration::from_secs(5), &tally).await;
    assert!(
        answer.replayed(),
        "the handler did not finish after the disconnect"
    );
    let answers = HashMap::from([(
        "hung-up-1".to_owned(),
        vec![answer.json()["id"].as_str().unwrap().to_owned()],
    )]);
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!(
        "client-disconnect: handler finished after the client left; retry replayed after {} x 409; \
         executions {}, duplicate commits {}",
        Tally::get(&tally.conflicts),
        figures.charges,
        figures.duplicate_rows
    );
    drop(instances);
    schema.drop().await;
}

pub async fn an_instance_killed_after_the_commit_leaves_the_payment_to_the_retry() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let lease = Duration::from_millis(1000);
    let mut env = env(&redis, &schema, &provider, 1000, 50);
    let survivor = Proc::example("payments", &env).await;
    env.push(("PAYMENTS_PAUSE_AFTER_COMMIT_MS", "5000".into()));
    let mut slowest = Duration::ZERO;
    let mut answers = HashMap::new();
    for k in 0..3 {
        let key = format!("committed-{k}");
        let mut doomed = Proc::example("payments", &env).await;
        let request = tokio::spawn({
            let (url, key) = (doomed.url("/payments"), key.clone());
            async move { post_json(&url, &key, PAYMENT).await }
        });
        // Killed once the payment is committed, before the answer leaves the instance.
        let committed: String = support::eventually(Duration::from_secs(5), "the commit", || {
            sqlx::query_scalar(
                "SELECT id FROM payments WHERE idempotency_key = $1 AND status = 'succeeded'",
            )
            .bind(&key)
            .fetch_one(&schema.pool)
        })
        .await;
        doomed.child.kill().unwrap();
        let killed_at = Instant::now();
        assert!(
            request.await.unwrap().is_err(),
            "the killed instance answered"
        );

        let tally = Tally::default();
        let url = [survivor.url("/payments")];
        let answer = deliver(&url, 0, &key, Duration::from_secs(10), &tally).await;
        let took = killed_at.elapsed();
        assert_eq!(
            answer.json()["id"],
            committed.as_str(),
            "{key}: the retry did not get the committed payment"
        );
        slowest = slowest.max(took);
        answers.insert(key, vec![committed]);
        drop(doomed);
    }
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!(
        "killed after the commit (lease {lease:?}): the retry on another instance got the \
         committed payment within {slowest:?} of the kill; {figures}"
    );
    assert!(slowest < lease + Duration::from_secs(2), "took {slowest:?}");
    drop(survivor);
    schema.drop().await;
}

/// The payment rows whose key is like `key` and whose status is like `status` (`%`: any).
async fn payment_rows(schema: &TestSchema, key: &str, status: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM payments WHERE idempotency_key LIKE $1 AND status LIKE $2",
    )
    .bind(key)
    .bind(status)
    .fetch_one(&schema.pool)
    .await
    .unwrap()
}

/// Kills an instance (SIGKILL) while a payment waits at `pause` (one of the example's pauses
/// between its steps) once `reached` says it got there, and retries on another instance: the
/// retry takes the key over when the lease ends, resumes from the last recovery point, and
/// answers with the one payment; the provider charged once. Returns how long after the kill
/// the answer came, and the provider's calls for the key.
async fn kill_between_steps(
    pause: &'static str,
    doomed_env: &[(&'static str, &str)],
    reached: impl AsyncFn(&TestSchema, &MockProvider, &str) -> bool,
) -> (Duration, u32) {
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let lease = Duration::from_millis(1000);
    let mut env = env(&redis, &schema, &provider, 1000, 0);
    // The retry resumes the payment here, not the completer.
    env.push(("PAYMENTS_COMPLETER_PERIOD_MS", "0".into()));
    let survivor = Proc::example("payments", &env).await;
    env.push((pause, "30000".into()));
    env.extend(
        doomed_env
            .iter()
            .map(|&(name, value)| (name, value.to_owned())),
    );
    let key = format!("resume-{}", uuid::Uuid::new_v4().simple());
    let mut doomed = Proc::example("payments", &env).await;
    let request = tokio::spawn({
        let (url, key) = (doomed.url("/payments"), key.clone());
        async move { post_json(&url, &key, PAYMENT).await }
    });
    let started = Instant::now();
    while !reached(&schema, &provider, &key).await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{pause}: never reached"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    doomed.child.kill().unwrap();
    let killed_at = Instant::now();
    assert!(
        request.await.unwrap().is_err(),
        "the killed instance answered"
    );

    let tally = Tally::default();
    let url = [survivor.url("/payments")];
    let answer = deliver(&url, 0, &key, Duration::from_secs(10), &tally).await;
    let took = killed_at.elapsed();
    let (id, status): (String, String) =
        sqlx::query_as("SELECT id, status FROM payments WHERE idempotency_key = $1")
            .bind(&key)
            .fetch_one(&schema.pool)
            .await
            .unwrap();
    assert_eq!(
        answer.json()["id"],
        id.as_str(),
        "the retry answered another payment"
    );
    assert_eq!(status, "succeeded");
    let answers = HashMap::from([(key.clone(), vec![id])]);
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    assert!(
        took < lease * 3 / 2 + Duration::from_secs(1),
        "{pause}: took {took:?}"
    );
    let calls = provider.calls()[&key];
    println!(
        "killed at {pause} (lease {lease:?}): answered {took:?} after the kill; {figures}; provider calls {calls}"
    );
    drop((survivor, doomed));
    schema.drop().await;
    (took, calls)
}

pub async fn an_instance_killed_after_recording_the_intent_is_resumed_by_the_retry() {
    let _serial = SERIAL.lock().await;
    let (_, calls) = kill_between_steps(
        "PAYMENTS_PAUSE_AFTER_INTENT_MS",
        &[],
        async |schema: &TestSchema, _: &MockProvider, key: &str| {
            payment_rows(schema, key, "%").await == 1
        },
    )
    .await;
    assert_eq!(calls, 1, "the killed instance never reached the provider");
}

pub async fn an_instance_killed_after_the_charge_is_resumed_and_charged_once() {
    let _serial = SERIAL.lock().await;
    let (_, calls) = kill_between_steps(
        "PAYMENTS_PAUSE_AFTER_CHARGE_MS",
        &[],
        async |_: &TestSchema, provider: &MockProvider, key: &str| {
            provider.calls().get(key) == Some(&1)
        },
    )
    .await;
    assert_eq!(
        calls, 2,
        "the retry called the provider again, with the same key"
    );
}

/// A last step that fences with plain `commit` (no answer stored with it), killed right after
/// it commits: the retry on another instance gets the payment the recovery hook rebuilds from
/// the payment row, about a lease and a half after the kill, instead of 24 h of outcome-unknown.
pub async fn an_instance_killed_after_a_plain_commit_is_answered_by_the_recovery_hook() {
    let _serial = SERIAL.lock().await;
    let plain = [("PAYMENTS_ANSWER_WITH_FENCE", "false")];
    let (_, calls) = kill_between_steps(
        "PAYMENTS_PAUSE_AFTER_COMMIT_MS",
        &plain,
        async |schema: &TestSchema, _: &MockProvider, key: &str| {
            payment_rows(schema, key, "succeeded").await == 1
        },
    )
    .await;
    assert_eq!(calls, 1, "the payment was not made again");
}

/// Many payments at once on an instance killed right after their plain commits (no answer
/// stored with the fence), then retried by two clients per key at once, one on each of two
/// other instances: with the recovery hook on, every retry gets the payment the hook rebuilds,
/// or a 409 that says to retry while the key is in flight; never `outcome-unknown`, which
/// would tell the client the payment's fate can never be known.
pub async fn payments_killed_after_plain_commits_are_never_answered_outcome_unknown() {
    const KEYS: usize = 20;
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let mut env = env(&redis, &schema, &provider, 1000, 0);
    env.push(("PAYMENTS_ANSWER_WITH_FENCE", "false".into()));
    // The retries ask the recovery hook here, not the completer.
    env.push(("PAYMENTS_COMPLETER_PERIOD_MS", "0".into()));
    let survivors = fleet(2, &env).await;
    env.push(("PAYMENTS_PAUSE_AFTER_COMMIT_MS", "30000".into()));
    let mut doomed = Proc::example("payments", &env).await;
    let prefix = format!("orphan-{}", uuid::Uuid::new_v4().simple());
    let requests: Vec<_> = (0..KEYS)
        .map(|k| {
            let (url, key) = (doomed.url("/payments"), format!("{prefix}-{k}"));
            tokio::spawn(async move { post_json(&url, &key, PAYMENT).await })
        })
        .collect();
    support::eventually(Duration::from_secs(10), "every commit", || async {
        let committed = payment_rows(&schema, &format!("{prefix}-%"), "succeeded").await;
        (committed == KEYS as i64).then_some(()).ok_or(committed)
    })
    .await;
    doomed.child.kill().unwrap();
    for request in requests {
        assert!(
            request.await.unwrap().is_err(),
            "the killed instance answered"
        );
    }

    // Clients as patient as the Stripe SDK's (80 s a request): they wait in the layer while
    // the key is in flight, and take the first answer it gives.
    let (urls, tally) = (urls(&survivors), Arc::new(Tally::default()));
    let retries: Vec<_> = (0..KEYS * 2)
        .map(|n| {
            let (urls, tally) = (Arc::clone(&urls), Arc::clone(&tally));
            let key = format!("{prefix}-{}", n / 2);
            tokio::spawn(async move {
                let answer = deliver(&urls, n, &key, Duration::from_secs(30), &tally).await;
                (key, answer.json()["id"].as_str().unwrap().to_owned())
            })
        })
        .collect();
    let mut answers: HashMap<String, Vec<String>> = HashMap::new();
    for retry in retries {
        let (key, id) = retry.await.unwrap();
        answers.entry(key).or_default().push(id);
    }
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!("killed after {KEYS} plain commits: {figures}; {tally}");
    assert_eq!(
        Tally::get(&tally.outcome_unknown),
        0,
        "a retry was told the outcome is unknown although the recovery hook rebuilds it: {tally}"
    );
    drop((survivors, doomed));
    schema.drop().await;
}

/// Payments whose instance is killed (SIGKILL) after the provider charged and before the last
/// step, and whose clients give up (nobody retries), are finished by the completers of the
/// three other instances: every payment ends `succeeded` with one charge, about a lease plus a
/// completer period after the kill, and a later retry gets that payment. Before the completer,
/// they stayed `pending` for the retention.
pub async fn payments_killed_after_the_charge_with_nobody_retrying_are_finished_by_the_completer() {
    let _serial = SERIAL.lock().await;
    abandoned_then_completed(
        "PAYMENTS_PAUSE_AFTER_CHARGE_MS",
        &[],
        async |schema: &TestSchema, provider: &MockProvider, prefix: &str| {
            let pending = payment_rows(schema, &format!("{prefix}-%"), "pending").await;
            let charged = provider
                .charges()
                .keys()
                .filter(|k| k.starts_with(prefix))
                .count();
            pending == ABANDONED as i64 && charged == ABANDONED
        },
        async |schema: &TestSchema, prefix: &str| {
            payment_rows(schema, &format!("{prefix}-%"), "succeeded").await == ABANDONED as i64
        },
    )
    .await;
}

/// Payments whose last step fenced with plain `commit` (no answer stored with it), killed right
/// after it, nobody retrying: the completers send the kept request through the route, whose
/// recovery hook rebuilds the answer from the payment row; every key ends completed with it,
/// and a later retry gets it.
pub async fn payments_killed_after_a_plain_commit_with_nobody_retrying_are_answered_by_the_completer()
 {
    let _serial = SERIAL.lock().await;
    abandoned_then_completed(
        "PAYMENTS_PAUSE_AFTER_COMMIT_MS",
        &[("PAYMENTS_ANSWER_WITH_FENCE", "false")],
        async |schema: &TestSchema, _: &MockProvider, prefix: &str| {
            payment_rows(schema, &format!("{prefix}-%"), "succeeded").await == ABANDONED as i64
        },
        async |schema: &TestSchema, prefix: &str| {
            let answered: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 AND state = 'completed'",
            )
            .bind(format!("{prefix}-%"))
            .fetch_one(&schema.pool)
            .await
            .unwrap();
            answered == ABANDONED as i64
        },
    )
    .await;
}

/// How many payments [`abandoned_then_completed`] abandons.
const ABANDONED: usize = 12;

/// Sends [`ABANDONED`] payments to an instance that pauses at `pause`, kills it (SIGKILL) once
/// `reached` says every payment got there, never retries, and waits for `finished` to say the
/// completers of three other instances finished them (about a lease and a period after the
/// kill); then checks a later retry gets each payment, one row and one charge each, and that
/// the completers' metrics counted them.
async fn abandoned_then_completed(
    pause: &'static str,
    doomed_env: &[(&'static str, &str)],
    reached: impl AsyncFn(&TestSchema, &MockProvider, &str) -> bool,
    finished: impl AsyncFn(&TestSchema, &str) -> bool,
) {
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let (lease, period) = (Duration::from_millis(1000), Duration::from_millis(500));
    let mut env = env(&redis, &schema, &provider, 1000, 0);
    env.push((
        "PAYMENTS_COMPLETER_PERIOD_MS",
        period.as_millis().to_string(),
    ));
    env.extend(
        doomed_env
            .iter()
            .map(|&(name, value)| (name, value.to_owned())),
    );
    let survivors = fleet(3, &env).await;
    env.push((pause, "30000".into()));
    let mut doomed = Proc::example("payments", &env).await;
    let prefix = format!("abandoned-{}", uuid::Uuid::new_v4().simple());
    let keys: Vec<String> = (0..ABANDONED).map(|k| format!("{prefix}-{k}")).collect();
    let requests: Vec<_> = keys
        .iter()
        .map(|key| {
            let (url, key) = (doomed.url("/payments"), key.clone());
            tokio::spawn(async move { post_json(&url, &key, PAYMENT).await })
        })
        .collect();
    support::eventually(Duration::from_secs(10), pause, || async {
        reached(&schema, &provider, &prefix)
            .await
            .then_some(())
            .ok_or("not yet")
    })
    .await;
    doomed.child.kill().unwrap();
    let killed_at = Instant::now();
    for request in requests {
        assert!(
            request.await.unwrap().is_err(),
            "the killed instance answered"
        );
    }

    // Nobody retries: the completers finish them.
    support::eventually(
        Duration::from_secs(20),
        "finished by the completers",
        || async {
            finished(&schema, &prefix)
                .await
                .then_some(())
                .ok_or("not yet")
        },
    )
    .await;
    let took = killed_at.elapsed();
    // A later retry gets the payment the completer finished.
    let (urls, tally) = (urls(&survivors), Tally::default());
    let mut answers: HashMap<String, Vec<String>> = HashMap::new();
    for (n, key) in keys.iter().enumerate() {
        let answer = deliver(&urls, n, key, Duration::from_secs(10), &tally).await;
        assert!(answer.replayed(), "{key}: not the completer's answer");
        let id = answer.json()["id"].as_str().unwrap().to_owned();
        answers.entry(key.clone()).or_default().push(id);
    }
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    let counted = completers_finished(&survivors).await;
    assert!(
        counted >= ABANDONED as f64,
        "the completers counted {counted} finished"
    );
    println!(
        "killed at {pause}, nobody retrying: all {ABANDONED} finished {took:?} after the kill \
         (lease {lease:?}, completer period {period:?}); {figures}"
    );
    assert!(
        took < lease + period * 2 + Duration::from_secs(3),
        "finished {took:?} after the kill"
    );
    drop((survivors, doomed));
    schema.drop().await;
}

/// `idempotency_completer_finished_total`, summed over `instances`' `/metrics`.
async fn completers_finished(instances: &[Proc]) -> f64 {
    let mut finished = 0.0;
    for instance in instances {
        let scraped = support::send(http::Method::GET, &instance.url("/metrics"), &[], "")
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&scraped.body).into_owned();
        finished += text
            .lines()
            .find_map(|line| line.strip_prefix("idempotency_completer_finished_total "))
            .and_then(|value| value.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no completer metrics in:\n{text}"));
    }
    finished
}

/// A provider that hangs for longer than the lease while duplicates arrive: the payment holds
/// no row lock and no open transaction meanwhile (the call runs between two steps), its lease
/// stays renewed, and the duplicates are told it is in flight, then get the payment.
pub async fn a_hanging_provider_holds_no_lock_and_duplicates_are_told_it_is_in_flight() {
    let _serial = SERIAL.lock().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::with_faults(
        Duration::ZERO,
        vec![support::ProviderFault::Slow(Duration::from_secs(4))],
    )
    .await;
    let application = format!("hang-{}", uuid::Uuid::new_v4().simple());
    let database = format!(
        "{}&application_name={application}",
        url_in_schema(&database_url(), &schema.name)
    );
    let env = [
        ("DATABASE_URL", database),
        ("PROVIDER_URL", provider.url.clone()),
        ("IDEMPOTENCY_LEASE_MS", "1000".into()),
        ("IDEMPOTENCY_WAIT_MS", "100".into()),
    ];
    let instances = [
        Proc::example("payments", &env).await,
        Proc::example("payments", &env).await,
    ];
    let key = format!("hang-{}", uuid::Uuid::new_v4().simple());
    let first = tokio::spawn({
        let (url, key) = (instances[0].url("/payments"), key.clone());
        async move { post_json(&url, &key, PAYMENT).await }
    });
    while !provider.calls().contains_key(&key) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // For over twice the lease into the hang: duplicates, and what the app's sessions hold.
    let mut in_flight = 0;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let duplicate = post_json(&instances[1].url("/payments"), &key, PAYMENT)
            .await
            .unwrap();
        assert_eq!(
            duplicate.status,
            StatusCode::CONFLICT,
            "{:?}",
            duplicate.body
        );
        assert!(duplicate.headers.contains_key("retry-after"));
        in_flight += 1;
        // A lock held across the call belongs to a session waiting between statements; a
        // renewal's own UPDATE, running at the moment of the sample, holds its transaction id
        // only while it runs, so sessions running a statement are not counted.
        let (open, locks): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = $1 AND state LIKE 'idle in transaction%'),
                    (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                     WHERE a.application_name = $1 AND a.state <> 'active'
                       AND l.locktype IN ('tuple', 'transactionid'))",
        )
        .bind(&application)
        .fetch_one(&schema.pool)
        .await
        .unwrap();
        assert_eq!(
            (open, locks),
            (0, 0),
            "a transaction or row lock held across the provider call"
        );
    }
    let paid = first.await.unwrap().unwrap();
    assert_eq!(paid.status, StatusCode::CREATED);
    let replay = post_json(&instances[1].url("/payments"), &key, PAYMENT)
        .await
        .unwrap();
    assert!(replay.replayed());
    assert_eq!(replay.json()["id"], paid.json()["id"]);
    assert_eq!(provider.charges()[&key], 1);
    println!(
        "provider hung 4 s (lease 1 s): {in_flight} duplicates answered 409 in flight, no lock or transaction held, one charge"
    );
    drop(instances);
    schema.drop().await;
}
