//! The store's authority as a model: the Postgres store's rules (claim, renew, complete,
//! release, and the fence in the handler's own transaction, with its owner check) over a map,
//! on tokio's clock, so that leases and retention run out in simulated time. The conformance
//! suite checks it keeps the contract every store keeps.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::time::Instant;
use tower_idempotency::{
    store::Fingerprint,
    store::StoredResponse,
    store::{
        BoxFuture, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, Store, StoreError,
    },
};
use uuid::Uuid;

/// A key's row.
#[derive(Clone)]
struct Row {
    fingerprint: Fingerprint,
    owner: Uuid,
    fence: u64,
    lease_until: Instant,
    expires_at: Instant,
    state: State,
}

#[derive(Clone)]
enum State {
    InFlight,
    /// The handler's transaction committed through the fence: the key must not run again.
    Committed,
    Completed(Arc<StoredResponse>),
}

/// What the model holds, and the defect it may be told to have.
#[derive(Default)]
struct Rows {
    rows: BTreeMap<(String, String), Row>,
    fences: u64,
}

/// The authority every simulated host reaches, over its own wire.
#[derive(Clone, Default)]
pub struct Authority {
    rows: Arc<Mutex<Rows>>,
    without_owner_check: bool,
}

fn id(record: &RecordKey) -> (String, String) {
    (record.scope().to_owned(), record.key().as_str().to_owned())
}

impl Authority {
    /// An authority with a defect on purpose: completions and fenced commits without the owner
    /// check.
    pub fn without_owner_check() -> Self {
        Self {
            without_owner_check: true,
            ..Self::default()
        }
    }

    /// The claim, as the Postgres store answers it.
    pub fn claim_now(&self, request: &ClaimRequest) -> ClaimOutcome {
        let now = Instant::now();
        let mut rows = self.rows.lock().unwrap();
        let key = id(request.record());
        if let Some(row) = rows.rows.get(&key) {
            let live = row.expires_at > now;
            match &row.state {
                _ if !live => {}
                // The owner's own claim, asked again: still its own.
                State::InFlight if row.owner == request.owner() && row.lease_until > now => {
                    return ClaimOutcome::Acquired { fence: row.fence };
                }
                _ if row.fingerprint != *request.fingerprint() => return ClaimOutcome::Mismatch,
                State::Completed(response) => {
                    return ClaimOutcome::Completed {
                        response: StoredResponse::clone(response),
                        expires_in: row.expires_at - now,
                    };
                }
                _ if row.lease_until > now => {
                    return ClaimOutcome::InFlight {
                        retry_after: row.lease_until - now,
                    };
                }
                State::Committed => return ClaimOutcome::Orphaned,
                State::InFlight => {}
            }
        }
        rows.fences += 1;
        let fence = rows.fences;
        let row = Row {
            fingerprint: *request.fingerprint(),
            owner: request.owner(),
            fence,
            lease_until: now + request.lease(),
            expires_at: now + request.lease() + Duration::from_secs(24 * 3600),
            state: State::InFlight,
        };
        rows.rows.insert(key, row);
        ClaimOutcome::Acquired { fence }
    }

    /// Applies `change` to `lease`'s row if its owner holds it (or always, with the defect).
    fn owned<T>(&self, lease: &Lease, change: impl FnOnce(&mut Row, Instant) -> T) -> Option<T> {
        let now = Instant::now();
        let mut rows = self.rows.lock().unwrap();
        let row = rows.rows.get_mut(&id(lease.record()))?;
        let held = row.owner == lease.owner() && !matches!(row.state, State::Completed(_));
        (held || self.without_owner_check).then(|| change(row, now))
    }

    /// The fence, in the handler's own transaction: marks the key committed if `lease`'s owner
    /// still holds it. `true` when it did (the transaction may commit its effects).
    pub fn commit_now(&self, lease: &Lease, extend: Duration) -> bool {
        self.owned(lease, |row, now| {
            row.state = State::Committed;
            row.lease_until = now + extend;
        })
        .is_some()
    }

    fn renew_now(&self, lease: &Lease, duration: Duration) -> Ownership {
        let renewed = self.owned(lease, |row, now| row.lease_until = now + duration);
        renewed.map_or(Ownership::Lost, |()| Ownership::Held)
    }

    fn complete_now(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        retention: Duration,
    ) -> Ownership {
        let completed = self.owned(lease, |row, now| {
            row.state = State::Completed(Arc::new(response.clone()));
            row.expires_at = now + retention;
        });
        completed.map_or(Ownership::Lost, |()| Ownership::Held)
    }

    fn release_now(&self, lease: &Lease) -> Ownership {
        let mut rows = self.rows.lock().unwrap();
        let key = id(lease.record());
        match rows.rows.get(&key) {
            Some(row) if row.owner == lease.owner() => match row.state {
                State::InFlight => {
                    rows.rows.remove(&key);
                    Ownership::Held
                }
                State::Committed => Ownership::Committed,
                State::Completed(_) => Ownership::Lost,
            },
            _ => Ownership::Lost,
        }
    }

    /// The key's stored answer, if it completed.
    pub fn stored(&self, record: &RecordKey) -> Option<Arc<StoredResponse>> {
        let rows = self.rows.lock().unwrap();
        match &rows.rows.get(&id(record))?.state {
            State::Completed(response) => Some(Arc::clone(response)),
            _ => None,
        }
    }

    /// Whether `lease`'s owner holds its key with a live lease, now.
    pub fn holds(&self, lease: &Lease) -> bool {
        let rows = self.rows.lock().unwrap();
        rows.rows.get(&id(lease.record())).is_some_and(|row| {
            row.owner == lease.owner()
                && !matches!(row.state, State::Completed(_))
                && row.lease_until > Instant::now()
        })
    }

    /// Whether the key's row is in flight with a live lease: someone still works on it.
    pub fn in_flight(&self, record: &RecordKey) -> bool {
        let rows = self.rows.lock().unwrap();
        rows.rows.get(&id(record)).is_some_and(|row| {
            matches!(row.state, State::InFlight) && row.lease_until > Instant::now()
        })
    }

    /// One of the calls below, as the wire delivers it: `call` applied at once.
    pub fn apply(&self, call: &Call<'_>) -> Answer {
        match *call {
            Call::Claim(request) => Answer::Claimed(self.claim_now(request)),
            Call::Renew(lease, duration) => Answer::Owned(self.renew_now(lease, duration)),
            Call::Complete(lease, response, retention) => {
                Answer::Owned(self.complete_now(lease, response, retention))
            }
            Call::Release(lease) => Answer::Owned(self.release_now(lease)),
            Call::Commit(lease, extend) => Answer::Committed(self.commit_now(lease, extend)),
        }
    }
}

/// A call to the authority.
pub enum Call<'a> {
    Claim(&'a ClaimRequest),
    Renew(&'a Lease, Duration),
    Complete(&'a Lease, &'a StoredResponse, Duration),
    Release(&'a Lease),
    Commit(&'a Lease, Duration),
}

/// Its answer.
pub enum Answer {
    Claimed(ClaimOutcome),
    Owned(Ownership),
    Committed(bool),
}

/// The authority reached directly (no wire), for the conformance suite.
impl Store for Authority {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move { Ok(self.claim_now(request)) })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move { Ok(self.renew_now(lease, duration)) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move { Ok(self.complete_now(lease, response, retention)) })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(async move { Ok(self.release_now(lease)) })
    }

    fn kind(&self) -> &'static str {
        "model"
    }
}
