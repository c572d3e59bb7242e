//! A consumer of a NATS JetStream stream whose effect commits once per order, however often
//! JetStream delivers its message: run several, kill any, restart the server.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo run --example nats_consumer
//! nats pub orders.o-1 '{"sku":"coffee"}'
//! ```
//!
//! Each message's subject ends with its order id (its idempotency key: `orders.o-1`), and its
//! payload is the order. The consumers share one durable pull consumer: JetStream hands each
//! message to one of them, and again to any of them when it is not acknowledged within
//! `ACK_WAIT_MS` (the consumer is slow, or died) or is handed back (`nak`). A consumer works on
//! up to `PREFETCH` messages at once; each delivery goes through `Once` (see
//! `consumers/shipping.rs`), so a message delivered twice, even to two live consumers at once,
//! ships once. A lost connection (the server restarted) is made again.
//!
//! | variable | effect |
//! |---|---|
//! | `NATS_URL` | the server (`nats://127.0.0.1:4222`) |
//! | `DATABASE_URL` | the idempotency store and the `shipments` table |
//! | `STREAM` | the stream (`orders`, on the subjects `orders.>`) |
//! | `DURABLE` | the durable consumer the consumers share (`shipping`) |
//! | `ACK_WAIT_MS` | how long a delivery stays unacknowledged before JetStream redelivers it (30000) |
//! | `CONSUMER` | this consumer's name in its logs (`consumer-<pid>`) |
//! | `PREFETCH` | messages worked on at once (10) |
//! | `WORK_MS` | work per message before its shipment is written (0) |
//! | `IDEMPOTENCY_LEASE_MS` | the claim's lease (30000) |
//! | `IDEMPOTENCY_UNITS` | `transaction`: each delivery's claim in its shipment's transaction (`Once::run_in_transaction`); `lease`: under a lease, the shipment fenced (`Once::run`) |

#[path = "consumers/shipping.rs"]
mod shipping;

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures_util::TryStreamExt;
use shipping::{Shipping, millis, var};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() {
    shipping::log();
    let url = var("NATS_URL", "nats://127.0.0.1:4222");
    let consumer = var("CONSUMER", &format!("consumer-{}", std::process::id()));
    let shipping = Shipping::open(consumer.clone()).await;
    loop {
        if let Err(error) = consume(&shipping, &url, &consumer).await {
            tracing::warn!(%error, "the JetStream consumer failed; starting again");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Consumes the stream through the shared durable consumer until it fails.
async fn consume(shipping: &Shipping, url: &str, consumer: &str) -> Result<(), Error> {
    let (name, durable) = (var("STREAM", "orders"), var("DURABLE", "shipping"));
    let client = async_nats::connect(url).await?;
    let context = jetstream::new(client);
    let stream = context
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            ..Default::default()
        })
        .await?;
    let config = pull::Config {
        durable_name: Some(durable.clone()),
        ack_wait: millis("ACK_WAIT_MS", 30_000),
        ..Default::default()
    };
    let messages = stream
        .get_or_create_consumer(&durable, config)
        .await?
        .messages()
        .await?;
    tracing::info!(%consumer, stream = %name, %durable, "consuming");
    // The whole window at once: deliveries in flight together share the store's claim and
    // completion statements, and each is acknowledged on its own as soon as it is done.
    let window: usize = var("PREFETCH", "10").parse().expect("PREFETCH");
    messages
        .map_err(Error::from)
        .try_for_each_concurrent(window, |message| async move {
            let order_id = message.subject.rsplit('.').next().unwrap_or_default();
            if shipping.ship(order_id, &message.payload).await {
                message.ack().await
            } else {
                message.ack_with(AckKind::Nak(None)).await
            }
        })
        .await?;
    Ok(())
}
