//! Leases: a live handler keeps its key, a stalled owner loses it and changes nothing, a loss is counted once and only when it happened, and the task that renews them starts again after it went idle or its runtime shut down.

use super::*;

#[tokio::test]
async fn a_live_handler_keeps_its_lease_past_the_lease_length() {
    let probe = Probe::gated();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_millis(300))
        .with_wait(Duration::ZERO);
    let app = app(&layer, &probe);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-slow", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        send(&app, post_payment("k-slow", "{}")).await.status,
        StatusCode::CONFLICT
    );
    probe.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(probe.runs(), 1);
    assert_eq!(layer.counters().snapshot().leases_lost, 0);
}

#[tokio::test]
async fn a_stalled_owner_loses_its_lease_and_its_finalize_changes_nothing() {
    let probe = Probe::gated();
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::FrozenRenewals,
    };
    let stalled_layer = IdempotencyLayer::new(store.clone()).with_lease(Duration::from_millis(200));
    let stalled = app(&stalled_layer, &probe);
    let healthy = app(&IdempotencyLayer::new(store.inner.clone()), &Probe::open());

    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { send(&stalled, post_payment("k-stall", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The lease ran out: a retry on another instance reclaims the key and runs.
    let retry = send(&healthy, post_payment("k-stall", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());

    probe.release_gate();
    let stale = first.await.unwrap();
    // The stale owner's caller gets the key's answer (the retry's), never its own.
    assert_eq!(stale.status, StatusCode::CREATED);
    assert!(stale.replayed(), "{stale:?}");
    assert_eq!(
        stale.body, retry.body,
        "the superseded attempt answered for the key"
    );
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);

    let replay = send(&healthy, post_payment("k-stall", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(
        replay.body, retry.body,
        "the stale owner overwrote the stored response"
    );
}

/// An owner whose lease is really lost counts it once: its renewal, sent when the instance
/// thawed, finds another owner, and so does its finalize; one loss, not two.
#[tokio::test]
async fn a_lease_lost_once_is_counted_once() {
    let probe = Probe::gated();
    let memory = MemoryStore::new();
    let stalled = Faulty {
        inner: memory.clone(),
        fault: StoreFault::StalledRenewals(Duration::from_millis(800)),
    };
    let stalled_layer = IdempotencyLayer::new(stalled).with_lease(Duration::from_millis(200));
    let stalled = app(&stalled_layer, &probe);
    let healthy = app(&IdempotencyLayer::new(memory), &Probe::open());
    let first = tokio::spawn({
        let stalled = stalled.clone();
        async move { send(&stalled, post_payment("k-lost-once", "{}")).await }
    });
    probe.started.notified().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = send(&healthy, post_payment("k-lost-once", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    // The stalled renewal reaches the store (and finds the retry's record), then the stale
    // owner finalizes.
    tokio::time::sleep(Duration::from_millis(700)).await;
    probe.release_gate();
    let stale = first.await.unwrap();
    assert_eq!(stale.body, retry.body);
    assert_eq!(stalled_layer.counters().snapshot().leases_lost, 1);
}

/// A renewal that reaches the store after this owner's own completion (the completion is
/// written, and answered late, as when a front store hangs after the authority completed) is
/// no loss: nothing is counted, and the key is this owner's answer.
#[tokio::test]
async fn a_renewal_that_meets_its_owners_own_completion_is_no_loss() {
    let probe = Probe::open();
    let store = Faulty {
        inner: MemoryStore::new(),
        fault: StoreFault::SlowCompletes(Duration::from_millis(700)),
    };
    let lease = Duration::from_millis(300);
    let layer = IdempotencyLayer::new(store.clone()).with_lease(lease);
    let answer = send(&app(&layer, &probe), post_payment("k-own", "{}")).await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let other = app(&IdempotencyLayer::new(store.inner.clone()), &Probe::open());
    let replay = send(&other, post_payment("k-own", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, answer.body);
    assert_eq!(probe.runs(), 1);
    let seen = layer.counters().snapshot();
    assert_eq!(seen.leases_lost, 0, "{seen:?}");
}

/// Sends a request with `key`, and waits until its handler has started (and is held at the
/// probe's gate).
async fn started(app: &Router, probe: &Probe, key: &str) -> tokio::task::JoinHandle<Answer> {
    let first = tokio::spawn({
        let (app, key) = (app.clone(), key.to_owned());
        async move { send(&app, post_payment(&key, "{}")).await }
    });
    probe.started.notified().await;
    first
}

/// Runs a slow request with `key` (its handler held at the probe's gate) and checks that its
/// lease is kept past three lease lengths: a duplicate sent then still gets 409.
async fn a_slow_request_keeps_its_key(app: &Router, probe: &Arc<Probe>, key: &str) {
    let first = started(app, probe, key).await;
    let runs = probe.runs();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // A duplicate that found the key free would run, and wait at the gate.
    let duplicate = send(app, post_payment(key, "{}"));
    let duplicate = tokio::time::timeout(Duration::from_secs(2), duplicate).await;
    let status = duplicate.map(|answer| answer.status).ok();
    assert_eq!(status, Some(StatusCode::CONFLICT), "{key} was free again");
    probe.release_gate();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(probe.runs(), runs, "{key} ran again");
}

/// The task that renews a layer's leases goes away after a lease with none to renew; the next
/// lease starts another.
#[tokio::test]
async fn a_lease_taken_after_the_renewals_went_idle_is_kept() {
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_millis(300))
        .with_wait(Duration::ZERO);
    let quick = send(&app(&layer, &Probe::open()), post_payment("k-first", "{}")).await;
    assert_eq!(quick.status, StatusCode::CREATED);
    // Nothing held for more than three leases: the renewing task has ended.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let probe = Probe::gated();
    a_slow_request_keeps_its_key(&app(&layer, &probe), &probe, "k-later").await;
    assert_eq!(layer.counters().snapshot().leases_lost, 0);
}

/// Renewals through a spawner whose runtime shut down: the renewing task went with it, and the
/// next lease starts another on the runtime the spawner now spawns on.
#[cfg(feature = "simulation")]
#[tokio::test]
async fn renewals_start_again_after_their_runtime_shut_down() {
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let renewals = Arc::new(std::sync::Mutex::new(Some(runtime())));
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_lease(Duration::from_millis(300))
        .with_wait(Duration::ZERO)
        .with_spawner({
            let renewals = Arc::clone(&renewals);
            move |task| renewals.lock().unwrap().as_ref().unwrap().spawn(task)
        });
    let probe = Probe::gated();
    let app = app(&layer, &probe);
    // A lease starts the renewing task on the first runtime, which then shuts down.
    let abandoned = started(&app, &probe, "k-abandoned").await;
    let first = renewals.lock().unwrap().replace(runtime()).unwrap();
    tokio::task::spawn_blocking(move || first.shutdown_timeout(Duration::from_secs(5)))
        .await
        .unwrap();
    a_slow_request_keeps_its_key(&app, &probe, "k-kept").await;
    abandoned.await.unwrap();
    let last = renewals.lock().unwrap().take().unwrap();
    last.shutdown_background();
}
