//! Every answer the layer gives instead of the handler goes through here: rendered (a gRPC
//! status, the application's problem hook, or `application/problem+json`), reported (span,
//! metrics, event, response extension), or replayed from the store.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};

use crate::{
    IdempotencyKey, IdempotencyOutcome,
    body::ResponseBody,
    grpc::Wire,
    headers::{self, IDEMPOTENT_REPLAYED, vary_names},
    problem::{Problem, Rejection},
    response::StoredResponse,
    telemetry::Telemetry,
};

/// The hook of [`IdempotencyLayer::with_problem_response`](crate::IdempotencyLayer::with_problem_response).
pub(crate) type ProblemFn = dyn Fn(&Problem) -> Response<Bytes> + Send + Sync;

/// The hook of [`IdempotencyLayer::with_replayed_response`](crate::IdempotencyLayer::with_replayed_response).
pub(crate) type ReplayedFn = dyn Fn(&mut http::response::Parts) + Send + Sync;

/// How the layer's own answers are rendered and logged: what the application configured.
#[derive(Clone)]
pub(crate) struct Answers {
    /// Renders problems to HTTP callers instead of `application/problem+json`.
    pub(crate) problem_response: Option<Arc<ProblemFn>>,
    /// Adjusts replayed responses before they leave.
    pub(crate) replayed_response: Option<Arc<ReplayedFn>>,
    /// The level of the event logged for each answer the layer gives.
    pub(crate) level: tracing::Level,
}

impl Default for Answers {
    fn default() -> Self {
        Self {
            problem_response: None,
            replayed_response: None,
            level: tracing::Level::INFO,
        }
    }
}

impl Answers {
    /// The layer's own answer, rendered and reported.
    pub(crate) fn respond<B>(
        &self,
        telemetry: &Telemetry,
        rejection: Rejection,
        key: Option<&IdempotencyKey>,
        wire: Wire,
    ) -> Response<ResponseBody<B>> {
        let outcome = rejection.outcome();
        let mut response = self
            .render(rejection, key, wire)
            .map(|body| ResponseBody::full(body, None));
        self.report(telemetry, outcome, &mut response);
        response
    }

    /// A stored response, replayed and reported; saying its key is protected for `protected`
    /// more, when the layer says so.
    pub(crate) fn replay<B>(
        &self,
        telemetry: &Telemetry,
        stored: StoredResponse,
        protected: Option<Duration>,
    ) -> Response<ResponseBody<B>> {
        let (status, mut headers, body, trailers) = stored.into_parts();
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        if let Some(left) = protected {
            headers::protected_for(&mut headers, left);
        }
        let mut response = Response::new(ResponseBody::full(body.unwrap_or_default(), trailers));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        self.report(telemetry, IdempotencyOutcome::Replayed, &mut response);
        match &self.replayed_response {
            Some(adjust) => {
                let (mut parts, body) = response.into_parts();
                adjust(&mut parts);
                let marker = HeaderValue::from_static("true");
                parts.headers.insert(IDEMPOTENT_REPLAYED, marker);
                Response::from_parts(parts, body)
            }
            None => response,
        }
    }

    /// Tells the outside what the layer did with a request: the span's `outcome`, the metrics,
    /// an event when the layer answered instead of the handler, and the response's extension.
    pub(crate) fn report<B>(
        &self,
        telemetry: &Telemetry,
        outcome: IdempotencyOutcome,
        response: &mut Response<B>,
    ) {
        self.record(telemetry, outcome);
        if outcome.answered_by_layer() {
            let status = response.status().as_u16();
            let message = "answered instead of the handler";
            match self.level {
                tracing::Level::ERROR => tracing::error!(%outcome, status, "{message}"),
                tracing::Level::WARN => tracing::warn!(%outcome, status, "{message}"),
                tracing::Level::INFO => tracing::info!(%outcome, status, "{message}"),
                tracing::Level::DEBUG => tracing::debug!(%outcome, status, "{message}"),
                tracing::Level::TRACE => tracing::trace!(%outcome, status, "{message}"),
            }
        }
        response.extensions_mut().insert(outcome);
    }

    /// The span's `outcome` and the metrics, for an answer that is not a response (the inner
    /// service's own error).
    pub(crate) fn record(&self, telemetry: &Telemetry, outcome: IdempotencyOutcome) {
        tracing::Span::current().record("outcome", outcome.as_str());
        telemetry.answered(outcome);
    }

    /// The layer's own answer, rendered for its caller: a gRPC status, or the problem through
    /// the configured hook.
    pub(crate) fn render(
        &self,
        rejection: Rejection,
        key: Option<&IdempotencyKey>,
        wire: Wire,
    ) -> Response<Bytes> {
        let problem = rejection.problem(key);
        match &self.problem_response {
            _ if wire == Wire::Grpc => problem.to_grpc_response(),
            Some(hook) => hook(&problem),
            None => problem.to_response(),
        }
    }
}

/// The names of the request headers the stored response varies on that this request sends
/// differently, if any: such a retry must not receive a body negotiated for another request.
pub(crate) fn vary_mismatch(
    stored: &StoredResponse,
    request: &HeaderMap,
) -> Option<Vec<HeaderName>> {
    let differing: Vec<HeaderName> = vary_names(stored.headers())
        .filter(|name| {
            !request
                .get_all(name)
                .iter()
                .eq(stored.varied_request_headers().get_all(name))
        })
        .collect();
    (!differing.is_empty()).then_some(differing)
}
