//! What a fresh key allocates, counted, against a budget: the layer's own allocations per
//! request (the route's without the layer subtracted), and the Redis store's per claim and
//! completion. Allocations are the same on every run of one build, so a change that adds one
//! fails here; one that removes some should lower the budget. Instructions and bytes, which
//! vary a little, are counted by `benches/counts.py` (BENCHMARKS.md).
//!
//! Counted on the test's own thread (each test runs its requests on a current-thread runtime):
//! other tests' threads allocate meanwhile.

#[path = "../benches/common/fresh_key.rs"]
mod fresh_key;
#[path = "../benches/common/route.rs"]
mod route;

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    future::Future,
};

use bytes::Bytes;
use fresh_key::FreshKeys;
use route::{app, send};
use tower_idempotency::{IdempotencyLayer, MemoryStore, store::RedisStore};
use uuid::Uuid;

/// The layer's allocations per fresh request, on the memory store, over the route's own.
const LAYER_BUDGET: u64 = 25;
/// The Redis store's allocations per claim and completion of a fresh key, the claim a pipeline
/// (Redis 7 and newer) and the completion complete.lua (Redis) ...
const REDIS_BUDGET: u64 = 29;
/// ... or a `SET … IFEQ` (Valkey 8.1 and newer), which counts one more.
const REDIS_IFEQ_BUDGET: u64 = 30;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down allocates too, after its locals are gone.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// Allocations per operation of `operation(i)` over `n` operations, after as many to warm up
/// (maps grown past their first sizes).
async fn per_operation<F>(n: u64, mut operation: impl FnMut(u64) -> F) -> f64
where
    F: Future<Output = ()>,
{
    for i in 0..n {
        operation(i).await;
    }
    let before = allocations();
    for i in n..2 * n {
        operation(i).await;
    }
    (allocations() - before) as f64 / n as f64
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_fresh_request_allocates_within_the_layers_budget() {
    runtime().block_on(async {
        let body = Bytes::from(vec![b'x'; 1024]);
        let bare = app(None);
        let bare = per_operation(500, |i| send(&bare, format!("fresh-{i}"), &body)).await;
        let store = MemoryStore::new().with_max_entries(100_000);
        let layered = app(Some(IdempotencyLayer::new(store)));
        let layered = per_operation(500, |i| send(&layered, format!("fresh-{i}"), &body)).await;
        // Rounded: maps that grow within the count add a fraction a request.
        let own = (layered - bare).round() as u64;
        eprintln!("the layer's allocations per fresh request: {own} ({layered} − {bare})");
        assert!(
            own <= LAYER_BUDGET,
            "the layer allocates {own} times per fresh request, over its budget of {LAYER_BUDGET}"
        );
    });
}

/// Whether the server takes `SET … IFEQ`, as the store finds out.
async fn has_ifeq(url: &str) -> bool {
    let client = redis::Client::open(url).unwrap();
    let mut redis = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("allocations:{}", Uuid::new_v4().simple());
    let set = redis::cmd("SET")
        .arg(&key)
        .arg("v")
        .arg("IFEQ")
        .arg("w")
        .clone();
    set.query_async::<Option<String>>(&mut redis).await.is_ok()
}

#[test]
fn a_fresh_key_on_redis_allocates_within_the_stores_budget() {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    runtime().block_on(async {
        let run = Uuid::new_v4().simple().to_string();
        let store = RedisStore::open(&url)
            .unwrap()
            .with_prefix(format!("allocations:{run}:"));
        let fresh = FreshKeys::new();
        let (n, mut counted) = (200, 0);
        // The first n warm up: the connection made, the commands' support probed.
        for i in 0..2 * n {
            // The claim is made outside the count: the layer makes it, not the store.
            let claim = fresh.claim(i);
            let before = allocations();
            fresh.claim_and_complete(&store, &claim).await;
            if i >= n {
                counted += allocations() - before;
            }
        }
        let own = (counted as f64 / n as f64).round() as u64;
        let budget = match has_ifeq(&url).await {
            true => REDIS_IFEQ_BUDGET,
            false => REDIS_BUDGET,
        };
        eprintln!("the Redis store's allocations per claim and completion: {own}");
        assert!(
            own <= budget,
            "a claim and completion on Redis allocate {own} times, over the budget of {budget}"
        );
    });
}
