//! A duplicate on another instance is answered the moment the first request's answer exists,
//! woken by the store rather than polling it: two payments instances, the first request of each
//! key sent to one, its duplicate to the other while it runs. Counted where it happens: the
//! answers' times at the client, the commands Redis ran (`INFO commandstats`) and the
//! transactions Postgres ran (read from the statement log of a server of the test's own), each
//! duplicate's share being what a run with duplicates cost more than the same run without.

use super::*;

/// How many keys each run pays.
const KEYS: usize = 20;

/// When the duplicate is sent, after the first request.
const DUPLICATE_AFTER: Duration = Duration::from_millis(150);

/// Redis in front of Postgres, handlers of 1.5 s and of 4 s: each duplicate answered with the
/// first's payment, at most 10 store calls each (commands and transactions), no more Redis
/// commands with the longer handler, and at most its one confirming Postgres claim.
pub async fn a_duplicate_on_another_instance_is_woken_by_redis_not_polling() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let postgres = counted_postgres().await;
    let short = wakeups(Some(&redis), &postgres, 1_500).await;
    let long = wakeups(Some(&redis), &postgres, 4_000).await;
    for figures in [&short, &long] {
        println!("Redis in front of Postgres: {figures}");
        assert!(
            figures.calls() <= 10.0,
            "a duplicate costs the stores {:.1} calls: {figures}",
            figures.calls()
        );
    }
    // Redis counts exactly, and a waiting duplicate's commands do not grow with the wait. Its
    // Postgres share is the authority confirming the front's "in flight", a claim that shares
    // a statement with whichever claims are pending at the same moment: 0 to 1 transaction a
    // duplicate from run to run, never more, however long the wait (polling cost 8.3).
    assert!(
        long.redis <= short.redis + 0.5,
        "a longer wait costs more Redis commands: {long} against {short}"
    );
    for figures in [&short, &long] {
        assert!(
            figures.postgres <= 1.5,
            "a duplicate costs Postgres more than its confirmation: {figures}"
        );
    }
}

/// Postgres alone: the same, with `LISTEN`/`NOTIFY`.
pub async fn a_duplicate_on_another_instance_is_woken_by_postgres_not_polling() {
    let _serial = SERIAL.lock().await;
    let postgres = counted_postgres().await;
    let figures = wakeups(None, &postgres, 1_500).await;
    println!("Postgres alone: {figures}");
    assert!(
        figures.calls() <= 10.0,
        "a duplicate costs Postgres {:.1} transactions: {figures}",
        figures.calls()
    );
}

/// How many duplicates of one key the herd sends, over how many instances.
const HERD: usize = 200;
const HERD_INSTANCES: usize = 4;

/// A herd: one key's first request to one of four instances (Redis in front of Postgres), and
/// 200 duplicates of it spread over all four while it runs. Every duplicate is answered with the
/// one payment (one row, one charge at the provider); mid-wait each process listens on one
/// subscribed connection with one channel (not one a waiting request, nor one a key); each
/// duplicate costs at most 10 store calls (Redis commands and Postgres transactions).
pub async fn a_herd_of_duplicates_over_four_instances_listens_once_a_process() {
    let _serial = SERIAL.lock().await;
    let (redis, postgres) = (RedisServer::start().await, counted_postgres().await);
    let schema = TestSchema::on(&postgres.url()).await;
    let provider = MockProvider::start(Duration::from_millis(1)).await;
    let env = [
        ("DATABASE_URL", url_in_schema(&postgres.url(), &schema.name)),
        ("REDIS_URL", redis.url()),
        ("PROVIDER_URL", provider.url.clone()),
        ("PAYMENTS_WORK_MS", "1500".into()),
        ("PAYMENTS_COMPLETER_PERIOD_MS", "3600000".into()),
    ];
    let instances = fleet(HERD_INSTANCES, &env).await;
    let urls = urls(&instances);
    // Every instance's connections made (a first request and a duplicate each), then one key
    // alone: what a key costs without duplicates.
    for (i, url) in urls.iter().enumerate() {
        let pair = Arc::new(vec![url.clone(), urls[(i + 1) % urls.len()].clone()]);
        run(&pair, &format!("warm-{i}"), 1, true).await;
    }
    let (redis_before, postgres_before) = counts(Some(&redis), &postgres).await;
    run(&urls, "alone", 1, false).await;
    let (redis_alone, postgres_alone) = counts(Some(&redis), &postgres).await;
    let first = post_json(&urls[0], "herd", PAYMENT);
    let duplicates = (0..HERD).map(|i| {
        let url = urls[i % urls.len()].clone();
        async move {
            // Spread over the first 500 ms of the first's 1.5 s.
            tokio::time::sleep(Duration::from_millis(100 + (i as u64 * 400) / HERD as u64)).await;
            post_json(&url, "herd", PAYMENT).await.unwrap()
        }
    });
    let listening = async {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let subscribers = redis.subscribers().await;
        subscribers
            .into_iter()
            .map(|(_, channels)| channels)
            .collect::<Vec<_>>()
    };
    let (first, answers, listening) =
        tokio::join!(first, futures_util::future::join_all(duplicates), listening);
    let first = first.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        assert!(answer.replayed(), "a duplicate ran: {answer:?}");
        assert_eq!(answer.body, first.body, "two answers");
    }
    let (redis_herd, postgres_herd) = counts(Some(&redis), &postgres).await;
    let share = |before: u64, alone: u64, herd: u64| {
        ((herd - alone) as f64 - (alone - before) as f64) / HERD as f64
    };
    let (per_redis, per_postgres) = (
        share(redis_before, redis_alone, redis_herd),
        share(postgres_before, postgres_alone, postgres_herd),
    );
    let pool = pool_in_schema(&postgres.url(), &schema.name).await;
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE idempotency_key = 'herd'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let charges = provider.charges();
    println!(
        "a herd of {HERD} duplicates over {HERD_INSTANCES} instances: {} subscribed \
         connections ({:?} channels each), {per_redis:.1} Redis commands and {per_postgres:.1} \
         Postgres transactions a duplicate",
        listening.len(),
        listening
    );
    assert_eq!(rows, 1, "payment rows for the herd's key");
    assert_eq!(charges["herd"], 1, "charges for the herd's key");
    assert_eq!(
        charges.len(),
        HERD_INSTANCES + 2,
        "keys charged: {charges:?}"
    );
    assert_eq!(
        listening,
        vec![1; HERD_INSTANCES],
        "subscribed connections mid-wait"
    );
    assert!(
        per_redis + per_postgres <= 10.0,
        "{per_redis:.1} + {per_postgres:.1} calls a duplicate"
    );
    pool.close().await;
    drop(instances);
    schema.drop().await;
}

/// What a run measured.
struct Figures {
    work: Duration,
    /// How long after the first request's answer each duplicate's came, sorted.
    lags: Vec<Duration>,
    /// Per duplicate: Redis commands, Postgres transactions.
    redis: f64,
    postgres: f64,
}

impl Figures {
    fn calls(&self) -> f64 {
        self.redis + self.postgres
    }

    fn lag(&self, percentile: usize) -> Duration {
        self.lags[(self.lags.len() - 1) * percentile / 100]
    }
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{KEYS} keys, handler {:?}, duplicate on the other instance {DUPLICATE_AFTER:?} \
             after the first: answered {:.1?} (p50) and {:.1?} (p90) after the first, at \
             {:.1} Redis commands and {:.1} Postgres transactions a duplicate",
            self.work,
            self.lag(50),
            self.lag(90),
            self.redis,
            self.postgres
        )
    }
}

/// Two instances on Redis (`redis`) in front of `postgres`, or on `postgres` alone, with
/// handlers of `work_ms`: a run of first requests alone, then a run with a duplicate each.
async fn wakeups(redis: Option<&RedisServer>, postgres: &PgCluster, work_ms: u64) -> Figures {
    let schema = TestSchema::on(&postgres.url()).await;
    let provider = MockProvider::start(Duration::from_millis(1)).await;
    let mut env = vec![
        ("DATABASE_URL", url_in_schema(&postgres.url(), &schema.name)),
        ("PROVIDER_URL", provider.url.clone()),
        ("PAYMENTS_WORK_MS", work_ms.to_string()),
        // No completer rounds while counting.
        ("PAYMENTS_COMPLETER_PERIOD_MS", "3600000".into()),
    ];
    if let Some(redis) = redis {
        env.push(("REDIS_URL", redis.url()));
    }
    let instances = fleet(2, &env).await;
    let urls = urls(&instances);
    // Each instance's connections (as many as a run opens), its listener's included, made
    // before counting: a connection's start is a transaction of the server's too.
    // Keys of this run's own: the Redis outlives it, and keeps the keys it completed.
    let run_of = |name: &str| format!("{name}-{work_ms}");
    run(&urls, &run_of("warm"), KEYS, true).await;
    let (redis_before, postgres_before) = counts(redis, postgres).await;
    run(&urls, &run_of("alone"), KEYS, false).await;
    let (redis_alone, postgres_alone) = counts(redis, postgres).await;
    let mut lags = run(&urls, &run_of("paired"), KEYS, true).await;
    let (redis_paired, postgres_paired) = counts(redis, postgres).await;
    lags.sort();
    let share = |before: u64, alone: u64, paired: u64| {
        ((paired - alone) as f64 - (alone - before) as f64) / KEYS as f64
    };
    drop(instances);
    schema.drop().await;
    Figures {
        work: Duration::from_millis(work_ms),
        lags,
        redis: share(redis_before, redis_alone, redis_paired),
        postgres: share(postgres_before, postgres_alone, postgres_paired),
    }
}

/// `keys` first requests to the first instance, all at once, and, with `duplicates`, each
/// one's duplicate to the second [`DUPLICATE_AFTER`] later: how long after its first each
/// duplicate was answered (nothing without duplicates). Every answer is the key's one payment.
async fn run(
    urls: &Arc<Vec<String>>,
    prefix: &str,
    keys: usize,
    duplicates: bool,
) -> Vec<Duration> {
    let pairs = (0..keys).map(|k| {
        let key = format!("{prefix}-{k}");
        let (first_url, second_url) = (urls[0].clone(), urls[1].clone());
        async move {
            let first = async {
                let answer = post_json(&first_url, &key, PAYMENT).await.unwrap();
                (answer, Instant::now())
            };
            let second = async {
                if !duplicates {
                    return None;
                }
                tokio::time::sleep(DUPLICATE_AFTER).await;
                let answer = post_json(&second_url, &key, PAYMENT).await.unwrap();
                Some((answer, Instant::now()))
            };
            let ((first, at), second) = tokio::join!(first, second);
            assert_eq!(first.status, StatusCode::CREATED, "{key}: {first:?}");
            let (second, then) = second?;
            assert_eq!(second.status, StatusCode::CREATED, "{key}: {second:?}");
            assert!(second.replayed(), "{key}: the duplicate ran");
            assert_eq!(first.body, second.body, "{key}: two answers");
            Some(then.saturating_duration_since(at))
        }
    });
    futures_util::future::join_all(pairs)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// A Postgres server of the test's own that logs every statement, with the session it ran in.
async fn counted_postgres() -> PgCluster {
    PgCluster::start_with(&[
        "autovacuum=off",
        "log_statement=all",
        "log_line_prefix='%m [%p] '",
    ])
    .await
}

/// The commands Redis ran and the transactions Postgres ran so far, once both have settled.
async fn counts(redis: Option<&RedisServer>, postgres: &PgCluster) -> (u64, u64) {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let redis = match redis {
        Some(redis) => redis.all_calls().await,
        None => 0,
    };
    (redis, transactions(&postgres.log()))
}

/// The transactions in a statement log (`log_statement = all`, the session's pid in each line):
/// a statement outside a transaction block is one, a block (`BEGIN` … `COMMIT`) one.
fn transactions(log: &str) -> u64 {
    let mut in_block = std::collections::HashSet::new();
    let mut transactions = 0;
    for line in log.lines() {
        let Some((session, statement)) = line.split_once(" [").and_then(|(_, rest)| {
            let (pid, rest) = rest.split_once(']')?;
            let statement = rest.split_once("LOG:  ")?.1;
            let statement = statement.strip_prefix("statement: ").or_else(|| {
                statement
                    .strip_prefix("execute ")?
                    .split_once(": ")
                    .map(|(_, s)| s)
            })?;
            Some((pid.to_owned(), statement.trim().to_ascii_uppercase()))
        }) else {
            continue;
        };
        if statement.starts_with("BEGIN") {
            in_block.insert(session);
            transactions += 1;
        } else if statement.starts_with("COMMIT") || statement.starts_with("ROLLBACK") {
            in_block.remove(&session);
        } else if !in_block.contains(&session) {
            transactions += 1;
        }
    }
    transactions
}
