//! `IdempotencyLayer` on a plain hyper 1.x server, without axum: a `tower` service built with
//! `ServiceBuilder`, served through hyper-util.
//!
//! ```sh
//! cargo run --example hyper_server          # serves 127.0.0.1:3000 (PORT overrides)
//! curl -si localhost:3000/orders -H 'Idempotency-Key: order-1' -d 'two coffees'
//! ```

use std::{
    convert::Infallible,
    env,
    net::{Ipv4Addr, SocketAddr},
    sync::atomic::{AtomicU64, Ordering},
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1};
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tower::ServiceBuilder;
use tower_idempotency::{IdempotencyClaim, IdempotencyLayer, MemoryStore, body::RequestBody};

static ORDERS: AtomicU64 = AtomicU64::new(0);

/// The application: `POST /orders` takes an order, once per key (the layer hands it the
/// buffered body); any other method there is 405, any other path 404. Both release the key,
/// so a corrected request runs.
async fn take_order(
    request: Request<RequestBody<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if request.uri().path() != "/orders" {
        return Ok(status(StatusCode::NOT_FOUND, "no such resource\n"));
    }
    if request.method() != Method::POST {
        let mut refused = status(StatusCode::METHOD_NOT_ALLOWED, "orders are POSTed\n");
        let allow = header::HeaderValue::from_static("POST");
        refused.headers_mut().insert(header::ALLOW, allow);
        return Ok(refused);
    }
    let key = request
        .extensions()
        .get::<IdempotencyClaim>()
        .map(|claim| claim.key().to_string());
    let body = match request.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return Ok(status(StatusCode::BAD_REQUEST, "unreadable body")),
    };
    let number = ORDERS.fetch_add(1, Ordering::Relaxed) + 1;
    let order = format!(
        "order {number}: {} (key {})\n",
        String::from_utf8_lossy(&body),
        key.as_deref().unwrap_or("none")
    );
    let mut response = status(StatusCode::CREATED, &order);
    response.headers_mut().insert(
        header::LOCATION,
        format!("/orders/{number}").parse().unwrap(),
    );
    Ok(response)
}

fn status(status: StatusCode, text: &str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_owned())));
    *response.status_mut() = status;
    response
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_key_required(true))
        .service_fn(take_order);

    let port = env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3000);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot listen on {addr}: {e}");
            std::process::exit(1)
        });
    tracing::warn!("running on the in-memory store, which protects this single process only");
    tracing::info!("orders API listening on http://{addr}");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "connection ended");
            }
        });
    }
}
