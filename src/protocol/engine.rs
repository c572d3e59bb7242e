//! The engine the requests of one layer run on: its settings, where it records what it does,
//! and the live state its requests share (waiters, held leases, recent durations).

use std::{
    cell::Cell,
    sync::{Arc, OnceLock, atomic::AtomicBool},
};

use http::Response;
use uuid::Uuid;

use super::{
    lease::Leases,
    wait::{Durations, Waiters},
};
use crate::{
    IdempotencyKey, IdempotencyOutcome, body::ResponseBody, grpc::Wire, problem::Rejection,
    settings::Settings, store::Store, stripes::Padded, telemetry::Telemetry,
};

/// What the services of one layer share: its settings, where they record what they do, and
/// what they learn at run time.
///
/// Aligned to a pair of cache lines, so that the count of the `Arc` every request clones is
/// not on a line with the settings every request reads (see `crate::stripes`).
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct Engine {
    pub(crate) settings: Settings,
    pub(crate) telemetry: Telemetry,
    pub(super) state: Arc<State>,
}

/// The live state of one layer's requests, shared by every service it builds.
#[derive(Default)]
pub(crate) struct State {
    /// Requests waiting for a duplicate of theirs to finish.
    pub(super) waiters: Waiters,
    /// The leases this layer's requests hold, and the task that renews them: locked by every
    /// request, so on cache lines of its own.
    pub(super) leases: Padded<Leases>,
    /// Recent handler durations, for `Retry-After` hints.
    pub(super) durations: Durations,
    /// Whether the warning about a timeout layer inside this one was logged.
    pub(super) warned_inner_timeout: AtomicBool,
    /// The store renewals go through: the store's detached twin, made with the first lease.
    renewals: OnceLock<Arc<dyn Store>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("waiters", &self.waiters)
            .field("leases", &self.leases)
            .field("durations", &self.durations)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub(crate) fn new(settings: Settings, telemetry: Telemetry, state: Arc<State>) -> Self {
        Self {
            settings,
            telemetry,
            state,
        }
    }

    /// The layer's own answer to a request, rendered and reported.
    pub(crate) fn respond<B>(
        &self,
        rejection: Rejection,
        key: Option<&IdempotencyKey>,
        wire: Wire,
    ) -> Response<ResponseBody<B>> {
        self.settings
            .answers
            .respond(&self.telemetry, rejection, key, wire)
    }

    /// Reports what the layer did with a request on its answer.
    pub(super) fn report<B>(&self, outcome: IdempotencyOutcome, response: &mut Response<B>) {
        self.settings
            .answers
            .report(&self.telemetry, outcome, response);
    }

    /// The store the calls made from the renewal thread go through, renewals and the release
    /// of a claim whose answer never came (see [`Store::detached`]).
    pub(super) fn renewal_store(&self) -> &Arc<dyn Store> {
        let store = &self.settings.store;
        self.state
            .renewals
            .get_or_init(|| store.detached().unwrap_or_else(|| Arc::clone(store)))
    }

    /// A fresh owner token, unique across the fleet without a system call per request: 64
    /// random bits each thread draws once, and a counter of the thread's own (one the threads
    /// shared would move between the workers' caches on every request); or, for a layer with
    /// a seed, the seed and a counter of the layer's own.
    pub(crate) fn owner_token(&self) -> Uuid {
        thread_local! {
            static TOKENS: Cell<(u64, u64)> = Cell::new((Uuid::new_v4().as_u64_pair().0, 0));
        }
        match &self.settings.seed {
            Some(seed) => seed.token(),
            None => TOKENS.with(|tokens| {
                let (thread, count) = tokens.get();
                tokens.set((thread, count + 1));
                Uuid::from_u64_pair(thread, count)
            }),
        }
    }
}
