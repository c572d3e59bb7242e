//! The simulated fleet: hosts each running the crate's layer in front of a handler, reaching
//! the authority over a wire of their own (delays, lost requests, lost answers, partitions),
//! with runtimes that can be blocked, and processes that can crash and restart.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering::SeqCst},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{Request, Response, StatusCode},
    routing::post,
};
use bytes::Bytes;
use http_body_util::BodyExt;
use tokio::task::{AbortHandle, JoinHandle};
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyClaim, IdempotencyLayer,
    store::StoredResponse,
    store::{BoxFuture, ClaimOutcome, ClaimRequest, Lease, Ownership, Store, StoreError},
    work::{Once, Unit, WorkError},
};

use super::{
    LEASE, Rng, SCOPE, SLOTS, UNITS, World,
    model::{Answer, Call},
};

/// How long a call over a partitioned wire takes to fail.
const TIMEOUT: Duration = Duration::from_millis(500);

/// One incarnation of a host's process: its runtime (blocked or not), its tasks, its layer.
/// Once it dies, none of its tasks runs again, and nothing it spawns runs at all.
struct Process {
    blocked: AtomicBool,
    alive: AtomicBool,
    waiting: Mutex<Vec<Waker>>,
    tasks: Mutex<Vec<AbortHandle>>,
    router: Mutex<Option<Router>>,
    once: Mutex<Option<Once>>,
}

impl Process {
    fn runs(&self) -> bool {
        !self.blocked.load(SeqCst)
    }

    fn unblock(&self) {
        self.blocked.store(false, SeqCst);
        for waker in self.waiting.lock().unwrap().drain(..) {
            waker.wake();
        }
    }

    /// Runs `task` as one of the process's, polled only while its runtime is not blocked.
    fn spawn(self: &Arc<Self>, task: BoxFuture<'static, ()>) -> JoinHandle<()> {
        let process = Arc::clone(self);
        let handle = tokio::spawn(Task { process, task });
        let mut tasks = self.tasks.lock().unwrap();
        tasks.retain(|task| !task.is_finished());
        tasks.push(handle.abort_handle());
        handle
    }

    /// The process dies where it stands.
    fn kill(&self) {
        self.alive.store(false, SeqCst);
        *self.router.lock().unwrap() = None;
        *self.once.lock().unwrap() = None;
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
        self.unblock();
    }
}

/// A task of a process.
struct Task {
    process: Arc<Process>,
    task: BoxFuture<'static, ()>,
}

impl Future for Task {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if !self.process.alive.load(SeqCst) {
            return Poll::Ready(());
        }
        if !self.process.runs() {
            self.process
                .waiting
                .lock()
                .unwrap()
                .push(cx.waker().clone());
            return Poll::Pending;
        }
        self.task.as_mut().poll(cx)
    }
}

/// One host: its wire to the authority, and its current process.
pub struct Host {
    pub index: usize,
    wire: Wire,
    process: Mutex<Arc<Process>>,
}

impl Host {
    pub fn start(index: usize, world: &World) -> Arc<Self> {
        let wire = Wire {
            world: world.clone(),
            partitioned: Arc::default(),
        };
        Arc::new(Self {
            index,
            process: Mutex::new(boot(wire.clone())),
            wire,
        })
    }

    fn process(&self) -> Arc<Process> {
        Arc::clone(&self.process.lock().unwrap())
    }

    /// Sends `request` to this host over the caller's network (delayed both ways; an answer
    /// now and then lost after the host sent it): its answer, or `None` when the host is down,
    /// died before answering, or the answer was lost.
    pub async fn call(&self, request: Request<Body>) -> Option<Response<Bytes>> {
        let (out, back, lost) = {
            let mut rng = self.wire.world.rng();
            let delay = |rng: &mut Rng| Duration::from_micros(rng.below(10_000));
            (delay(&mut rng), delay(&mut rng), rng.chance(0.03))
        };
        tokio::time::sleep(out).await;
        let answer = self.serve(request).await?;
        tokio::time::sleep(back).await;
        if lost {
            self.wire.world.fault();
            return None;
        }
        Some(answer)
    }

    /// `request` served by the host's current process.
    async fn serve(&self, request: Request<Body>) -> Option<Response<Bytes>> {
        let process = self.process();
        let router = process.router.lock().unwrap().clone()?;
        let (answer, answered) = tokio::sync::oneshot::channel();
        let serve = async move {
            let Ok(response) = router.oneshot(request).await;
            let (parts, body) = response.into_parts();
            if let Ok(body) = body.collect().await {
                let _ = answer.send(Response::from_parts(parts, body.to_bytes()));
            }
        };
        process.spawn(Box::pin(serve));
        answered.await.ok()
    }

    /// Delivers unit `key` to this host's consumer: what `Once::run` said (the value, or the
    /// error's kind), or `None` when the host is down or died before it finished.
    pub async fn deliver(&self, key: String) -> Option<Result<String, &'static str>> {
        let process = self.process();
        let once = process.once.lock().unwrap().clone()?;
        let wire = self.wire.clone();
        let (answer, answered) = tokio::sync::oneshot::channel();
        let consume = async move {
            let unit = Unit::new(UNITS, &key, b"{}").unwrap();
            let done = once.run(unit, |claim| work(wire, claim)).await;
            let _ = answer.send(match done {
                Ok(done) => Ok(done.value),
                Err(error) => Err(kind(&error)),
            });
        };
        process.spawn(Box::pin(consume));
        answered.await.ok()
    }

    /// The process dies: every task of it ends where it is; a new one starts after `down`.
    pub async fn crash(&self, down: Duration) {
        self.process().kill();
        tokio::time::sleep(down).await;
        *self.process.lock().unwrap() = boot(self.wire.clone());
    }

    /// The runtime is blocked for `length`: none of the process's tasks runs meanwhile.
    pub async fn block(&self, length: Duration) {
        let process = self.process();
        process.blocked.store(true, SeqCst);
        tokio::time::sleep(length).await;
        process.unblock();
    }

    /// The host's wire is cut for `length`.
    pub async fn partition(&self, length: Duration) {
        self.wire.partitioned.store(true, SeqCst);
        tokio::time::sleep(length).await;
        self.wire.partitioned.store(false, SeqCst);
    }
}

/// A new process on `wire`: a layer of its own (its state, its renewals) in front of the
/// handler.
fn boot(wire: Wire) -> Arc<Process> {
    let process = Arc::new(Process {
        blocked: AtomicBool::new(false),
        alive: AtomicBool::new(true),
        waiting: Mutex::default(),
        tasks: Mutex::default(),
        router: Mutex::new(None),
        once: Mutex::new(None),
    });
    let spawner = {
        let process = Arc::clone(&process);
        move |task| process.spawn(task)
    };
    let seed = wire.world.rng().draw();
    let once = Once::new(wire.clone())
        .with_seed(seed ^ 1)
        .with_lease(LEASE)
        .with_wait(Duration::from_secs(2))
        .with_spawner({
            let process = Arc::clone(&process);
            move |task| process.spawn(task)
        });
    process.spawn(Box::pin(schedule(wire.clone(), once.clone())));
    *process.once.lock().unwrap() = Some(once);
    let layer = IdempotencyLayer::new(wire.clone())
        .with_seed(seed)
        .with_lease(LEASE)
        .with_wait(Duration::from_secs(2))
        .with_scope(|_| Some(SCOPE.to_owned()))
        .with_spawner(spawner);
    let router = Router::new()
        .route("/pay", post(pay))
        .layer(layer)
        .with_state(wire);
    *process.router.lock().unwrap() = Some(router);
    process
}

/// A host's way to the authority: each call may be delayed, lost on the way (not applied) or
/// lost on the way back (applied), and fails while the host is partitioned.
#[derive(Clone)]
struct Wire {
    world: World,
    partitioned: Arc<AtomicBool>,
}

impl Wire {
    async fn deliver(&self, call: Call<'_>) -> Result<Answer, StoreError> {
        let lost = || StoreError::Timeout {
            store: "simulated",
            after: TIMEOUT,
        };
        let (out, back, drop_call, drop_answer) = {
            let mut rng = self.world.rng();
            let delay = |rng: &mut Rng| Duration::from_micros(rng.below(20_000));
            (
                delay(&mut rng),
                delay(&mut rng),
                rng.chance(0.02),
                rng.chance(0.02),
            )
        };
        if self.partitioned.load(SeqCst) {
            tokio::time::sleep(TIMEOUT).await;
            return Err(lost());
        }
        tokio::time::sleep(out).await;
        if drop_call || self.partitioned.load(SeqCst) {
            self.world.fault();
            return Err(lost());
        }
        let answer = self.world.apply(&call);
        tokio::time::sleep(back).await;
        if drop_answer || self.partitioned.load(SeqCst) {
            self.world.fault();
            return Err(lost());
        }
        Ok(answer)
    }

    async fn owned(&self, call: Call<'_>) -> Result<Ownership, StoreError> {
        match self.deliver(call).await? {
            Answer::Owned(ownership) => Ok(ownership),
            _ => unreachable!("an owner-checked call answers ownership"),
        }
    }
}

impl Store for Wire {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest,
    ) -> BoxFuture<'a, Result<ClaimOutcome, StoreError>> {
        Box::pin(async move {
            match self.deliver(Call::Claim(request)).await? {
                Answer::Claimed(outcome) => Ok(outcome),
                _ => unreachable!("a claim answers a claim outcome"),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(self.owned(Call::Renew(lease, duration)))
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        retention: Duration,
    ) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(self.owned(Call::Complete(lease, response, retention)))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Ownership, StoreError>> {
        Box::pin(self.owned(Call::Release(lease)))
    }

    fn kind(&self) -> &'static str {
        "simulated"
    }
}

/// The process's scheduler: every second, `run_slot` for the current slot (a new one every ten
/// seconds of the chaos), as every instance of a scheduled job calls it.
async fn schedule(wire: Wire, once: Once) {
    let start = tokio::time::Instant::now() - wire.world.elapsed();
    loop {
        let slot = (tokio::time::Instant::now() - start).as_secs() / 10;
        if slot >= SLOTS {
            return;
        }
        let key = format!("{}{slot}", wire.world.slot_prefix());
        let job = |claim| {
            let wire = wire.clone();
            async move { work(wire, claim).await.map(drop) }
        };
        wire.world.seen().requests += 1;
        let _ = once.run_slot(&key, job).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A unit's work: the handler's, through `Once` (its value names the payment it committed).
async fn work(wire: Wire, claim: IdempotencyClaim) -> Result<String, &'static str> {
    match pay(State(wire), claim).await {
        (StatusCode::CREATED, effect) => Ok(effect),
        _ => Err("the payment did not commit"),
    }
}

/// The kind of a unit's error, for the trace.
fn kind<E>(error: &WorkError<E>) -> &'static str {
    match error {
        WorkError::Failed(_) => "failed",
        WorkError::InFlight { .. } => "in flight",
        WorkError::Mismatch => "mismatch",
        WorkError::Superseded => "superseded",
        WorkError::OutcomeUnknown => "outcome unknown",
        WorkError::Store(_) => "store",
        _ => "other",
    }
}

/// The handler: some work, an effect nobody fences (counted), and the payment, committed in
/// a transaction with the fence. Its answer names the effect it committed.
async fn pay(State(wire): State<Wire>, claim: IdempotencyClaim) -> (StatusCode, String) {
    if !wire.world.authority.holds(claim.lease()) {
        wire.world
            .broke(format!("{} ran on a lapsed claim", claim.key()));
    }
    let work = Duration::from_millis(wire.world.rng().below(LEASE.as_millis() as u64 * 2));
    tokio::time::sleep(work).await;
    wire.world.unfenced(claim.key().as_str());
    match wire.deliver(Call::Commit(claim.lease(), LEASE)).await {
        Ok(Answer::Committed(true)) => {
            let effect = format!("{}#{}", claim.key(), claim.fence());
            (StatusCode::CREATED, effect)
        }
        Ok(_) => (StatusCode::INTERNAL_SERVER_ERROR, "lost the key".into()),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "the payment's outcome is unknown".into(),
        ),
    }
}
