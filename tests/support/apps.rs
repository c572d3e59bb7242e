//! The example apps as processes of their own, and the mock payment provider they call.

use super::*;

/// A command that runs the example `name` with `env` and, whatever the shell that runs the
/// tests has, no other store settings: the stores are the test's choice alone.
pub fn example_command(name: &str, env: &[(&str, String)]) -> Command {
    let mut command = Command::new(example(name));
    for store in [
        "DATABASE_URL",
        "REDIS_URL",
        "REDIS_CLUSTER_NODES",
        "REDIS_PREFIX",
    ] {
        command.env_remove(store);
    }
    command.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    command
}

/// The path of an example binary; `cargo test` builds the examples before the tests. One older
/// than any of the crate's sources is refused: a lone `cargo test --test brokers` does not build
/// the examples, and would run whatever an earlier build left.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = target.join("examples").join(name);
    let built = match path.metadata().and_then(|m| m.modified()) {
        Ok(built) => built,
        Err(_) => panic!(
            "{} is missing: run `cargo test --all-features`, which builds the examples",
            path.display()
        ),
    };
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = ["src", "examples", "lua", "migrations"].map(|dir| root.join(dir));
    if let Some((_, newer)) = newest(&sources).filter(|(changed, _)| *changed > built) {
        panic!(
            "{} is older than {}: run `cargo test --all-features` (or `cargo build \
             --all-features --examples`), which builds the examples",
            path.display(),
            newer.display()
        );
    }
    path
}

/// The most recently modified file under `dirs`, and when.
fn newest(dirs: &[PathBuf]) -> Option<(std::time::SystemTime, PathBuf)> {
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    let mut pending = dirs.to_vec();
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(metadata) = entry.metadata() else {
                continue;
            };
            if metadata.is_dir() {
                pending.push(entry.path());
            } else if let Ok(modified) = metadata.modified()
                && newest.as_ref().is_none_or(|(time, _)| modified > *time)
            {
                newest = Some((modified, entry.path()));
            }
        }
    }
    newest
}

/// A child process killed when dropped, so a failing test leaves nothing running. Its output
/// goes to a log file, removed on drop unless the test is failing.
pub struct Proc {
    pub child: Child,
    pub port: u16,
    log: PathBuf,
}

impl Proc {
    /// Starts an example serving on a fresh port, with extra environment, and waits until it
    /// accepts connections.
    pub async fn example(name: &str, env: &[(&str, String)]) -> Self {
        let proc = Self::worker(name, env);
        proc.wait_until_listening().await;
        proc
    }

    /// An example that serves nothing (a consumer, a scheduled job), started without waiting.
    pub fn worker(name: &str, env: &[(&str, String)]) -> Self {
        let port = free_port();
        let log = std::env::temp_dir().join(format!("{name}-{port}.log"));
        let out = std::fs::File::create(&log).unwrap();
        // The test's own settings come last, and win.
        let log_level = std::env::var("EXAMPLE_LOG").unwrap_or_else(|_| "warn".into());
        let mut settings = vec![
            ("PORT", port.to_string()),
            ("RUST_LOG", log_level),
            ("NO_COLOR", "1".to_owned()),
        ];
        settings.extend(env.iter().map(|(k, v)| (*k, v.clone())));
        let mut command = example_command(name, &settings);
        command
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        let child = command.spawn().unwrap();
        Self { child, port, log }
    }

    async fn wait_until_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "nothing listens on port {}: {}",
                self.port,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process has written so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A frozen process must thaw to die cleanly.
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// A payment provider for the tests, on a free port of this process (`POST /charges`), that
/// behaves like a real one: it deduplicates on `Idempotency-Key` (a repeated key gets the
/// first charge back, not a second one), and counts separately the calls it received and the
/// charges it made, per payment (the `reference` of the charge's body, the payment's own key).
pub struct MockProvider {
    pub url: String,
    ledger: std::sync::Arc<std::sync::Mutex<ProviderLedger>>,
    task: tokio::task::JoinHandle<()>,
}

/// What the first call with each idempotency key meets, in turn (the plan repeats).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderFault {
    /// It is answered.
    None,
    /// 503, without `Retry-After`: nothing was charged.
    Unavailable,
    /// The charge is made, but answered only after this long (past the caller's timeout).
    Slow(Duration),
    /// 409 with `Retry-After: 1`, as a provider says a request with this key is in progress.
    InFlight,
}

#[derive(Default)]
struct ProviderLedger {
    /// Calls received per reference, faulted ones included.
    calls: std::collections::HashMap<String, u32>,
    /// Charges by idempotency key: the reference and the charge id.
    charges: std::collections::HashMap<String, (String, String)>,
    /// Idempotency keys seen, in the order of their first call.
    seen: Vec<String>,
    plan: Vec<ProviderFault>,
    latency: Duration,
}

impl MockProvider {
    /// Starts the provider; each charge takes `latency`.
    pub async fn start(latency: Duration) -> Self {
        Self::with_faults(latency, vec![ProviderFault::None]).await
    }

    /// Starts the provider; the first call with each key meets the next fault of `plan`.
    pub async fn with_faults(latency: Duration, plan: Vec<ProviderFault>) -> Self {
        use axum::routing::post;
        let ledger = std::sync::Arc::new(std::sync::Mutex::new(ProviderLedger {
            plan,
            latency,
            ..ProviderLedger::default()
        }));
        let app = axum::Router::new()
            .route("/charges", post(provider_charge))
            .with_state(ledger.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url, ledger, task }
    }

    /// Calls received per payment, whatever became of them: with a well-behaved client, the
    /// handler's executions that reached the provider.
    pub fn calls(&self) -> std::collections::HashMap<String, u32> {
        self.ledger.lock().unwrap().calls.clone()
    }

    /// Charges made per payment (distinct idempotency keys): never more than one.
    pub fn charges(&self) -> std::collections::HashMap<String, u32> {
        let mut charges = std::collections::HashMap::new();
        for (reference, _) in self.ledger.lock().unwrap().charges.values() {
            *charges.entry(reference.clone()).or_default() += 1;
        }
        charges
    }
}

async fn provider_charge(
    axum::extract::State(ledger): axum::extract::State<
        std::sync::Arc<std::sync::Mutex<ProviderLedger>>,
    >,
    headers: http::HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let reference = body["reference"].as_str().unwrap_or(&key).to_owned();
    let (fault, latency) = {
        let mut ledger = ledger.lock().unwrap();
        *ledger.calls.entry(reference.clone()).or_default() += 1;
        let first = !ledger.seen.contains(&key);
        let fault = if first {
            ledger.seen.push(key.clone());
            ledger.plan[(ledger.seen.len() - 1) % ledger.plan.len()]
        } else {
            ProviderFault::None
        };
        (fault, ledger.latency)
    };
    tokio::time::sleep(latency).await;
    match fault {
        ProviderFault::Unavailable => return http::StatusCode::SERVICE_UNAVAILABLE.into_response(),
        ProviderFault::InFlight => {
            return (http::StatusCode::CONFLICT, [("retry-after", "1")]).into_response();
        }
        ProviderFault::None | ProviderFault::Slow(_) => {}
    }
    let id = {
        let mut ledger = ledger.lock().unwrap();
        let charge = ledger
            .charges
            .entry(key.clone())
            .or_insert_with(|| (reference, format!("ch_{}", uuid::Uuid::new_v4().simple())));
        charge.1.clone()
    };
    if let ProviderFault::Slow(after) = fault {
        tokio::time::sleep(after).await;
    }
    (http::StatusCode::CREATED, format!(r#"{{"id":"{id}"}}"#)).into_response()
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a duplicate sent to another instance got ([`duplicate_elsewhere`]).
pub struct Duplicate {
    /// The duplicate's answer.
    pub answer: Answer,
    /// The first request's answer.
    pub first: Answer,
    /// The duplicate's instance's counters.
    pub counters: tower_idempotency::telemetry::CountersSnapshot,
    /// How many times the handler ran, on either instance.
    pub runs: usize,
}

impl Duplicate {
    /// The duplicate got the first request's answer, replayed, the handler ran once, and the
    /// duplicate was woken `times` (by the store's word, or by its listener lost), never by a
    /// poll. `what` names the case in a failure.
    pub fn assert_woken(&self, times: u64, what: &str) {
        assert_eq!(
            self.answer.status,
            StatusCode::CREATED,
            "{what}: {:?}",
            self.answer
        );
        assert!(self.answer.replayed(), "{what}: the duplicate ran");
        assert_eq!(
            (self.runs, &self.answer.body),
            (1, &self.first.body),
            "{what}: runs, and the answer"
        );
        assert_eq!(
            (self.counters.woken, self.counters.polled),
            (times, 0),
            "{what}: {:?}",
            self.counters
        );
    }
}

/// Two instances of one app, each its own layer on its own store (`first`, `second`: two
/// store objects on one backend, as two processes have), the handler answering 201 "paid" once
/// `gate` opens. The key `key` is sent to the first instance, and, 100 ms later, to the second,
/// which waits; once it has waited 300 ms, `meanwhile` runs, then the gate opens.
pub async fn duplicate_elsewhere<S: Store>(
    (first, second): (S, S),
    key: &'static str,
    meanwhile: impl AsyncFnOnce(),
) -> Duplicate {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let instance = |store: S| {
        let (gate, runs) = (gate.clone(), runs.clone());
        let handler = move || async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _open = gate.acquire().await.unwrap();
            (StatusCode::CREATED, "paid")
        };
        let layer = tower_idempotency::IdempotencyLayer::new(store);
        let counters = layer.counters();
        let app =
            axum::Router::new().route("/pay", axum::routing::post(handler).route_layer(layer));
        (app, counters)
    };
    let ((first_app, _), (second_app, counters)) = (instance(first), instance(second));
    let request = move || {
        Request::post("/pay")
            .header("idempotency-key", key)
            .body(axum::body::Body::empty())
            .unwrap()
    };
    let first = tokio::spawn(async move { call(&first_app, request()).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = tokio::spawn(async move { call(&second_app, request()).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    meanwhile().await;
    gate.add_permits(1_000);
    let (first, answer) = (first.await.unwrap(), second.await.unwrap());
    Duplicate {
        answer,
        first,
        counters: counters.snapshot(),
        runs: runs.load(std::sync::atomic::Ordering::SeqCst),
    }
}
