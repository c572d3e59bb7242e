//! A consumer of a Redis stream (a consumer group) whose effect commits once per message,
//! however often the stream redelivers it: run several, kill any.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
//!   cargo run --example stream_consumer
//! redis-cli XADD orders '*' order_id o-1 payload '{"sku":"coffee"}'
//! ```
//!
//! Each message carries an `order_id` (its idempotency key) and a `payload`. The consumer reads
//! new messages with `XREADGROUP`, and takes over messages another consumer left pending for
//! `CLAIM_IDLE_MS` (it died, or is slow) with `XAUTOCLAIM`: that is how Redis Streams
//! redelivers. Every delivery goes through `Once`: the shipment row is written in one
//! transaction with the delivery's claim (or, under leases, fenced by it), so a message delivered twice (to two consumers at once, or
//! again after a consumer died mid-work) ships once; a delivery that meets another still running
//! waits for it, and both are acknowledged with the one outcome.
//!
//! | variable | effect |
//! |---|---|
//! | `REDIS_URL`, `DATABASE_URL` | the stream, and the idempotency store and the `shipments` table |
//! | `STREAM`, `GROUP` | the stream (`orders`) and the consumer group (`shipping`) |
//! | `CONSUMER` | this consumer's name in the group (`consumer-<pid>`) |
//! | `WORK_MS` | work per message before its shipment is written (0) |
//! | `CLAIM_IDLE_MS` | how long a message stays pending before another consumer takes it (2000) |
//! | `IDEMPOTENCY_LEASE_MS` | the claim's lease (30000) |
//! | `IDEMPOTENCY_UNITS` | `transaction`: each delivery's claim in its shipment's transaction (`Once::run_in_transaction`); `lease`: under a lease, the shipment fenced (`Once::run`) |

#[path = "consumers/shipping.rs"]
mod shipping;

use std::time::Duration;

use redis::{Value, aio::MultiplexedConnection};
use shipping::{Shipping, millis, var};

/// One message: its stream id, order id and payload.
struct Message {
    id: String,
    order_id: String,
    payload: String,
}

#[tokio::main]
async fn main() {
    shipping::log();
    let stream = var("STREAM", "orders");
    let group = var("GROUP", "shipping");
    let consumer = var("CONSUMER", &format!("consumer-{}", std::process::id()));
    let idle = millis("CLAIM_IDLE_MS", 2000);
    let shipping = Shipping::open(consumer.clone()).await;

    let client =
        redis::Client::open(std::env::var("REDIS_URL").expect("REDIS_URL")).expect("REDIS_URL");
    let mut redis = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let created: Result<(), _> = redis::cmd("XGROUP")
        .arg(&["CREATE", &stream, &group, "0", "MKSTREAM"][..])
        .query_async(&mut redis)
        .await;
    if let Err(error) = created
        && error.code() != Some("BUSYGROUP")
    {
        panic!("XGROUP CREATE: {error}");
    }
    tracing::info!(%consumer, %stream, %group, "consuming");
    loop {
        let messages = next(&mut redis, &stream, &group, &consumer, idle).await;
        for message in messages {
            let payload = message.payload.as_bytes();
            if !shipping.ship(&message.order_id, payload).await {
                continue;
            }
            let _: Result<i64, _> = redis::cmd("XACK")
                .arg(&stream)
                .arg(&group)
                .arg(&message.id)
                .query_async(&mut redis)
                .await;
        }
    }
}

/// Messages other consumers left pending for `idle` (taken over), else new ones.
async fn next(
    redis: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    consumer: &str,
    idle: Duration,
) -> Vec<Message> {
    let claimed: Result<Value, _> = redis::cmd("XAUTOCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(idle.as_millis() as u64)
        .arg("0-0")
        .arg("COUNT")
        .arg(10)
        .query_async(redis)
        .await;
    if let Ok(Value::Array(reply)) = claimed
        && let Some(entries) = reply.into_iter().nth(1)
    {
        let taken = messages(entries);
        if !taken.is_empty() {
            tracing::info!(count = taken.len(), "took over pending messages");
            return taken;
        }
    }
    let read: Result<Value, _> = redis::cmd("XREADGROUP")
        .arg(
            &[
                "GROUP", group, consumer, "COUNT", "1", "BLOCK", "200", "STREAMS", stream, ">",
            ][..],
        )
        .query_async(redis)
        .await;
    match read {
        // [[stream, entries]]
        Ok(Value::Array(streams)) => streams
            .into_iter()
            .filter_map(|stream| match stream {
                Value::Array(pair) => pair.into_iter().nth(1),
                _ => None,
            })
            .flat_map(messages)
            .collect(),
        _ => Vec::new(),
    }
}

/// Stream entries (`[[id, [field, value, …]], …]`) as messages.
fn messages(entries: Value) -> Vec<Message> {
    let Value::Array(entries) = entries else {
        return Vec::new();
    };
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        Value::SimpleString(text) => text.clone(),
        _ => String::new(),
    };
    let mut messages = Vec::new();
    for entry in entries {
        let Value::Array(parts) = entry else { continue };
        let [id, Value::Array(fields)] = parts.as_slice() else {
            continue;
        };
        let field = |name: &str| {
            fields
                .chunks(2)
                .find(|pair| text(&pair[0]) == name)
                .map(|pair| text(&pair[1]))
                .unwrap_or_default()
        };
        messages.push(Message {
            id: text(id),
            order_id: field("order_id"),
            payload: field("payload"),
        });
    }
    messages
}
