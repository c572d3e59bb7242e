//! Once across the fleet beyond HTTP: queue consumers, webhook processors and scheduled jobs,
//! on the same stores and with the same guarantees as the HTTP layer.
//!
//! Every broker delivers at least once, and two instances with one cron schedule run it twice.
//! [`Once`] gives any unit of work what the layer gives a request: the key is claimed (with a
//! scope and a fingerprint of the payload), the work runs while its lease is renewed, its
//! outcome (any value serde can serialize) is stored, and a later delivery of the same key gets
//! that outcome instead of running again. A delivery that meets another still running waits for
//! it (or is told it is in flight); the same key with another payload is a mismatch. The work
//! gets an [`IdempotencyClaim`]: with Postgres, its writes are fenced exactly as a handler's
//! ([`IdempotencyClaim::commit`], [`IdempotencyClaim::advance`]).
//!
//! ```no_run
//! use tower_idempotency::{MemoryStore, work::{Once, Unit}};
//!
//! # async fn run(message_id: &str, payload: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! let once = Once::new(MemoryStore::new()); // Postgres (behind Redis) in production
//! let unit = Unit::new("orders", message_id, payload)?;
//! let done = once
//!     .run(unit, |claim| async move {
//!         // The effect: once per message, whatever the broker redelivers.
//!         Ok::<_, std::io::Error>(format!("shipped under fence {}", claim.fence()))
//!     })
//!     .await?;
//! println!("{} (replayed: {})", done.value, done.replayed);
//! // Acknowledge the message now: a redelivery would get the same outcome anyway.
//! # Ok(()) }
//! ```
//!
//! # Scheduled work
//!
//! [`Once::run_slot`] runs a job at most once per schedule slot across the fleet
//! (`"nightly-cleanup:2026-12-01"`): start it on every instance; one runs it, the others learn
//! it is running or done. A run that dies is taken over once its lease runs out by the next
//! instance that tries; its fenced writes (each in a transaction with
//! [`IdempotencyClaim::advance`], which also records how far it got) never double, and the
//! taker-over resumes from the recovery point.
//!
//! # A consumer killed after its commit
//!
//! Store the outcome in the work's fenced transaction
//! ([`IdempotencyClaim::commit_with_outcome`]) and a delivery after a kill gets it at once; for
//! work that commits with a plain [`IdempotencyClaim::commit`], [`Once::with_recovery`] rebuilds
//! the outcome from the application's rows. Without either, such a unit answers
//! [`WorkError::OutcomeUnknown`] for the whole retention: it never runs again.
//!
//! # What differs from HTTP
//!
//! No client waits for an answer: a delivery that finds its key in flight waits up to
//! [`with_wait`](Once::with_wait) (10 s by default) and then gets [`WorkError::InFlight`];
//! leave the message unacknowledged and let the broker redeliver it. How soon a message is
//! redelivered (an ack wait, a visibility timeout, `XAUTOCLAIM`'s idle time) is the broker's;
//! keep it above the lease, or deliveries meet their own key in flight and wait.

use std::{fmt, sync::Arc, time::Duration};

use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

#[cfg(feature = "postgres")]
use crate::protocol::{deliver_batch_in_transaction, deliver_in_transaction};
use crate::{
    IdempotencyClaim, IdempotencyKey, KeyError,
    fingerprint::Fingerprint,
    protocol::{Delivered, Engine, State, deliver},
    settings::Settings,
    store::{RecordKey, Store, StoreError},
    telemetry::{Counters, Family, Telemetry},
};

/// Runs units of work at most once per key across every process sharing its store.
#[derive(Clone)]
pub struct Once {
    engine: Arc<Engine>,
}

/// One unit of work: its scope, key and payload (the payload's fingerprint tells a redelivery
/// from a different message reusing the key).
#[derive(Debug, Clone)]
pub struct Unit {
    record: RecordKey,
    fingerprint: Fingerprint,
}

impl Unit {
    /// The unit `key` in `scope` (a queue, a tenant, a job's name), carrying `payload`.
    pub fn new(scope: impl Into<String>, key: &str, payload: &[u8]) -> Result<Self, KeyError> {
        let key = IdempotencyKey::try_from(key)?;
        Ok(Self {
            record: RecordKey::new(scope, key),
            fingerprint: Fingerprint::of_payload(payload),
        })
    }

    /// The record the unit claims.
    pub fn record(&self) -> &RecordKey {
        &self.record
    }
}

/// A unit's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Done<T> {
    /// What the work returned (this delivery's, or the stored one of an earlier delivery).
    pub value: T,
    /// Whether an earlier delivery ran the work and this one got its stored outcome.
    pub replayed: bool,
}

/// What [`Once::run_slot`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// This instance ran the job for the slot.
    Ran,
    /// The job ran for this slot already (here or on another instance).
    AlreadyRan,
    /// Another instance is running it now; try again later (it may die and need taking over).
    RunningElsewhere,
}

/// Why a unit of work did not give an outcome.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkError<E> {
    /// The work failed; the key was released, so the next delivery runs it again.
    #[error("the work failed: {0}")]
    Failed(E),
    /// Another delivery is running it, still after the wait: leave the message for the broker
    /// to redeliver.
    #[error("another delivery of this unit is running it; retry after {retry_after:?}")]
    InFlight {
        /// When the other delivery is likely done.
        retry_after: Duration,
    },
    /// The key was first used with another payload.
    #[error("this key was first used with another payload")]
    Mismatch,
    /// This delivery ran the work, but its lease ran out meanwhile and another delivery took
    /// the unit over; the key was free again when this one looked for its outcome (the other
    /// failed, or the record was swept). This delivery's value was not stored and is not the
    /// unit's: leave the message for the broker to redeliver; a fenced write of this one
    /// never committed.
    #[error("another delivery took this unit over while it ran; its outcome is not this one's")]
    Superseded,
    /// An earlier delivery committed its writes and then died, or failed, before its outcome
    /// was stored: the work will not run again, and there is no outcome to give.
    #[error("an earlier delivery committed its writes but left no outcome; it will not run again")]
    OutcomeUnknown,
    /// An earlier delivery ran the work, and its outcome is past its retention (a store with
    /// tombstones keeps the key until its horizon): the work will not run again, and there is
    /// no outcome to give.
    #[error(
        "an earlier delivery ran this unit, and its outcome is no longer kept; it will not run again"
    )]
    AnswerExpired,
    /// The store could not be reached, and the work did not run; or, for a unit in its own
    /// transaction ([`Once::run_in_transaction`]), the transaction failed outside the work (its
    /// `BEGIN`, the key's row, or the commit, a deferred constraint of the work's included), so
    /// nothing of it committed, unless the connection was lost during the commit. Either way,
    /// the next delivery finds out from the key: it runs the work, or gets its outcome.
    #[error("the idempotency store failed; the work did not run, or its commit failed")]
    Store(#[from] StoreError),
    /// The outcome could not be serialized, or the stored one read back.
    #[error("the outcome could not be encoded or decoded")]
    Outcome(#[source] serde_json::Error),
    /// The unit's key, as [`OnceLayer`]'s function read it from the request, is not a valid key.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[source] KeyError),
}

impl Once {
    /// Units on `store`, with the layer's defaults: a 30 s lease renewed while the work runs,
    /// 24 h retention of outcomes, a 10 s wait for a delivery in flight.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared_store(Arc::new(store))
    }

    /// Units on a store already shared behind an `Arc` (the one an HTTP layer uses, say).
    pub fn from_shared_store(store: Arc<dyn Store>) -> Self {
        Self::with_settings(Settings::new(store))
    }

    fn with_settings(settings: Settings) -> Self {
        let store = settings.store.kind();
        crate::telemetry::register_unit_metrics(store);
        let telemetry = Telemetry::new(Arc::default(), store, Family::Units);
        let engine = Engine::new(settings, telemetry, Arc::new(State::default()));
        Self {
            engine: Arc::new(engine),
        }
    }

    fn change(self, change: impl FnOnce(&mut Settings)) -> Self {
        let mut settings = self.engine.settings.clone();
        change(&mut settings);
        Self::with_settings(settings)
    }

    /// How long a claim survives its process without renewal (renewed every third of it while
    /// the work runs); a dead process's units are taken over once it runs out.
    pub fn with_lease(self, lease: Duration) -> Self {
        self.change(|s| s.lease = lease)
    }

    /// How long outcomes are kept for later deliveries.
    pub fn with_retention(self, retention: Duration) -> Self {
        self.change(|s| s.retention = retention)
    }

    /// How long a delivery that finds its key in flight waits for the other one.
    pub fn with_wait(self, wait: Duration) -> Self {
        self.change(|s| s.wait = wait)
    }

    /// Runs the renewals of units' leases through `spawn`, as
    /// [`IdempotencyLayer::with_spawner`](crate::IdempotencyLayer::with_spawner) does for
    /// requests: for a runtime whose clock you control (paused time, a simulation).
    #[cfg(feature = "simulation")]
    #[cfg_attr(docsrs, doc(cfg(feature = "simulation")))]
    pub fn with_spawner(
        self,
        spawn: impl Fn(crate::store::BoxFuture<'static, ()>) -> tokio::task::JoinHandle<()>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        let spawn: Arc<crate::settings::SpawnFn> = Arc::new(spawn);
        self.change(move |s| s.spawner = Some(spawn))
    }

    /// Makes the units' owner tokens a function of `seed`, as
    /// [`IdempotencyLayer::with_seed`](crate::IdempotencyLayer::with_seed) does for requests:
    /// for a run that must replay exactly. Never in production.
    #[cfg(feature = "simulation")]
    #[cfg_attr(docsrs, doc(cfg(feature = "simulation")))]
    pub fn with_seed(self, seed: u64) -> Self {
        self.change(|s| s.seed = Some(crate::settings::Seed::new(seed)))
    }

    /// Rebuilds the outcome of a unit whose work committed through the fence
    /// ([`IdempotencyClaim::commit`]) and whose process died before the outcome was stored:
    /// the hook gets the unit's record and answers from the application's own rows (the
    /// shipment the work wrote, say). The outcome is stored, owner-checked, and given to this
    /// and every later delivery (replayed), instead of [`WorkError::OutcomeUnknown`] for the
    /// whole retention. `None` means "no outcome yet" (the read failed, say): the delivery is
    /// told the unit is in flight, to be delivered again, as when the store cannot keep the
    /// rebuilt outcome. Called only for such units, once their owner's lease has run out. Needs a store that can adopt a key (Postgres, alone or
    /// behind Redis). Storing the outcome with the fence
    /// ([`IdempotencyClaim::commit_with_outcome`]) makes the hook unnecessary for the units
    /// that do.
    ///
    /// ```
    /// use tower_idempotency::{MemoryStore, work::Once};
    ///
    /// let once = Once::new(MemoryStore::new()).with_recovery(|record| async move {
    ///     // Look the shipment up by `record.key()` in the application's tables…
    ///     Some(format!("shipment for {}", record.key()))
    /// });
    /// ```
    pub fn with_recovery<T, F, Fut>(self, recover: F) -> Self
    where
        T: Serialize,
        F: Fn(RecordKey) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<T>> + Send + 'static,
    {
        let recover = Arc::new(recover);
        self.change(move |s| {
            s.recovery = Some(Arc::new(move |record| {
                let found = recover(record);
                Box::pin(async move {
                    let outcome = serde_json::to_vec(&found.await?)
                        .inspect_err(|error| {
                            tracing::warn!(%error, "the recovered outcome could not be serialized");
                        })
                        .ok()?;
                    Some(http::Response::new(Bytes::from(outcome)))
                })
            }));
        })
    }

    /// The counters of the units run through this value (and its clones).
    pub fn counters(&self) -> Arc<Counters> {
        self.engine.telemetry.counters()
    }

    /// Runs `work` for `unit` unless an earlier delivery did: this delivery's outcome, or the
    /// stored one. `work` gets the unit's claim (to fence its writes); its error releases the
    /// key for the next delivery (unless it committed through the fence).
    ///
    /// The work starts only under a lease the store still confirms: a grant this process saw
    /// after its lease ran out (its runtime was blocked) is given up if another delivery took
    /// the unit meanwhile. A delivery whose lease another took over while its work ran gets the
    /// unit's outcome (the other's, `replayed`), never its own value, which was not stored; or
    /// [`WorkError::Superseded`] when the key was free again.
    pub async fn run<T, E, F, Fut>(&self, unit: Unit, work: F) -> Result<Done<T>, WorkError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(IdempotencyClaim) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let wait = self.engine.settings.wait;
        self.run_waiting(unit, wait, work).await
    }

    async fn run_waiting<T, E, F, Fut>(
        &self,
        unit: Unit,
        wait: Duration,
        work: F,
    ) -> Result<Done<T>, WorkError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(IdempotencyClaim) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let encoded = async |claim| -> Result<Bytes, Encoded<E>> {
            let value = work(claim).await.map_err(Encoded::Work)?;
            serde_json::to_vec(&value)
                .map(Bytes::from)
                .map_err(Encoded::Json)
        };
        let span = self.span(&unit);
        let delivered = deliver(&self.engine, unit.record, unit.fingerprint, wait, encoded);
        answered(tracing::Instrument::instrument(delivered, span).await)
    }

    /// Runs `work` for `unit` in one transaction on a connection of `pool`, with the unit's
    /// claim and outcome in that same transaction, unless an earlier delivery ran it: for work
    /// whose effects are all writes to the Postgres this `Once`'s store keeps its keys in
    /// (alone, or behind Redis). `work` gets the transaction's connection; return from it
    /// without committing.
    ///
    /// One commit per unit, where [`run`](Self::run) makes the claim, the fence and the
    /// completion each a write: the key's lock is taken first in the transaction (deliveries
    /// of one key in this mode run one after the other), its row read, the work done, and the
    /// row written with the outcome last, so the work, the claim and the answer commit together
    /// or not at all. A delivery whose process dies, or whose work fails, rolls back and leaves
    /// nothing behind, and its lock ends with its transaction.
    ///
    /// What stands for the lease: the transaction's pauses are bounded by
    /// [`with_lease`](Self::with_lease) (`idle_in_transaction_session_timeout`, for this
    /// transaction), so a process stalled between statements for longer loses its session, and
    /// with it everything it would have committed, while the next delivery runs. A delivery that
    /// finds the key held (its lock, or a lease of the other mode) tries again every 10 to
    /// 100 ms, holding no connection in between, up to [`with_wait`](Self::with_wait), then gets
    /// [`WorkError::InFlight`]. Keep what the work does outside the database (a call to another
    /// service) out of this mode, or idempotent on its own: it is not rolled back.
    ///
    /// Units of one key are best run in one mode. They exclude each other across modes all
    /// the same: a delivery in this mode waits for a key [`run`](Self::run) holds, and the
    /// row's primary key decides between the two. [`WorkError::Store`] here means nothing
    /// of the work committed, or, when the commit's answer was lost, all of it did with its
    /// outcome (the next delivery gets it). Needs one Postgres (not Citus).
    ///
    /// ```no_run
    /// use tower_idempotency::{sqlx::{self, PgPool}, store::PostgresStore, work::{Once, Unit}};
    ///
    /// # async fn run(pool: PgPool, order_id: &str, payload: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
    /// let once = Once::new(PostgresStore::new(pool.clone()));
    /// let unit = Unit::new("orders", order_id, payload)?;
    /// let done = once
    ///     .run_in_transaction(unit, &pool, async |tx: &mut sqlx::PgConnection| {
    ///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
    ///             .bind(order_id)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok::<_, sqlx::Error>(format!("shp_{order_id}"))
    ///     })
    ///     .await?;
    /// println!("{} (replayed: {})", done.value, done.replayed);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub async fn run_in_transaction<T, E, F>(
        &self,
        unit: Unit,
        pool: &sqlx::PgPool,
        work: F,
    ) -> Result<Done<T>, WorkError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, E>,
    {
        let encoded = async |tx: &mut sqlx::PgConnection| -> Result<Bytes, Encoded<E>> {
            let value = work(tx).await.map_err(Encoded::Work)?;
            serde_json::to_vec(&value)
                .map(Bytes::from)
                .map_err(Encoded::Json)
        };
        let span = self.span(&unit);
        let (engine, wait) = (&self.engine, self.engine.settings.wait);
        let unit = (unit.record, unit.fingerprint);
        let delivered = deliver_in_transaction(engine, pool, unit, wait, encoded);
        answered(tracing::Instrument::instrument(delivered, span).await)
    }

    /// Runs the work of `units` in one transaction on a connection of `pool`, with their
    /// claims and outcomes in it: [`run_in_transaction`](Self::run_in_transaction) for a
    /// consumer's prefetch window, with one commit for the window instead of one per unit.
    /// `work(i)` is the work of the unit at `i` in `units` (asked for each time that unit is
    /// to run), which gets the transaction's connection; the answers come back in the units'
    /// order, each what `run_in_transaction` would have given it.
    ///
    /// The units whose keys are free are worked first, one after the other, in one
    /// transaction: their locks taken and their keys read in its first statement, their rows
    /// written with their outcomes in one statement after the last one's work, and one commit.
    /// Besides its work, a window of n units costs 4 round trips, against 3n for n
    /// transactions without `Once`. They commit together or not at all. Every other unit is
    /// then delivered on its own as `run_in_transaction` delivers it: one redelivered (its
    /// outcome, `replayed`), held by another delivery (waited for up to
    /// [`with_wait`](Self::with_wait)), another payload's, or a second unit of a key already in
    /// the batch.
    ///
    /// When the batch does not commit, each unit is delivered on its own, which reads its key
    /// first: a unit's work that fails rolls back the whole batch and is that unit's
    /// [`WorkError::Failed`], and the other units run again, one transaction each (the work of
    /// those before it ran twice, once rolled back: as in `run_in_transaction`, keep what is
    /// not in the database out of the work). Likewise when a key of the batch was claimed
    /// meanwhile by [`run`](Self::run) (which the locks do not hold back), or the commit's
    /// answer was lost: a unit the batch did commit is then answered `replayed`. When no
    /// connection or transaction could be had, no work ran and every unit gets
    /// [`WorkError::Store`].
    ///
    /// The batch holds its free keys' locks until it commits, so deliveries of those keys in
    /// this mode wait for it: keep a batch to what the broker delivered at once (its prefetch
    /// window). The pauses between its statements are bounded by
    /// [`with_lease`](Self::with_lease), as in `run_in_transaction`. Needs one Postgres (not
    /// Citus).
    ///
    /// ```no_run
    /// use tower_idempotency::{sqlx::{self, PgPool}, store::PostgresStore, work::{Once, Unit}};
    ///
    /// # async fn run(pool: PgPool, window: Vec<(String, Vec<u8>)>) -> Result<(), Box<dyn std::error::Error>> {
    /// let once = Once::new(PostgresStore::new(pool.clone()));
    /// let units = (window.iter())
    ///     .map(|(order_id, payload)| Unit::new("orders", order_id, payload))
    ///     .collect::<Result<Vec<_>, _>>()?;
    /// let ship = |i: usize| {
    ///     let order_id = &window[i].0;
    ///     async move |tx: &mut sqlx::PgConnection| {
    ///         sqlx::query("INSERT INTO shipments (order_id) VALUES ($1)")
    ///             .bind(order_id)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok::<_, sqlx::Error>(format!("shp_{order_id}"))
    ///     }
    /// };
    /// for ((order_id, _), done) in window.iter().zip(once.run_batch_in_transaction(units, &pool, ship).await) {
    ///     // Acknowledge each message that was delivered (its outcome is stored); leave the
    ///     // others for the broker to deliver again.
    ///     println!("{order_id}: {:?}", done.map(|done| done.value));
    /// }
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub async fn run_batch_in_transaction<T, E, W>(
        &self,
        units: Vec<Unit>,
        pool: &sqlx::PgPool,
        mut work: impl FnMut(usize) -> W,
    ) -> Vec<Result<Done<T>, WorkError<E>>>
    where
        T: Serialize + DeserializeOwned,
        W: AsyncFnOnce(&mut sqlx::PgConnection) -> Result<T, E>,
    {
        let encoded = |i: usize| {
            let work = work(i);
            async move |tx: &mut sqlx::PgConnection| -> Result<Bytes, Encoded<E>> {
                let value = work(tx).await.map_err(Encoded::Work)?;
                serde_json::to_vec(&value)
                    .map(Bytes::from)
                    .map_err(Encoded::Json)
            }
        };
        let span = tracing::info_span!("idempotency_units", units = units.len());
        let (engine, wait) = (&self.engine, self.engine.settings.wait);
        let units: Vec<_> = (units.into_iter())
            .map(|unit| (unit.record, unit.fingerprint))
            .collect();
        let delivered = deliver_batch_in_transaction(engine, pool, &units, wait, encoded);
        let delivered = tracing::Instrument::instrument(delivered, span).await;
        delivered.into_iter().map(answered).collect()
    }

    /// A span per delivery, as per guarded request: key and scope as pseudonyms.
    fn span(&self, unit: &Unit) -> tracing::Span {
        let settings = &self.engine.settings;
        tracing::info_span!(
            "idempotency_unit",
            key = %settings.shown(unit.record.key().as_str()),
            scope = %settings.shown(unit.record.scope()),
        )
    }

    /// Runs `job` for `slot` (say `"nightly-cleanup:2026-12-01"`) unless it ran already or
    /// runs elsewhere now, without waiting: call it on every instance, and again while the
    /// slot lasts, so that a run that died is taken over once its lease runs out. `job` gets
    /// the slot's claim: fence each write with [`IdempotencyClaim::advance`] (which records how
    /// far the run got, for the one that takes over) or [`IdempotencyClaim::commit`].
    pub async fn run_slot<E, F, Fut>(&self, slot: &str, job: F) -> Result<Slot, WorkError<E>>
    where
        F: FnOnce(IdempotencyClaim) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let unit = Unit::new("schedule", slot, b"").map_err(|_| WorkError::Mismatch)?;
        match self.run_waiting(unit, Duration::ZERO, job).await {
            Ok(Done {
                replayed: false, ..
            }) => Ok(Slot::Ran),
            Ok(Done { replayed: true, .. }) => Ok(Slot::AlreadyRan),
            Err(WorkError::InFlight { .. }) => Ok(Slot::RunningElsewhere),
            // Ran, long enough ago that its outcome is gone.
            Err(WorkError::AnswerExpired) => Ok(Slot::AlreadyRan),
            Err(error) => Err(error),
        }
    }
}

tokio::task_local! {
    /// The claim of the unit an [`OnceService`] is running, for the inner service to fence with.
    static CLAIM: IdempotencyClaim;
}

/// The claim of the unit of work this task runs under an [`OnceLayer`]: fence the service's
/// writes with it (`current_claim().unwrap().commit(&mut tx)`). `None` outside one.
pub fn current_claim() -> Option<IdempotencyClaim> {
    CLAIM.try_with(IdempotencyClaim::clone).ok()
}

/// Applies [`OnceService`] to any `Service<Request>`: each request is a unit of work whose
/// scope, key and payload `unit` reads from it (a job's id and arguments, a message's id and
/// body), so job frameworks built on tower and hand-written consumer loops get the same
/// guarantees as [`Once::run`]. The inner service's response is the outcome (serde), and it
/// finds the unit's claim with [`current_claim`].
///
/// ```
/// use tower_idempotency::{MemoryStore, work::{Once, OnceLayer, Unit}};
///
/// struct Job { id: String, args: Vec<u8> }
///
/// let layer = OnceLayer::new(Once::new(MemoryStore::new()), |job: &Job| {
///     Unit::new("emails", &job.id, &job.args)
/// });
/// let service = tower::ServiceBuilder::new()
///     .layer(layer)
///     .service_fn(|job: Job| async move { Ok::<_, std::io::Error>(job.args.len()) });
/// ```
pub struct OnceLayer<U> {
    once: Once,
    unit: Arc<U>,
}

impl<U> OnceLayer<U> {
    /// Units of `once`, read from each request by `unit`.
    pub fn new(once: Once, unit: U) -> Self {
        Self {
            once,
            unit: Arc::new(unit),
        }
    }
}

impl<U> Clone for OnceLayer<U> {
    fn clone(&self) -> Self {
        Self {
            once: self.once.clone(),
            unit: Arc::clone(&self.unit),
        }
    }
}

impl<U> fmt::Debug for OnceLayer<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnceLayer")
            .field("once", &self.once)
            .finish_non_exhaustive()
    }
}

impl<S, U> tower_layer::Layer<S> for OnceLayer<U> {
    type Service = OnceService<S, U>;

    fn layer(&self, inner: S) -> Self::Service {
        OnceService {
            inner,
            once: self.once.clone(),
            unit: Arc::clone(&self.unit),
        }
    }
}

/// Middleware that runs each request as a unit of work, at most once per key across the fleet.
/// Built by [`OnceLayer`]; its response is the [`Done`] outcome.
pub struct OnceService<S, U> {
    inner: S,
    once: Once,
    unit: Arc<U>,
}

impl<S: Clone, U> Clone for OnceService<S, U> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            once: self.once.clone(),
            unit: Arc::clone(&self.unit),
        }
    }
}

impl<S: fmt::Debug, U> fmt::Debug for OnceService<S, U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnceService")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, U, Req> tower_service::Service<Req> for OnceService<S, U>
where
    S: tower_service::Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Response: Serialize + DeserializeOwned + Send,
    S::Error: Send,
    U: Fn(&Req) -> Result<Unit, KeyError> + Send + Sync + 'static,
    Req: Send + 'static,
{
    type Response = Done<S::Response>;
    type Error = WorkError<S::Error>;
    type Future = crate::store::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(WorkError::Failed)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let unit = (self.unit)(&request);
        // The service driven to readiness is the one called; a clone stays here.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let once = self.once.clone();
        Box::pin(async move {
            let unit = unit.map_err(WorkError::InvalidKey)?;
            let work = |claim: IdempotencyClaim| CLAIM.scope(claim, inner.call(request));
            once.run(unit, work).await
        })
    }
}

/// What a delivery answers its caller.
fn answered<T: DeserializeOwned, E>(
    delivered: Delivered<Encoded<E>>,
) -> Result<Done<T>, WorkError<E>> {
    let decode = |bytes: Bytes, replayed| {
        let value = serde_json::from_slice(&bytes).map_err(WorkError::Outcome)?;
        Ok(Done { value, replayed })
    };
    match delivered {
        Delivered::Executed(bytes) => decode(bytes, false),
        Delivered::Superseded => Err(WorkError::Superseded),
        Delivered::Replayed(bytes) => decode(bytes, true),
        Delivered::Failed(Encoded::Work(error)) => Err(WorkError::Failed(error)),
        Delivered::Failed(Encoded::Json(error)) => Err(WorkError::Outcome(error)),
        Delivered::CommittedButFailed | Delivered::OutcomeUnknown => Err(WorkError::OutcomeUnknown),
        Delivered::InFlight { retry_after } => Err(WorkError::InFlight { retry_after }),
        Delivered::Mismatch => Err(WorkError::Mismatch),
        Delivered::AnswerExpired => Err(WorkError::AnswerExpired),
        Delivered::Store(error) => Err(WorkError::Store(error)),
    }
}

/// The work's outcome on its way to the store.
enum Encoded<E> {
    Work(E),
    Json(serde_json::Error),
}

impl fmt::Debug for Once {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Once")
            .field("settings", &self.engine.settings)
            .finish_non_exhaustive()
    }
}
