//! The future [`Idempotency`](crate::Idempotency) returns.

use std::{
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll, ready},
};

use futures_util::FutureExt;
use http::Response;
use pin_project_lite::pin_project;
use tokio::sync::oneshot;
use tracing::{Instrument, Span};

use crate::{
    body::ResponseBody,
    grpc::Wire,
    problem::Rejection,
    protocol::{Engine, Reply},
    store::RecordKey,
};

/// The work on a guarded request: reading the body, claiming, running the handler, finalizing.
pub(crate) type Work = Pin<Box<dyn Future<Output = ()> + Send>>;

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
        // A guarded request, worked on by this future (see `Guarded`).
        Guarded { guarded: Guarded<B, E> },
        // An answer known at once (a bad key).
        Ready { response: Option<Response<ResponseBody<B>>> },
    }
}

/// A guarded request's work, polled by the caller's own future, and its answer.
///
/// Running the work here rather than in a task of its own spares a spawn and a hand-off between
/// tasks per request. The promise that the handler runs to completion (and its outcome is
/// stored) even when the caller goes away is kept on drop: work that has not finished then
/// moves to a task of its own. Work left once the caller has its answer (a response streamed
/// past the cache limit, a finalize retried in the background) moves to a task too.
///
/// The work's events belong to the caller's span wherever it runs, and a panic outside the
/// handler (whose own panics are caught where it runs: a fingerprint hook, the completion
/// policy, a store) drops the reply: the caller gets the layer's 500 answer, rendered and
/// reported like every other.
pub(crate) struct Guarded<B, E> {
    work: Option<Work>,
    reply: oneshot::Receiver<Reply<B, E>>,
    span: Span,
    /// Who answers if the work ends without an answer, and about which key.
    engine: Arc<Engine>,
    /// `None` while the key is in the body, not read yet.
    record: Option<Arc<RecordKey>>,
    wire: Wire,
}

impl<B, E> Guarded<B, E> {
    /// Polls the work, within the caller's span; `true` once it is done (or has panicked).
    fn poll_work(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(work) = &mut self.work else {
            return true;
        };
        let _entered = self.span.enter();
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx)));
        if !matches!(polled, Ok(Poll::Pending)) {
            self.work = None;
            return true;
        }
        false
    }

    /// The answer to a caller whose work ended without one: it panicked outside the handler.
    fn panicked(&self) -> Response<ResponseBody<B>> {
        let _entered = self.span.enter();
        tracing::error!(
            "the work on a guarded request panicked outside the handler (a fingerprint hook, \
             the completion policy or the store); a key it claimed frees itself when its lease \
             ends"
        );
        let key = self.record.as_deref().map(RecordKey::key);
        self.engine
            .respond(Rejection::HandlerFailed, key, self.wire)
    }

    /// Hands the unfinished work to a task of its own: through the layer's spawner if it has
    /// one, else on the current runtime (without one, it is shutting down, and nothing could
    /// run the work anyway).
    fn detach(&mut self) {
        if let Some(work) = self.work.take() {
            let work = AssertUnwindSafe(work).catch_unwind().map(drop);
            let work = work.instrument(self.span.clone());
            if let Some(spawn) = &self.engine.settings.spawner {
                spawn(Box::pin(work));
            } else if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(work);
            }
        }
    }
}

impl<B, E> Drop for Guarded<B, E> {
    fn drop(&mut self) {
        self.detach();
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            inner: Kind::Passthrough { future },
        }
    }

    pub(crate) fn guarded(
        work: Work,
        reply: oneshot::Receiver<Reply<B, E>>,
        span: Span,
        engine: Arc<Engine>,
        record: Option<Arc<RecordKey>>,
        wire: Wire,
    ) -> Self {
        let guarded = Guarded {
            work: Some(work),
            reply,
            span,
            engine,
            record,
            wire,
        };
        Self {
            inner: Kind::Guarded { guarded },
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
            KindProj::Guarded { guarded } => {
                guarded.poll_work(cx);
                let answer = match ready!(Pin::new(&mut guarded.reply).poll(cx)) {
                    Ok(reply) => reply,
                    Err(_) => Ok(guarded.panicked()),
                };
                guarded.detach();
                Poll::Ready(answer)
            }
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
