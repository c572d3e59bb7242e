//! Duplicates that wait for the first request with their key: for how long, how they are woken,
//! and what to tell them if they cannot.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, PoisonError, Weak,
        atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
    },
    time::Duration,
};

use futures_util::FutureExt;
use http::HeaderMap;
use tokio::{sync::Notify, time::Instant};

use super::Engine;
use crate::{
    grpc, headers,
    settings::Settings,
    store::{ClaimRequest, Marked, RecordKey, Wake},
    stripes::{self, Padded, STRIPES},
    telemetry::{Operation, Wakeup},
};

/// How long a duplicate may wait for the first request with its key, and whether that is the
/// request's own preference.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    pub(super) budget: Duration,
    /// The request asked (`Prefer: wait=N`) and the layer honors it.
    preferred: bool,
}

impl Wait {
    /// The request's preference up to the layer's maximum, or the layer's budget; within the
    /// deadline a gRPC caller announced (`grpc-timeout`).
    pub(super) fn of(settings: &Settings, headers: &HeaderMap) -> Self {
        let preferred = headers::preferred_wait(headers);
        let budget = preferred.map_or(settings.wait, |wait| wait.min(settings.max_wait));
        let budget = match grpc::deadline(headers) {
            // Leave the caller a fifth of its deadline to read the answer.
            Some(deadline) => budget.min(deadline * 4 / 5),
            None => budget,
        };
        Self {
            budget,
            preferred: preferred.is_some(),
        }
    }

    /// Says on the layer's own answer that the preference was honored, and for how long.
    pub(super) fn applied<B>(self, answer: &mut http::Response<B>) {
        if self.preferred {
            let applied = format!("wait={}", self.budget.as_secs());
            let value = http::HeaderValue::try_from(applied).expect("digits");
            answer
                .headers_mut()
                .insert(headers::PREFERENCE_APPLIED, value);
        }
    }
}

/// How often a waiter that hears from the store looks at the key anyway: a word lost without
/// its connection's loss being noticed (a network that went silent, a front the breaker
/// skipped) costs at most this. A lost connection is noticed, and its waiters look at once.
const BACKSTOP: Duration = Duration::from_secs(5);

/// How soon after the holder's lease runs out a waiter looks: the holder may be gone, and the
/// key claimable.
const PAST_THE_LEASE: Duration = Duration::from_millis(20);

/// How soon a waiter marks again a record a transaction holds locked (the owner's fence, about
/// to commit).
const MARK_BUSY: Duration = Duration::from_millis(20);

/// A request that waits for the first request with its key: woken by the first when it runs
/// in this process, by the store's word when it runs elsewhere in the fleet (where the store
/// gives word: [`Wakes`](crate::store::Wakes)), or, without word, by polling.
pub(super) struct Waiting<'a> {
    interest: Interest<'a>,
    /// The store's word of the key's end, where it gives it and listens.
    wake: Option<Wake>,
    backoff: Backoff,
}

impl<'a> Waiting<'a> {
    /// Starts waiting for `claim`'s key: counted, heard by this process's owner, and listened
    /// for where the store gives word.
    pub(super) async fn start(engine: &'a Engine, claim: &'a ClaimRequest) -> Self {
        engine.telemetry.waiting();
        let record = claim.record();
        let interest = engine.state.waiters.interest(record);
        let wake = match engine.settings.store.wakes() {
            Some(wakes) => {
                let listen = wakes.listen(record);
                let listened = engine.telemetry.timed(Operation::Mark, listen).await;
                listened.ok()
            }
            None => None,
        };
        let (prefix, count) = claim.owner().as_u64_pair();
        let backoff = Backoff::new(prefix ^ count.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        Self {
            interest,
            wake,
            backoff,
        }
    }

    /// Pauses until the key may have ended: its end heard (from this process's owner, or the
    /// store), the holder's lease over (`lease_left`), the slow poll due, or, without the
    /// store's word, the next poll; never past `deadline`. `None` if `gone` (the caller
    /// leaving) resolved first. The record is marked first, so that its end is told.
    pub(super) async fn pause(
        &mut self,
        engine: &Engine,
        record: &RecordKey,
        (lease_left, deadline): (Duration, Instant),
        gone: &mut (impl Future<Output = ()> + Unpin),
    ) -> Option<Wakeup> {
        let local = self.interest.notify().notified();
        let mut local = std::pin::pin!(local);
        local.as_mut().enable();
        let heard = self.wake.as_ref().map(Wake::notified);
        let mut heard = std::pin::pin!(heard);
        if let Some(heard) = heard.as_mut().as_pin_mut() {
            heard.enable();
        }
        let pause = match self.marked(engine, record).await {
            Some(Marked::Waited) => BACKSTOP.min(lease_left + PAST_THE_LEASE),
            Some(Marked::Busy) => MARK_BUSY,
            // Ended already: look at once.
            Some(_) => return Some(Wakeup::Store),
            None => self.backoff.pause(),
        };
        let pause = pause.min(deadline.saturating_duration_since(Instant::now()));
        let heard = async {
            match heard.as_mut().as_pin_mut() {
                Some(heard) => heard.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = gone => None,
            () = local => Some(Wakeup::Process),
            () = heard => Some(Wakeup::Store),
            () = tokio::time::sleep(pause) => Some(Wakeup::Poll),
        }
    }

    /// What marking the record found, where the store listens for this waiter; `None` where
    /// it does not (or the mark failed): the waiter polls.
    async fn marked(&self, engine: &Engine, record: &RecordKey) -> Option<Marked> {
        self.wake.as_ref()?;
        let wakes = engine.settings.store.wakes()?;
        let marked = engine.telemetry.timed(Operation::Mark, wakes.mark(record));
        match marked.await {
            Ok(marked) => Some(marked),
            Err(error) => {
                tracing::debug!(
                    error = &error as &dyn std::error::Error,
                    "could not mark the key waited for; polling"
                );
                None
            }
        }
    }
}

/// Whether `gone` resolved already.
pub(super) fn left(gone: &mut (impl Future<Output = ()> + Unpin)) -> bool {
    gone.now_or_never().is_some()
}

/// The keys this process's requests are waiting on, each with a notification their owner (on
/// this process) fires once it has finalized the key. Requests waiting on an owner elsewhere in
/// the fleet hear from the store (or poll it).
#[derive(Debug, Default)]
pub(crate) struct Waiters {
    keys: Mutex<HashMap<RecordKey, Weak<Notify>>>,
    /// How many keys are watched: finalizing costs nothing while no request waits.
    watched: AtomicUsize,
}

/// A waiter's interest in one key; the entry goes when the last waiter does.
pub(crate) struct Interest<'a> {
    waiters: &'a Waiters,
    record: &'a RecordKey,
    notify: Arc<Notify>,
}

impl Waiters {
    pub(crate) fn interest<'a>(&'a self, record: &'a RecordKey) -> Interest<'a> {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let notify = match keys.get(record).and_then(Weak::upgrade) {
            Some(notify) => notify,
            None => {
                let notify = Arc::new(Notify::new());
                keys.insert(record.clone(), Arc::downgrade(&notify));
                self.watched.store(keys.len(), Relaxed);
                notify
            }
        };
        Interest {
            waiters: self,
            record,
            notify,
        }
    }

    /// Wakes every request of this process waiting on `record`.
    pub(crate) fn wake(&self, record: &RecordKey) {
        if self.watched.load(Relaxed) == 0 {
            return;
        }
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(notify) = keys.get(record).and_then(Weak::upgrade) {
            notify.notify_waiters();
        }
    }
}

impl Interest<'_> {
    pub(crate) fn notify(&self) -> &Notify {
        &self.notify
    }
}

impl Drop for Interest<'_> {
    fn drop(&mut self) {
        let mut keys = self
            .waiters
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // The map holds a weak reference: this is the last waiter when ours is the only strong one.
        if Arc::strong_count(&self.notify) == 1 {
            keys.remove(self.record);
            self.waiters.watched.store(keys.len(), Relaxed);
        }
    }
}

/// How long a waiting request pauses between two looks at the store: short at first (most
/// handlers are quick), doubling up to a ceiling that bounds the load a waiter puts on the store.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    jitter: u64,
}

const FIRST_POLL: Duration = Duration::from_millis(10);
const LAST_POLL: Duration = Duration::from_millis(200);

impl Backoff {
    /// A schedule; `seed` (random per request) spreads waiters that started together.
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            next: FIRST_POLL,
            jitter: seed | 1,
        }
    }

    pub(crate) fn pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(LAST_POLL);
        // ±25 %, from a xorshift of the seed.
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        let quarter = pause.as_micros() as u64 / 4;
        let offset = self.jitter % (2 * quarter + 1);
        pause - Duration::from_micros(quarter) + Duration::from_micros(offset)
    }
}

/// The last handler durations this layer saw, for a `Retry-After` that says when the answer is
/// likely ready rather than when the lease would run out: the last [`SAMPLES`] each thread
/// recorded, in its own stripe (every request records one; see `crate::stripes`).
#[derive(Debug, Default)]
pub(crate) struct Durations {
    stripes: [Padded<Samples>; STRIPES],
}

/// One thread's last durations, in milliseconds, in a ring; zero marks an empty slot.
#[derive(Debug, Default)]
struct Samples {
    millis: [AtomicU64; SAMPLES],
    next: AtomicUsize,
}

const SAMPLES: usize = 16;

impl Durations {
    pub(crate) fn record(&self, took: Duration) {
        let samples = &self.stripes[stripes::mine()];
        let slot = samples.next.fetch_add(1, Relaxed) % SAMPLES;
        // A sub-millisecond run counts as one.
        samples.millis[slot].store((took.as_millis() as u64).max(1), Relaxed);
    }

    /// The 90th percentile of the recent durations, if any were seen.
    pub(crate) fn typical(&self) -> Option<Duration> {
        let mut seen: Vec<u64> = (self.stripes.iter())
            .flat_map(|samples| &samples.millis)
            .map(|slot| slot.load(Relaxed))
            .filter(|&ms| ms > 0)
            .collect();
        if seen.is_empty() {
            return None;
        }
        seen.sort_unstable();
        Some(Duration::from_millis(seen[seen.len() * 9 / 10]))
    }

    /// How long to tell a client to wait before retrying a key still in flight: the recent
    /// typical duration, never more than the time left on the lease.
    pub(crate) fn retry_after(&self, lease_left: Duration) -> Duration {
        let typical = self.typical().unwrap_or(Duration::from_secs(1));
        typical.min(lease_left).max(Duration::from_millis(50))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    #[test]
    fn the_hint_follows_recent_durations_within_the_lease() {
        let durations = Durations::default();
        assert_eq!(
            durations.retry_after(Duration::from_secs(30)),
            Duration::from_secs(1)
        );
        for _ in 0..100 {
            durations.record(Duration::from_millis(50));
        }
        durations.record(Duration::from_secs(20));
        assert_eq!(
            durations.retry_after(Duration::from_secs(30)),
            Duration::from_millis(50)
        );
        for _ in 0..20 {
            durations.record(Duration::from_secs(20));
        }
        assert_eq!(
            durations.retry_after(Duration::from_secs(30)),
            Duration::from_secs(20)
        );
        assert_eq!(
            durations.retry_after(Duration::from_secs(3)),
            Duration::from_secs(3)
        );
    }

    #[test]
    fn backoff_doubles_to_its_ceiling_with_jitter() {
        let mut backoff = Backoff::new(7);
        let pauses: Vec<_> = (0..8).map(|_| backoff.pause()).collect();
        assert!(
            pauses[0] >= Duration::from_micros(7500) && pauses[0] <= Duration::from_micros(12500)
        );
        assert!(pauses[7] >= Duration::from_millis(150) && pauses[7] <= Duration::from_millis(250));
    }

    #[tokio::test]
    async fn waiters_are_woken_and_forgotten() {
        let waiters = Waiters::default();
        let record = RecordKey::new("s", IdempotencyKey::try_from("k").unwrap());
        {
            let interest = waiters.interest(&record);
            let notified = interest.notify().notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            waiters.wake(&record);
            notified.await;
        }
        assert!(waiters.keys.lock().unwrap().is_empty());
    }
}
