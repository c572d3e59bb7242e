//! The engine: one guarded request, from its body to its finalized key, and the live state the
//! requests of one layer share.
//!
//! [`run`] is `admit → execute → settle`, one file per phase, in the order a request meets
//! them: [`admit`](mod@admit) claims the key once [`read`] has buffered and fingerprinted the
//! body (waiting for a duplicate in flight, see [`wait`]), and holds the grant only if its lease
//! still stands; [`execute`](mod@execute) runs the handler and reads its response while
//! [`lease`] renews the lease from a thread of its own; [`settle`](mod@settle) finalizes the
//! key and answers. [`engine`] is what the requests of one layer share; [`units`] is the same
//! claim, lease and settle for a unit of work beyond HTTP.

mod engine;
mod read;
mod wait;
mod lease;
mod admit;
mod execute;
mod settle;
mod units;

use std::sync::Arc;

use http::{HeaderMap, Request, Response};
use http_body::Body;
use tokio::sync::oneshot;
use tower_service::Service;

#[cfg(feature = "postgres")]
pub(crate) use self::units::{deliver_batch_in_transaction, deliver_in_transaction};
pub(crate) use self::{
    admit::claim_committed,
    engine::{Engine, State},
    units::{Delivered, deliver},
};
use self::{lease::Keeper, wait::Wait};
use crate::{
    body::{RequestBody, ResponseBody},
    grpc::Wire,
    policy::Completion,
    problem::Rejection,
    response::StoredResponse,
    store::{BoxError, ClaimRequest, Lease, RecordKey},
};

/// Whose key a guarded request claims: known from its head (the key header, or the completer's
/// resumption), or read from its JSON body once buffered, in the scope its head gave
/// ([`with_key_from_body`](crate::IdempotencyLayer::with_key_from_body)).
pub(crate) enum Keyed {
    Known(Arc<RecordKey>),
    InBody { scope: String },
}

impl Keyed {
    /// The record, if the key is known before the body is read.
    pub(crate) fn known(&self) -> Option<Arc<RecordKey>> {
        match self {
            Self::Known(record) => Some(Arc::clone(record)),
            Self::InBody { .. } => None,
        }
    }
}

/// What the work on a guarded request sends back to its caller.
pub(crate) type Reply<B, E> = Result<Response<ResponseBody<B>>, E>;

/// Where the answer to the caller goes.
pub(crate) type Caller<B, E> = oneshot::Sender<Reply<B, E>>;

/// What the layer's own answers to one guarded request depend on, passed whole through its
/// phases: the engine, the request's headers (a replay must agree with them on `Vary`), how
/// long a duplicate waits for the first request with its key, and what the caller speaks.
#[derive(Clone, Copy)]
struct Exchange<'a, 'h> {
    engine: &'a Arc<Engine>,
    headers: &'h HeaderMap,
    wait: Wait,
    wire: Wire,
}

impl Exchange<'_, '_> {
    /// The layer's own answer to this request about `claim`'s key, instead of the handler's.
    fn refuse<B>(&self, rejection: Rejection, claim: &ClaimRequest) -> Response<ResponseBody<B>> {
        let key = Some(claim.record().key());
        self.engine.respond(rejection, key, self.wire)
    }
}

/// A claim this process holds: the claim, the lease the store granted it, and the keeper that
/// renews the lease until this is dropped. Work runs only under a hold.
struct Hold<'a> {
    claim: ClaimRequest,
    lease: Lease,
    keeper: Keeper<'a>,
}

/// What the work left to store, and whether to complete or release the key with it.
struct Outcome {
    response: StoredResponse,
    completion: Completion,
}

/// Runs one guarded request: buffer and fingerprint, verify, claim (waiting for a duplicate in
/// flight), run the handler while the lease is renewed, finalize the key, then answer.
pub(crate) async fn run<S, ReqBody, ResBody>(
    engine: Arc<Engine>,
    inner: S,
    keyed: Keyed,
    request: Request<ReqBody>,
    reply: Caller<ResBody, S::Error>,
    wire: Wire,
) where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let wait = Wait::of(&engine.settings, &parts.headers);
    let exchange = Exchange {
        engine: &engine,
        headers: &parts.headers,
        wait,
        wire,
    };
    let Some((hold, body, reply)) = admit::admit(exchange, keyed, &parts, body, reply).await else {
        return;
    };
    let lease = &hold.lease;
    let (handled, headers) =
        execute::execute(&engine, inner, parts, body, lease, reply, wire).await;
    let exchange = Exchange {
        engine: &engine,
        headers: &headers,
        wait,
        wire,
    };
    settle::settle(exchange, hold, handled).await;
}
