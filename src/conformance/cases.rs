//! The cases of the suite: each checks one rule of the contract on a fresh store, and panics
//! naming the rule broken.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use uuid::Uuid;

use super::{LONG, PAST_SHORT, SHORT, TOMBSTONE_HORIZON, record, request};
use crate::{
    IdempotencyKey,
    response::StoredResponse,
    store::{Admin, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, RecordState, Store},
};

/// A response with every awkward part: repeated headers, opaque bytes, binary body, trailers.
fn response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("content-type", HeaderValue::from_static("application/json"));
    headers.append("location", HeaderValue::from_static("/payments/pay_1"));
    headers.append("x-repeated", HeaderValue::from_static("first"));
    headers.append("x-repeated", HeaderValue::from_static("second"));
    headers.append("x-opaque", HeaderValue::from_bytes(b"\xfe\xff").unwrap());
    let mut trailers = HeaderMap::new();
    trailers.append("grpc-status", HeaderValue::from_static("0"));
    StoredResponse::new(
        StatusCode::CREATED,
        headers,
        Some(Bytes::from_static(b"{\"id\":\"pay_1\"}\x00\xff\r\n")),
        Some(trailers),
    )
}

/// Expects a replay within the retention the suite stores with; returns the response.
fn replayed(outcome: ClaimOutcome) -> StoredResponse {
    match outcome {
        ClaimOutcome::Completed {
            response,
            expires_in,
        } => {
            assert!(
                expires_in > Duration::ZERO && expires_in <= LONG,
                "expires_in {expires_in:?} is not within the retention"
            );
            response
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

async fn claim(store: &impl Store, request: &ClaimRequest) -> ClaimOutcome {
    store
        .claim(request)
        .await
        .unwrap_or_else(|e| panic!("claim of {} failed: {e:?}", request.record()))
}

/// Claims and expects to acquire; returns the lease.
async fn acquire(store: &impl Store, request: &ClaimRequest) -> Lease {
    match claim(store, request).await {
        ClaimOutcome::Acquired { fence } => request.lease_with_fence(fence),
        other => panic!(
            "claim of {} should have acquired, got {other:?}",
            request.record()
        ),
    }
}

async fn complete(store: &impl Store, lease: &Lease, response: &StoredResponse) -> Ownership {
    store
        .complete(lease, response, LONG)
        .await
        .expect("complete failed")
}

async fn release(store: &impl Store, lease: &Lease) -> Ownership {
    store.release(lease).await.expect("release failed")
}

async fn renew(store: &impl Store, lease: &Lease, duration: Duration) -> Ownership {
    store.renew(lease, duration).await.expect("renew failed")
}

/// A first claim acquires, with a positive fence.
pub async fn fresh_key_is_acquired(store: &impl Store) {
    let lease = acquire(store, &request(&record(), "a", LONG)).await;
    assert!(lease.fence() > 0, "fences start above zero");
}

/// A claim asked again by the same owner while it holds the key (its first answer was lost on
/// the way back: a connection cut, a timeout) is granted again, so the caller goes on with the
/// claim it made instead of being locked out of its own key for a lease; once the key is
/// finished, the owner is answered like anyone else. The fence granted again is the first
/// one, or (a store that reads its clock at each claim) a later one: the caller uses the
/// last answer it got.
pub async fn a_claim_asked_again_by_its_owner_is_its_own(store: &impl Store) {
    let record = record();
    let mine = request(&record, "a", LONG);
    let first = acquire(store, &mine).await;
    let again = acquire(store, &mine).await;
    assert!(
        again.fence() >= first.fence(),
        "the owner's claim, granted again with an earlier fence"
    );
    the_owners_alone(store, &mine, &first).await;
}

/// The owner's claim asked again after its lease ran out (its first answer lost, its retry
/// late, by a clone of the claim) holds the key anew, with a greater fence, and nobody else
/// gets in; every lease of the owner's holds it, the one made from the first answer too: a
/// store checks the owner, whichever of its claims wrote what the key holds now.
pub async fn an_owner_asking_again_after_its_lease_ran_out_holds_the_key_anew(store: &impl Store) {
    let record = record();
    let mine = request(&record, "a", SHORT);
    let first = acquire(store, &mine).await;
    tokio::time::sleep(PAST_SHORT).await;
    let again = acquire(store, &mine.clone()).await;
    assert_eq!(
        renew(store, &first, LONG).await,
        Ownership::Held,
        "the first answer's lease, renewed"
    );
    assert!(
        again.fence() > first.fence(),
        "asked again late, not a greater fence"
    );
    the_owners_alone(store, &mine, &again).await;
}

/// Checks that the key `mine` claimed is its owner's alone: another owner's claim finds it in
/// flight, `lease` completes it, and `mine` asked again gets the answer.
async fn the_owners_alone(store: &impl Store, mine: &ClaimRequest, lease: &Lease) {
    let other = request(mine.record(), "a", LONG);
    let found = claim(store, &other).await;
    assert!(
        matches!(found, ClaimOutcome::InFlight { .. }),
        "another owner got in: {found:?}"
    );
    assert_eq!(complete(store, lease, &response()).await, Ownership::Held);
    assert_eq!(replayed(claim(store, mine).await), response());
}

/// A second claim during a live lease is in flight, with the time left on the lease.
pub async fn live_claim_is_in_flight(store: &impl Store) {
    let record = record();
    acquire(store, &request(&record, "a", LONG)).await;
    match claim(store, &request(&record, "a", LONG)).await {
        ClaimOutcome::InFlight { retry_after } => assert!(
            retry_after > Duration::ZERO && retry_after <= LONG,
            "retry_after {retry_after:?} is not within the lease"
        ),
        other => panic!("a live claim must answer InFlight, got {other:?}"),
    }
}

/// A claim with another fingerprint while in flight is a mismatch.
pub async fn other_fingerprint_mismatches_in_flight(store: &impl Store) {
    let record = record();
    acquire(store, &request(&record, "a", LONG)).await;
    assert_eq!(
        claim(store, &request(&record, "b", LONG)).await,
        ClaimOutcome::Mismatch
    );
}

/// A completed key replays exactly what was stored.
pub async fn completed_key_replays_its_response(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    assert_eq!(complete(store, &lease, &response()).await, Ownership::Held);
    let stored = replayed(claim(store, &request(&record, "a", LONG)).await);
    assert_eq!(stored, response());
    let order = |r: &StoredResponse| {
        r.headers()
            .iter()
            .map(|(_, v)| v.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(order(&stored), order(&response()), "header order changed");
}

/// A claim with another fingerprint on a completed key is a mismatch, not a replay.
pub async fn other_fingerprint_mismatches_completed(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    complete(store, &lease, &response()).await;
    assert_eq!(
        claim(store, &request(&record, "b", LONG)).await,
        ClaimOutcome::Mismatch
    );
}

/// A response stored without its body (over the cache limit) still completes the key.
pub async fn response_without_body_replays_as_such(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    let bodyless = StoredResponse::new(StatusCode::OK, HeaderMap::new(), None, None);
    assert_eq!(complete(store, &lease, &bodyless).await, Ownership::Held);
    assert_eq!(
        replayed(claim(store, &request(&record, "a", LONG)).await),
        bodyless
    );
}

/// A released key can be claimed again (even with another fingerprint), with a greater fence.
pub async fn released_key_is_claimable_with_greater_fence(store: &impl Store) {
    let record = record();
    let first = acquire(store, &request(&record, "a", LONG)).await;
    assert_eq!(release(store, &first).await, Ownership::Held);
    let second = acquire(store, &request(&record, "b", LONG)).await;
    assert!(
        second.fence() > first.fence(),
        "fence {} after release is not greater than {}",
        second.fence(),
        first.fence()
    );
}

/// Once a lease expires, the next claim acquires, with a greater fence.
pub async fn expired_lease_is_reclaimable_with_greater_fence(store: &impl Store) {
    let record = record();
    let first = acquire(store, &request(&record, "a", SHORT)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = acquire(store, &request(&record, "a", LONG)).await;
    assert!(
        second.fence() > first.fence(),
        "a reclaim must raise the fence"
    );
}

/// Renewal moves the lease deadline: the key stays in flight past the first lease.
pub async fn renewal_keeps_the_lease(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", SHORT)).await;
    assert_eq!(renew(store, &lease, LONG).await, Ownership::Held);
    let renewed = SystemTime::now();
    tokio::time::sleep(PAST_SHORT).await;
    let next = claim(store, &request(&record, "a", LONG)).await;
    if !matches!(next, ClaimOutcome::InFlight { .. }) && past_the_renewed_lease(renewed) {
        return;
    }
    assert!(
        matches!(next, ClaimOutcome::InFlight { .. }),
        "a renewed lease expired at its first deadline: the next claim, {:?} after the renewal \
         by the wall clock, got {next:?}",
        renewed.elapsed().unwrap_or_default()
    );
    assert_eq!(complete(store, &lease, &response()).await, Ownership::Held);
}

/// Whether the wall clock passed the renewed lease ([`LONG`]) since `renewed`, though the case
/// slept [`PAST_SHORT`]: the stores count leases on their servers' clocks, which a machine
/// paused or suspended meanwhile moves on while the case's own clock stands still. The lease
/// then ended as it should; the case has nothing to check, and says so.
fn past_the_renewed_lease(renewed: SystemTime) -> bool {
    let elapsed = renewed.elapsed().unwrap_or_default();
    let past = elapsed >= LONG;
    if past {
        eprintln!(
            "the wall clock moved {elapsed:?} during a sleep of {PAST_SHORT:?}: the renewed lease \
             ended; nothing to check"
        );
    }
    past
}

/// Under load, every renewal a store answers `Held` keeps each other claimant out until the
/// renewed deadline: many keys at once, each claimed for a short lease and renewed for a long
/// one, then claimed by another owner past the short lease. A store that reports `Held`
/// without holding lets two owners run one key.
pub async fn held_renewals_keep_every_claimant_out(store: &impl Store) {
    const KEYS: usize = 200;
    let records: Vec<RecordKey> = (0..KEYS).map(|_| record()).collect();
    let claimed = futures_util::future::join_all(records.iter().map(async |record| {
        let lease = acquire(store, &request(record, "a", SHORT)).await;
        let renewed = renew(store, &lease, LONG).await;
        (lease, renewed)
    }))
    .await;
    let renewed = SystemTime::now();
    tokio::time::sleep(PAST_SHORT).await;
    let requests: Vec<ClaimRequest> = records.iter().map(|r| request(r, "a", LONG)).collect();
    let next = futures_util::future::join_all(requests.iter().map(|r| claim(store, r))).await;
    let mut held = 0;
    for ((lease, ownership), next) in claimed.iter().zip(&next) {
        if *ownership != Ownership::Held {
            continue;
        }
        held += 1;
        if !matches!(next, ClaimOutcome::InFlight { .. }) && past_the_renewed_lease(renewed) {
            return;
        }
        assert!(
            matches!(next, ClaimOutcome::InFlight { .. }),
            "a renewal answered Held, yet another claim of {} got {next:?} before the renewed \
             deadline",
            lease.record()
        );
    }
    assert!(held > 0, "no renewal of {KEYS} held: {claimed:?}");
}

/// After a reclaim, the old owner can neither renew, complete nor release; the new owner can.
pub async fn stale_owner_changes_nothing(store: &impl Store) {
    let record = record();
    let stale = acquire(store, &request(&record, "a", SHORT)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let current = acquire(store, &request(&record, "a", LONG)).await;

    assert_eq!(renew(store, &stale, LONG).await, Ownership::Lost);
    let stale_response = StoredResponse::new(StatusCode::ACCEPTED, HeaderMap::new(), None, None);
    assert_eq!(
        complete(store, &stale, &stale_response).await,
        Ownership::Lost
    );
    assert_eq!(release(store, &stale).await, Ownership::Lost);
    assert!(
        matches!(
            claim(store, &request(&record, "a", LONG)).await,
            ClaimOutcome::InFlight { .. }
        ),
        "a stale owner's writes disturbed the current claim"
    );

    assert_eq!(
        complete(store, &current, &response()).await,
        Ownership::Held
    );
    assert_eq!(
        replayed(claim(store, &request(&record, "a", LONG)).await),
        response(),
        "the replay must be the current owner's response"
    );
}

/// A token that never held the key changes nothing.
pub async fn strangers_change_nothing(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    let stranger = Lease::new(record.clone(), Uuid::new_v4(), lease.fence());
    assert_eq!(renew(store, &stranger, LONG).await, Ownership::Lost);
    assert_eq!(
        complete(store, &stranger, &response()).await,
        Ownership::Lost
    );
    assert_eq!(release(store, &stranger).await, Ownership::Lost);
    assert!(matches!(
        claim(store, &request(&record, "a", LONG)).await,
        ClaimOutcome::InFlight { .. }
    ));
    // A stranger on a key that does not exist at all.
    let nowhere = Lease::new(self::record(), Uuid::new_v4(), 1);
    assert_eq!(renew(store, &nowhere, LONG).await, Ownership::Lost);
    assert_eq!(
        complete(store, &nowhere, &response()).await,
        Ownership::Lost
    );
    assert_eq!(release(store, &nowhere).await, Ownership::Lost);
}

/// A completed key is final: completing or releasing it again changes nothing.
pub async fn finished_key_cannot_be_finalized_again(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    assert_eq!(complete(store, &lease, &response()).await, Ownership::Held);
    let other = StoredResponse::new(StatusCode::GONE, HeaderMap::new(), None, None);
    assert_eq!(complete(store, &lease, &other).await, Ownership::Lost);
    assert_eq!(release(store, &lease).await, Ownership::Lost);
    assert_eq!(renew(store, &lease, LONG).await, Ownership::Lost);
    assert_eq!(
        replayed(claim(store, &request(&record, "a", LONG)).await),
        response()
    );
}

/// A completed key is forgotten after its retention.
pub async fn retention_expiry_frees_the_key(store: &impl Store) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    assert_eq!(
        store
            .complete(&lease, &response(), SHORT)
            .await
            .expect("complete failed"),
        Ownership::Held
    );
    tokio::time::sleep(PAST_SHORT).await;
    let again = acquire(store, &request(&record, "b", LONG)).await;
    assert!(again.fence() > lease.fence());
}

/// With tombstones: a key completed with a short retention (300 ms) is, past it, answered
/// `AnswerExpired` (its status, and about how long ago it completed) to the same request and
/// `Mismatch` to another, never acquired, until [`TOMBSTONE_HORIZON`] after its completion; then
/// it is free, with a greater fence.
pub async fn a_key_past_its_retention_is_refused_until_the_horizon(store: &impl Store) {
    assert_eq!(
        store.tombstone_horizon(),
        TOMBSTONE_HORIZON,
        "build the store with_tombstones(TOMBSTONE_HORIZON)"
    );
    let (record, lease, completing) = completed_past_its_retention(store).await;
    match claim(store, &request(&record, "a", LONG)).await {
        ClaimOutcome::AnswerExpired {
            status,
            completed_ago,
        } => {
            assert_eq!(status, StatusCode::CREATED, "the tombstone's status");
            let slack = Duration::from_millis(200);
            assert!(
                completed_ago >= SHORT && completed_ago <= completing.elapsed() + slack,
                "completed {completed_ago:?} ago, said the tombstone"
            );
        }
        other => panic!("a retry past the retention should be refused, got {other:?}"),
    }
    assert!(
        matches!(
            claim(store, &request(&record, "b", LONG)).await,
            ClaimOutcome::Mismatch
        ),
        "another request with a buried key is a mismatch"
    );
    tokio::time::sleep_until(completing + TOMBSTONE_HORIZON + PAST_SHORT).await;
    let again = acquire(store, &request(&record, "b", LONG)).await;
    assert!(again.fence() > lease.fence());
}

/// With tombstones, for a store that offers an operator's paths: `inspect` shows a key past
/// its retention as `AnswerExpired`, with its status, until no later than the horizon;
/// `forget` deletes it, and the key is free.
pub async fn an_operator_sees_and_forgets_a_tombstone(store: &impl Store) {
    let admin = admin(store);
    let (record, ..) = completed_past_its_retention(store).await;
    match admin.inspect(&record).await {
        Ok(Some(info)) => {
            assert_eq!(info.state, RecordState::AnswerExpired);
            assert_eq!(info.status, Some(StatusCode::CREATED));
            assert!(info.expires_in <= TOMBSTONE_HORIZON, "{info:?}");
        }
        other => panic!("inspect of a tombstone: {other:?}"),
    }
    assert!(
        admin.forget(&record).await.expect("forget failed"),
        "forget found no tombstone"
    );
    acquire(store, &request(&record, "b", LONG)).await;
}

/// The store's operator's paths, which the case checks.
fn admin(store: &impl Store) -> &dyn Admin {
    store.offers().admin.unwrap_or_else(|| {
        panic!(
            "the {} store offers no Admin (Store::offers): run only the cases of the four \
             operations on it",
            store.kind()
        )
    })
}

/// A fresh key claimed and completed for the request with body "a", with a [`SHORT`] retention,
/// once that retention has passed: the key, its lease, and about when it completed (just before).
async fn completed_past_its_retention(
    store: &impl Store,
) -> (RecordKey, Lease, tokio::time::Instant) {
    let record = record();
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    let completing = tokio::time::Instant::now();
    let completed = store.complete(&lease, &response(), SHORT).await;
    assert_eq!(completed.expect("complete failed"), Ownership::Held);
    tokio::time::sleep(PAST_SHORT).await;
    (record, lease, completing)
}

/// The same key in two scopes is two keys.
pub async fn scopes_are_independent(store: &impl Store) {
    let key = IdempotencyKey::try_from("shared-key").unwrap();
    let tenant_a = RecordKey::new(format!("conformance-a-{}", Uuid::new_v4()), key.clone());
    let tenant_b = RecordKey::new(format!("conformance-b-{}", Uuid::new_v4()), key);
    let a = acquire(store, &request(&tenant_a, "a", LONG)).await;
    let b = acquire(store, &request(&tenant_b, "b", LONG)).await;
    assert_eq!(complete(store, &a, &response()).await, Ownership::Held);
    assert!(matches!(
        claim(store, &request(&tenant_b, "b", LONG)).await,
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(release(store, &b).await, Ownership::Held);
    assert_eq!(
        replayed(claim(store, &request(&tenant_a, "a", LONG)).await),
        response()
    );
}

/// Many simultaneous claims of one key: exactly one acquires, every other is in flight.
pub async fn concurrent_claims_have_one_winner<S: Store>(store: &S) {
    const CLAIMS: usize = 16;
    for _round in 0..5 {
        let record = record();
        let requests: Vec<_> = (0..CLAIMS).map(|_| request(&record, "a", LONG)).collect();
        let outcomes =
            futures_util::future::join_all(requests.iter().map(|r| claim(store, r))).await;
        let acquired = outcomes
            .iter()
            .filter(|o| matches!(o, ClaimOutcome::Acquired { .. }))
            .count();
        let in_flight = outcomes
            .iter()
            .filter(|o| matches!(o, ClaimOutcome::InFlight { .. }))
            .count();
        assert_eq!(acquired, 1, "{CLAIMS} concurrent claims: {outcomes:?}");
        assert_eq!(in_flight, CLAIMS - 1, "{outcomes:?}");
    }
}

/// An operator's paths ([`Admin`]): `inspect` shows a key in flight with its fence, owner and
/// lease, then completed with its status; `stuck` lists a key in flight claimed longer ago than
/// asked, and only then; `forget` deletes a key, which is claimable again.
pub async fn an_operator_can_inspect_list_and_forget_keys(store: &impl Store) {
    let admin = admin(store);
    let record = record();
    match admin.inspect(&record).await {
        Ok(None) => {}
        other => panic!("inspect of a key never claimed: {other:?}"),
    }
    let lease = acquire(store, &request(&record, "a", LONG)).await;
    shows_in_flight(admin, &lease).await;
    assert!(
        is_stuck(admin, &record, Duration::ZERO).await,
        "stuck does not list a key in flight"
    );
    assert!(
        !is_stuck(admin, &record, Duration::from_secs(3600)).await,
        "stuck lists a key claimed a moment ago as an hour old"
    );

    complete(store, &lease, &response()).await;
    let info = admin
        .inspect(&record)
        .await
        .unwrap()
        .expect("inspect does not see a completed key");
    assert_eq!(info.state, RecordState::Completed);
    assert_eq!(info.status, Some(StatusCode::CREATED));
    assert!(
        !is_stuck(admin, &record, Duration::ZERO).await,
        "stuck lists a completed key"
    );

    assert!(
        admin.forget(&record).await.expect("forget failed"),
        "forget found nothing"
    );
    assert_eq!(
        admin.inspect(&record).await.unwrap(),
        None,
        "forgotten, still there"
    );
    assert!(!admin.forget(&record).await.unwrap(), "forgot a key twice");
    acquire(store, &request(&record, "another request", LONG)).await;
}

/// `inspect` shows `lease`'s key in flight, with its fence (the one its record keeps: on Redis,
/// where the claim was made without a script, the fence that names the record), owner and
/// lease.
async fn shows_in_flight(admin: &dyn Admin, lease: &Lease) {
    let info = admin
        .inspect(lease.record())
        .await
        .expect("inspect failed")
        .expect("inspect does not see a key in flight");
    assert_eq!(&info.record, lease.record());
    assert_eq!(info.state, RecordState::InFlight);
    let written = lease.receipt().map(|written| written.fence);
    assert!(
        info.fence == lease.fence() || Some(info.fence) == written,
        "inspect shows another fence: {} for {} (record {written:?})",
        info.fence,
        lease.fence()
    );
    assert_eq!(info.owner, lease.owner(), "inspect shows another owner");
    let left = info
        .lease_left
        .expect("no lease left shown for a key in flight");
    assert!(
        left > LONG / 2 && left <= LONG,
        "lease left {left:?} of {LONG:?}"
    );
    assert_eq!(info.status, None);
}

/// Whether `stuck` lists `record` as in flight for at least `older_than`.
async fn is_stuck(admin: &dyn Admin, record: &RecordKey, older_than: Duration) -> bool {
    let stuck = admin
        .stuck(older_than, 100_000)
        .await
        .expect("stuck failed");
    stuck.iter().any(|info| &info.record == record)
}

/// A diagnosis of the store ([`Admin::diagnose`]) finds something to say, and every finding
/// names a store and a check: what the doctor prints, one line per finding.
pub async fn a_diagnosis_names_the_store(store: &impl Store) {
    let diagnosis = admin(store).diagnose().await;
    assert!(
        !diagnosis.findings.is_empty(),
        "a diagnosis without findings"
    );
    for finding in &diagnosis.findings {
        assert!(
            !finding.store.is_empty(),
            "a finding names no store: {finding}"
        );
        assert!(
            !finding.check.is_empty(),
            "a finding names no check: {finding}"
        );
        assert!(
            !finding.message.is_empty(),
            "a finding says nothing: {finding}"
        );
    }
}
