//! `Idempotency-Key-Protected-Until`: on the answers that stand for a key's outcome, until when
//! a retry with the key gets that outcome.

use std::time::SystemTime;

use super::*;

/// The date an answer says its key is protected until, in seconds from now (`None` without it).
fn protected_for(answer: &Answer) -> Option<i64> {
    let until = answer.headers.get("idempotency-key-protected-until")?;
    let until = httpdate::parse_http_date(until.to_str().unwrap()).unwrap();
    let now = SystemTime::now();
    Some(match until.duration_since(now) {
        Ok(ahead) => ahead.as_secs_f64().round() as i64,
        Err(behind) => -(behind.duration().as_secs_f64().round() as i64),
    })
}

fn assert_about(answer: &Answer, seconds: i64) {
    let said = protected_for(answer).unwrap_or_else(|| panic!("no protection said: {answer:?}"));
    assert!(
        (said - seconds).abs() <= 2,
        "protected for {said} s, not {seconds} s"
    );
}

#[tokio::test]
async fn the_answers_that_stand_for_a_key_say_how_long_it_is_protected() {
    let probe = Probe::open();
    let store = MemoryStore::new().with_tombstones(Duration::from_secs(3600));
    let layer = IdempotencyLayer::new(store)
        .with_retention(Duration::from_secs(1))
        .with_protected_until_header(true);
    let app = app(&layer, &probe);

    // The answer that completed the key, and its replay: the tombstone's hour.
    let first = send(&app, post_payment("k-protected", "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_about(&first, 3600);
    let replay = send(&app, post_payment("k-protected", "{}")).await;
    assert!(replay.replayed());
    assert_about(&replay, 3600);

    // Past the retention, the tombstone's refusal: the same date, as the hour is counted from
    // the completion.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let expired = send(&app, post_payment("k-protected", "{}")).await;
    assert_eq!(expired.status, StatusCode::GONE, "{expired:?}");
    assert_about(&expired, 3598);
    assert_eq!(probe.runs(), 1);

    // An answer that released its key protects nothing: the next request runs.
    let failed = send(&app, request(Method::POST, "/status", Some("k-503"), "503")).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(protected_for(&failed), None, "{failed:?}");
    // Nor does a key mismatch (the key is another request's).
    let mismatch = send(&app, post_payment("k-protected", r#"{"other":1}"#)).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(protected_for(&mismatch), None);
}

#[tokio::test]
async fn without_tombstones_a_key_is_protected_for_its_retention_and_by_default_nothing_is_said() {
    let probe = Probe::open();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_retention(Duration::from_secs(600))
        .with_protected_until_header(true);
    let app = app(&layer, &probe);
    let first = send(&app, post_payment("k-retention", "{}")).await;
    assert_about(&first, 600);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let replay = send(&app, post_payment("k-retention", "{}")).await;
    assert!(replay.replayed());
    assert_about(&replay, 599);

    let quiet = super::app(&IdempotencyLayer::new(MemoryStore::new()), &probe);
    let first = send(&quiet, post_payment("k-quiet", "{}")).await;
    let replay = send(&quiet, post_payment("k-quiet", "{}")).await;
    assert!(replay.replayed());
    assert_eq!(
        (protected_for(&first), protected_for(&replay)),
        (None, None)
    );
}

#[tokio::test]
async fn a_duplicate_of_a_key_in_flight_is_told_nothing_until_the_key_completes() {
    let probe = Probe::gated();
    let layer = IdempotencyLayer::new(MemoryStore::new())
        .with_wait(Duration::ZERO)
        .with_protected_until_header(true);
    let app = app(&layer, &probe);
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post_payment("k-flight", "{}")).await }
    });
    probe.started.notified().await;
    let duplicate = send(&app, post_payment("k-flight", "{}")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(protected_for(&duplicate), None);
    probe.release_gate();
    let first = first.await.unwrap();
    assert_about(&first, 24 * 3600);
}
