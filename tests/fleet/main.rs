//! The payment example as a fleet: separate OS processes sharing one Redis and one Postgres,
//! duplicate deliveries spread across them at once, and the faults of DESIGN.md's failure matrix
//! injected mid-run. Every test counts at the destination (payment rows in Postgres, charges at
//! the provider), never in logs, and prints its figures (run with `--nocapture` to see them).

#[path = "../support/mod.rs"]
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
    /// 409s saying the key's outcome is unknown (committed, its answer lost): counted among
    /// `conflicts` too.
    outcome_unknown: AtomicUsize,
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
            "{} HTTP requests: {} created, {} replayed, {} x 409 ({} outcome-unknown), {} x 503, \
             {} attempts timed out or refused",
            Self::get(&self.requests),
            Self::get(&self.created),
            Self::get(&self.replayed),
            Self::get(&self.conflicts),
            Self::get(&self.outcome_unknown),
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
                StatusCode::CONFLICT => {
                    if answer.problem_type().ends_with(":outcome-unknown") {
                        tally.outcome_unknown.fetch_add(1, Relaxed);
                    }
                    tally.conflicts.fetch_add(1, Relaxed)
                }
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

mod stalls;
mod store_faults;
mod kills;
mod citus;
mod wakeups;
mod webhooks;
/// The webhooks example's signatures, which the tests sign deliveries with.
#[path = "../../examples/webhooks/signatures.rs"]
mod signatures;

/// A test whose program is missing is reported as not run (see `tests/support/needs.rs`).
fn main() -> std::process::ExitCode {
    use support::Need::*;
    let mut tests = crate::tests![&[RedisServer];
        stalls::four_instances_with_stalls_commit_each_key_exactly_once,
        stalls::concurrent_submits_on_two_instances_both_get_the_answer_without_waiting_for_the_lease,
        store_faults::redis_flushed_mid_run,
        store_faults::redis_restarted_mid_run,
        store_faults::redis_stalled_mid_run_falls_back_to_postgres_without_errors,
        kills::an_instance_killed_mid_request_frees_its_key_when_the_lease_ends,
        kills::a_client_that_disconnects_mid_request_gets_the_replay,
        kills::an_instance_killed_after_the_commit_leaves_the_payment_to_the_retry,
        kills::an_instance_killed_after_recording_the_intent_is_resumed_by_the_retry,
        kills::an_instance_killed_after_the_charge_is_resumed_and_charged_once,
        kills::an_instance_killed_after_a_plain_commit_is_answered_by_the_recovery_hook,
        kills::payments_killed_after_plain_commits_are_never_answered_outcome_unknown,
        kills::payments_killed_after_the_charge_with_nobody_retrying_are_finished_by_the_completer,
        kills::payments_killed_after_a_plain_commit_with_nobody_retrying_are_answered_by_the_completer,
    ];
    tests.extend(crate::tests![&[];
        kills::a_hanging_provider_holds_no_lock_and_duplicates_are_told_it_is_in_flight,
        webhooks::signatures_agree_with_the_senders_libraries,
    ]);
    tests.extend(crate::tests![&[PostgresServer];
        wakeups::a_duplicate_on_another_instance_is_woken_by_postgres_not_polling,
    ]);
    tests.extend(crate::tests![&[RedisServer, PostgresServer];
        wakeups::a_duplicate_on_another_instance_is_woken_by_redis_not_polling,
        wakeups::a_herd_of_duplicates_over_four_instances_listens_once_a_process,
        webhooks::each_event_is_handled_once_through_forgeries_duplicates_and_redeliveries,
        webhooks::an_instance_killed_mid_handler_leaves_the_event_to_the_senders_retry,
    ]);
    tests.extend(crate::tests![&[RedisServer, RedisCli];
        store_faults::a_fleet_on_a_redis_cluster_survives_failovers_a_killed_master_and_a_resharding,
    ]);
    tests.extend(crate::tests![&[RedisServer, PostgresServer];
        store_faults::postgres_down_means_503_then_service_resumes_with_nothing_lost,
    ]);
    tests.extend(crate::tests![&[Citus];
        citus::a_fleet_on_citus_commits_each_key_once_through_a_worker_restart_a_shard_move_and_a_coordinator_restart,
        citus::a_fleet_on_citus_serves_every_key_through_30_s_without_its_coordinator_and_a_logical_shard_move,
    ]);
    support::run(tests)
}
