//! Reading a guarded request body: within its size and time limits, fingerprinted as it arrives.

use std::{pin::pin, task::Poll, time::Duration};

use bytes::{Buf, Bytes};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError};

use crate::{
    body::Chunks, fingerprint::Fingerprint, fingerprint::FingerprintHasher, problem::Rejection,
    settings::Settings, store::BoxError,
};

/// Buffers a guarded request body, up to the size and time limits, and fingerprints the request
/// (hashing the body as it arrives, unless a hook must see all of it).
pub(super) async fn read_body<B>(
    settings: &Settings,
    parts: &http::request::Parts,
    body: B,
) -> Result<(Bytes, Fingerprint), Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let limit = settings.max_request_body;
    // A declared length over the limit is refused before a byte is read.
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::BodyTooLarge { limit: Some(limit) });
    }
    let mut hasher = FingerprintHasher::new(parts, &settings.fingerprint_headers);
    let hashing = settings.fingerprint_body.is_none().then_some(&mut hasher);
    let read = within_deadline(settings.request_body_timeout, collect(body, limit, hashing));
    let body = read.await?.concat();
    let fingerprint = match &settings.fingerprint_body {
        None => hasher.finish(),
        Some(hook) => {
            let mut hasher = FingerprintHasher::new(parts, &settings.fingerprint_headers);
            hasher.update(&hook(parts, &body));
            hasher.finish()
        }
    };
    Ok((body, fingerprint))
}

/// Reads every data frame of `body`, up to `limit` bytes, feeding them to `hasher` if given.
async fn collect<B>(
    body: B,
    limit: usize,
    mut hasher: Option<&mut FingerprintHasher>,
) -> Result<Chunks, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    let (mut chunks, mut len) = (Chunks::default(), 0);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            let error: BoxError = error.into();
            if caused_by::<LengthLimitError>(&*error) {
                // A limit outside this layer (tower-http's RequestBodyLimitLayer, say).
                Rejection::BodyTooLarge { limit: None }
            } else {
                tracing::debug!(
                    error = &*error as &dyn std::error::Error,
                    "request body failed"
                );
                Rejection::BodyUnreadable
            }
        })?;
        if let Ok(mut data) = frame.into_data() {
            let data = data.copy_to_bytes(data.remaining());
            len += data.len();
            if len > limit {
                return Err(Rejection::BodyTooLarge { limit: Some(limit) });
            }
            if let Some(hasher) = &mut hasher {
                hasher.update(&data);
            }
            chunks.push(data);
        }
    }
    Ok(chunks)
}

/// Runs `read` within `timeout`. Most bodies have arrived with their request: a timer is armed,
/// and the clock read, only for one that has not (its first poll, an instant earlier, found it
/// pending).
async fn within_deadline<T>(
    timeout: Duration,
    read: impl Future<Output = Result<T, Rejection>>,
) -> Result<T, Rejection> {
    let mut read = pin!(read);
    match std::future::poll_fn(|cx| Poll::Ready(read.as_mut().poll(cx))).await {
        Poll::Ready(read) => read,
        Poll::Pending => match tokio::time::timeout(timeout, read).await {
            Ok(read) => read,
            Err(_elapsed) => Err(Rejection::BodyTimeout { after: timeout }),
        },
    }
}

/// Whether `error`, or any error in its chain of sources, is an `E`.
fn caused_by<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.is::<E>() {
            return true;
        }
        next = error.source();
    }
    false
}
