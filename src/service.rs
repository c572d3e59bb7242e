//! The middleware service.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use http::{Request, Response};
use http_body::Body;
use tokio::sync::oneshot;
use tower_service::Service;

use crate::{
    IdempotencyKey,
    body::{RequestBody, ResponseBody},
    future::ResponseFuture,
    grpc::Wire,
    kept::Resumption,
    problem::Rejection,
    protocol::{self, Engine, Keyed},
    store::{BoxError, RecordKey},
};

/// Middleware that runs each guarded request at most once per (scope, key) across every instance
/// sharing its store, and replays the stored response to retries. Built by
/// [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// A guarded request is worked on by its response future; if that future is dropped before the
/// work is done, the work moves to a task of its own (`tokio::spawn`), so the handler finishes,
/// and its outcome is stored, even when the caller goes away. This needs a Tokio runtime and
/// `Send + 'static` services, futures and bodies.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    engine: Arc<Engine>,
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, engine: Arc<Engine>) -> Self {
        Self { inner, engine }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = &self.engine.settings;
        if !settings.methods.contains(request.method()) {
            return self.pass_through(request);
        }
        let wire = Wire::of(request.headers());
        if let Some(resumption) = request.extensions().get::<Resumption>() {
            // The completer's: key and scope as the key was claimed with.
            let record = Arc::clone(&resumption.record);
            let span = request_span();
            let shown = settings.shown_record(&record);
            span.record("key", tracing::field::display(shown.key));
            span.record("scope", tracing::field::display(shown.scope));
            return self.guard(Keyed::Known(record), request, wire, span);
        }
        // A key in the body is read once the body is buffered (`protocol::admit`).
        let key = match settings.key_in_body {
            Some(_) => None,
            None => match IdempotencyKey::from_headers(request.headers(), &settings.key_header) {
                Ok(Some(key)) => Some(key),
                Ok(None) if !settings.key_required => return self.pass_through(request),
                Ok(None) => return self.reject(Rejection::MissingKey, None, wire, request_span()),
                Err(error) => {
                    let rejection = Rejection::InvalidKey(error);
                    return self.reject(rejection, None, wire, request_span());
                }
            },
        };
        // A span per guarded request, the caller's span its parent: the layer's events and the
        // handler's run inside it. Key and scope appear as pseudonyms unless configured not to.
        let span = request_span();
        if let Some(key) = &key {
            span.record("key", tracing::field::display(settings.shown(key.as_str())));
        }
        let (parts, body) = request.into_parts();
        let Some(scope) = (settings.scope)(&parts) else {
            span.in_scope(|| {
                tracing::error!(
                    "no idempotency scope for this request: is the layer that authenticates \
                     requests installed outside the idempotency layer?"
                )
            });
            return self.reject(Rejection::NoScope, key.as_ref(), wire, span);
        };
        span.record("scope", tracing::field::display(settings.shown(&scope)));
        let keyed = match key {
            Some(key) => Keyed::Known(Arc::new(RecordKey::new(scope, key))),
            None => Keyed::InBody { scope },
        };
        self.guard(keyed, Request::from_parts(parts, body), wire, span)
    }
}

impl<S> Idempotency<S> {
    /// Runs a guarded request for the key `keyed` says.
    fn guard<ReqBody, ResBody>(
        &mut self,
        keyed: Keyed,
        request: Request<ReqBody>,
        wire: Wire,
        span: tracing::Span,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
            + Clone
            + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body + Send + 'static,
        ReqBody::Data: Send,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body + Send + 'static,
        ResBody::Data: Send,
        ResBody::Error: Into<BoxError>,
    {
        // The service that was driven to readiness is the one that must be called, and it moves
        // into the task; a clone stays here. See tower-service's "Be careful when cloning inner
        // services".
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (reply, receiver) = oneshot::channel();
        let record = keyed.known();
        // Boxed at once: the work's state is kilobytes, and moves through no wrapper.
        let work = Box::pin(protocol::run(
            Arc::clone(&self.engine),
            inner,
            keyed,
            request,
            reply,
            wire,
        ));
        let engine = Arc::clone(&self.engine);
        ResponseFuture::guarded(work, receiver, span, engine, record, wire)
    }
}

/// The span of one guarded request; its fields are filled in as they become known.
fn request_span() -> tracing::Span {
    tracing::info_span!(
        "idempotency",
        key = tracing::field::Empty,
        scope = tracing::field::Empty,
        fence = tracing::field::Empty,
        outcome = tracing::field::Empty,
    )
}

impl<S> Idempotency<S> {
    /// Hands a request the layer does not guard to the inner service, untouched.
    fn pass_through<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
    ) -> ResponseFuture<S::Future, ResBody, S::Error>
    where
        S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    {
        ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::passthrough)))
    }

    fn reject<B, F, E>(
        &self,
        rejection: Rejection,
        key: Option<&IdempotencyKey>,
        wire: Wire,
        span: tracing::Span,
    ) -> ResponseFuture<F, B, E> {
        let response = span.in_scope(|| self.engine.respond(rejection, key, wire));
        ResponseFuture::ready(response)
    }
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}
