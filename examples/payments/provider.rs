//! The payment provider: a mock that counts charges per key, or an HTTP one called through the
//! crate's client layer; either way each charge carries a key derived from the payment's.

use super::*;

/// The payment provider. A key derived from the payment's goes with every charge, so a real
/// provider deduplicates on its side too; the mock counts charges per key, a number that must
/// stay at one.
pub(crate) enum Provider {
    Mock(Mutex<HashMap<String, u32>>),
    Http {
        url: String,
        client: Box<ProviderClient>,
    },
}

/// An HTTP client that retries the provider safely: the same key on every attempt.
pub(crate) type ProviderClient = IdempotencyClient<Client<HttpConnector, ClientBody<Full<Bytes>>>>;

impl Provider {
    /// Charges for the payment `claim` guards: once, whatever the retries.
    pub(crate) async fn charge(
        &self,
        claim: &IdempotencyClaim,
        amount_cents: i64,
    ) -> Result<String, String> {
        let key = claim.derived_key("charge");
        match self {
            Provider::Mock(charges) => {
                let mut charges = charges.lock().unwrap();
                let count = charges.entry(key.to_string()).or_default();
                *count += 1;
                if *count > 1 {
                    tracing::error!(%key, count = *count, "DUPLICATE CHARGE");
                }
                Ok(format!("ch_{}", uuid::Uuid::new_v4().simple()))
            }
            Provider::Http { url, client } => {
                let body = serde_json::json!({
                    "amount_cents": amount_cents,
                    "reference": claim.key().as_str(),
                });
                let request = Request::post(format!("{url}/charges"))
                    .header("idempotency-key", key.as_str())
                    .header(header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body.to_string())))
                    .map_err(|e| e.to_string())?;
                let response = client
                    .clone()
                    .oneshot(request)
                    .await
                    .map_err(|e| e.to_string())?;
                if !response.status().is_success() {
                    return Err(format!("provider answered {}", response.status()));
                }
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?;
                let charge: serde_json::Value =
                    serde_json::from_slice(&body.to_bytes()).map_err(|e| e.to_string())?;
                charge["id"]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| "provider answered without a charge id".into())
            }
        }
    }
}

impl Provider {
    /// The provider `PROVIDER_URL` names, called through the client layer, or the mock.
    pub(crate) fn from_env() -> Self {
        match env::var("PROVIDER_URL") {
            Ok(url) => Provider::Http {
                url,
                client: Box::new(
                    ServiceBuilder::new()
                        .layer(
                            IdempotencyClientLayer::new()
                                .with_attempt_timeout(env_millis("PROVIDER_TIMEOUT_MS", 10_000)),
                        )
                        .service(Client::builder(TokioExecutor::new()).build_http()),
                ),
            },
            Err(_) => Provider::Mock(Mutex::default()),
        }
    }
}
