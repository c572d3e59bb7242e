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
//! redelivers. Every delivery goes through `Once::run`: the shipment row is written in a
//! transaction fenced by the claim, so a message delivered twice (to two consumers at once, or
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

use std::{env, time::Duration};

use redis::{Value, aio::MultiplexedConnection};
use sqlx::PgPool;
use tower_idempotency::{
    store::PostgresStore,
    work::{Once, Unit, WorkError},
};

/// One message: its stream id, order id and payload.
struct Message {
    id: String,
    order_id: String,
    payload: String,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let var = |name: &str, default: &str| env::var(name).unwrap_or_else(|_| default.to_owned());
    let millis = |name: &str, default: u64| {
        Duration::from_millis(
            env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default),
        )
    };
    let stream = var("STREAM", "orders");
    let group = var("GROUP", "shipping");
    let consumer = var("CONSUMER", &format!("consumer-{}", std::process::id()));
    let (work, idle) = (millis("WORK_MS", 0), millis("CLAIM_IDLE_MS", 2000));

    let pool = PgPool::connect(&env::var("DATABASE_URL").expect("DATABASE_URL"))
        .await
        .expect("Postgres");
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.expect("migrations");
    // Consumers starting together would race on `CREATE TABLE IF NOT EXISTS`: one at a time.
    let mut tx = pool.begin().await.expect("Postgres");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('tower-idempotency examples'))")
        .execute(&mut *tx)
        .await
        .expect("the advisory lock");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS shipments (
             order_id text NOT NULL, consumer text NOT NULL, shipped_at timestamptz DEFAULT now())",
    )
    .execute(&mut *tx)
    .await
    .expect("the shipments table");
    tx.commit().await.expect("the shipments table");
    let once = Once::new(store).with_lease(millis("IDEMPOTENCY_LEASE_MS", 30_000));

    let client = redis::Client::open(env::var("REDIS_URL").expect("REDIS_URL")).expect("REDIS_URL");
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
            if !consume(&once, &pool, &consumer, work, &message).await {
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

/// One delivery: the shipment, once per order, fenced. Whether to acknowledge the message: not
/// when it was not delivered (it failed, or another delivery still runs it), so that the
/// stream redelivers it.
async fn consume(
    once: &Once,
    pool: &PgPool,
    consumer: &str,
    work: Duration,
    message: &Message,
) -> bool {
    let Ok(unit) = Unit::new("orders", &message.order_id, message.payload.as_bytes()) else {
        tracing::error!(id = %message.id, "a message without a valid order_id: dropped");
        return true;
    };
    let shipped = once
        .run(unit, |claim| async move {
            tokio::time::sleep(work).await;
            let mut tx = pool.begin().await?;
            // The fence: a delivery whose claim another took over writes nothing.
            claim
                .commit(&mut tx)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            sqlx::query("INSERT INTO shipments (order_id, consumer) VALUES ($1, $2)")
                .bind(&message.order_id)
                .bind(consumer)
                .execute(&mut *tx)
                .await?;
            // The outcome commits with the shipment: a consumer killed right after this
            // commit leaves the next delivery its outcome, not "outcome unknown".
            let outcome = format!("shipped by {consumer}");
            claim
                .commit_with_outcome(&mut tx, &outcome)
                .await
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(outcome)
        })
        .await;
    match shipped {
        Ok(done) => {
            let (order, outcome) = (&message.order_id, &done.value);
            tracing::info!(%order, replayed = done.replayed, %outcome, "delivered");
            true
        }
        Err(error @ (WorkError::Mismatch | WorkError::OutcomeUnknown)) => {
            tracing::error!(order = %message.order_id, %error, "dropped: it will never ship again");
            true
        }
        Err(error) => {
            let order = &message.order_id;
            tracing::warn!(%order, %error, "not delivered; the stream redelivers it");
            false
        }
    }
}
