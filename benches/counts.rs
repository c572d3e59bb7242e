//! What one operation costs this process, counted rather than timed: under valgrind, a
//! workload's allocations an operation are the same from run to run and its instructions within
//! 0.5 % (hash seeds, owner tokens and the socket's timing differ), whatever else the machine
//! does, where the load bench's rates move by ±20 %. For a change to the layer's or a store's
//! own work, measured before and after.
//!
//! ```sh
//! python3 benches/counts.py                   # every workload: needs valgrind and a Redis
//! python3 benches/counts.py layer bare        # some of them
//! ```
//!
//! This program runs one workload `n` times, one operation after the other on a current-thread
//! runtime: `counts <workload> <n>`. benches/counts.py runs each under callgrind and DHAT at two
//! `n` and divides the difference by the extra operations, which leaves start-up, connecting
//! and a script's first load out. The workloads:
//!
//! - `bare`: a `POST` with a fresh `Idempotency-Key` and a 1 KiB body through an axum route
//!   without the layer, the response read whole;
//! - `layer`: the same through the layer on the memory store;
//! - `cached`: the same through the layer on the memory store behind `CachedStore` (what the
//!   replay cache costs a fresh key);
//! - `replay`: the same request again and again, its key completed once: every operation a
//!   replay from the memory store;
//! - `naive`: the naive guard's two commands on Redis (`SET key "" NX EX`, then `SET key answer
//!   EX`), through redis-rs's `ConnectionManager`, as the load bench sends them;
//! - `redis`: a claim and a completion of a fresh key through `RedisStore` (the fingerprint made
//!   once, a 200-byte answer), on `REDIS_URL` (default `redis://127.0.0.1:6379/`).

use axum::Router;
use bytes::Bytes;
use tower_idempotency::{
    IdempotencyLayer, MemoryStore,
    store::{CachedStore, RedisStore},
};
use uuid::Uuid;

#[path = "common/fresh_key.rs"]
mod fresh_key;
#[path = "common/route.rs"]
mod route;

use fresh_key::FreshKeys;
use route::{ANSWER, app, send};

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(workload), Some(Ok(n))) = (args.next(), args.next().map(|n| n.parse::<u64>())) else {
        eprintln!(
            "usage: counts <bare|layer|cached|replay|naive|redis> <n> (see benches/counts.py)"
        );
        std::process::exit(2);
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    // Keys of this run only: runs share the Redis.
    let run = Uuid::new_v4().simple().to_string();
    runtime.block_on(async {
        match workload.as_str() {
            "bare" => requests(app(None), n).await,
            "layer" => {
                let store = MemoryStore::new().with_max_entries(100_000);
                requests(app(Some(IdempotencyLayer::new(store))), n).await;
            }
            "cached" => {
                let store = CachedStore::new(MemoryStore::new().with_max_entries(100_000));
                requests(app(Some(IdempotencyLayer::new(store))), n).await;
            }
            "replay" => {
                let store = MemoryStore::new().with_max_entries(100_000);
                replays(app(Some(IdempotencyLayer::new(store))), n).await;
            }
            "naive" => naive(&url, &run, n).await,
            "redis" => store(&url, &run, n).await,
            other => panic!("no workload {other:?}"),
        }
    });
}

async fn requests(app: Router, n: u64) {
    let body = Bytes::from(vec![b'x'; 1024]);
    for i in 0..n {
        send(&app, format!("fresh-{i}"), &body).await;
    }
}

/// One request, then `n` more of it: each a replay of the first's answer.
async fn replays(app: Router, n: u64) {
    let body = Bytes::from(vec![b'x'; 1024]);
    send(&app, "replayed".to_owned(), &body).await;
    for _ in 0..n {
        send(&app, "replayed".to_owned(), &body).await;
    }
}

async fn naive(url: &str, run: &str, n: u64) {
    let client = redis::Client::open(url).unwrap();
    let mut redis = redis::aio::ConnectionManager::new(client).await.unwrap();
    for i in 0..n {
        let key = format!("counts:{run}:{i}");
        let claimed: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg("")
            .arg("NX")
            .arg("EX")
            .arg(86_400)
            .query_async(&mut redis)
            .await
            .unwrap();
        assert!(claimed.is_some(), "{key} was not fresh");
        let () = redis::cmd("SET")
            .arg(&key)
            .arg(ANSWER)
            .arg("EX")
            .arg(86_400)
            .query_async(&mut redis)
            .await
            .unwrap();
    }
}

async fn store(url: &str, run: &str, n: u64) {
    let store = RedisStore::open(url)
        .unwrap()
        .with_prefix(format!("counts:{run}:"));
    let fresh = FreshKeys::new();
    for i in 0..n {
        fresh.claim_and_complete(&store, &fresh.claim(i)).await;
    }
}
