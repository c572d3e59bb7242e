//! Helpers shared by the tests, by what they support: servers of their own (Redis, Postgres,
//! Citus), a Redis Cluster, network faults, the example apps and the mock provider, clients,
//! stores that misbehave on purpose, and the harness of the test binaries.

#![allow(dead_code, unreachable_pub)]

mod apps;
mod brokers;
mod clients;
mod cluster;
mod faults;
mod needs;
mod postgres;
mod servers;
mod stores;

// Each test uses some of them.
#[allow(unused_imports)]
pub use self::{
    apps::*, brokers::*, clients::*, cluster::*, faults::*, needs::*, postgres::*, servers::*,
    stores::*,
};

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
use tower_idempotency::store::{self, Store};
/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
/// A busy loop on every core while it lives: a machine shared with other jobs.
pub struct Busy {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Busy {
    pub fn on_every_core() -> Self {
        use std::sync::{Arc, atomic::AtomicBool, atomic::Ordering::Relaxed};
        let stop = Arc::new(AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (0..cores)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Call before a test sets a subscriber of its own (`set_default`, `with_default`): with a
/// single dispatcher registered, tracing-core asks a callsite first hit on another test's thread
/// (where nobody listens) for its interest there only, and caches "never" for good, so the
/// test's events were dropped unseen whenever a concurrent test hit the same callsite first. A
/// second dispatcher, kept for the process, makes it ask every registered one.
pub fn scoped_subscribers_hear_every_callsite() {
    static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
}

/// Sends a signal with kill(1).
pub fn signal_pid(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal} {pid} failed");
}
/// Retries `attempt` every 100 ms until it succeeds; fails the test after `within`.
pub async fn eventually<T, E: std::fmt::Display, F: Future<Output = Result<T, E>>>(
    within: Duration,
    what: &str,
    mut attempt: impl FnMut() -> F,
) -> T {
    let started = Instant::now();
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(error) => {
                assert!(
                    started.elapsed() < within,
                    "{what}: still failing after {within:?}: {error}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}
