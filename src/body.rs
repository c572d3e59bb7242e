//! The request and response bodies the layer hands on: the handler's request body
//! ([`RequestBody`], already read when the layer had to fingerprint it) and the body of every
//! answer ([`ResponseBody`]).

use std::{
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;

use crate::store::BoxError;

pin_project! {
    /// The request body the inner service receives: the caller's body untouched for requests the
    /// layer does not guard, or the bytes it buffered to fingerprint a guarded request.
    pub struct RequestBody<B> {
        #[pin]
        inner: RequestBodyInner<B>,
    }
}

pin_project! {
    #[project = RequestBodyProj]
    enum RequestBodyInner<B> {
        Buffered { data: Option<Bytes> },
        Passthrough { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: RequestBodyInner::Buffered { data },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            inner: RequestBodyInner::Passthrough { body },
        }
    }
}

impl<B> Body for RequestBody<B>
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
            RequestBodyProj::Buffered { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
            RequestBodyProj::Passthrough { body } => poll_to_bytes(body, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            RequestBodyInner::Buffered { data } => data.is_none(),
            RequestBodyInner::Passthrough { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            RequestBodyInner::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestBodyInner::Passthrough { body } => body.size_hint(),
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

/// A frame sent from the task that runs the handler to the caller's response body.
pub(crate) type LiveFrame = Result<Frame<Bytes>, BoxError>;

pin_project! {
    /// The response body the layer returns: the inner service's body for requests it does not
    /// guard, a stored or problem response it answers itself, or the handler's body relayed from
    /// the task that runs it (so the handler finishes even if the caller goes away).
    pub struct ResponseBody<B> {
        #[pin]
        inner: ResponseBodyInner<B>,
    }
}

pin_project! {
    #[project = ResponseBodyProj]
    enum ResponseBodyInner<B> {
        Passthrough { #[pin] body: B },
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        // `remaining` is the exact length still to come, when the handler's body declared one.
        Live { frames: mpsc::Receiver<LiveFrame>, remaining: Option<u64> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            inner: ResponseBodyInner::Passthrough { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            inner: ResponseBodyInner::Full { data, trailers },
        }
    }

    pub(crate) fn live(frames: mpsc::Receiver<LiveFrame>, hint: &SizeHint) -> Self {
        Self {
            inner: ResponseBodyInner::Live {
                frames,
                remaining: hint.exact(),
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
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
            ResponseBodyProj::Passthrough { body } => poll_to_bytes(body, cx),
            ResponseBodyProj::Full { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
            ResponseBodyProj::Live { frames, remaining } => {
                let frame = ready!(frames.poll_recv(cx));
                if let (Some(Ok(frame)), Some(remaining)) = (&frame, remaining) {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    *remaining = remaining.saturating_sub(len);
                }
                Poll::Ready(frame)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            ResponseBodyInner::Passthrough { body } => body.is_end_stream(),
            ResponseBodyInner::Full { data, trailers } => data.is_none() && trailers.is_none(),
            ResponseBodyInner::Live { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            ResponseBodyInner::Passthrough { body } => body.size_hint(),
            ResponseBodyInner::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseBodyInner::Live { remaining, .. } => {
                remaining.map_or_else(SizeHint::default, SizeHint::with_exact)
            }
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

/// Polls a body, turning its data into `Bytes` (free when it already is) and its error into a
/// boxed one.
pub(crate) fn poll_to_bytes<B>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    Poll::Ready(ready!(body.poll_frame(cx)).map(|frame| match frame {
        Ok(frame) => Ok(frame.map_data(|mut data| data.copy_to_bytes(data.remaining()))),
        Err(error) => Err(error.into()),
    }))
}

/// Body chunks as they are read. The first is kept apart, so that a body that arrives in one
/// chunk (most do) is gathered without a vector and joined without a copy.
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    first: Option<Bytes>,
    rest: Vec<Bytes>,
}

impl Chunks {
    /// Adds the next chunk.
    pub(crate) fn push(&mut self, chunk: Bytes) {
        match self.first {
            None => self.first = Some(chunk),
            Some(_) => self.rest.push(chunk),
        }
    }

    /// Joins the chunks, without a copy when there is one.
    pub(crate) fn concat(self) -> Bytes {
        match self.first {
            None => Bytes::new(),
            Some(first) if self.rest.is_empty() => first,
            Some(first) => {
                let len = first.len() + self.rest.iter().map(Bytes::len).sum::<usize>();
                let mut all = BytesMut::with_capacity(len);
                all.extend_from_slice(&first);
                self.rest.iter().for_each(|c| all.extend_from_slice(c));
                all.freeze()
            }
        }
    }
}

impl IntoIterator for Chunks {
    type Item = Bytes;
    type IntoIter = std::iter::Chain<std::option::IntoIter<Bytes>, std::vec::IntoIter<Bytes>>;

    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.rest)
    }
}
