//! The fleet on Citus: payments instances on a coordinator and two workers, the keys and the
//! payments sharded by key and co-located, while a worker restarts, a shard moves to the other
//! worker and the coordinator restarts, and while the coordinator is down for 30 s and a shard
//! moves by logical replication. The same exactly-once count as on one Postgres.

use super::*;
use support::CitusCluster;

/// The instances' lease (ms).
const LEASE_MS: u64 = 1000;

/// A coordinator and two workers, the mock provider, and three payments instances on them
/// (lease [`LEASE_MS`]). The instances' sessions refuse any statement Citus would run on more
/// than one shard: a payment's transactions, the fence included, each stay on one worker.
async fn citus_fleet() -> (CitusCluster, MockProvider, Vec<Proc>) {
    let citus = CitusCluster::start(2).await;
    let provider = MockProvider::start(Duration::from_millis(20)).await;
    let env = [
        ("DATABASE_URL", citus.single_shard_url()),
        ("PROVIDER_URL", provider.url.clone()),
        ("IDEMPOTENCY_LEASE_MS", LEASE_MS.to_string()),
        ("PAYMENTS_WORK_MS", "100".to_owned()),
    ];
    let instances = fleet(3, &env).await;
    (citus, provider, instances)
}

pub async fn a_fleet_on_citus_commits_each_key_once_through_a_worker_restart_a_shard_move_and_a_coordinator_restart()
 {
    let _serial = SERIAL.lock().await;
    let (mut citus, provider, instances) = citus_fleet().await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());

    // A key on each worker, apart from the burst's, to ask for while the first is down.
    let on_worker = |worker: usize| {
        let (citus, port) = (&citus, i32::from(citus.workers[worker].port));
        async move {
            for k in 0.. {
                let key = format!("outage-{k}");
                if citus.shard_of("idempotency_keys", &key).await.1 == port {
                    return key;
                }
            }
            unreachable!()
        }
    };
    let (down_key, up_key) = (on_worker(0).await, on_worker(1).await);
    let outage_url = urls[0].clone();
    let (down, up) = (down_key.clone(), up_key.clone());

    let faults = tokio::spawn(async move {
        let mut done = Vec::new();
        let took = |since: Instant| format!("{:.1} s", since.elapsed().as_secs_f64());
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let outage = Instant::now();
        citus.workers[0].stop_server();
        // Its keys are unavailable, and run nowhere; the other worker's keys are served, at once
        // (a worker's failure reaches the store as an error on a session that goes on, and
        // costs the other keys nothing: it once dropped every connection, and they answered
        // seconds late or 503).
        let down = post_json(&outage_url, &down, PAYMENT).await.unwrap();
        assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
        let up = post_json(&outage_url, &up, PAYMENT).await.unwrap();
        assert_eq!(up.status, StatusCode::CREATED, "{up:?}");
        let served = took(outage);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        citus.workers[0].start_server().await;
        done.push(format!(
            "worker 1 down for {} (its keys 503; the other worker's key served {served} into the \
             outage)",
            took(outage)
        ));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let moving = Instant::now();
        let moved = citus
            .move_shard_of("idempotency_keys", "citus-7", "block_writes")
            .await;
        done.push(format!("the shard of citus-7 moved in {}", took(moving)));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let restart = Instant::now();
        citus.coordinator.restart_server().await;
        done.push(format!("coordinator restarted in {}", took(restart)));
        (citus, done, moved)
    });
    let answers = burst(&urls, "citus", 120, 3, Duration::from_millis(7000), &tally).await;
    let (citus, faults, moved) = faults.await.unwrap();
    assert_eq!(citus.shard_of("idempotency_keys", "citus-7").await.1, moved);
    tokio::time::sleep(Duration::from_millis(2 * LEASE_MS)).await;

    let pool = PgPool::connect(&citus.url()).await.unwrap();
    // The key refused while its worker was down, delivered now, with the others'.
    let mut answers = answers;
    for key in [&down_key, &up_key] {
        let answer = deliver(&urls, 0, key, Duration::from_millis(1500), &tally).await;
        let id = answer.json()["id"].as_str().unwrap().to_owned();
        answers.entry(key.clone()).or_default().push(id);
    }
    let figures = exactly_once(&pool, &provider, &answers).await;
    println!(
        "fleet on Citus: 3 instances, a coordinator and 2 workers (lease {LEASE_MS} ms); \
         {}; {figures}; {tally}",
        faults.join(", ")
    );
    assert!(
        Tally::get(&tally.unavailable) + Tally::get(&tally.failed_attempts) > 0,
        "no fault reached a request: nothing was tested"
    );
    drop(instances);
    pool.close().await;
}

/// The coordinator stopped for 30 s under a steady load, then a shard moved by logical
/// replication (writes go on while it copies) while the load goes on: the instances serve every
/// key from the shard map they have, on the workers, with no request failing while the
/// coordinator is down; the same exactly-once count at the end.
pub async fn a_fleet_on_citus_serves_every_key_through_30_s_without_its_coordinator_and_a_logical_shard_move()
 {
    let _serial = SERIAL.lock().await;
    let (mut citus, provider, instances) = citus_fleet().await;
    let urls = urls(&instances);
    let tally = Arc::new(Tally::default());
    // A payment on each instance first: a store reads the shard map on its first statement
    // (from the coordinator), and one that never read it has no worker to turn to while the
    // coordinator is down (documented on `on_citus`).
    let mut warm = HashMap::new();
    for first in 0..urls.len() {
        let key = format!("warm-{first}");
        let answer = deliver(&urls, first, &key, Duration::from_millis(1500), &tally).await;
        let id = answer.json()["id"].as_str().unwrap().to_owned();
        warm.insert(key, vec![id]);
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;

    let faults = {
        let tally = Arc::clone(&tally);
        tokio::spawn(async move {
            let counts = |tally: &Tally| {
                let failed = Tally::get(&tally.unavailable) + Tally::get(&tally.failed_attempts);
                (Tally::get(&tally.created), failed)
            };
            tokio::time::sleep(Duration::from_millis(2000)).await;
            let before = counts(&tally);
            citus.coordinator.stop_server();
            tokio::time::sleep(Duration::from_secs(30)).await;
            let after = counts(&tally);
            citus.coordinator.start_server().await;
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let moving = Instant::now();
            let moved = citus
                .move_shard_of("idempotency_keys", "outage-7", "force_logical")
                .await;
            let took = moving.elapsed();
            (citus, before, after, moved, took)
        })
    };
    let mut answers = burst(&urls, "outage", 300, 3, Duration::from_secs(40), &tally).await;
    answers.extend(warm);
    let (citus, before, after, moved, took) = faults.await.unwrap();
    let (served, failed) = (after.0 - before.0, after.1 - before.1);
    assert!(
        served > 100,
        "{served} keys run while the coordinator was down"
    );
    assert_eq!(
        failed, 0,
        "requests failed while the coordinator was down; {tally}"
    );
    assert_eq!(
        citus.shard_of("idempotency_keys", "outage-7").await.1,
        moved
    );
    tokio::time::sleep(Duration::from_millis(2 * LEASE_MS)).await;

    let pool = PgPool::connect(&citus.url()).await.unwrap();
    let figures = exactly_once(&pool, &provider, &answers).await;
    println!(
        "fleet on Citus: 3 instances, a coordinator and 2 workers (lease {LEASE_MS} ms); the \
         coordinator down 30 s ({served} keys run meanwhile, {failed} requests failed), a shard \
         moved by logical replication in {:.1} s; {figures}; {tally}",
        took.as_secs_f64()
    );
    drop(instances);
    pool.close().await;
}
