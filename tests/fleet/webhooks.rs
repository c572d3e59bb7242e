//! The webhooks example as a fleet of receivers, delivered to as senders deliver: signed
//! deliveries (Standard Webhooks and Stripe, signed as the senders' own libraries sign), each
//! event delivered to two instances at once and again later with a fresh timestamp and
//! signature, forged and stale deliveries first, and an instance killed mid-handler. Counted in
//! `webhook_effects`: one row per event.

use http::{HeaderMap, Method};

use super::*;
use crate::signatures::{StandardSecret, StripeSecret, TOLERANCE, now};

const STANDARD_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STRIPE_SECRET: &str = "whsec_test_secret";

/// The example's signatures agree with the senders' own libraries: vectors made by
/// `standardwebhooks` 1.3.0 (`Webhook(secret).sign(id, timestamp, body)`) and by Stripe's
/// Python SDK 16.1.0 (`WebhookSignature.generate_signature_header(body, secret, timestamp)`),
/// signed and verified here; a tampered body, a stale timestamp and a future one refused.
pub async fn signatures_agree_with_the_senders_libraries() {
    let timestamp = 1_733_600_000;
    let standard = StandardSecret::parse(STANDARD_SECRET).unwrap();
    let (id, body) = (
        "msg_2Lh9KRb0pzN4LePd3XiA4xp",
        r#"{"type":"invoice.paid","data":{"id":"in_1"}}"#,
    );
    let signature = "v1,NpCdfmhMLU2NF6oHlU5wdLNJTIVBB65HETDvUb70CeA=";
    assert_eq!(standard.sign(id, timestamp, body.as_bytes()), signature);
    let headers = header_map(&[
        ("webhook-id", id),
        ("webhook-timestamp", &timestamp.to_string()),
        (
            "webhook-signature",
            &format!("v1,bm90IHRoaXMgb25l {signature}"),
        ),
    ]);
    assert_eq!(
        standard.verify(&headers, body.as_bytes(), timestamp + 299),
        Ok(())
    );
    assert!(
        standard.verify(&headers, b"{}", timestamp).is_err(),
        "a tampered body"
    );
    let tolerance = TOLERANCE.as_secs();
    for now in [timestamp + tolerance + 1, timestamp - tolerance - 1] {
        assert!(
            standard.verify(&headers, body.as_bytes(), now).is_err(),
            "{now}"
        );
    }

    let stripe = StripeSecret::new(STRIPE_SECRET);
    let body = r#"{"id":"evt_1QbXJY2eZvKYlo2C","object":"event","type":"charge.refunded"}"#;
    let header = "t=1733600000,v1=323956cb153150cae33772157f7ef29ad44746387e0e6edfaae51d9d5d9b954f";
    assert_eq!(stripe.sign(timestamp, body.as_bytes()), header);
    let headers = header_map(&[("stripe-signature", header)]);
    assert_eq!(
        stripe.verify(&headers, body.as_bytes(), timestamp + 300),
        Ok(())
    );
    assert!(
        stripe.verify(&headers, b"{}", timestamp).is_err(),
        "a tampered body"
    );
    assert!(
        stripe
            .verify(&headers, body.as_bytes(), timestamp + 301)
            .is_err(),
        "stale"
    );
    let unsigned = stripe.verify(&HeaderMap::new(), body.as_bytes(), timestamp);
    assert_eq!(unsigned.unwrap_err().status(), StatusCode::BAD_REQUEST);
}

/// Two receivers on Redis in front of Postgres. Every event is first delivered forged (a
/// wrong secret) and, for half of them, stale (10 minutes old, correctly signed): each refused,
/// nothing written. Then the genuine delivery goes to both instances at once, and once
/// answered, a redelivery with a fresh timestamp and signature: one row per event, the
/// redelivery answered with the stored 200.
pub async fn each_event_is_handled_once_through_forgeries_duplicates_and_redeliveries() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let env = receiver_env(&redis, &schema, 300);
    let instances = [
        Proc::example("webhooks", &env).await,
        Proc::example("webhooks", &env).await,
    ];
    let sender = Sender::new();
    let events: Vec<Event> = (0..12).map(Event::new).collect();
    let deliveries = events.iter().enumerate().map(|(i, event)| {
        let (sender, instances) = (&sender, &instances);
        async move {
            let forged = sender
                .forged()
                .deliver(&instances[i % 2], event, now())
                .await;
            assert_eq!(
                forged.status,
                StatusCode::UNAUTHORIZED,
                "{event:?}: {forged:?}"
            );
            if i % 2 == 0 {
                let stale = sender.deliver(&instances[0], event, now() - 600).await;
                assert_eq!(
                    stale.status,
                    StatusCode::UNAUTHORIZED,
                    "{event:?}: {stale:?}"
                );
            }
            // Two timestamps, so two signatures, as two attempts of a sender differ.
            let (first, second) = tokio::join!(
                sender.deliver(&instances[0], event, now()),
                sender.deliver(&instances[1], event, now() - 1),
            );
            for answer in [&first, &second] {
                assert_eq!(answer.status, StatusCode::OK, "{event:?}: {answer:?}");
            }
            assert!(
                first.replayed() != second.replayed(),
                "{event:?}: one ran, one replayed"
            );
            let again = sender
                .deliver(&instances[(i + 1) % 2], event, now() + 2)
                .await;
            assert_eq!(
                (again.status, again.replayed()),
                (StatusCode::OK, true),
                "{event:?}"
            );
        }
    });
    futures_util::future::join_all(deliveries).await;
    let rows = effects(&schema.pool).await;
    for event in &events {
        assert_eq!(rows.get(&event.id), Some(&1), "{event:?}: {rows:?}");
    }
    assert_eq!(rows.len(), events.len(), "{rows:?}");
    println!(
        "webhooks: {} events (Standard Webhooks and Stripe) to 2 instances, each forged first, \
         half stale, then duplicated and redelivered: {} rows, one per event",
        events.len(),
        rows.values().sum::<i64>()
    );
    schema.drop().await;
}

/// An instance killed (`kill -9`) while it handles an event: the sender's retry reaches the
/// other instance, which waits while the dead one's lease lasts (a 409 with `Retry-After`,
/// honoured here, if its wait ran out first) and then handles the event, once.
pub async fn an_instance_killed_mid_handler_leaves_the_event_to_the_senders_retry() {
    let _serial = SERIAL.lock().await;
    let redis = RedisServer::start().await;
    let schema = TestSchema::new().await;
    let mut slow = Proc::example("webhooks", &receiver_env(&redis, &schema, 3_000)).await;
    let other = Proc::example("webhooks", &receiver_env(&redis, &schema, 0)).await;
    let sender = Sender::new();
    for event in [Event::new(0), Event::new(1)] {
        let delivered = sender.try_deliver(&slow, &event, now());
        let killed = async {
            tokio::time::sleep(Duration::from_millis(700)).await;
            signal_pid(slow.pid(), "-KILL");
        };
        let (lost, ()) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(5), delivered),
            killed
        );
        let answered = matches!(&lost, Ok(Ok(answer)) if answer.status == StatusCode::OK);
        assert!(
            !answered,
            "{event:?}: answered before its instance was killed: {lost:?}"
        );
        let (mut conflicts, retried) = (0, std::time::Instant::now());
        let answer = loop {
            let answer = sender.deliver(&other, &event, now()).await;
            if answer.status != StatusCode::CONFLICT {
                break answer;
            }
            conflicts += 1;
            let retry_after: u64 = answer.headers["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            tokio::time::sleep(Duration::from_secs(retry_after.min(1))).await;
        };
        assert_eq!(
            (answer.status, answer.replayed()),
            (StatusCode::OK, false),
            "{event:?}"
        );
        assert_eq!(
            effects(&schema.pool).await.get(&event.id),
            Some(&1),
            "{event:?}"
        );
        println!(
            "{event:?}: its instance killed mid-handler, handled once by the retry, answered \
             after {:?} and {conflicts} 409s",
            retried.elapsed()
        );
        slow = Proc::example("webhooks", &receiver_env(&redis, &schema, 3_000)).await;
    }
    drop((slow, other));
    schema.drop().await;
}

/// The receiver's environment: its stores, the senders' secrets, a lease of 1 s and handlers
/// of `work_ms`.
fn receiver_env(
    redis: &RedisServer,
    schema: &TestSchema,
    work_ms: u64,
) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", url_in_schema(&database_url(), &schema.name)),
        ("REDIS_URL", redis.url()),
        ("WEBHOOK_SECRET", STANDARD_SECRET.into()),
        ("STRIPE_WEBHOOK_SECRET", STRIPE_SECRET.into()),
        ("IDEMPOTENCY_LEASE_MS", "1000".into()),
        ("WEBHOOKS_WORK_MS", work_ms.to_string()),
    ]
}

/// An event as its sender names it: odd ones Stripe's (the id in the body), even ones a
/// Standard Webhooks sender's (the id in `webhook-id`).
#[derive(Debug)]
struct Event {
    id: String,
    stripe: bool,
}

impl Event {
    fn new(n: usize) -> Self {
        let stripe = n % 2 == 1;
        let prefix = if stripe { "evt" } else { "msg" };
        let id = format!("{prefix}_{n}_{}", uuid::Uuid::new_v4().simple());
        Self { id, stripe }
    }
}

/// Signs deliveries as the senders do; [`forged`](Self::forged) signs with the wrong secrets.
struct Sender {
    standard: StandardSecret,
    stripe: StripeSecret,
}

impl Sender {
    fn new() -> Self {
        Self {
            standard: StandardSecret::parse(STANDARD_SECRET).unwrap(),
            stripe: StripeSecret::new(STRIPE_SECRET),
        }
    }

    fn forged(&self) -> Self {
        Self {
            standard: StandardSecret::parse("whsec_Zm9yZ2VkIHNlY3JldA==").unwrap(),
            stripe: StripeSecret::new("whsec_forged"),
        }
    }

    /// Delivers `event` to `instance`, signed at `timestamp`.
    async fn deliver(&self, instance: &Proc, event: &Event, timestamp: u64) -> Answer {
        let delivered = self.try_deliver(instance, event, timestamp).await;
        delivered.unwrap_or_else(|e| panic!("{event:?}: {e}"))
    }

    /// Delivers `event` to `instance`, signed at `timestamp`; `Err` if the connection fails.
    async fn try_deliver(
        &self,
        instance: &Proc,
        event: &Event,
        timestamp: u64,
    ) -> Result<Answer, String> {
        let (path, body, signed) = if event.stripe {
            let body = format!(
                r#"{{"id": "{}", "object": "event", "type": "charge.refunded"}}"#,
                event.id
            );
            let signature = self.stripe.sign(timestamp, body.as_bytes());
            (
                "/webhooks/stripe",
                body,
                vec![("stripe-signature", signature)],
            )
        } else {
            let body = r#"{"type": "invoice.paid", "data": {"id": "in_1"}}"#.to_owned();
            let signature = self.standard.sign(&event.id, timestamp, body.as_bytes());
            let headers = vec![
                ("webhook-id", event.id.clone()),
                ("webhook-timestamp", timestamp.to_string()),
                ("webhook-signature", signature),
            ];
            ("/webhooks/standard", body, headers)
        };
        let mut headers: Vec<(&str, &str)> = signed.iter().map(|(k, v)| (*k, v.as_str())).collect();
        headers.push(("content-type", "application/json"));
        let url = instance.url(path);
        support::send(Method::POST, &url, &headers, &body).await
    }
}

/// Rows of `webhook_effects` per event id.
async fn effects(pool: &PgPool) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_id, count(*) FROM webhook_effects GROUP BY event_id")
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter().collect()
}

fn header_map(pairs: &[(&'static str, &str)]) -> HeaderMap {
    pairs
        .iter()
        .map(|(name, value)| (http::HeaderName::from_static(name), value.parse().unwrap()))
        .collect()
}
