//! The stores failing under a fleet: Redis flushed, restarted, frozen, a Redis Cluster failing over and resharding, Postgres down.

use super::*;

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
pub async fn a_fleet_on_a_redis_cluster_survives_failovers_a_killed_master_and_a_resharding() {
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

pub async fn redis_flushed_mid_run() {
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

pub async fn redis_restarted_mid_run() {
    burst_during("redis-restarted", async |redis: &mut RedisServer| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        redis.stop();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        redis.restart().await;
    })
    .await;
}

pub async fn redis_stalled_mid_run_falls_back_to_postgres_without_errors() {
    burst_during("redis-stalled", async |redis: &mut RedisServer| {
        tokio::time::sleep(Duration::from_millis(600)).await;
        redis.pause();
        tokio::time::sleep(Duration::from_millis(1500)).await;
        redis.resume();
    })
    .await;
}

pub async fn postgres_down_means_503_then_service_resumes_with_nothing_lost() {
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
