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
            .get(tower_idempotency::headers::IDEMPOTENT_REPLAYED)
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

/// What a [`FaultProxy`] does to one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Relays both ways.
    None,
    /// Relays the request, then closes the caller's connection before any answer: the server
    /// got the request and runs it, the caller learns nothing.
    DropAfterRequest,
    /// Relays the request, waits for the first bytes of the answer (the server has answered),
    /// and closes the caller's connection without them.
    DropAnswer,
}

/// A TCP proxy in front of servers (round-robin), that does to each new connection what the
/// next entry of its plan says (the plan repeats). With `Fault::None` alone and
/// [`point_at`](Self::point_at), it is a fixed address that a failover moves (a virtual IP, a
/// DNS name).
pub struct FaultProxy {
    pub url: String,
    pub port: u16,
    upstreams: std::sync::Arc<std::sync::Mutex<Vec<std::net::SocketAddr>>>,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstreams: Vec<std::net::SocketAddr>, plan: Vec<Fault>) -> Self {
        use std::sync::{Arc, Mutex, atomic::AtomicUsize, atomic::Ordering::SeqCst};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let upstreams = Arc::new(Mutex::new(upstreams));
        let (counted, current) = (Arc::clone(&connections), Arc::clone(&upstreams));
        let task = tokio::spawn(async move {
            loop {
                let (client, _) = listener.accept().await.unwrap();
                let n = counted.fetch_add(1, SeqCst);
                let upstream = {
                    let upstreams = current.lock().unwrap();
                    upstreams[n % upstreams.len()]
                };
                let fault = plan[n % plan.len()];
                tokio::spawn(relay(client, upstream, fault));
            }
        });
        Self {
            url: format!("http://{address}"),
            port: address.port(),
            upstreams,
            connections,
            task,
        }
    }

    /// New connections go to `upstreams` from now on.
    pub fn point_at(&self, upstreams: Vec<std::net::SocketAddr>) {
        *self.upstreams.lock().unwrap() = upstreams;
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

async fn relay(mut client: tokio::net::TcpStream, upstream: std::net::SocketAddr, fault: Fault) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
        return;
    };
    if fault == Fault::None {
        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        return;
    }
    // One request: read what the client sent until it pauses, pass it on.
    let mut buffer = vec![0; 64 * 1024];
    let Ok(n) = client.read(&mut buffer).await else {
        return;
    };
    if n == 0 || server.write_all(&buffer[..n]).await.is_err() {
        return;
    }
    if fault == Fault::DropAnswer {
        // The server has answered once its first bytes arrive; they go nowhere.
        let _ = server.read(&mut buffer).await;
    } else {
        // Let the request reach the handler; the server keeps its end open meanwhile.
        tokio::time::sleep(Duration::from_millis(20)).await;
        tokio::spawn(async move {
            let _ = server.read_to_end(&mut Vec::new()).await;
        });
    }
    drop(client);
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
