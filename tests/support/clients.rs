//! Clients: requests sent in process or over HTTP, and their answers read in full.

use super::*;

/// An answer read in full.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The `type` of a problem answer (which must be `application/problem+json`).
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

/// Sends one request through a service in process and reads the whole answer.
pub async fn call<S, B>(service: &S, request: Request<axum::body::Body>) -> Answer
where
    S: tower::Service<Request<axum::body::Body>, Response = http::Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    use tower::ServiceExt;
    let response = service.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

/// Sends one request; `Err` when the connection fails.
pub async fn send(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let response = client.request(request).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
        trailers: None,
    })
}

/// `POST` a JSON body with an idempotency key.
pub async fn post_json(url: &str, key: &str, body: &str) -> Result<Answer, String> {
    send(
        Method::POST,
        url,
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        body,
    )
    .await
}
