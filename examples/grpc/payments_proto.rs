//! `proto/payments.proto` in Rust: the messages, a server and a client, written out the way
//! tonic-build generates them, so that building needs no `protoc`. Shared by
//! `examples/grpc_payments.rs` and `tests/grpc.rs`.

#![allow(dead_code)]

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::uri::PathAndQuery;
use tonic::{
    Request, Response, Status,
    body::Body,
    client::GrpcService,
    server::{Grpc, NamedService, UnaryService},
};
use tonic_prost::ProstCodec;
use tower_service::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `payments.v1.CreatePaymentRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreatePaymentRequest {
    #[prost(int64, tag = "1")]
    pub amount_cents: i64,
    #[prost(string, tag = "2")]
    pub currency: String,
    #[prost(string, tag = "3")]
    pub customer: String,
}

/// `payments.v1.Payment`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payment {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int64, tag = "2")]
    pub amount_cents: i64,
    #[prost(string, tag = "3")]
    pub currency: String,
    #[prost(string, tag = "4")]
    pub customer: String,
    #[prost(string, tag = "5")]
    pub charge_id: String,
    #[prost(string, tag = "6")]
    pub idempotency_key: String,
}

const CREATE_PAYMENT: &str = "/payments.v1.Payments/CreatePayment";

/// The `payments.v1.Payments` service, as an application implements it.
pub trait Payments: Send + Sync + 'static {
    fn create_payment(
        &self,
        request: Request<CreatePaymentRequest>,
    ) -> impl Future<Output = Result<Response<Payment>, Status>> + Send;
}

/// Serves a [`Payments`] implementation; add it to a `tonic::transport::Server`.
pub struct PaymentsServer<T> {
    inner: Arc<T>,
}

impl<T> PaymentsServer<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }
}

impl<T> Clone for PaymentsServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> NamedService for PaymentsServer<T> {
    const NAME: &'static str = "payments.v1.Payments";
}

impl<T, B> Service<http::Request<B>> for PaymentsServer<T>
where
    T: Payments,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        struct CreatePayment<T>(Arc<T>);

        impl<T: Payments> UnaryService<CreatePaymentRequest> for CreatePayment<T> {
            type Response = Payment;
            type Future = BoxFuture<Result<Response<Payment>, Status>>;

            fn call(&mut self, request: Request<CreatePaymentRequest>) -> Self::Future {
                let inner = Arc::clone(&self.0);
                Box::pin(async move { inner.create_payment(request).await })
            }
        }

        if request.uri().path() != CREATE_PAYMENT {
            return Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) });
        }
        let method = CreatePayment(Arc::clone(&self.inner));
        Box::pin(async move {
            let mut grpc = Grpc::new(ProstCodec::default());
            Ok(grpc.unary(method, request).await)
        })
    }
}

/// A client of `payments.v1.Payments`.
#[derive(Clone)]
pub struct PaymentsClient<T> {
    inner: tonic::client::Grpc<T>,
}

impl PaymentsClient<tonic::transport::Channel> {
    pub async fn connect(url: String) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::new(url)?.connect().await?;
        Ok(Self::new(channel))
    }
}

impl<T> PaymentsClient<T>
where
    T: GrpcService<Body>,
    T::Error: Into<BoxError>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    pub fn new(inner: T) -> Self {
        Self {
            inner: tonic::client::Grpc::new(inner),
        }
    }

    pub async fn create_payment(
        &mut self,
        request: impl tonic::IntoRequest<CreatePaymentRequest>,
    ) -> Result<Response<Payment>, Status> {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unknown(format!("service was not ready: {}", e.into())))?;
        self.inner
            .unary(
                request.into_request(),
                PathAndQuery::from_static(CREATE_PAYMENT),
                ProstCodec::default(),
            )
            .await
    }
}
