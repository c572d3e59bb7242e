//! The payment example as a fleet: separate OS processes sharing one Redis and one Postgres,
//! duplicate deliveries spread across them at once, and the faults of DESIGN.md's failure matrix
//! injected mid-run. Every test counts at the destination (payment rows in Postgres, charges at
//! the provider), never in logs, and prints its figures (run with `--nocapture` to see them).

mod support;

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use http::StatusCode;
use sqlx::PgPool;
use support::{
    Answer, MockProvider, PgCluster, Proc, RedisCluster, RedisServer, TestSchema, database_url,
    pool_in_schema, post_json, signal_pid, url_in_schema,
};

/// Fleet tests load both cores with several processes each: they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PAYMENT: &str = r#"{"amount_cents": 4900, "currency": "usd", "customer": "cus_1"}"#;

/// Starts `count` instances of the payment example.
async fn fleet(count: usize, env: &[(&str, String)]) -> Vec<Proc> {
    let mut instances = Vec::with_capacity(count);
    for _ in 0..count {
        instances.push(Proc::example("payments", env).await);
    }
    instances
}

fn urls(instances: &[Proc]) -> Arc<Vec<String>> {
    Arc::new(instances.iter().map(|i| i.url("/payments")).collect())
}

/// What the clients saw.
#[derive(Default, Debug)]
struct Tally {
    requests: AtomicUsize,
    created: AtomicUsize,
    replayed: AtomicUsize,
    conflicts: AtomicUsize,
    unavailable: AtomicUsize,
    failed_attempts: AtomicUsize,
}

impl Tally {
    fn get(counter: &AtomicUsize) -> usize {
        counter.load(Relaxed)
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} HTTP requests: {} created, {} replayed, {} x 409, {} x 503, {} attempts timed out \
             or refused",
            Self::get(&self.requests),
            Self::get(&self.created),
            Self::get(&self.replayed),
            Self::get(&self.conflicts),
            Self::get(&self.unavailable),
            Self::get(&self.failed_attempts),
        )
    }
}

/// Delivers one payment as a careful client does: retry on 409, 503, timeouts and refused
/// connections (moving to the next instance) until it gets its 201, first or replayed.
async fn deliver(
    urls: &[String],
    first: usize,
    key: &str,
    attempt_timeout: Duration,
    tally: &Tally,
) -> Answer {
    let started = Instant::now();
    for attempt in 0.. {
        let url = &urls[(first + attempt) % urls.len()];
        tally.requests.fetch_add(1, Relaxed);
        match tokio::time::timeout(attempt_timeout, post_json(url, key, PAYMENT)).await {
            Ok(Ok(answer)) => match answer.status {
                StatusCode::CREATED => {
                    let counter = if answer.replayed() {
                        &tally.replayed
                    } else {
                        &tally.created
                    };
                    counter.fetch_add(1, Relaxed);
                    return answer;
                }
                StatusCode::CONFLICT => tally.conflicts.fetch_add(1, Relaxed),
                StatusCode::SERVICE_UNAVAILABLE => tally.unavailable.fetch_add(1, Relaxed),
                other => panic!(
                    "{key}: unexpected {other}: {}",
                    String::from_utf8_lossy(&answer.body)
                ),
            },
            Ok(Err(_)) | Err(_) => tally.failed_attempts.fetch_add(1, Relaxed),
        };
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{key} undelivered after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

/// A small deterministic generator, so schedules vary without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Delivers `copies` of each of `keys` payments, each copy to a random instance after a random
/// delay within `spread`. Returns the payment id every copy of each key was answered with.
async fn burst(
    urls: &Arc<Vec<String>>,
    prefix: &str,
    keys: usize,
    copies: usize,
    spread: Duration,
    tally: &Arc<Tally>,
) -> HashMap<String, Vec<String>> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ keys as u64);
    let mut tasks = Vec::new();
    for k in 0..keys {
        for _ in 0..copies {
            let key = format!("{prefix}-{k}");
            let delay = Duration::from_millis(rng.below(spread.as_millis() as u64 + 1));
            let first = rng.below(urls.len() as u64) as usize;
            let (urls, tally) = (Arc::clone(urls), Arc::clone(tally));
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let answer = deliver(&urls, first, &key, Duration::from_millis(1500), &tally).await;
                (key, answer.json()["id"].as_str().unwrap().to_owned())
            }));
        }
    }
    let mut answers: HashMap<String, Vec<String>> = HashMap::new();
    for task in tasks {
        let (key, id) = task.await.unwrap();
        answers.entry(key).or_default().push(id);
    }
    answers
}

/// What reached the destinations.
#[derive(Debug)]
struct Figures {
    keys: usize,
    deliveries: usize,
    rows: i64,
    charges: u32,
    duplicate_rows: i64,
    duplicate_charges: u32,
    left_in_flight: i64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} deliveries of {} keys; executions (charges) {}, payment rows {}, duplicate commits \
             {}, duplicate charges {}, keys left in flight {}",
            self.deliveries,
            self.keys,
            self.charges,
            self.rows,
            self.duplicate_rows,
            self.duplicate_charges,
            self.left_in_flight,
        )
    }
}

/// Checks exactly-once at the destinations: one payment row and one charge per key, every copy
/// answered with that payment, no key left unfinished.
async fn exactly_once(
    pool: &PgPool,
    provider: &MockProvider,
    answers: &HashMap<String, Vec<String>>,
) -> Figures {
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT idempotency_key, id FROM payments")
        .fetch_all(pool)
        .await
        .unwrap();
    let mut rows_per_key: HashMap<&str, Vec<&str>> = HashMap::new();
    for (key, id) in &rows {
        rows_per_key.entry(key).or_default().push(id);
    }
    // Charges the provider made (it deduplicates on the key the payment derives): an attempt
    // that resumes after another may call it again, with the same key; a second charge would
    // need a second key.
    let charges = provider.charges();
    // Final: completed, or committed with the response the fence stored.
    let left_in_flight: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE state <> 'completed' AND response IS NULL",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let figures = Figures {
        keys: answers.len(),
        deliveries: answers.values().map(Vec::len).sum(),
        rows: rows.len() as i64,
        charges: charges.values().sum(),
        duplicate_rows: rows_per_key.values().map(|ids| ids.len() as i64 - 1).sum(),
        duplicate_charges: charges.values().map(|c| c - 1).sum(),
        left_in_flight,
    };
    for (key, ids) in answers {
        let stored = rows_per_key.get(key.as_str()).map(Vec::as_slice);
        assert_eq!(
            stored.map(<[_]>::len),
            Some(1),
            "{key}: payment rows {stored:?}"
        );
        assert!(
            ids.iter().all(|id| id == stored.unwrap()[0]),
            "{key}: answered with {ids:?}, stored {stored:?}"
        );
        assert_eq!(charges.get(key), Some(&1), "{key}: charges");
    }
    assert_eq!(figures.duplicate_rows, 0, "{figures:?}");
    assert_eq!(figures.duplicate_charges, 0, "{figures:?}");
    assert_eq!(
        figures.left_in_flight, 0,
        "keys left unfinished: {figures:?}"
    );
    figures
}

/// Environment for instances on `redis` and the test's schema.
fn env(
    redis: &RedisServer,
    schema: &TestSchema,
    provider: &MockProvider,
    lease_ms: u64,
    work_ms: u64,
) -> Vec<(&'static str, String)> {
    env_on(
        ("REDIS_URL", redis.url()),
        schema,
        provider,
        lease_ms,
        work_ms,
    )
}

/// Environment for instances on the Redis that `redis` (a variable and its value) names.
fn env_on(
    redis: (&'static str, String),
    schema: &TestSchema,
    provider: &MockProvider,
    lease_ms: u64,
    work_ms: u64,
) -> Vec<(&'static str, String)> {
    vec![
        redis,
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("PROVIDER_URL", provider.url.clone()),
        ("IDEMPOTENCY_LEASE_MS", lease_ms.to_string()),
        ("PAYMENTS_WORK_MS", work_ms.to_string()),
    ]
}

fn count_lines(instances: &[Proc], needle: &str) -> usize {
    instances
        .iter()
        .map(|i| i.log().matches(needle).count())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_with_stalls_commit_each_key_exactly_once() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(20)).await;
    let lease_ms = 800;
    let instances = fleet(4, &env(&redis, &schema, &provider, lease_ms, 150)).await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());

    // Freeze an instance past its lease now and then, as a long GC pause or a VM migration would.
    let pids: Vec<u32> = instances.iter().map(Proc::pid).collect();
    let stalls = tokio::spawn(async move {
        let mut rng = Rng(42);
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let pid = pids[rng.below(pids.len() as u64) as usize];
            signal_pid(pid, "-STOP");
            tokio::time::sleep(Duration::from_millis(2 * lease_ms)).await;
            signal_pid(pid, "-CONT");
        }
        4
    });
    let answers = burst(&urls, "fleet", 150, 4, Duration::from_millis(6000), &tally).await;
    let stalls = stalls.await.unwrap();
    // Let stale attempts resumed from a stall finish, so nothing is left in flight.
    tokio::time::sleep(Duration::from_millis(2 * lease_ms)).await;

    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    let fenced = count_lines(&instances, "stale attempt stopped by the fence");
    let leases_lost = count_lines(&instances, "lease lost");
    println!(
        "fleet: 4 instances, {stalls} stalls of {} ms (lease {lease_ms} ms); {figures}; {tally}; \
         stale attempts stopped by the fence {fenced}, lease-lost finalizes {leases_lost}",
        2 * lease_ms,
    );
    // A client whose attempt timed out on a frozen instance never saw its 201: its retry got the
    // replay. So at most one creation per key reaches a client.
    assert!(Tally::get(&tally.created) <= figures.keys);
    assert!(
        stalls > 0 && fenced + leases_lost > 0 || Tally::get(&tally.failed_attempts) > 0,
        "no stall hit a request: nothing was tested"
    );
    drop(instances);
    schema.drop().await;
}

/// Runs a burst on three instances while `fault` does its damage to Redis, and checks that every
/// key still committed exactly once and that no client saw a 503: Postgres carried the load.
async fn burst_during(name: &str, fault: impl AsyncFnOnce(&mut RedisServer)) {
    let _serial = SERIAL.lock().await;
    let redis = &mut RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let instances = fleet(3, &env(redis, &schema, &provider, 2000, 50)).await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());
    let run = burst(&urls, name, 60, 3, Duration::from_millis(2500), &tally);
    let ((), answers) = tokio::join!(fault(redis), run);
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!("{name}: 3 instances; {figures}; {tally}");
    assert_eq!(
        Tally::get(&tally.unavailable),
        0,
        "{name}: requests failed with 503"
    );
    drop(instances);
    schema.drop().await;
}

/// The production setup on a Redis Cluster (three masters, three replicas): three instances
/// with `REDIS_CLUSTER_NODES` in front of Postgres, while a replica takes over by `CLUSTER
/// FAILOVER`, 2000 slots in use move to another master, and a master is killed (its replica
/// takes over after the node timeout, and whatever it had not replicated is lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_on_a_redis_cluster_survives_failovers_a_killed_master_and_a_resharding() {
    let _serial = SERIAL.lock().await;
    let cluster = tokio::task::spawn_blocking(RedisCluster::start);
    let cluster = Arc::new(cluster.await.unwrap());
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let redis = ("REDIS_CLUSTER_NODES", cluster.seeds());
    let instances = fleet(3, &env_on(redis, &schema, &provider, 2000, 50)).await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());
    let faults = {
        let cluster = Arc::clone(&cluster);
        let started = Instant::now();
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(700));
            cluster.failover();
            let failed_over = started.elapsed();
            cluster.reshard(2000);
            let resharded = started.elapsed();
            cluster.kill_a_master();
            [failed_over, resharded, started.elapsed()]
        })
    };
    // Deliveries go on in rounds of 30 keys until the faults are over, and one round after: the
    // faults take as long as they take (resharding 2000 slots took 6.8 s on Valkey 8.1), and
    // every one of them happens while duplicates flow.
    let started = Instant::now();
    let mut answers = HashMap::new();
    let mut rounds = 0;
    loop {
        let over = faults.is_finished();
        let prefix = format!("cluster-{rounds}");
        let spread = Duration::from_millis(2000);
        answers.extend(burst(&urls, &prefix, 30, 3, spread, &tally).await);
        rounds += 1;
        if over && rounds >= 4 {
            break;
        }
    }
    let burst_took = started.elapsed();
    let [failed_over, resharded, replaced] = faults.await.unwrap();
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!(
        "redis cluster: 3 instances; failover done at {failed_over:.1?}, 2000 slots resharded by \
         {resharded:.1?}, a killed master replaced by {replaced:.1?}, {rounds} rounds of \
         deliveries over {burst_took:.1?}; {figures}; {tally}"
    );
    assert_eq!(
        Tally::get(&tally.unavailable),
        0,
        "requests failed with 503: Postgres should have carried them"
    );
    drop(instances);
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_flushed_mid_run() {
    burst_during("redis-flushed", async |redis: &mut RedisServer| {
        let mut admin = redis.admin().await;
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let () = redis::cmd("FLUSHALL")
                .query_async(&mut admin)
                .await
                .unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_mid_run() {
    burst_during("redis-restarted", async |redis: &mut RedisServer| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        redis.stop();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        redis.restart().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_stalled_mid_run_falls_back_to_postgres_without_errors() {
    burst_during("redis-stalled", async |redis: &mut RedisServer| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        redis.pause();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        redis.resume();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_means_503_then_service_resumes_with_nothing_lost() {
    let _serial = SERIAL.lock().await;
    let mut cluster = PgCluster::start().await;
    let pool = pool_in_schema(&cluster.url(), "public").await;
    let redis = RedisServer::start().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    let env = vec![
        ("REDIS_URL", redis.url()),
        ("DATABASE_URL", cluster.url()),
        ("PROVIDER_URL", provider.url.clone()),
    ];
    let instances = fleet(2, &env).await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());
    let before = burst(&urls, "before", 20, 2, Duration::from_millis(300), &tally).await;

    cluster.stop_server();
    let mut refused = 0;
    for k in 0..10 {
        let answer = post_json(&urls[k % 2], &format!("during-{k}"), PAYMENT)
            .await
            .unwrap();
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
        assert!(answer.headers.contains_key("retry-after"));
        refused += 1;
    }
    // Completed keys are still replayed, from Redis.
    for key in before.keys().take(5) {
        let answer = post_json(&urls[0], key, PAYMENT).await.unwrap();
        assert!(answer.replayed(), "{key}: {}", answer.status);
        assert_eq!(answer.json()["id"], before[key][0].as_str());
    }
    assert!(
        provider
            .calls()
            .keys()
            .all(|key| key.starts_with("before-")),
        "a handler ran while Postgres was down"
    );

    cluster.start_server().await;
    let mut after = burst(&urls, "during", 10, 2, Duration::from_millis(300), &tally).await;
    after.extend(before);
    let figures = exactly_once(&pool, &provider, &after).await;
    println!(
        "postgres-down: {refused} requests during the outage, all 503 with no execution; \
         {} keys served before and after, executions {}, duplicate commits {}, duplicate charges {}",
        figures.keys, figures.charges, figures.duplicate_rows, figures.duplicate_charges
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_mid_request_frees_its_key_when_the_lease_ends() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_request_gets_the_replay() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_submits_on_two_instances_both_get_the_answer_without_waiting_for_the_lease() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let provider = MockProvider::start(Duration::from_millis(10)).await;
    // The default 30 s lease; a 300 ms handler.
    let instances = fleet(2, &env(&redis, &schema, &provider, 30_000, 300)).await;
    let urls = urls(&instances);
    let mut slowest = Duration::ZERO;
    let mut answers = HashMap::new();
    for k in 0..10 {
        let key = format!("pair-{k}");
        let started = Instant::now();
        let submit = |url: String, key: String| async move {
            let answer = post_json(&url, &key, PAYMENT).await.unwrap();
            (answer, started.elapsed())
        };
        let ((a, took_a), (b, took_b)) = tokio::join!(
            submit(urls[0].clone(), key.clone()),
            submit(urls[1].clone(), key.clone())
        );
        assert_eq!(a.status, StatusCode::CREATED, "{key}: {a:?}");
        assert_eq!(b.status, StatusCode::CREATED, "{key}: {b:?}");
        assert_eq!(a.body, b.body, "{key}: two different answers");
        assert!(
            a.replayed() != b.replayed(),
            "{key}: one runs, one is replayed"
        );
        slowest = slowest.max(took_a).max(took_b);
        let id = a.json()["id"].as_str().unwrap().to_owned();
        answers.insert(key, vec![id.clone(), id]);
    }
    let figures = exactly_once(&schema.pool, &provider, &answers).await;
    println!(
        "concurrent pairs: 10 keys x 2 instances at once, handler 300 ms, lease 30 s: both \
         callers answered with the same 201 within {slowest:?}; {figures}"
    );
    assert!(slowest < Duration::from_secs(1), "took {slowest:?}");
    drop(instances);
    schema.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_after_the_commit_leaves_the_payment_to_the_retry() {
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

/// The payment rows of `key` whose status is like `status` (`%`: any).
async fn payment_rows(schema: &TestSchema, key: &str, status: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM payments WHERE idempotency_key = $1 AND status LIKE $2",
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_after_recording_the_intent_is_resumed_by_the_retry() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_after_the_charge_is_resumed_and_charged_once() {
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_after_a_plain_commit_is_answered_by_the_recovery_hook() {
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

/// A provider that hangs for longer than the lease while duplicates arrive: the payment holds
/// no row lock and no open transaction meanwhile (the call runs between two steps), its lease
/// stays renewed, and the duplicates are told it is in flight, then get the payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_provider_holds_no_lock_and_duplicates_are_told_it_is_in_flight() {
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
        let (open, locks): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = $1 AND state LIKE 'idle in transaction%'),
                    (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                     WHERE a.application_name = $1 AND l.locktype IN ('tuple', 'transactionid'))",
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
