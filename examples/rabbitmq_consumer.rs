//! A consumer of a RabbitMQ queue whose effect commits once per order, however often RabbitMQ
//! delivers its message: run several, kill any, restart the broker.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example rabbitmq_consumer
//! # then publish to the queue `orders`, with the order id as the message id (any AMQP client):
//! # basic.publish(routing_key="orders", properties={message_id: "o-1"}, body='{"sku":"coffee"}')
//! ```
//!
//! Each message carries its order id (its idempotency key) as its AMQP `message-id` and the
//! payload as its body. The consumer takes up to `PREFETCH` messages unacknowledged and works
//! on all of them at once (or, with `IDEMPOTENCY_UNITS=batch`, in batches of what it was
//! delivered at once, one transaction each); each goes through `Once` (see
//! `consumers/shipping.rs`): a message delivered twice (published twice, or redelivered after
//! a consumer died with it unacknowledged) ships once. A message that was delivered is
//! acknowledged; one that was not (the work failed, or another delivery still ran it after the
//! wait) is handed back (`basic.nack`, requeued), so that RabbitMQ delivers it again. A lost
//! connection (the broker restarted) is made again.
//!
//! | variable | effect |
//! |---|---|
//! | `AMQP_URL` | the broker (`amqp://guest:guest@127.0.0.1:5672/%2f`) |
//! | `DATABASE_URL` | the idempotency store and the `shipments` table |
//! | `QUEUE` | the queue (`orders`, durable) |
//! | `CONSUMER` | this consumer's name (`consumer-<pid>`) |
//! | `PREFETCH` | messages taken before acknowledging (10) |
//! | `WORK_MS` | work per message before its shipment is written (0) |
//! | `IDEMPOTENCY_LEASE_MS` | the claim's lease (30000) |
//! | `IDEMPOTENCY_UNITS` | `transaction`: each delivery's claim in its shipment's transaction (`Once::run_in_transaction`); `lease`: under a lease, the shipment fenced (`Once::run`); `batch`: what RabbitMQ delivered at once (up to the prefetch window) in one transaction, the shipments, claims and outcomes together (`Once::run_batch_in_transaction`) |

#[path = "consumers/shipping.rs"]
mod shipping;

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use lapin::{
    Connection, ConnectionProperties,
    message::Delivery,
    options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, QueueDeclareOptions},
    types::FieldTable,
};
use shipping::{Shipping, Units, var};

#[tokio::main]
async fn main() {
    shipping::log();
    let url = var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let queue = var("QUEUE", "orders");
    let consumer = var("CONSUMER", &format!("consumer-{}", std::process::id()));
    let prefetch = var("PREFETCH", "10").parse().expect("PREFETCH");
    let shipping = Shipping::open(consumer.clone()).await;
    loop {
        if let Err(error) = consume(&shipping, &url, &queue, &consumer, prefetch).await {
            tracing::warn!(%error, "the broker connection failed; connecting again");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Consumes `queue` on one connection until it fails.
async fn consume(
    shipping: &Shipping,
    url: &str,
    queue: &str,
    consumer: &str,
    prefetch: u16,
) -> lapin::Result<()> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), durable, FieldTable::default())
        .await?;
    channel.basic_qos(prefetch, Default::default()).await?;
    let deliveries = channel
        .basic_consume(
            queue.into(),
            consumer.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    tracing::info!(%consumer, %queue, "consuming");
    if shipping.units() == Units::InBatches {
        // What RabbitMQ delivered at once, as one batch in one transaction; two batches at a
        // time, so that the next fills while one commits.
        let batches = deliveries.ready_chunks(usize::from(prefetch)).map(Ok);
        return (batches.try_for_each_concurrent(2, |batch| async move {
            let batch: Vec<Delivery> = batch.into_iter().collect::<Result<_, _>>()?;
            let ids: Vec<_> = (batch.iter())
                .map(|delivery| delivery.properties.message_id().clone().unwrap_or_default())
                .collect();
            let window: Vec<(&str, &[u8])> = (ids.iter().zip(&batch))
                .map(|(id, delivery)| (id.as_str(), &delivery.data[..]))
                .collect();
            let acks = shipping.ship_window(&window).await;
            for (delivery, ack) in batch.iter().zip(acks) {
                acknowledge(delivery, ack).await?;
            }
            Ok(())
        }))
        .await;
    }
    // The whole prefetch window at once: deliveries in flight together share the store's claim
    // and completion statements (one round trip and one commit for all of them), and each
    // is acknowledged on its own as soon as it is done.
    deliveries
        .try_for_each_concurrent(usize::from(prefetch), |delivery| async move {
            let order_id = delivery.properties.message_id().clone().unwrap_or_default();
            let ack = shipping.ship(order_id.as_str(), &delivery.data).await;
            acknowledge(&delivery, ack).await
        })
        .await
}

/// Acknowledges `delivery` when it was delivered (`ack`), or hands it back for RabbitMQ to
/// deliver again.
async fn acknowledge(delivery: &Delivery, ack: bool) -> lapin::Result<()> {
    if ack {
        delivery.ack(BasicAckOptions::default()).await.map(drop)
    } else {
        let again = BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        };
        delivery.nack(again).await.map(drop)
    }
}
