//! The request body the client sends on each attempt: the caller's body buffered (so that every
//! attempt sends the same bytes), or, past the buffer limit, what was read and the rest of the
//! caller's body, sent once.

use std::{
    collections::VecDeque,
    pin::{Pin, pin},
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

use crate::{
    body::{Chunks, poll_to_bytes},
    store::BoxError,
};

pin_project! {
    /// The body an [`IdempotencyClient`](super::IdempotencyClient) hands its inner service: the
    /// bytes of the caller's body, the same on every attempt, or (for a body over the buffer
    /// limit, sent once) the part already read followed by the rest.
    pub struct ClientBody<B> {
        #[pin]
        inner: Inner<B>,
    }
}

pin_project! {
    #[project = InnerProj]
    enum Inner<B> {
        Buffered { data: Option<Bytes> },
        Prefixed { read: VecDeque<Bytes>, #[pin] rest: B },
    }
}

impl<B> ClientBody<B> {
    /// The caller's body as it is, sent once.
    pub(crate) fn once(body: B) -> Self {
        prefixed(VecDeque::new(), body)
    }

    pub(crate) fn buffered(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: Inner::Buffered { data },
        }
    }
}

/// A caller's body, read up to the buffer limit.
pub(crate) enum Read<B> {
    /// The whole body, within the limit: it can be sent any number of times.
    Whole(Bytes),
    /// Past the limit: it can be sent once.
    TooLarge(ClientBody<B>),
}

/// Reads `body` whole if it fits in `limit` bytes (its trailers, rare on requests, are not kept).
pub(crate) async fn read<B>(body: B, limit: usize) -> Result<Read<B>, BoxError>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Ok(Read::TooLarge(ClientBody::once(body)));
    }
    let mut body = body;
    let (mut read, mut len) = (Chunks::default(), 0);
    while let Some(frame) = pin!(&mut body).frame().await {
        let Ok(mut data) = frame.map_err(Into::into)?.into_data() else {
            continue;
        };
        let data = data.copy_to_bytes(data.remaining());
        len += data.len();
        read.push(data);
        if len > limit {
            return Ok(Read::TooLarge(prefixed(read.into_iter().collect(), body)));
        }
    }
    Ok(Read::Whole(read.concat()))
}

fn prefixed<B>(read: VecDeque<Bytes>, rest: B) -> ClientBody<B> {
    ClientBody {
        inner: Inner::Prefixed { read, rest },
    }
}

impl<B> Body for ClientBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().inner.project() {
            InnerProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            InnerProj::Prefixed { read, rest } => match read.pop_front() {
                Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                None => poll_to_bytes(rest, cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Buffered { data } => data.is_none(),
            Inner::Prefixed { read, rest } => read.is_empty() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Inner::Prefixed { read, rest } => {
                let read = read.iter().map(|d| d.len() as u64).sum();
                prefixed_hint(read, rest.size_hint())
            }
        }
    }
}

/// The size of `read` bytes followed by a body of size `rest`.
fn prefixed_hint(read: u64, rest: SizeHint) -> SizeHint {
    let mut hint = SizeHint::new();
    hint.set_lower(rest.lower() + read);
    if let Some(upper) = rest.upper() {
        hint.set_upper(upper + read);
    }
    hint
}

impl<B> std::fmt::Debug for ClientBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientBody").finish_non_exhaustive()
    }
}

pin_project! {
    /// The body of a response an [`IdempotencyClient`](super::IdempotencyClient) returns: the
    /// server's, as it comes; for a gRPC answer whose status comes in its trailers, the frames
    /// read to see that status, then the rest.
    pub struct ClientResponseBody<B> {
        read: VecDeque<Frame<Bytes>>,
        // Whether `rest` already ended (a body is not polled again after it did).
        ended: bool,
        #[pin]
        rest: B,
    }
}

impl<B> ClientResponseBody<B> {
    /// The server's body, untouched.
    pub(crate) fn live(body: B) -> Self {
        Self {
            read: VecDeque::new(),
            ended: false,
            rest: body,
        }
    }

    /// The trailers read ahead, if the body was read to its end.
    pub(crate) fn trailers(&self) -> Option<&http::HeaderMap> {
        self.read.back()?.trailers_ref()
    }
}

/// Reads a response body to its trailers, within `limit` bytes of data (a larger one is read
/// no further: its trailers are not seen). What was read is replayed by the returned body.
pub(crate) async fn read_to_trailers<B>(
    body: B,
    limit: usize,
) -> Result<ClientResponseBody<B>, BoxError>
where
    B: Body + Unpin,
    B::Error: Into<BoxError>,
{
    let mut body = ClientResponseBody::live(body);
    let mut len = 0;
    while len <= limit {
        let Some(frame) = pin!(&mut body.rest).frame().await else {
            body.ended = true;
            break;
        };
        let frame = frame
            .map_err(Into::into)?
            .map_data(|mut data| data.copy_to_bytes(data.remaining()));
        len += frame.data_ref().map_or(0, Bytes::len);
        body.read.push_back(frame);
    }
    Ok(body)
}

impl<B> Body for ClientResponseBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.read.pop_front() {
            Some(frame) => Poll::Ready(Some(Ok(frame))),
            None if *this.ended => Poll::Ready(None),
            None => poll_to_bytes(this.rest, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && (self.ended || self.rest.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let read = self.read.iter().filter_map(Frame::data_ref);
        let read = read.map(|d| d.len() as u64).sum();
        if self.ended {
            return SizeHint::with_exact(read);
        }
        prefixed_hint(read, self.rest.size_hint())
    }
}

impl<B> std::fmt::Debug for ClientResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientResponseBody").finish_non_exhaustive()
    }
}
