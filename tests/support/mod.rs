//! Helpers shared by the tests that drive real processes over HTTP.

#![allow(dead_code, unreachable_pub)]

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

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

/// A child process killed when dropped, so a failing test leaves nothing running.
pub struct Proc {
    pub child: Child,
    pub port: u16,
}

impl Proc {
    /// Starts an example serving on a fresh port, with extra environment, and waits until it
    /// accepts connections.
    pub async fn example(name: &str, env: &[(&str, String)]) -> Self {
        let port = free_port();
        let mut command = Command::new(example(name));
        command
            .env("PORT", port.to_string())
            .env(
                "RUST_LOG",
                std::env::var("EXAMPLE_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null());
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().unwrap();
        let proc = Self { child, port };
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
                "nothing listens on port {}",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An answer read in full.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

/// Sends one request; `Err` when the connection fails.
pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// `POST` a JSON body with an idempotency key.
pub async fn post_json(url: &str, key: &str, body: &str) -> Result<Answer, String> {
    send(
        Method::POST,
        url,
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
}
