//! The Redis store on a real local Redis Cluster: three masters and three replicas, started by
//! the tests (`redis-server --cluster-enabled yes`, `redis-cli --cluster create`). The store
//! suites share one cluster per run, each case under a prefix of its own; the tests that fail
//! over or reshard have a cluster of their own.

mod support;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{Router, body::Body, routing::post};
use http::{Request, StatusCode};
use support::{
    Busy, Need, RedisCluster, acquire, claim_request, database_url, eventually, pool_in_schema,
};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyLayer,
    store::StoredResponse,
    store::{
        Admin, CachedStore, ClaimOutcome, Ownership, PostgresStore, RedisStore, Store, TieredStore,
    },
};
use uuid::Uuid;

fn store_on(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .unwrap()
        .with_prefix(format!("test:{}:", Uuid::new_v4()))
}

/// The store on the shared cluster (started by the first case that needs it).
async fn shared_store() -> RedisStore {
    let cluster = tokio::task::spawn_blocking(RedisCluster::shared)
        .await
        .unwrap();
    store_on(cluster)
}

/// Every test here builds a Redis Cluster of its own (or shares one): without `redis-server`
/// and `redis-cli`, each is reported as not run (see `tests/support/needs.rs`). The
/// conformance cases are named by the store they run on.
fn main() -> std::process::ExitCode {
    use tower_idempotency::conformance::{admin_cases, cases, tombstone_cases};
    let needs = &[Need::RedisServer, Need::RedisCli];
    let mut tests = support::conformance("redis_cluster", needs, cases(), shared_store);
    tests.extend(support::conformance(
        "redis_cluster",
        needs,
        admin_cases(),
        shared_store,
    ));
    // The tombstone beside each record, in its slot.
    tests.extend(support::conformance(
        "redis_cluster_tombstones",
        needs,
        tombstone_cases(),
        || async {
            let horizon = tower_idempotency::conformance::TOMBSTONE_HORIZON;
            shared_store().await.with_tombstones(horizon)
        },
    ));
    tests.extend(support::conformance(
        "redis_cluster_in_front_of_postgres",
        needs,
        cases(),
        || async {
            let pool = pool_in_schema(&database_url(), "tower_idempotency_conformance").await;
            TieredStore::new(shared_store().await, PostgresStore::new(pool))
        },
    ));
    tests.extend(crate::tests![needs;
        a_duplicate_elsewhere_is_woken_through_its_keys_shard_channel,
        records_spread_over_the_masters_and_stuck_lists_them_all,
        a_claim_on_a_cluster_runs_no_script,
        a_failover_and_a_resharding_mid_run_run_nothing_twice,
        once_the_cluster_settles_after_a_killed_master_every_key_is_served_within_seconds,
        the_doctor_checks_every_master_and_the_slot_coverage,
        the_replay_cache_is_told_by_every_master,
        after_a_resharding_answers_are_watched_where_their_slots_went,
        one_master_lost_or_silent_ends_what_the_watcher_vouches_for,
        a_key_in_a_migrating_slot_is_left_unwatched_and_the_others_stay_watched,
    ]);
    support::run(tests)
}

/// Records land on every master, and the admin operations find them wherever they are.
async fn records_spread_over_the_masters_and_stuck_lists_them_all() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::shared)
        .await
        .unwrap();
    let prefix = format!("test:{}:", Uuid::new_v4());
    let store = RedisStore::cluster(cluster.urls())
        .unwrap()
        .with_prefix(&prefix);
    for k in 0..30 {
        let request = claim_request(&format!("k-{k}"), Duration::from_secs(30));
        assert!(matches!(
            store.claim(&request).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }
    let per_master: Vec<usize> = cluster
        .masters()
        .into_iter()
        .map(|port| {
            let keys = cluster.cli(port, &["--scan", "--pattern", &format!("{prefix}*")]);
            keys.lines().count()
        })
        .collect();
    assert_eq!(per_master.iter().sum::<usize>(), 30, "{per_master:?}");
    assert!(
        per_master.iter().filter(|&&n| n > 0).count() >= 2,
        "30 keys on one master: {per_master:?}"
    );
    let stuck = store.stuck(Duration::ZERO, 100).await.unwrap();
    assert_eq!(stuck.len(), 30);
    let some = stuck[0].record.clone();
    assert!(store.inspect(&some).await.unwrap().is_some());
    assert!(store.forget(&some).await.unwrap());
    assert!(store.inspect(&some).await.unwrap().is_none());
}

/// On a cluster as on one server, a fresh key's claim is one pipeline on its master (a
/// `SET … NX GET`, a `PTTL`, a `TIME`), not claim.lua: the probe for what the servers offer goes
/// to one node (routed by its arguments, as if they were keys, it was refused: every claim ran the
/// script).
async fn a_claim_on_a_cluster_runs_no_script() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let store = store_on(&cluster);
    let (scripts, claims, transactions) = (
        calls_per_master(&cluster, "evalsha"),
        calls_per_master(&cluster, "pttl"),
        calls_per_master(&cluster, "exec"),
    );
    for k in 0..30 {
        let request = claim_request(&format!("k-{k}"), Duration::from_secs(30));
        assert!(matches!(
            store.claim(&request).await.unwrap(),
            ClaimOutcome::Acquired { .. }
        ));
    }
    let ran = |command, before: Vec<u64>| -> Vec<u64> {
        let after = calls_per_master(&cluster, command);
        after.iter().zip(before).map(|(a, b)| a - b).collect()
    };
    let claims = ran("pttl", claims);
    assert_eq!(ran("evalsha", scripts), [0, 0, 0], "no claim ran a script");
    assert_eq!(
        ran("exec", transactions),
        [0, 0, 0],
        "a claim in a transaction"
    );
    assert_eq!(claims.iter().sum::<u64>(), 30, "{claims:?}");
    assert!(
        claims.iter().all(|&n| n > 0),
        "every master claimed some: {claims:?}"
    );
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// Counts the handler's runs per key.
fn counting_app(store: RedisStore, runs: &Arc<Mutex<HashMap<String, usize>>>) -> Router {
    let runs = Arc::clone(runs);
    Router::new()
        .route(
            "/orders",
            post(move |request: Request<Body>| async move {
                let key = request.headers()["idempotency-key"]
                    .to_str()
                    .unwrap()
                    .to_owned();
                *runs.lock().unwrap().entry(key).or_default() += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                (StatusCode::CREATED, "ordered")
            }),
        )
        .layer(IdempotencyLayer::new(store).with_lease(Duration::from_secs(5)))
}

/// Sends one key until it gets its 201 (first or replayed), retrying 409 and 503 as a client
/// honouring `Retry-After` would, faster.
async fn deliver(app: &Router, key: &str) -> (usize, usize) {
    let started = Instant::now();
    let mut refused = 0;
    loop {
        let request = Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        match status {
            StatusCode::CREATED => return (1, refused),
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => refused += 1,
            other => panic!("{key}: unexpected {other}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{key} unanswered after 60 s: last {status} {}",
            String::from_utf8_lossy(&body)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Redis alone, on a cluster of the test's own: a coordinated failover and a resharding of the
/// slots in use while duplicates of every key arrive. Neither loses a write, so nothing runs
/// twice even without Postgres behind (a master that dies is another matter: see
/// `fleet::store_faults::a_fleet_on_a_redis_cluster_survives_failovers_a_killed_master_and_a_resharding`).
async fn a_failover_and_a_resharding_mid_run_run_nothing_twice() {
    let cluster = Arc::new(
        tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .unwrap(),
    );
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let app = counting_app(store_on(&cluster), &runs);

    // The machine is busy while the faults run: a busy loop on every core, as in a CI runner
    // shared with other jobs (an earlier version left 12 keys at 503 for 60 s on a busy machine).
    let load = Busy::on_every_core();
    let faults = {
        let cluster = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_millis(500));
            cluster.failover();
            cluster.reshard(3000);
            cluster.failover();
        })
    };
    let mut tasks = Vec::new();
    let started = Instant::now();
    let mut k = 0;
    while !faults.is_finished() || k < 100 {
        for _copy in 0..3 {
            let (app, key) = (app.clone(), format!("order-{k}"));
            tasks.push(tokio::spawn(async move { deliver(&app, &key).await }));
        }
        k += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    faults.await.unwrap();
    let faults_over = Instant::now();
    drop(load);
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap().1;
    }
    let settled = faults_over.elapsed();
    let runs = runs.lock().unwrap();
    let executions: usize = runs.values().sum();
    println!(
        "redis cluster alone: {} deliveries of {k} keys over {:?} with 2 failovers and 3000 slots \
         resharded, on a busy machine; executions {executions}, duplicates {}, 409/503 answers \
         retried {refused}; every key answered {settled:.1?} after the last fault",
        3 * k,
        started.elapsed(),
        executions - runs.len(),
    );
    assert!(
        settled < Duration::from_secs(10),
        "keys still unanswered {settled:?} after the last fault"
    );
    assert_eq!(runs.len(), k, "every key ran");
    assert!(runs.values().all(|&n| n == 1), "a key ran twice");
}

/// Redis alone, on a cluster of the test's own, under load: failovers, a resharding and a
/// master killed (its replica promoted by the cluster), with deliveries flowing throughout.
/// Once the cluster has settled, every key is served again within seconds: a store whose
/// connection still points at what the cluster was (the killed master, slots that moved)
/// answers 503 for as long as nothing rebuilds it.
async fn once_the_cluster_settles_after_a_killed_master_every_key_is_served_within_seconds() {
    const WITHIN: Duration = Duration::from_secs(5);
    // How long the cluster itself may take to agree again after each fault, on a machine made
    // busy on purpose and running other tests beside: not what this test measures (it once
    // took over 30 s in CI), so generous.
    const SETTLING: Duration = Duration::from_secs(60);
    let cluster = Arc::new(
        tokio::task::spawn_blocking(RedisCluster::start)
            .await
            .unwrap(),
    );
    let runs = Arc::new(Mutex::new(HashMap::new()));
    let store = store_on(&cluster).with_timeout(Duration::from_millis(500));
    let app = counting_app(store, &runs);
    let load = Busy::on_every_core();
    // The faults can leave the cluster itself broken (in one CI run, a slot nobody served and
    // nodes that disagreed for minutes after the last fault): an operator would repair it,
    // and so does the test. A cluster that even then does not settle is not what this test
    // measures: it says so and ends, the store's recovery unmeasured.
    let settle = |cluster: &RedisCluster| {
        cluster.settled_within(SETTLING).or_else(|_| {
            cluster.repair();
            cluster.settled_within(SETTLING)
        })
    };
    let faults = {
        let cluster = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || {
            cluster.failover();
            cluster.reshard(2000);
            cluster.kill_a_master();
            // A master frozen past the node timeout: its replica takes over, and the old
            // master comes back as a replica, its connections to the store still open.
            let frozen = cluster.masters()[0];
            let pid = cluster.pid_of(frozen);
            support::signal_pid(pid, "-STOP");
            std::thread::sleep(Duration::from_secs(4));
            support::signal_pid(pid, "-CONT");
            settle(&cluster)?;
            cluster.failover();
            // Every node frozen for longer than the store's timeout: every call fails for
            // seconds, and the store connects to the cluster afresh.
            let pids: Vec<u32> = (cluster.ports.iter().map(|&p| cluster.pid_of(p)))
                .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
                .collect();
            pids.iter()
                .for_each(|&pid| support::signal_pid(pid, "-STOP"));
            std::thread::sleep(Duration::from_secs(5));
            pids.iter()
                .for_each(|&pid| support::signal_pid(pid, "-CONT"));
            settle(&cluster)
        })
    };
    // Traffic throughout, each key once: the store meets every fault as it happens.
    let mut k = 0;
    while !faults.is_finished() {
        let request = Request::post("/orders")
            .header("idempotency-key", format!("during-{k}"))
            .body(Body::empty())
            .unwrap();
        let _ = app.clone().oneshot(request).await.unwrap();
        k += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Err(unsettled) = faults.await.unwrap() {
        println!("NOT MEASURED: the cluster never settled, even repaired: {unsettled}");
        return;
    }
    let settled = Instant::now();
    // Fresh keys over every master's slots, a sweep at a time, until one sweep is all served.
    let mut sweep = 0;
    let served = loop {
        let mut refused = Vec::new();
        for n in 0..60 {
            let key = format!("after-{sweep}-{n}");
            let request = Request::post("/orders")
                .header("idempotency-key", &key)
                .body(Body::empty())
                .unwrap();
            let status = app.clone().oneshot(request).await.unwrap().status();
            if status != StatusCode::CREATED {
                refused.push((key, status));
            }
        }
        if refused.is_empty() {
            break settled.elapsed();
        }
        assert!(
            settled.elapsed() < WITHIN * 4,
            "the settled cluster still refuses keys {:?} after {:?}: {refused:?}",
            refused.len(),
            settled.elapsed()
        );
        sweep += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    drop(load);
    println!(
        "redis cluster alone: {k} keys during a failover, a resharding of 2000 slots, a killed \
         master, a frozen master, another failover and every node frozen for 5 s; every fresh \
         key served {served:.1?} after the cluster settled ({sweep} sweeps refused)"
    );
    assert!(
        served < WITHIN,
        "served again only {served:?} after the cluster settled"
    );
    let runs = runs.lock().unwrap();
    assert!(runs.values().all(|&n| n == 1), "a key ran twice");
}

/// The doctor checks every master of a cluster and its slot coverage: a healthy cluster has
/// nothing to report; one with a slot nobody serves is at risk.
async fn the_doctor_checks_every_master_and_the_slot_coverage() {
    use tower_idempotency::store::Severity;

    let shared = tokio::task::spawn_blocking(RedisCluster::shared)
        .await
        .unwrap();
    let diagnosis = store_on(shared).diagnose().await;
    println!("{diagnosis}");
    assert_eq!(diagnosis.worst(), Severity::Ok, "{diagnosis}");
    assert_eq!(diagnosis.of("version").count(), 3, "one line per master");
    assert_eq!(diagnosis.of("persistence").count(), 3);
    let coverage = diagnosis.of("cluster").next().expect("a cluster finding");
    assert!(coverage.message.contains("16384 of 16384"), "{coverage}");

    // A cluster of its own, where every node forgets who serves slot 0.
    let cluster = tokio::task::spawn_blocking(|| {
        let cluster = RedisCluster::start();
        for port in cluster.masters() {
            cluster.cli(port, &["cluster", "delslots", "0"]);
        }
        cluster
    })
    .await
    .unwrap();
    let diagnosis = store_on(&cluster).diagnose().await;
    println!("{diagnosis}");
    let coverage = diagnosis.of("cluster").next().expect("a cluster finding");
    assert_eq!(coverage.severity, Severity::Risk, "{diagnosis}");
    assert!(coverage.message.contains("16383 of 16384"), "{coverage}");
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
}

/// How many times each master ran `command` (lower case), failed calls left out.
fn calls_per_master(cluster: &RedisCluster, command: &str) -> Vec<u64> {
    calls_on(cluster, &cluster.masters(), command)
}

/// How many times each node of `ports` ran `command`.
fn calls_on(cluster: &RedisCluster, ports: &[u16], command: &str) -> Vec<u64> {
    let field = |stats: &str, name: &str| -> u64 {
        stats
            .split(',')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .map_or(0, |value| value.parse().unwrap())
    };
    let line = format!("cmdstat_{command}:");
    ports
        .iter()
        .map(|&port| {
            let info = cluster.cli(port, &["info", "commandstats"]);
            info.lines()
                .find_map(|l| l.trim().strip_prefix(&line))
                .map_or(0, |stats| {
                    field(stats, "calls") - field(stats, "failed_calls")
                })
        })
        .collect()
}

/// A cluster of its own, the store on it, a replay cache in front watched with `bound`, and
/// [`keys`] completed through the cache and watched ([`complete_and_watch`]).
struct Watched(
    Arc<RedisCluster>,
    RedisStore,
    CachedStore<RedisStore>,
    Vec<String>,
);

async fn watched_cluster(bound: Duration) -> Watched {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start)
        .await
        .unwrap();
    let store = store_on(&cluster);
    let cached = CachedStore::new(store.clone())
        .with_bound(bound)
        .with_watcher(store.watcher());
    let keys = keys();
    complete_and_watch(&cluster, &cached, &keys).await;
    Watched(Arc::new(cluster), store, cached, keys)
}

const BOUND: Duration = Duration::from_millis(300);
const LEASE: Duration = Duration::from_secs(30);

/// Enough keys that every master of three holds some.
fn keys() -> Vec<String> {
    (0..30).map(|k| format!("k-{k}")).collect()
}

/// Completes each key through `cached`, asks for it again, and waits until the watcher has read
/// them all on their masters (the `GET`s each master counts), every master some.
async fn complete_and_watch(
    cluster: &RedisCluster,
    cached: &CachedStore<RedisStore>,
    keys: &[String],
) {
    let response = StoredResponse::new(StatusCode::CREATED, Default::default(), None, None);
    for key in keys {
        let held = acquire(cached, &claim_request(key, LEASE)).await;
        let completed = cached
            .complete(&held, &response, Duration::from_secs(600))
            .await;
        assert_eq!(completed.unwrap(), Ownership::Held);
    }
    // Asked again: served from memory, and watched (the store's own calls are done by now).
    let gets_before = calls_per_master(cluster, "get");
    for key in keys {
        let again = cached.claim(&claim_request(key, LEASE)).await.unwrap();
        assert!(matches!(again, ClaimOutcome::Completed { .. }), "{key}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let gets = calls_per_master(cluster, "get");
        let read: Vec<u64> = gets.iter().zip(&gets_before).map(|(n, b)| n - b).collect();
        if read.iter().sum::<u64>() >= keys.len() as u64 {
            assert!(
                read.iter().all(|&n| n > 0),
                "a master read nothing: {read:?}"
            );
            return;
        }
        assert!(Instant::now() < deadline, "the watcher never read them all");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How many claims (scripts, or transactions) reached the cluster while every key was asked for
/// again, past the bound.
async fn claims_past_the_bound(
    cluster: &RedisCluster,
    cached: &CachedStore<RedisStore>,
    keys: &[String],
) -> u64 {
    claims_on(cluster, &cluster.masters(), cached, keys, BOUND).await
}

/// How many claims (scripts, or transactions) reached the masters of `ports` (which hold `keys`)
/// while every key was asked for again, past the cache's `bound`.
async fn claims_on(
    cluster: &RedisCluster,
    ports: &[u16],
    cached: &CachedStore<RedisStore>,
    keys: &[String],
    bound: Duration,
) -> u64 {
    tokio::time::sleep(2 * bound).await;
    let claims = || -> u64 {
        let scripts = calls_on(cluster, ports, "evalsha").into_iter();
        scripts.chain(calls_on(cluster, ports, "pttl")).sum()
    };
    let before = claims();
    for key in keys {
        // A master frozen, or failing over meanwhile, may keep the cluster from answering in
        // the store's time: asked again (each attempt may count).
        let request = claim_request(key, LEASE);
        let replay = eventually(Duration::from_secs(10), key, || cached.claim(&request)).await;
        assert!(matches!(replay, ClaimOutcome::Completed { .. }), "{key}");
    }
    claims() - before
}

/// Forgets every key through `store` (another process), and waits until `cached` no longer
/// serves any: each goes when its master says so. Unwatched, they would have gone at the bound
/// already; watched and never told, they would stay.
async fn forgotten_elsewhere(
    store: &RedisStore,
    cached: &CachedStore<RedisStore>,
    keys: &[String],
) {
    for key in keys {
        let record = claim_request(key, LEASE).record().clone();
        assert!(store.forget(&record).await.unwrap(), "{key}");
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for key in keys {
        loop {
            match cached.claim(&claim_request(key, LEASE)).await.unwrap() {
                ClaimOutcome::Acquired { .. } => break,
                ClaimOutcome::Completed { .. } => {}
                other => panic!("{key}: {other:?}"),
            }
            assert!(
                Instant::now() < deadline,
                "{key}: still served after it was forgotten"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The replay cache's watcher on a cluster keeps a tracking connection to each master and reads
/// each key on its slot's: answers on every master are served past the bound without a round
/// trip while nothing changes, and go the moment another process forgets them.
async fn the_replay_cache_is_told_by_every_master() {
    let Watched(cluster, store, cached, keys) = watched_cluster(BOUND).await;
    let claims = claims_past_the_bound(&cluster, &cached, &keys).await;
    assert_eq!(claims, 0, "replays past the bound reached the cluster");
    forgotten_elsewhere(&store, &cached, &keys).await;
}

/// Every slot of a master moved to another (`redis-cli --cluster reshard`): its keys' answers
/// go when the old master deletes them, the watcher's next read there is redirected, and it
/// connects again with the slots as they are now; the answers are watched on their new master,
/// and told from there.
async fn after_a_resharding_answers_are_watched_where_their_slots_went() {
    let Watched(cluster, store, cached, keys) = watched_cluster(BOUND).await;
    let emptied = cluster.masters()[0];
    let dbsize = |port| {
        cluster
            .cli(port, &["dbsize"])
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    assert!(dbsize(emptied) > 0, "the master to empty holds keys");
    let moved = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || moved.reshard(slots_of(&moved, emptied)))
        .await
        .unwrap();
    assert_eq!(dbsize(emptied), 0, "every key moved");
    // Asked for again until they are watched again: each round served past the bound without a
    // script, once the watcher reads every key on its new master.
    let deadline = Instant::now() + Duration::from_secs(15);
    while claims_past_the_bound(&cluster, &cached, &keys).await > 0 {
        assert!(
            Instant::now() < deadline,
            "never watched again after the resharding"
        );
    }
    forgotten_elsewhere(&store, &cached, &keys).await;
}

/// One master's tracking connection killed: every watched answer goes back to the store (the
/// watcher cannot know what that master would have told), and the watcher connects again and
/// watches them anew. One master frozen (SIGSTOP): past the bound after the watcher last heard
/// from every master, no watched answer is served from memory, those on the live masters
/// included.
async fn one_master_lost_or_silent_ends_what_the_watcher_vouches_for() {
    // A bound well past the store's timeout (250 ms), so that a ping a frozen master never
    // answers would still leave time to serve from memory if the others' answers were enough.
    let bound = Duration::from_secs(1);
    let Watched(cluster, store, cached, keys) = watched_cluster(bound).await;
    let master = cluster.masters()[0];

    let clients = cluster.cli(master, &["client", "list"]);
    let tracking: Vec<&str> = clients
        .lines()
        .filter(|line| {
            line.split(' ')
                .any(|f| f.strip_prefix("flags=").is_some_and(|f| f.contains('t')))
        })
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .collect();
    assert_eq!(tracking.len(), 1, "one tracking connection per master");
    cluster.cli(master, &["client", "kill", "id", tracking[0]]);
    let masters = cluster.masters();
    let claims = claims_on(&cluster, &masters, &cached, &keys, bound).await;
    assert_eq!(
        claims,
        keys.len() as u64,
        "every answer went back to the store"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while claims_on(&cluster, &masters, &cached, &keys, bound).await > 0 {
        assert!(Instant::now() < deadline, "never watched again");
    }

    // The keys that live elsewhere than on the master about to be frozen.
    let elsewhere: Vec<String> = keys
        .iter()
        .filter(|key| {
            let record = claim_request(key, LEASE).record().clone();
            let there = cluster.cli(master, &["exists", &store.record_key(&record)]);
            there.trim() != "1"
        })
        .cloned()
        .collect();
    assert!(!elsewhere.is_empty() && elsewhere.len() < keys.len());
    // Asked before the freeze: a frozen node answers no `redis-cli`.
    let live: Vec<u16> = cluster
        .masters()
        .into_iter()
        .filter(|&p| p != master)
        .collect();
    let frozen = Frozen::new(cluster.pid_of(master));
    let claims = claims_on(&cluster, &live, &cached, &elsewhere, bound).await;
    drop(frozen);
    assert!(
        claims >= elsewhere.len() as u64,
        "answers served from memory while a master was silent: {claims} claims for {} keys",
        elsewhere.len()
    );
}

/// A slot being migrated by hand (`CLUSTER SETSLOT … IMPORTING/MIGRATING`, its key moved with
/// `MIGRATE`): the moved key's answer goes when its old master deletes it, and the watcher's
/// read of it there is answered `ASK`. That key is left unwatched, and every other answer stays
/// watched: no reconnection, nothing dropped.
async fn a_key_in_a_migrating_slot_is_left_unwatched_and_the_others_stay_watched() {
    let Watched(cluster, store, cached, keys) = watched_cluster(BOUND).await;
    let (moving, others) = keys.split_first().unwrap();
    let key = store.record_key(claim_request(moving, LEASE).record());
    let roles = cluster.roles();
    let masters: Vec<_> = roles.iter().filter(|r| r.2.is_none()).collect();
    let holds = |port: u16| cluster.cli(port, &["exists", &key]).trim() == "1";
    let source = masters.iter().find(|m| holds(m.0)).unwrap();
    let target = masters.iter().find(|m| m.0 != source.0).unwrap();
    let slot = cluster.cli(source.0, &["cluster", "keyslot", &key]);
    let slot = slot.trim();
    cluster.cli(
        target.0,
        &["cluster", "setslot", slot, "importing", &source.1],
    );
    cluster.cli(
        source.0,
        &["cluster", "setslot", slot, "migrating", &target.1],
    );
    let to = target.0.to_string();
    cluster.cli(source.0, &["migrate", "127.0.0.1", &to, &key, "0", "5000"]);
    assert_eq!(keys_in_slot(&cluster, target.0, slot), 1, "moved");
    assert!(!holds(source.0));

    // Asked for again: the store follows the `ASK`, and the watcher's read is answered `ASK`.
    let asked = rejected_gets(&cluster, source.0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while rejected_gets(&cluster, source.0) == asked {
        let replay = cached.claim(&claim_request(moving, LEASE)).await.unwrap();
        assert!(matches!(replay, ClaimOutcome::Completed { .. }), "{moving}");
        assert!(
            Instant::now() < deadline,
            "the watcher never read the moved key"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let claims = claims_past_the_bound(&cluster, &cached, others).await;
    assert_eq!(claims, 0, "the other answers were dropped");
}

/// How many keys the node of `port` holds in `slot`.
fn keys_in_slot(cluster: &RedisCluster, port: u16, slot: &str) -> u64 {
    let count = cluster.cli(port, &["cluster", "countkeysinslot", slot]);
    count.trim().parse().unwrap()
}

/// How many `GET`s the node of `port` refused (redirected, on a cluster).
fn rejected_gets(cluster: &RedisCluster, port: u16) -> u64 {
    let info = cluster.cli(port, &["info", "commandstats"]);
    info.lines()
        .find_map(|l| l.trim().strip_prefix("cmdstat_get:"))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|pair| pair.strip_prefix("rejected_calls=")?.parse().ok())
        })
        .unwrap_or(0)
}

/// A process stopped (SIGSTOP) until this is dropped.
struct Frozen(u32);

impl Frozen {
    fn new(pid: u32) -> Self {
        support::signal_pid(pid, "-STOP");
        Self(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        support::signal_pid(self.0, "-CONT");
    }
}

/// How many slots the master on `port` serves (its `myself` line of `CLUSTER NODES`).
fn slots_of(cluster: &RedisCluster, port: u16) -> usize {
    let nodes = cluster.cli(port, &["cluster", "nodes"]);
    let myself = nodes.lines().find(|l| l.contains("myself")).unwrap();
    myself
        .split_whitespace()
        .skip(8)
        .map(|range| match range.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// A duplicate on another instance (another store object, with a listener of its own) is woken
/// through its key's shard channel (`SSUBSCRIBE`; `SPUBLISH` from the completion's script on the
/// key's master) the moment the first completes, without polling.
async fn a_duplicate_elsewhere_is_woken_through_its_keys_shard_channel() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::shared).await;
    let prefix = format!("test:{}:", Uuid::new_v4());
    let elsewhere = || store_on(cluster.as_ref().unwrap()).with_prefix(&prefix);
    for key in ["k-one", "k-two", "k-three"] {
        let instances = (elsewhere(), elsewhere());
        let woken = support::duplicate_elsewhere(instances, key, async || {}).await;
        woken.assert_woken(1, key);
    }
}
