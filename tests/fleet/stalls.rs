//! Duplicates across a fleet of payments instances, some frozen past their lease: one commit per key.

use super::*;

pub async fn four_instances_with_stalls_commit_each_key_exactly_once() {
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

pub async fn concurrent_submits_on_two_instances_both_get_the_answer_without_waiting_for_the_lease()
{
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
