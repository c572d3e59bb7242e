//! Queue consumers on real brokers, as separate processes: the RabbitMQ and NATS JetStream
//! examples, three consumers each, sharing one Postgres. Messages are delivered more than once
//! (published twice, redelivered to a live consumer mid-work, left unacknowledged by a consumer
//! killed with SIGKILL, requeued by a broker restart); shipments are counted in Postgres, where
//! they are written: one per order.

mod support;

use std::time::{Duration, Instant};

use support::{Broker, BrokerKind, Need, Proc, TestSchema, database_url, url_in_schema};

const ORDERS: usize = 12;

/// Publishes each order `copies` times (a publisher that retried), confirmed by the broker.
async fn publish(broker: &Broker, copies: usize) {
    match broker.kind() {
        BrokerKind::Nats => {
            let client = async_nats::connect(broker.url()).await.unwrap();
            let jetstream = async_nats::jetstream::new(client);
            orders_stream(&jetstream).await;
            for n in 0..ORDERS {
                for _ in 0..copies {
                    let payload = format!(r#"{{"sku":"item-{n}"}}"#);
                    let sent = jetstream.publish(format!("orders.order-{n}"), payload.into());
                    sent.await.unwrap().await.unwrap();
                }
            }
        }
        BrokerKind::RabbitMq => {
            use lapin::{BasicProperties, options::*};
            let (connection, channel, _) = orders_queue(broker, false).await;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .unwrap();
            for n in 0..ORDERS {
                for _ in 0..copies {
                    let properties = BasicProperties::default()
                        .with_message_id(format!("order-{n}").into())
                        .with_delivery_mode(2);
                    let payload = format!(r#"{{"sku":"item-{n}"}}"#);
                    let confirm = channel
                        .basic_publish(
                            "".into(),
                            "orders".into(),
                            BasicPublishOptions::default(),
                            payload.as_bytes(),
                            properties,
                        )
                        .await
                        .unwrap();
                    assert!(confirm.await.unwrap().is_ack(), "the broker took it");
                }
            }
            connection.close(200, "published".into()).await.unwrap();
        }
    }
}

/// The queue the RabbitMQ example consumes, declared as it declares it (`passive`: only
/// looked up), on a connection and channel of the test's own.
async fn orders_queue(
    broker: &Broker,
    passive: bool,
) -> (lapin::Connection, lapin::Channel, lapin::Queue) {
    use lapin::{options::QueueDeclareOptions, types::FieldTable};
    let props = lapin::ConnectionProperties::default();
    let connection = lapin::Connection::connect(&broker.url(), props)
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let options = QueueDeclareOptions {
        passive,
        durable: true,
        ..Default::default()
    };
    let queue = channel
        .queue_declare("orders".into(), options, FieldTable::default())
        .await
        .unwrap();
    (connection, channel, queue)
}

/// The stream the NATS example consumes, as it makes it.
async fn orders_stream(jetstream: &async_nats::jetstream::Context) {
    let config = async_nats::jetstream::stream::Config {
        name: "orders".into(),
        subjects: vec!["orders.>".into()],
        ..Default::default()
    };
    jetstream.get_or_create_stream(config).await.unwrap();
}

/// Whether the broker still holds messages not acknowledged (ready or delivered).
async fn pending(broker: &Broker) -> u64 {
    match broker.kind() {
        BrokerKind::Nats => {
            let client = async_nats::connect(broker.url()).await.unwrap();
            let jetstream = async_nats::jetstream::new(client);
            let stream = jetstream.get_stream("orders").await.unwrap();
            let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                stream.get_consumer("shipping").await.unwrap();
            let info = consumer.info().await.unwrap();
            info.num_pending + info.num_ack_pending as u64
        }
        // RabbitMQ counts the ready messages; those delivered and not yet acknowledged come
        // back to it when their consumer goes, and are counted then.
        BrokerKind::RabbitMq => u64::from(orders_queue(broker, true).await.2.message_count()),
    }
}

async fn shipped(schema: &TestSchema) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT order_id) FROM shipments")
        .fetch_one(&schema.pool)
        .await
        .unwrap_or((0, 0))
}

/// Three consumers of `example` on a broker of the test's own; every order published twice;
/// once two orders shipped, one consumer is killed (SIGKILL) and the broker restarted; then
/// until every order shipped and the broker holds nothing. One shipment per order.
async fn consumers_ship_each_order_once(kind: BrokerKind, example: &str, env: &[(&str, &str)]) {
    let schema = TestSchema::new().await;
    let mut broker = Broker::start(kind).await;
    let url_var = match kind {
        BrokerKind::Nats => "NATS_URL",
        BrokerKind::RabbitMq => "AMQP_URL",
    };
    let mut settings = vec![
        (url_var, broker.url()),
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("IDEMPOTENCY_LEASE_MS", "1000".into()),
        ("RUST_LOG", "info".into()),
    ];
    settings.extend(env.iter().map(|(k, v)| (*k, (*v).to_owned())));
    publish(&broker, 2).await;
    let mut consumers: Vec<Proc> = (0..3).map(|_| Proc::worker(example, &settings)).collect();

    let started = Instant::now();
    while shipped(&schema).await.1 < 2 {
        if started.elapsed() > Duration::from_secs(60) {
            let logs: String = consumers.iter().map(Proc::log).collect();
            panic!("nothing shipped:\n{logs}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumers[0].child.kill().unwrap();
    broker.restart().await;
    loop {
        let (_, distinct) = shipped(&schema).await;
        if distinct == ORDERS as i64 && pending(&broker).await == 0 {
            break;
        }
        let logs: String = consumers.iter().map(Proc::log).collect();
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{distinct} of {ORDERS} shipped:\n{logs}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, count(*) FROM shipments GROUP BY order_id")
            .fetch_all(&schema.pool)
            .await
            .unwrap();
    assert_eq!(rows.len(), ORDERS);
    assert!(
        rows.iter().all(|(_, n)| *n == 1),
        "an order shipped twice: {rows:?}"
    );
    let logs: String = consumers.iter().map(Proc::log).collect();
    let delivered = logs.matches("delivered order=").count();
    let replayed = logs.matches("replayed=true").count();
    assert!(replayed > 0, "no delivery met a shipped order:\n{logs}");
    println!(
        "{kind:?}: {ORDERS} orders published twice, 3 consumers (one killed), the broker \
         restarted: {delivered} deliveries acknowledged, {replayed} of them with the stored \
         outcome, every order shipped once, in {:?}",
        started.elapsed()
    );
    drop(consumers);
    schema.drop().await;
}

/// JetStream redelivers a message not acknowledged within 300 ms while its consumer still works
/// on it (600 ms): deliveries of one order meet on live consumers, besides the copies, the kill
/// and the restart.
async fn nats_jetstream_consumers_ship_each_order_once() {
    let env = [("WORK_MS", "600"), ("ACK_WAIT_MS", "300")];
    consumers_ship_each_order_once(BrokerKind::Nats, "nats_consumer", &env).await;
}

/// What a consumer was delivered at once, in one transaction (`IDEMPOTENCY_UNITS=batch`):
/// the copies of an order in one batch, the kill and the restart.
async fn rabbitmq_consumers_in_batches_ship_each_order_once() {
    let env = [
        ("WORK_MS", "100"),
        ("PREFETCH", "4"),
        ("IDEMPOTENCY_UNITS", "batch"),
    ];
    consumers_ship_each_order_once(BrokerKind::RabbitMq, "rabbitmq_consumer", &env).await;
}

/// The examples' default: each delivery's claim in its shipment's transaction.
async fn rabbitmq_consumers_ship_each_order_once() {
    let env = [("WORK_MS", "300"), ("PREFETCH", "2")];
    consumers_ship_each_order_once(BrokerKind::RabbitMq, "rabbitmq_consumer", &env).await;
}

/// The same under leases (`Once::run`, the shipment fenced).
async fn rabbitmq_consumers_under_leases_ship_each_order_once() {
    let env = [
        ("WORK_MS", "300"),
        ("PREFETCH", "2"),
        ("IDEMPOTENCY_UNITS", "lease"),
    ];
    consumers_ship_each_order_once(BrokerKind::RabbitMq, "rabbitmq_consumer", &env).await;
}

/// A test whose broker program is missing is reported as not run (see
/// `tests/support/needs.rs`).
fn main() -> std::process::ExitCode {
    let mut tests =
        crate::tests![&[Need::NatsServer]; nats_jetstream_consumers_ship_each_order_once];
    tests.extend(crate::tests![&[Need::RabbitMqServer];
        rabbitmq_consumers_in_batches_ship_each_order_once,
        rabbitmq_consumers_ship_each_order_once,
        rabbitmq_consumers_under_leases_ship_each_order_once,
    ]);
    support::run(tests)
}
