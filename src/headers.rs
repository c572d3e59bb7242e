//! Header names and values the layer reads or writes on the wire.

use http::{HeaderMap, HeaderName, header::VARY};

/// The header that marks a replayed response (`Idempotent-Replayed: true`).
pub(crate) const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The request header names a response's `Vary` headers list (`*` names none in particular).
pub(crate) fn vary_names(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    headers
        .get_all(VARY)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|list| list.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
}

/// The values `request` sends for each header a response with `response_headers` varies on:
/// what a replay of that response must be sent again to be acceptable.
pub(crate) fn varied_request_headers(
    response_headers: &HeaderMap,
    request: &HeaderMap,
) -> HeaderMap {
    let mut varied = HeaderMap::new();
    for name in vary_names(response_headers) {
        for value in request.get_all(&name) {
            varied.append(name.clone(), value.clone());
        }
    }
    varied
}
