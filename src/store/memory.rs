use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use tokio::time::Instant;
use uuid::Uuid;

use super::{
    BoxFuture, ClaimOutcome, ClaimRequest, Lease, Ownership, RecordKey, Store, StoreError,
};
use crate::{Fingerprint, StoredResponse};

/// An in-process store, **for tests and single-process development only**.
///
/// # It gives no protection across instances
///
/// Every process has its own `MemoryStore`. Run two instances of a service behind a load
/// balancer and each one happily runs the "same" request: exactly the bug this crate exists to
/// kill. Its records also vanish on restart. Use the Redis and Postgres stores in production.
///
/// Within one process it implements the whole [`Store`] contract (leases, fences, retention),
/// so it is a faithful stand-in for tests. Clones share the same records.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    records: HashMap<RecordKey, Entry>,
    last_fence: u64,
    claims_since_sweep: usize,
}

#[derive(Debug)]
struct Entry {
    fingerprint: Fingerprint,
    /// The lease deadline while in flight, the retention deadline once completed.
    expires_at: Instant,
    state: EntryState,
}

#[derive(Debug)]
enum EntryState {
    InFlight { owner: Uuid },
    Completed(Box<StoredResponse>),
}

/// Expired entries are dropped in one pass every this many claims.
const SWEEP_EVERY: usize = 1024;

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records held, expired ones not yet swept included.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No operation leaves the map half-updated, so a panic elsewhere does not taint it.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    fn claim(&mut self, request: &ClaimRequest) -> ClaimOutcome {
        let now = Instant::now();
        self.claims_since_sweep += 1;
        if self.claims_since_sweep >= SWEEP_EVERY {
            self.claims_since_sweep = 0;
            self.records.retain(|_, entry| entry.expires_at > now);
        }
        if let Some(entry) = self.records.get(request.record()) {
            if entry.expires_at > now {
                return if entry.fingerprint != *request.fingerprint() {
                    ClaimOutcome::Mismatch
                } else {
                    match &entry.state {
                        EntryState::InFlight { .. } => ClaimOutcome::InFlight {
                            retry_after: entry.expires_at - now,
                        },
                        EntryState::Completed(response) => ClaimOutcome::Completed {
                            response: response.clone(),
                            expires_in: entry.expires_at - now,
                        },
                    }
                };
            }
        }
        self.last_fence += 1;
        self.records.insert(
            request.record().clone(),
            Entry {
                fingerprint: *request.fingerprint(),
                expires_at: now + request.lease(),
                state: EntryState::InFlight {
                    owner: request.owner(),
                },
            },
        );
        ClaimOutcome::Acquired {
            fence: self.last_fence,
        }
    }

    /// The entry `lease`'s owner holds in flight, if it still does.
    fn held(&mut self, lease: &Lease) -> Option<&mut Entry> {
        self.records.get_mut(lease.record()).filter(
            |entry| matches!(entry.state, EntryState::InFlight { owner } if owner == lease.owner()),
        )
    }
}

impl Store for MemoryStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        let outcome = self.lock().claim(request);
        Box::pin(async move { Ok(outcome) })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let ownership = match self.lock().held(lease) {
            Some(entry) => {
                entry.expires_at = Instant::now() + duration;
                Ownership::Held
            }
            None => Ownership::Lost,
        };
        Box::pin(async move { Ok(ownership) })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let ownership = match self.lock().held(lease) {
            Some(entry) => {
                entry.expires_at = Instant::now() + retention;
                entry.state = EntryState::Completed(Box::new(response.clone()));
                Ownership::Held
            }
            None => Ownership::Lost,
        };
        Box::pin(async move { Ok(ownership) })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        let mut state = self.lock();
        let ownership = match state.held(lease) {
            Some(_) => {
                state.records.remove(lease.record());
                Ownership::Held
            }
            None => Ownership::Lost,
        };
        drop(state);
        Box::pin(async move { Ok(ownership) })
    }
}

#[cfg(test)]
mod tests {
    crate::store_conformance_tests!(async { super::MemoryStore::new() });
}
