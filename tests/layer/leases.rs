//! Leases: a live handler keeps its key, a stalled owner loses it and changes nothing, and a loss is counted once and only when it happened.

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
