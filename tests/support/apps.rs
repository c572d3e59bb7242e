//! The example apps as processes of their own, and the mock payment provider they call.

use super::*;

/// The path of an example binary; `cargo test` builds the examples before the tests.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let target = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = target.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo test`, which builds examples",
        path.display()
    );
    path
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
        let port = free_port();
        let log = std::env::temp_dir().join(format!("{name}-{port}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let mut command = Command::new(example(name));
        command
            .env("PORT", port.to_string())
            .env(
                "RUST_LOG",
                std::env::var("EXAMPLE_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        // The stores are the test's choice alone, whatever the shell that runs the tests has.
        for store in [
            "DATABASE_URL",
            "REDIS_URL",
            "REDIS_CLUSTER_NODES",
            "REDIS_PREFIX",
        ] {
            command.env_remove(store);
        }
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().unwrap();
        let proc = Self { child, port, log };
        proc.wait_until_listening().await;
        proc
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

/// A payment provider for the fleet: counts every charge per idempotency key, the number that
/// must never exceed one. Serves `POST /charges` on a free port of this process.
pub struct MockProvider {
    pub url: String,
    charges: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>,
    task: tokio::task::JoinHandle<()>,
}

impl MockProvider {
    /// Starts the provider; each charge takes `latency`.
    pub async fn start(latency: Duration) -> Self {
        use axum::{extract::State, http::HeaderMap, routing::post};

        type Charges = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>;
        async fn charge(
            State((charges, latency)): State<(Charges, Duration)>,
            headers: HeaderMap,
        ) -> (http::StatusCode, String) {
            tokio::time::sleep(latency).await;
            let key = headers
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let mut charges = charges.lock().unwrap();
            let count = charges.entry(key.clone()).or_default();
            *count += 1;
            (
                http::StatusCode::CREATED,
                format!(r#"{{"id":"ch_{key}_{count}"}}"#),
            )
        }

        let charges = Charges::default();
        let app = axum::Router::new()
            .route("/charges", post(charge))
            .with_state((charges.clone(), latency));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { url, charges, task }
    }

    /// Charges per idempotency key.
    pub fn charges(&self) -> std::collections::HashMap<String, u32> {
        self.charges.lock().unwrap().clone()
    }
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        self.task.abort();
    }
}
