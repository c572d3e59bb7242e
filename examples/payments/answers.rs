//! The example's own error answers, as `application/problem+json`.

use super::*;

pub(crate) fn problem(status: StatusCode, title: &str, detail: impl std::fmt::Display) -> Response {
    let body = serde_json::json!({ "title": title, "status": status.as_u16(), "detail": detail.to_string() });
    let mut response = (status, Json(body)).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

pub(crate) fn unavailable(error: sqlx::Error) -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "database unavailable",
        error,
    )
}

/// A fence or recovery point refused: a stale attempt, stopped before it wrote anything.
pub(crate) fn fence_failed(error: FenceError) -> Response {
    match error {
        error @ FenceError::LeaseLost { .. } => {
            tracing::warn!(%error, "stale attempt stopped by the fence");
            problem(StatusCode::CONFLICT, "claim lost", error)
        }
        error => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "database unavailable",
            error,
        ),
    }
}
