//! The future [`Idempotency`](crate::Idempotency) returns.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll, ready},
};

use http::Response;
use pin_project_lite::pin_project;
use tokio::sync::oneshot;

use crate::{body::ResponseBody, problem::Rejection};

/// What the task running a guarded request sends back to its caller.
pub(crate) type Reply<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// Response future of [`Idempotency`](crate::Idempotency).
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        inner: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // A request the layer does not guard: the inner service's own future.
        Passthrough { #[pin] future: F },
        // A guarded request, run by a task of its own so that it finishes even if this future
        // is dropped.
        Spawned { reply: oneshot::Receiver<Reply<B, E>> },
        // An answer known at once (a bad key).
        Ready { response: Option<Response<ResponseBody<B>>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            inner: Kind::Passthrough { future },
        }
    }

    pub(crate) fn spawned(reply: oneshot::Receiver<Reply<B, E>>) -> Self {
        Self {
            inner: Kind::Spawned { reply },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            inner: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().inner.project() {
            KindProj::Passthrough { future } => {
                Poll::Ready(ready!(future.poll(cx)).map(|r| r.map(ResponseBody::passthrough)))
            }
            KindProj::Spawned { reply } => Poll::Ready(match ready!(Pin::new(reply).poll(cx)) {
                Ok(reply) => reply,
                // The task ended without an answer: the runtime is shutting down.
                Err(_) => Ok(Rejection::HandlerFailed
                    .problem(None)
                    .to_response()
                    .map(|body| ResponseBody::full(body, None))),
            }),
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
