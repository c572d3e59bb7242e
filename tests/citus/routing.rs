//! Every statement of a request's path to one shard, on the key's worker: routes read from
//! Citus's metadata, kept while the coordinator is down, and set where an operator says.

use super::*;

/// A request's whole path through the layer (a fresh key with a recovery point, renewals and
/// the fence in the handler's transaction on a co-located table, on the key's worker, a replay, a duplicate in
/// flight, a different request, a release, an expired key taken over) and the operator's
/// commands for one key, on sessions where any multi-shard statement is an error: each of them
/// is routed to one shard. The check itself is shown to bite: a statement over every shard
/// fails on those sessions.
pub(crate) async fn citus_routes_every_statement_of_a_requests_path_to_one_shard() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let routed = pool(&cluster.single_shard_url()).await;
    let across = sqlx::query("SELECT count(*) FROM idempotency_keys")
        .execute(&routed)
        .await;
    assert!(across.is_err(), "a multi-shard statement was allowed");

    // One machine, one clock: the sweep below need not wait out a skew.
    let store = PostgresStore::new(routed.clone())
        .on_citus()
        .with_clock_skew(Duration::ZERO);
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (store, runs) = (store.clone(), Arc::clone(&runs));
        move |claim: IdempotencyClaim, body: String| async move {
            runs.fetch_add(1, SeqCst);
            let key = claim.key().as_str().to_owned();
            if body == "fail" {
                return StatusCode::INTERNAL_SERVER_ERROR;
            }
            let pool = store.pool_for(&claim);
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO orders (key, step) VALUES ($1, 'placed')")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            claim
                .advance(&mut tx, "placed", &serde_json::json!({ "order": key }))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            // Longer than the lease: the owner renews it meanwhile.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut tx = pool.begin().await.unwrap();
            sqlx::query("INSERT INTO orders (key, step) VALUES ($1, 'paid')")
                .bind(&key)
                .execute(&mut *tx)
                .await
                .unwrap();
            claim.commit(&mut tx).await.unwrap();
            tx.commit().await.unwrap();
            StatusCode::CREATED
        }
    };
    let app = Router::new().route("/orders", post(handler)).layer(
        IdempotencyLayer::new(store.clone())
            .with_lease(Duration::from_millis(300))
            // The recovery point keeps the request too: one statement more, routed.
            .with_kept_requests(KeptRequests::new()),
    );
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let send = |key: String, body: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::from(body))
                .unwrap();
            app.oneshot(request).await.unwrap()
        }
    };

    // A fresh key, and a duplicate while it runs.
    let placed = format!("{prefix}-placed");
    let first = tokio::spawn(send(placed.clone(), "order"));
    tokio::time::sleep(Duration::from_millis(150)).await;
    // The duplicate finds it in flight, waits for it, and gets its answer.
    let duplicate = send(placed.clone(), "order").await;
    assert_eq!(first.await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(duplicate.status(), StatusCode::CREATED);
    assert_eq!(
        duplicate.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    // The replay, and another request with the same key.
    let replay = send(placed.clone(), "order").await;
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(
        replay.headers()[tower_idempotency::headers::IDEMPOTENT_REPLAYED],
        "true"
    );
    let other = send(placed.clone(), "another order").await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);

    // A handler that fails releases its key; the retry runs.
    let failed = format!("{prefix}-failed");
    let answer = send(failed.clone(), "fail").await;
    assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let answer = send(failed.clone(), "fail").await;
    assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_ne!(
        answer
            .headers()
            .get(tower_idempotency::headers::IDEMPOTENT_REPLAYED)
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );

    // A key whose owner died: its lease ends, and the request takes it over.
    let abandoned = format!("{prefix}-abandoned");
    let claim = tower_idempotency::conformance::claim_request(
        ANONYMOUS_SCOPE,
        &abandoned,
        "order",
        Duration::from_millis(50),
    );
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
    tokio::time::sleep(Duration::from_millis(150)).await;
    let taken = send(abandoned.clone(), "order").await;
    assert_eq!(taken.status(), StatusCode::CREATED);

    // The operator's commands for one key.
    let record = RecordKey::new(ANONYMOUS_SCOPE, placed.as_str().try_into().unwrap());
    let info = store.inspect(&record).await.unwrap().expect("the key");
    assert_eq!(info.state, RecordState::Completed);
    assert!(store.forget(&record).await.unwrap());

    // The sweeper, shard by shard on the workers: an abandoned key's row goes.
    let swept = format!("{prefix}-swept");
    let claim =
        tower_idempotency::conformance::claim_request("t", &swept, "b", Duration::from_millis(10));
    assert!(matches!(
        store.claim(&claim).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(store.sweep().await.unwrap() >= 1);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(&swept)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert_eq!(left, 0, "the expired row was swept");

    // Counted at the destination: each order placed and paid once, the failing one never.
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key, count(*) FROM orders WHERE key LIKE $1 || '%' GROUP BY key ORDER BY key",
    )
    .bind(&prefix)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(
        rows,
        vec![(abandoned.clone(), 2), (placed.clone(), 2)],
        "orders placed and paid"
    );
    assert_eq!(runs.load(SeqCst), 4, "placed, failed twice, taken over");
}

/// Citus hashes a text distribution value with PostgreSQL's `hashtext`, which the store ports
/// (checked against the server's own on 10,000 keys by the crate's unit tests): the same on
/// 10,000 keys here, empty, ASCII and multi-byte UTF-8, short and long.
pub(crate) async fn citus_worker_hash_is_postgres_hashtext() {
    let cluster = cluster().await;
    let admin = pool(&cluster.url()).await;
    let differing: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (
             SELECT repeat(md5(i::text) || 'é€🦀', i % 9) || left(i::text, i % 4) AS k
             FROM generate_series(0, 9999) i) keys
         WHERE worker_hash(k) <> hashtext(k)",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!(differing, 0);
}

/// The coordinator leaves the request path: once the store has read the shard map, requests
/// for keys on live workers go on while the coordinator is stopped. Fresh keys run once each
/// (counted in a co-located business table, written with the fence in one transaction on the
/// key's worker, `pool_for`), their retries replay; the sweeper, which reads every shard
/// through the coordinator, fails until it is back. An instance started during the outage,
/// told where the workers are (`with_citus_node`), reads the map from one of them and serves
/// too: other keys once each, and the first instance's keys replayed.
pub(crate) async fn citus_keys_on_live_workers_are_served_while_the_coordinator_is_down() {
    let mut cluster = CitusCluster::start(2).await;
    distribute(&cluster.url()).await;
    let admin = pool(&cluster.url()).await;
    business_tables(&admin).await;
    let store = PostgresStore::new(admin.clone()).on_citus();
    let send = orders_app(&store);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    // A first request reads the map (in the background): the next ones follow it.
    let first = format!("{prefix}-first");
    assert_eq!(send(first.clone()).await.status(), StatusCode::CREATED);
    let worker = cluster.shard_of("idempotency_keys", &first).await.1;
    let lease = claim_request(&first, Duration::from_secs(1)).lease_with_fence(1);
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;

    cluster.coordinator.stop_server();
    let keys: Vec<String> = (0..100).map(|n| format!("{prefix}-{n}")).collect();
    let expect = async |send: &SendOrder, keys: &[String], round: &str| {
        let answers = futures_util::future::join_all(keys.iter().cloned().map(send)).await;
        for (key, answer) in keys.iter().zip(answers) {
            assert_eq!(answer.status(), StatusCode::CREATED, "{round} {key}");
            let replayed = answer
                .headers()
                .get(tower_idempotency::headers::IDEMPOTENT_REPLAYED)
                .is_some();
            assert_eq!(replayed, round == "replayed", "{round} {key}");
        }
    };
    expect(&send, &keys, "fresh").await;
    expect(&send, &keys, "replayed").await;
    assert!(
        store.sweep().await.is_err(),
        "the sweeper needs the coordinator"
    );

    // A new instance: its pool on the coordinator (down), the workers named.
    let coordinator = PgPoolOptions::new()
        .max_connections(2)
        .connect_lazy(&cluster.url())
        .unwrap();
    let mut started = PostgresStore::new(coordinator).on_citus();
    for node in &cluster.workers {
        let options: sqlx::postgres::PgConnectOptions = node.url().parse().unwrap();
        started = started.with_citus_node("127.0.0.1", node.port, options);
    }
    let on_started = orders_app(&started);
    // The coordinator does not answer: the map is read from a worker.
    until_routed(&started, &lease, u16::try_from(worker).unwrap()).await;
    let others: Vec<String> = (0..50).map(|n| format!("{prefix}-started-{n}")).collect();
    expect(&on_started, &others, "fresh").await;
    expect(&on_started, &others, "replayed").await;
    expect(&on_started, &keys, "replayed").await;
    cluster.coordinator.start_server().await;

    // Counted at the destination: one order per key.
    let admin = pool(&cluster.url()).await;
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT key) FROM orders WHERE key LIKE $1 || '-%'",
    )
    .bind(&prefix)
    .fetch_one(&admin)
    .await
    .unwrap();
    assert_eq!((rows, distinct), (151, 151), "one order per key");
    store.sweep().await.unwrap();
}

/// Sends a POST /orders with the key given to an app whose handler pays the order on the key's
/// worker (`pay_on_its_worker`), behind the layer on `store`.
type SendOrder = Box<
    dyn Fn(String) -> futures_util::future::BoxFuture<'static, axum::response::Response>
        + Send
        + Sync,
>;

pub(crate) fn orders_app(store: &PostgresStore) -> SendOrder {
    let handler = {
        let store = store.clone();
        move |claim: IdempotencyClaim, _: String| async move {
            pay_on_its_worker(&store, &claim).await;
            StatusCode::CREATED
        }
    };
    let app = Router::new()
        .route("/orders", post(handler))
        .layer(IdempotencyLayer::new(store.clone()));
    Box::new(move |key: String| {
        let app = app.clone();
        Box::pin(async move {
            let request = Request::post("/orders")
                .header("idempotency-key", key)
                .body(Body::from("order"))
                .unwrap();
            app.oneshot(request).await.unwrap()
        })
    })
}

/// `with_citus_node`: a worker the metadata names by one address is reached by the one given.
/// Pointed at a port where nothing listens, the keys on that worker fail (and nothing runs), so
/// the override is what the store used; pointed at the worker by another name, they succeed.
pub(crate) async fn citus_a_worker_is_reached_where_with_citus_node_says() {
    let cluster = cluster().await;
    let url = cluster.url();
    let pool = pool(&url).await;
    let worker = cluster.workers[0].port;
    let key = async |n: usize| loop {
        let key = format!("{}-{n}", uuid::Uuid::new_v4().simple());
        if cluster.shard_of("idempotency_keys", &key).await.1 == i32::from(worker) {
            return key;
        }
    };
    let options = |host: &str, port: u16| {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        options.host(host).port(port)
    };
    // The map is read in the background, on the first statement: `request`'s statements go
    // where the map routes them (to `port`) from then on.
    let settle = async |store: &PostgresStore, request: &ClaimRequest, port: u16| {
        let warm = claim_request("warm-up", Duration::from_secs(1));
        let _ = store.claim(&warm).await;
        until_routed(store, &request.lease_with_fence(1), port).await;
    };

    let nowhere = support::free_port();
    let wrong = PostgresStore::new(pool.clone()).on_citus().with_citus_node(
        "127.0.0.1",
        worker,
        options("127.0.0.1", nowhere),
    );
    let request = claim_request(&key(0).await, Duration::from_secs(1));
    settle(&wrong, &request, nowhere).await;
    assert!(
        wrong.claim(&request).await.is_err(),
        "the override was not used"
    );

    let renamed = PostgresStore::new(pool.clone()).on_citus().with_citus_node(
        "127.0.0.1",
        worker,
        options("localhost", worker),
    );
    let request = claim_request(&key(1).await, Duration::from_secs(1));
    settle(&renamed, &request, worker).await;
    assert!(matches!(
        renamed.claim(&request).await.unwrap(),
        ClaimOutcome::Acquired { .. }
    ));
}

/// `pool_for` called outside a Tokio runtime (a thread of the application's own) answers
/// instead of panicking: the coordinator's pool until a map is read, then the worker's, the map
/// read inside the runtime.
pub(crate) async fn citus_pool_for_answers_outside_a_runtime() {
    let cluster = cluster().await;
    let store = PostgresStore::new(pool(&cluster.url()).await).on_citus();
    // A lease made by hand: the store has run nothing yet, and its map is due.
    let claim = claim_request("outside", Duration::from_secs(1));
    let lease = tower_idempotency::store::Lease::new(claim.record().clone(), claim.owner(), 1);
    let outside = {
        let (store, lease) = (store.clone(), lease.clone());
        std::thread::spawn(move || store.pool_for(&lease).connect_options().get_port())
    };
    let port = outside.join().expect("pool_for panicked outside a runtime");
    let ports: Vec<u16> = std::iter::once(&cluster.coordinator)
        .chain(&cluster.workers)
        .map(|node| node.port)
        .collect();
    assert!(ports.contains(&port), "{port} is none of {ports:?}");
    // Inside the runtime the map is read, in the background, and then the key's worker answers.
    let worker = cluster.shard_of("idempotency_keys", "outside").await.1;
    until_routed(&store, &lease, u16::try_from(worker).unwrap()).await;
}

/// A store built in steps (`on_citus`, then `with_max_connections`, `with_timeout`,
/// `with_max_batch`: each makes the store's routes anew) reads the shard map once, on one
/// connection to the coordinator, not once a step. Built where the runtime runs no task before
/// the builder is done (a current-thread runtime), counted at a proxy in front of the
/// coordinator: one connection, where each step's read made one (four).
pub(crate) async fn citus_a_store_built_in_steps_reads_the_map_once() {
    let cluster = cluster().await;
    let coordinator = std::net::SocketAddr::from(([127, 0, 0, 1], cluster.coordinator.port));
    let proxy = support::FaultProxy::start(vec![coordinator], vec![support::Fault::None]).await;
    let url = support::postgres_url(proxy.port);
    let worker = cluster.shard_of("idempotency_keys", "in-steps").await.1;
    let worker = u16::try_from(worker).unwrap();
    let built = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let pool = PgPoolOptions::new().connect_lazy(&url).unwrap();
            let store = PostgresStore::new(pool)
                .on_citus()
                .with_max_connections(4)
                .with_timeout(Duration::from_secs(5))
                .with_max_batch(8);
            let claim = claim_request("in-steps", Duration::from_secs(1));
            let lease = Lease::new(claim.record().clone(), claim.owner(), 1);
            until_routed(&store, &lease, worker).await;
        });
    });
    tokio::task::spawn_blocking(move || built.join())
        .await
        .unwrap()
        .expect("the store was not routed");
    assert_eq!(
        proxy.connections(),
        1,
        "connections to the coordinator while the store was built and its map read"
    );
}
