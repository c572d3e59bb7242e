//! The consumer rows: orders on a RabbitMQ queue, shipped by three consumers, each with a store
//! and a pool of its own as three processes would have, through the examples' own shipping step,
//! against the same consumers writing the shipment alone ("bare"). The step claims either under
//! a lease (`Once::run`, the fence with the outcome in the shipment's transaction: "once") or in
//! the shipment's own transaction (`Once::run_in_transaction`, as the examples do by default).
//! Bare and leased kinds also run with deliveries one at a time (as the examples did before),
//! beside the whole prefetch window at once (as they do now, so that the store's claims and
//! completions go out together).
//!
//! A run fills a queue of its own, consumes it for the run's seconds (or until it is empty), and
//! counts what was acknowledged; then it counts the shipments in Postgres, where they were
//! written: one per acknowledged order, none twice, or the run panics.

use futures_util::{StreamExt, TryStreamExt};
use lapin::{
    BasicProperties, Connection, ConnectionProperties,
    message::Delivery,
    options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions},
    types::FieldTable,
};
use sqlx::PgPool;

use super::*;

#[path = "../../examples/consumers/shipping.rs"]
#[allow(dead_code)]
mod shipping;

use shipping::Units;

/// The consumers of a run, as the RabbitMQ example runs them.
const CONSUMERS: usize = 3;

/// Messages each consumer takes unacknowledged, as the RabbitMQ example's default.
const PREFETCH: u16 = 10;

/// Messages put on the queue per second of a run: more than any kind ships (bare, the fastest,
/// about 4,000 here); a kind that empties the queue is measured until its last acknowledgement.
const FILL_PER_SECOND: usize = 5_000;

/// How a consumer takes its deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taking {
    /// One delivery at a time, as the examples did first.
    OneAtATime,
    /// The whole prefetch window at once, each delivery in a transaction of its own (so that
    /// the store's claims and completions of concurrent deliveries go out together).
    Window,
    /// What the broker delivered at once (up to the prefetch window) as one batch: one
    /// transaction for the batch's shipments (through `Once::run_batch_in_transaction`, with
    /// their claims and outcomes), `BATCHES` batches at a time.
    Batches,
}

/// Batches a consumer works on at once: while one commits, the next fills.
const BATCHES: usize = 2;

/// The consumer kinds, by name: how each claims through `Once` (`None`: it does not), and how
/// it takes its deliveries.
pub(crate) const CONSUMER_KINDS: [(&str, Option<Units>, Taking); 7] = [
    ("bare", None, Taking::Window),
    ("once", Some(Units::Leased), Taking::Window),
    (
        "once, in its transaction",
        Some(Units::InTransaction),
        Taking::Window,
    ),
    ("bare, one at a time", None, Taking::OneAtATime),
    (
        "once, one at a time",
        Some(Units::Leased),
        Taking::OneAtATime,
    ),
    ("bare, in batches", None, Taking::Batches),
    ("once, in batches", Some(Units::InBatches), Taking::Batches),
];

/// The broker, or `None` (and why) when none answers at `AMQP_URL`.
pub(crate) async fn broker() -> Option<String> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(connection) => {
            let _ = connection.close(200, "probed".into()).await;
            Some(url)
        }
        Err(error) => {
            eprintln!("consumers: no RabbitMQ at {url} ({error}); the consumer rows are left out");
            None
        }
    }
}

/// What one kind of consumer did in one run, per message where not said otherwise.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Consumed {
    /// Messages shipped and acknowledged per second.
    pub(crate) rate: f64,
    /// CPU of this process (the consumers, their stores, lapin), in µs.
    pub(crate) app_us: f64,
    /// CPU of every `postgres` process, in µs.
    pub(crate) postgres_us: f64,
    /// CPU of the RabbitMQ node (`beam.smp`), in µs.
    pub(crate) rabbitmq_us: f64,
    /// Write transactions (transaction ids Postgres assigned): each is a commit.
    pub(crate) transactions: f64,
    /// WAL written, in bytes.
    pub(crate) wal_bytes: f64,
}

/// Where Postgres and the processes stand: CPU so far, and the cluster's position.
struct Reading {
    app: Duration,
    postgres: Duration,
    rabbitmq: Duration,
    position: PostgresPosition,
}

impl Reading {
    async fn now(pool: &PgPool) -> Self {
        Self {
            app: process_cpu(std::process::id()),
            postgres: postgres_cpu(),
            rabbitmq: programs_cpu("beam.smp"),
            position: PostgresPosition::read(pool).await,
        }
    }

    /// What `messages` shipped in `elapsed` cost, from `self` to `later`.
    fn per_message(&self, later: &Self, messages: u64, elapsed: Duration) -> Consumed {
        let n = messages.max(1) as f64;
        let us = |a: Duration, b: Duration| b.saturating_sub(a).as_secs_f64() * 1e6 / n;
        let (transactions, wal) = later.position.since(&self.position);
        Consumed {
            rate: messages as f64 / elapsed.as_secs_f64(),
            app_us: us(self.app, later.app),
            postgres_us: us(self.postgres, later.postgres),
            rabbitmq_us: us(self.rabbitmq, later.rabbitmq),
            transactions: transactions as f64 / n,
            wal_bytes: wal as f64 / n,
        }
    }
}

/// One kind of consumer for `seconds`: three consumers, each with a pool and a store of its own
/// (closed after the run), shipping into `schema`.
pub(crate) async fn measure_consumers(
    url: &str,
    (database_url, schema): (&str, &str),
    (units, taking): (Option<Units>, Taking),
    seconds: Duration,
) -> Consumed {
    let run = Uuid::new_v4().simple().to_string();
    let queue = format!("bench-{run}");
    let count = FILL_PER_SECOND * seconds.as_secs() as usize;
    fill(url, &queue, &run, count).await;
    let published = count as u64;
    let mut shippings = Vec::new();
    for n in 0..CONSUMERS {
        let pool = pool_in(database_url, schema, u32::from(PREFETCH)).await;
        let lease = Duration::from_secs(30);
        let consumer = format!("consumer-{n}");
        let units = units.unwrap_or(Units::InTransaction);
        let shipping =
            shipping::Shipping::on(pool.clone(), consumer, (Duration::ZERO, lease), units);
        shippings.push((shipping.await, pool));
    }
    let acked = Arc::new(AtomicU64::new(0));
    let before = Reading::now(&shippings[0].1).await;
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + seconds;
    let consumers = shippings.iter().map(|(shipping, pool)| {
        let (acked, kind) = (Arc::clone(&acked), (units.is_some(), taking));
        consume(
            url, &queue, shipping, pool, kind, deadline, acked, published,
        )
    });
    let lasts = futures_util::future::join_all(consumers).await;
    let elapsed = lasts.into_iter().max().unwrap_or(started) - started;
    let acked = acked.load(Relaxed);
    let after = Reading::now(&shippings[0].1).await;
    let (rows, distinct): (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT order_id) FROM shipments WHERE order_id LIKE $1",
    )
    .bind(format!("{run}-%"))
    .fetch_one(&shippings[0].1)
    .await
    .unwrap();
    assert_eq!(rows, distinct, "an order shipped twice");
    assert!(rows as u64 >= acked, "{acked} acknowledged, {rows} shipped");
    for (_, pool) in &shippings {
        pool.close().await;
    }
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    let _ = connection.close(200, "measured".into()).await;
    before.per_message(&after, acked, elapsed)
}

/// Puts `count` orders on a new `queue`, their ids `<run>-<n>`.
async fn fill(url: &str, queue: &str, run: &str, count: usize) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // A thousand publishes in flight at a time: one after another, filling took longer than
    // the run it filled.
    for chunk in (0..count).collect::<Vec<_>>().chunks(1000) {
        let publishes = chunk.iter().map(|n| {
            let properties =
                BasicProperties::default().with_message_id(format!("{run}-{n}").into());
            let payload = format!(r#"{{"sku":"item-{n}","quantity":1}}"#);
            let channel = &channel;
            async move {
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        payload.as_bytes(),
                        properties,
                    )
                    .await
            }
        });
        futures_util::future::try_join_all(publishes).await.unwrap();
    }
    // Published without confirms, for speed: wait until the broker holds them all.
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    loop {
        let declared = channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap();
        if declared.message_count() as usize >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = connection.close(200, "filled".into()).await;
}

/// One consumer until `deadline`, or until every one of `published` was acknowledged: when it
/// acknowledged its last delivery.
#[allow(clippy::too_many_arguments)]
async fn consume(
    url: &str,
    queue: &str,
    shipping: &shipping::Shipping,
    pool: &PgPool,
    (once, taking): (bool, Taking),
    deadline: tokio::time::Instant,
    acked: Arc<AtomicU64>,
    published: u64,
) -> Instant {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .basic_qos(PREFETCH, Default::default())
        .await
        .unwrap();
    let deliveries = channel
        .basic_consume(
            queue.into(),
            format!("bench-{}", Uuid::new_v4().simple()).as_str().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let last = std::sync::Mutex::new(Instant::now());
    let drained = || acked.load(Relaxed) >= published;
    let deliveries = deliveries
        .take_until(tokio::time::sleep_until(deadline))
        .take_while(|_| std::future::ready(!drained()));
    // Acknowledges `done`, counting it.
    let acknowledge = async |done: &[Delivery]| -> lapin::Result<()> {
        for delivery in done {
            delivery.ack(BasicAckOptions::default()).await?;
        }
        acked.fetch_add(done.len() as u64, Relaxed);
        *last.lock().unwrap() = Instant::now();
        Ok(())
    };
    let window = usize::from(PREFETCH);
    let consumed = match taking {
        Taking::Batches => {
            let batches = deliveries.ready_chunks(window).map(Ok::<_, lapin::Error>);
            let batches = batches.try_for_each_concurrent(BATCHES, |batch| async move {
                let batch: Vec<Delivery> = batch.into_iter().collect::<Result<_, _>>()?;
                let ids: Vec<String> = (batch.iter())
                    .map(|d| {
                        d.properties
                            .message_id()
                            .clone()
                            .unwrap_or_default()
                            .to_string()
                    })
                    .collect();
                let shipped = if once {
                    let window: Vec<(&str, &[u8])> = (ids.iter().zip(&batch))
                        .map(|(id, d)| (id.as_str(), &d.data[..]))
                        .collect();
                    shipping
                        .ship_window(&window)
                        .await
                        .into_iter()
                        .all(|ack| ack)
                } else {
                    ship_bare(pool, &ids).await
                };
                assert!(shipped, "orders {ids:?} were not all shipped");
                acknowledge(&batch).await
            });
            Box::pin(batches).await
        }
        Taking::OneAtATime | Taking::Window => {
            let at_once = if taking == Taking::Window { window } else { 1 };
            let each = deliveries.try_for_each_concurrent(at_once, |delivery| async move {
                let order_id = delivery.properties.message_id().clone().unwrap_or_default();
                let shipped = if once {
                    shipping.ship(order_id.as_str(), &delivery.data).await
                } else {
                    ship_bare(pool, &[order_id.as_str()]).await
                };
                assert!(shipped, "order {order_id} was not shipped");
                acknowledge(std::slice::from_ref(&delivery)).await
            });
            Box::pin(each).await
        }
    };
    consumed.unwrap();
    let _ = connection.close(200, "consumed".into()).await;
    last.into_inner().unwrap()
}

/// The shipments of `order_ids` in one transaction, as the shipping step writes them without
/// `Once` (one message's, or a batch's).
async fn ship_bare(pool: &PgPool, order_ids: &[impl AsRef<str>]) -> bool {
    let mut tx = pool.begin().await.unwrap();
    for order_id in order_ids {
        sqlx::query("INSERT INTO shipments (order_id, consumer) VALUES ($1, 'bare')")
            .bind(order_id.as_ref())
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.is_ok()
}
