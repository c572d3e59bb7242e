//! The load benchmark: what a guarded request costs on each store, against a bare handler and
//! against a naive `SET NX EX` guard, over real HTTP on loopback, with each store's floor
//! measured by the same program.
//!
//! ```sh
//! cargo bench --bench load                      # about ten minutes
//! cargo bench --bench load -- --seconds 3 --rounds 1 --only bare,memory
//! ```
//!
//! Each setup runs as a server process of its own (this binary, re-run with `--serve`), so its
//! CPU time (`/proc/<pid>/stat`) is the server's alone; 64 connections (`--connections`) send
//! `POST /payments` with a 1 KiB JSON body for `--seconds` (5) after a one-second warm-up; the
//! handler answers 201 with about 200 bytes. "fresh" requests carry a new key each; "replay"
//! requests repeat keys completed during the warm-up. Rounds (`--rounds`, 3) interleave the
//! setups, and ratios are medians of per-round ratios. `--rate r` paces the measured requests at
//! `r` a second in all (each connection at its share, sending late rather than skipping when
//! behind): setups below their capacity then serve the same offered load, and their CPU per
//! request compares at that load, not at each one's own closed-loop concurrency.
//!
//! `REDIS_SERVER` (and `REDIS_CLI`) name the server program, so a Valkey run is the same command
//! with `REDIS_SERVER=valkey-server`. "redis-cluster" is the Redis store on a cluster of three
//! masters this program starts (`redis-cli --cluster create`), on the same cores. "valkey" and
//! "naive-valkey" are the Redis store and the naive guard on a Valkey server beside the Redis
//! one, in the same rounds, when a `valkey-server` is found (`VALKEY_SERVER`, the `PATH`, or
//! where `.ci/valkey` puts it); without one they are left out. With "redis-cluster", each round
//! also sends `SET`s of fresh keys to the cluster through redis-rs's cluster driver and straight
//! to each key's master, and to the single Redis: what the driver adds to a command.
//!
//! "consumers" (in `--only`, and in a run without it) is the consumer row: a RabbitMQ queue
//! (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`) shipped by three consumers
//! through `Once` against the same consumers without it (`consumers.rs`); without a broker
//! it is left out. "tiered-single" and "postgres-single" are their stores sending every claim
//! and completion on its own statement (`with_max_batch(1)`), as before batches;
//! "postgres-window" and "tiered-window" the stores of "postgres" and "tiered" with a batch
//! window of 1 ms at Postgres (`with_batch_window`).
//!
//! "naive-memory" is the naive guard in process, its answers in a bounded moka cache (what
//! in-process peers keep theirs in): the floor of a guard that has no fingerprint, owner or
//! lease, for the memory store to be measured against.
//!
//! "memory-cached", "redis-cached" and "tiered-cached" are those stores behind `CachedStore`
//! (replays from the server's memory, for at most 1 s after it stored or read them; on the
//! memory store it shows what the cache itself costs a fresh key); "redis-watched" the Redis
//! store behind `CachedStore` with its watcher (replays served for as long as Redis says their
//! key has not changed, RESP3 client tracking); "redis-cluster-watched" the same on the cluster
//! (a tracking connection per master).
//!
//! "node" and "node-single" are the Postgres store (batched, and one call a statement) on a
//! PostgreSQL server this program starts; "citus-1" and "citus-2" the store built for Citus
//! (`on_citus`) on a coordinator with one and two workers it starts beside it, every server with
//! the same settings (`nodes.rs`), all on the same cores, their table in 2 shards a worker (the
//! sizing guide's advice; `CITUS_SHARDS=n` for `n`, Citus's own default being 32). Without
//! Citus installed they are left out.
//!
//! `BENCH_WORKERS=n` gives each server process a runtime of `n` workers instead of one per core
//! (with one, no two requests of a server contend for its locks).
//!
//! Redis runs as a `redis-server` this program starts on a free port, emptied before each run,
//! so that its CPU time (`/proc`, per request) and `MEMORY USAGE` (per completed key) count only
//! that run; Postgres is `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), in a
//! schema of the run's own, dropped at the end.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr, TcpListener},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::post,
};
use http_body_util::{BodyExt, Full};
use redis::{AsyncCommands, aio::ConnectionManager};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, MemoryStore,
    store::Fingerprint,
    store::StoredResponse,
    store::{
        CachedStore, ClaimOutcome, ClaimRequest, DEFAULT_MEMORY_MAX_ENTRIES,
        DEFAULT_POSTGRES_BATCH, DISTRIBUTE_ON_CITUS, PARTITION_BY_HASH, PostgresStore, RecordKey,
        RedisStore, Store, TieredStore,
    },
};
use uuid::Uuid;

const SETUPS: [&str; 26] = [
    "bare",
    "memory",
    "memory-cached",
    "naive",
    "naive-memory",
    "redis",
    "redis-cached",
    "redis-watched",
    "redis-cluster",
    "redis-cluster-watched",
    "naive-valkey",
    "valkey",
    "postgres",
    "postgres-single",
    "postgres-window",
    "postgres-partitioned",
    "tiered",
    "tiered-cached",
    "tiered-single",
    "tiered-window",
    "memory-1mib",
    "memory-1mib-unbounded",
    "node",
    "node-single",
    "citus-1",
    "citus-2",
];

/// About 200 bytes, as a payment API answers.
const ANSWER: &str = r#"{"id":"pay_8f14e45fceea167a5a36dedd4bea2543","object":"payment","amount_cents":4900,"currency":"usd","customer":"cus_1","status":"succeeded","charge_id":"ch_c9f0f895fb98ab9159f51fd0297e236d"}"#;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--serve") {
        return serve(&args[at + 1], args[at + 2].parse().unwrap(), &args[at + 3]);
    }
    let options = Options::parse(&args);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(drive(options));
}

struct Options {
    seconds: u64,
    rounds: usize,
    connections: usize,
    /// Requests a second in all (`--rate`), each connection sending at its share of it, for
    /// setups measured at the same offered load; `None`: each connection sends as soon as its
    /// last answer came (a closed loop).
    rate: Option<f64>,
    only: Vec<String>,
}

impl Options {
    fn parse(args: &[String]) -> Self {
        let value = |name: &str| {
            args.iter()
                .position(|a| a == name)
                .and_then(|at| args.get(at + 1).cloned())
        };
        Self {
            seconds: value("--seconds").map_or(5, |v| v.parse().unwrap()),
            rounds: value("--rounds").map_or(3, |v| v.parse().unwrap()),
            connections: value("--connections").map_or(64, |v| v.parse().unwrap()),
            rate: value("--rate").map(|v| v.parse().unwrap()),
            only: value("--only").map_or_else(
                || {
                    SETUPS
                        .iter()
                        .chain(&["consumers"])
                        .map(|s| s.to_string())
                        .collect()
                },
                |v| v.split(',').map(str::to_owned).collect(),
            ),
        }
    }
}

/// Every run, by setup and workload.
type Runs = BTreeMap<(String, String), Vec<Run>>;

/// One measured run of one setup and workload.
#[derive(Debug, Clone, Default)]
struct Run {
    rps: f64,
    /// The server's peak resident memory, in MiB.
    peak_rss_mib: f64,
    /// Mean `MEMORY USAGE` of the keys a Redis setup completed.
    redis_bytes_per_key: Option<f64>,
    p50_us: u64,
    p99_us: u64,
    /// The slowest request: a stall of the whole server (a lock held across a table's growth)
    /// delays only the requests in flight, too few to move the p99 of this client.
    max_us: u64,
    cpu_us_per_req: f64,
    redis_us_per_req: Option<f64>,
    /// CPU of every `postgres` process on this machine per request (the server is local).
    postgres_us_per_req: Option<f64>,
    /// Write transactions (commits) and WAL bytes per request, on Postgres-backed setups.
    postgres_written_per_req: Option<(f64, f64)>,
    /// CPU per request of a Citus setup's coordinator and of its workers.
    citus_us_per_req: Option<(f64, f64)>,
}

/// The Redis servers of the run: the one server, and the cluster and the Valkey server when the
/// run has them.
#[derive(Clone, Copy)]
struct Servers<'a> {
    redis: &'a RedisServer,
    cluster: Option<&'a RedisServer>,
    valkey: Option<&'a RedisServer>,
}

mod setups;
mod consumers;
mod drive;
mod floors;
mod servers;
mod nodes;
mod report;

use self::{consumers::*, drive::*, floors::*, nodes::*, report::*, servers::*, setups::*};
