//! Keeping the lease of a claim this process holds: renewed by one task per layer on a thread
//! of the process's own, and checked before work starts under a grant seen late.

use std::{
    sync::{Arc, LazyLock, Mutex, PoisonError},
    time::Duration,
};

use tokio::{task::JoinHandle, time::Instant};

use super::Engine;
use crate::{
    store::{ClaimRequest, Lease, Ownership},
    telemetry::Operation,
};

/// How soon a renewal that found the record locked (by the handler's own fence transaction)
/// tries again: the lease must be fresh as soon as that transaction ends.
const BUSY_RETRY: Duration = Duration::from_millis(20);

/// The leases a layer's requests hold, renewed by one task of the layer's own.
///
/// A task of the process's own renewal thread, not of the application's runtime: a handler that
/// blocks its worker threads (synchronous I/O, a long computation), every one of them or the
/// only one, would otherwise block its own renewals too, and lose its key while it still runs.
///
/// One task for all of them, not one per request: a request shorter than a third of its lease
/// (most are) costs an entry in a map and nothing else. The task sleeps until the next renewal
/// is due, and goes away after a lease without any.
#[derive(Debug, Default)]
pub(crate) struct Leases {
    state: Mutex<LeasesState>,
    /// Told of every renewal's answer, for work waiting to start under a lease confirmed late.
    renewed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct LeasesState {
    /// Held leases by slot; a slot is reused once its request is done.
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    keeper: Option<JoinHandle<()>>,
    /// The generation the next lease gets.
    generations: u64,
}

/// One held lease, as the renewals see it.
#[derive(Debug)]
struct Slot {
    lease: Lease,
    /// The lease length each renewal asks for.
    length: Duration,
    /// When the next renewal is due; `None` while one is under way.
    due: Option<Instant>,
    /// Whether a renewal kept the lease since it was handed to the renewals (every renewal of
    /// this slot and generation was sent after that): from then on they keep it, whatever the
    /// application's runtime does.
    renewed: bool,
    /// Whether work started under the lease: before it does, a lease found lost only means
    /// the grant came too late to act on.
    started: bool,
    /// Whether a renewal found the key in another owner's hands.
    lost: bool,
    /// Whether the key's finalize started: a renewal answered "not held" from then on may
    /// have met this owner's own completion, and the finalize's answer tells.
    finalizing: bool,
    /// Whether the loss was reported (counted and logged): once per lease.
    reported: bool,
    /// Tells a renewal that outlived its request from the slot's next holder.
    generation: u64,
}

/// Whether work may start under a granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// The renewals hold the lease: the grant was seen in time, or a renewal sent after the
    /// lease was handed to them kept it.
    Live,
    /// The grant lapsed before this process could act on it, and another owner took the key
    /// (or finished it): nothing may run under it.
    Lost,
    /// The store did not confirm the lease within a lease (it kept failing).
    Unconfirmed,
}

/// A lease held for a request, renewed until this is dropped. It borrows the engine its
/// request runs on: a clone of the `Arc` would write the count every request shares.
pub(crate) struct Keeper<'a> {
    engine: &'a Arc<Engine>,
    slot: usize,
    /// Tells this request's lease from the slot's later holders.
    generation: u64,
    /// Whether the grant was seen in time: the renewals held it from the start.
    seen_in_time: bool,
}

impl<'a> Keeper<'a> {
    /// Starts renewing `lease`, granted by a claim sent at `sent`, every third of the layer's
    /// lease length. A grant this process saw late (its runtime was busy or blocked when the
    /// answer came) is renewed at once, from the renewal thread.
    pub(crate) fn start(engine: &'a Arc<Engine>, lease: Lease, sent: Instant) -> Self {
        let length = engine.settings.lease;
        let overdue = sent.elapsed() >= period(length);
        // The defect this check fixed, put back on purpose for the simulation to find
        // (`tests/simulation`); never built otherwise.
        #[cfg(simulate_defect_lapsed_grants)]
        let overdue = overdue && false;
        let due = sent + period(length);
        let (slot, generation) = {
            let mut state = engine.state.leases.lock();
            let generation = state.generations;
            state.generations += 1;
            let held = Slot {
                lease: lease.clone(),
                length,
                due: (!overdue).then_some(due),
                renewed: false,
                // Seen in time, the work starts at once.
                started: !overdue,
                lost: false,
                finalizing: false,
                reported: false,
                generation,
            };
            let slot = match state.free.pop() {
                Some(slot) => {
                    state.slots[slot] = Some(held);
                    slot
                }
                None => {
                    state.slots.push(Some(held));
                    state.slots.len() - 1
                }
            };
            let running = state.keeper.as_ref().is_some_and(|k| !k.is_finished());
            if !running {
                state.keeper = Some(engine.spawn_renewal(keep(Arc::clone(engine))));
            }
            (slot, generation)
        };
        if overdue {
            let renewal = renew(Arc::clone(engine), slot, generation, lease, length);
            engine.spawn_renewal(renewal);
        }
        crate::telemetry::claims_held(1.0);
        Self {
            engine,
            slot,
            generation,
            seen_in_time: !overdue,
        }
    }

    /// Whether work may start under the lease: only once the renewals hold it, which they do
    /// whatever the application's runtime does from then on. A grant seen in time (within a
    /// third of the lease of its claim, nearly always) is theirs at once, and costs nothing
    /// more. One this process saw after a stall (its runtime was blocked when the answer came)
    /// waits for the renewal `start` sent at once, from the renewal thread: the grant is acted
    /// on only if that renewal finds it still this owner's, and given up if another owner took
    /// the key meanwhile.
    pub(crate) async fn standing(&self) -> Standing {
        if self.seen_in_time {
            return Standing::Live;
        }
        match self.look() {
            Some(standing) => standing,
            None => Box::pin(self.wait_for_confirmation()).await,
        }
    }

    /// The standing of a grant seen late, if it is settled: live once a renewal sent after the
    /// hand-over kept it; marks the work started then.
    fn look(&self) -> Option<Standing> {
        let mut state = self.engine.state.leases.lock();
        let held = state.slots[self.slot].as_mut().expect("held until dropped");
        if held.lost {
            return Some(Standing::Lost);
        }
        held.started |= held.renewed;
        held.renewed.then_some(Standing::Live)
    }

    /// Waits for a renewal to confirm the lease (or find it lost), up to a lease.
    async fn wait_for_confirmation(&self) -> Standing {
        let give_up = Instant::now() + self.engine.settings.lease;
        loop {
            let renewed = self.engine.state.leases.renewed.notified();
            let mut renewed = std::pin::pin!(renewed);
            renewed.as_mut().enable();
            if let Some(standing) = self.look() {
                return standing;
            }
            if tokio::time::timeout_at(give_up, renewed).await.is_err() {
                return self.look().unwrap_or(Standing::Unconfirmed);
            }
        }
    }

    /// Notes that the key's finalize starts (renewals go on while it is retried).
    pub(super) fn finalizing(&self) {
        let mut state = self.engine.state.leases.lock();
        if let Some(held) = state.slots[self.slot].as_mut() {
            held.finalizing = true;
        }
    }

    /// The finalize found another owner: the lease is lost, reported unless a renewal already
    /// did (one loss, whichever found it first).
    pub(super) fn finalize_lost(&self) {
        let what = "before finalizing: nothing stored (another attempt holds the key)";
        mark_lost(self.engine, self.slot, self.generation, Some(what));
    }

    /// Whether a renewal found the key in another owner's hands.
    pub(crate) fn lost(&self) -> bool {
        self.engine.state.leases.lock().slots[self.slot]
            .as_ref()
            .is_some_and(|held| held.lost)
    }
}

impl Drop for Keeper<'_> {
    fn drop(&mut self) {
        crate::telemetry::claims_held(-1.0);
        let mut state = self.engine.state.leases.lock();
        state.slots[self.slot] = None;
        state.free.push(self.slot);
    }
}

impl Leases {
    fn lock(&self) -> std::sync::MutexGuard<'_, LeasesState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Engine {
    /// Runs a renewal task: on the layer's spawner if it was given one, else on [`renewer`].
    fn spawn_renewal(&self, task: impl Future<Output = ()> + Send + 'static) -> JoinHandle<()> {
        match &self.settings.spawner {
            Some(spawn) => spawn(Box::pin(task)),
            None => renewer().spawn(task),
        }
    }

    /// Releases, owner-checked and off the request's path, a claim whose answer never came:
    /// if the store applied it, the key is this owner's and no handler runs under it. A few
    /// tries while the store is failing; after that its lease frees it.
    pub(super) fn release_unanswered(&self, claim: &ClaimRequest) {
        // From the renewal thread, through the connections it drives.
        let store = Arc::clone(self.renewal_store());
        let (telemetry, lease) = (self.telemetry.clone(), claim.lease_with_fence(0));
        self.spawn_renewal(async move {
            for pause in [100, 400, 1600].map(Duration::from_millis) {
                match telemetry
                    .timed(Operation::Release, store.release(&lease))
                    .await
                {
                    Ok(_) => return,
                    Err(_) => tokio::time::sleep(pause).await,
                }
            }
        });
    }
}

/// The runtime renewals run on: a thread of the process's own, with a current-thread runtime,
/// so that handlers that block every worker of the application's runtime (or its only one)
/// never stop their own renewals. Renewals use the store's detached twin
/// ([`Store::detached`](crate::store::Store::detached)), whose connections are made, and
/// driven, here. One thread per process, started with the first lease.
fn renewer() -> &'static tokio::runtime::Handle {
    static RENEWER: LazyLock<tokio::runtime::Handle> = LazyLock::new(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("idempotency-renewals")
            .build()
            .expect("the renewal runtime builds");
        let handle = runtime.handle().clone();
        std::thread::Builder::new()
            .name("idempotency-renewals".into())
            .spawn(move || runtime.block_on(std::future::pending::<()>()))
            .expect("the renewal thread starts");
        handle
    });
    &RENEWER
}

/// Renewals every third of the lease; never zero, which would spin.
fn period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(1))
}

/// The keeper: renews what is due, sleeps until the next is, and ends after a lease without any
/// lease to keep. Each renewal runs in a task of its own, so a slow store delays no other.
/// Requests shorter than a third of their lease never come due: for them a slot was all.
async fn keep(engine: Arc<Engine>) {
    let mut idle_since = Instant::now();
    loop {
        let now = Instant::now();
        let mut next = now + period(engine.settings.lease);
        let mut due = Vec::new();
        {
            let mut state = engine.state.leases.lock();
            let mut holding = false;
            for (slot, held) in state.slots.iter_mut().enumerate() {
                let Some(held) = held else { continue };
                holding = true;
                match held.due {
                    Some(when) if when <= now => {
                        held.due = None;
                        due.push((slot, held.generation, held.lease.clone(), held.length));
                    }
                    Some(when) => next = next.min(when),
                    None => {}
                }
            }
            if holding {
                idle_since = now;
            } else if now - idle_since >= engine.settings.lease {
                // Nothing held for a whole lease: let the task go. The next lease starts another.
                state.keeper = None;
                return;
            }
        }
        for (slot, generation, lease, length) in due {
            tokio::spawn(renew(Arc::clone(&engine), slot, generation, lease, length));
        }
        tokio::time::sleep_until(next).await;
    }
}

/// One renewal; schedules the next one, or marks the lease lost. A record locked by the
/// handler's own fence transaction is tried again every 20 ms, so that the lease is fresh as
/// soon as that transaction ends.
///
/// The next renewal is due a third of the lease after this one *started*, not after it
/// answered: the lease it got runs from when the store saw it, so a slow store (a renewal that
/// takes most of a third of the lease, or more) does not push every later renewal back by its
/// own slowness. The key is kept as long as each renewal answers within the lease, not within
/// two thirds of it.
async fn renew(engine: Arc<Engine>, slot: usize, generation: u64, lease: Lease, length: Duration) {
    let still_held = |engine: &Engine| {
        engine.state.leases.lock().slots[slot]
            .as_ref()
            .is_some_and(|h| h.generation == generation)
    };
    let next = loop {
        let started = Instant::now();
        let renewed = engine.renewal_store().renew(&lease, length);
        match engine.telemetry.timed(Operation::Renew, renewed).await {
            Ok(Ownership::Held) => confirm(&engine, slot, generation),
            Ok(Ownership::Busy) => {
                tokio::time::sleep(BUSY_RETRY.min(period(length))).await;
                if !still_held(&engine) {
                    return;
                }
                continue;
            }
            Ok(_) => break None,
            Err(error) => {
                tracing::warn!(
                    record = %engine.settings.shown_record(lease.record()),
                    error = &error as &dyn std::error::Error,
                    "lease renewal failed; retrying"
                );
            }
        }
        let due = started + period(length);
        // A renewal that took a period or more is followed at once, by this task: the keeper
        // looks again only a period after it handed this one out.
        if Instant::now() < due || !still_held(&engine) {
            break Some(due);
        }
    };
    match next {
        Some(due) => schedule(&engine, slot, generation, due),
        None => mark_lost(&engine, slot, generation, None),
    }
}

/// Sets when the lease's next renewal is due.
fn schedule(engine: &Engine, slot: usize, generation: u64, due: Instant) {
    let mut state = engine.state.leases.lock();
    if let Some(held) = state.slots[slot]
        .as_mut()
        .filter(|h| h.generation == generation)
    {
        held.due = Some(due);
    }
}

/// Marks the lease lost and tells work waiting to start under it; reports the loss (counts
/// and logs it) once per lease. A finalize's finding (`finalize_says`) is always a loss. A
/// renewal's is one only while the work runs: before it started the grant only came too late
/// to act on, and once the finalize started its own answer tells whether another owner took
/// the key.
fn mark_lost(engine: &Engine, slot: usize, generation: u64, finalize_says: Option<&str>) {
    let mut state = engine.state.leases.lock();
    let Some(held) = state.slots[slot]
        .as_mut()
        .filter(|h| h.generation == generation)
    else {
        // Finished meanwhile.
        return;
    };
    held.lost = true;
    let loss = finalize_says.is_some() || (held.started && !held.finalizing);
    let report = loss && !std::mem::replace(&mut held.reported, true);
    let lease = report.then(|| held.lease.clone());
    drop(state);
    engine.state.leases.renewed.notify_waiters();
    if let Some(lease) = lease {
        let what =
            finalize_says.unwrap_or("while the handler runs; its outcome will not be stored");
        engine.telemetry.lease_lost();
        tracing::warn!(
            record = %engine.settings.shown_record(lease.record()),
            owner = %lease.owner(),
            fence = lease.fence(),
            "lease lost {what}"
        );
    }
}

/// Records that a renewal kept the lease, and tells work waiting to start.
fn confirm(engine: &Engine, slot: usize, generation: u64) {
    let mut state = engine.state.leases.lock();
    if let Some(held) = state.slots[slot]
        .as_mut()
        .filter(|h| h.generation == generation)
    {
        held.renewed = true;
        drop(state);
        engine.state.leases.renewed.notify_waiters();
    }
}
