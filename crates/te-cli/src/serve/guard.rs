//! Request guards below the routes: the request body's deadline (a body
//! that has not arrived within `--body-read-timeout-secs` of its head
//! fails, and the handler answers 400), and the browser policy:
//!
//! - without API keys, the `Host` must be an IP address, `localhost` or an
//!   `--allowed-host` (else 421): a DNS-rebinding page (`evil.example`
//!   resolved to 127.0.0.1) is refused;
//! - a request with an `Origin` other than the server's own and the
//!   `--cors-origin`s is refused (403), and only those origins get CORS
//!   headers (and answers to preflight `OPTIONS`);
//! - without API keys, a `POST` must be `Content-Type: application/json`
//!   (else 415), which no cross-site form or simple request can send.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::BoxError;
use futures_util::StreamExt;

use super::error::ApiError;
use super::state::AppState;

/// Gives the request body a deadline: `--body-read-timeout-secs` from now.
pub async fn body_deadline(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if matches!(*req.method(), Method::GET | Method::HEAD) {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let limit = s.body_read_timeout;
    let mut deadline = Box::pin(tokio::time::sleep(limit));
    let mut data = body.into_data_stream();
    let timed = futures_util::stream::poll_fn(move |cx| {
        if deadline.as_mut().poll(cx).is_ready() {
            let e: BoxError = format!(
                "the body did not arrive within {} s (--body-read-timeout-secs)",
                limit.as_secs_f64()
            )
            .into();
            return Poll::Ready(Some(Err(e)));
        }
        data.poll_next_unpin(cx)
            .map(|item| item.map(|r| r.map_err(BoxError::from)))
    });
    next.run(Request::from_parts(parts, Body::from_stream(timed)))
        .await
}

/// The browser policy (see the module doc).
pub async fn browser(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let policy = &s.browser;
    let headers = req.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if policy.keyless && !policy.host_allowed(host) {
        return ApiError::status(
            StatusCode::MISDIRECTED_REQUEST,
            "invalid_request_error",
            "host_not_allowed",
            format!(
                "Host `{host}` is not served (a server without API keys answers only to IP \
                 addresses, localhost and --allowed-host)."
            ),
        )
        .into_response();
    }
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let cors = origin
        .as_deref()
        .filter(|o| policy.cors_origins.iter().any(|c| c == o));
    if let Some(o) = origin.as_deref() {
        let own = o
            .split_once("://")
            .is_some_and(|(_, rest)| rest.eq_ignore_ascii_case(host));
        if !own && cors.is_none() {
            return ApiError::status(
                StatusCode::FORBIDDEN,
                "invalid_request_error",
                "origin_not_allowed",
                format!("Requests from origin `{o}` are not allowed (see --cors-origin)."),
            )
            .into_response();
        }
    }
    if let Some(o) = cors {
        let allow = HeaderValue::from_str(o).ok();
        if req.method() == Method::OPTIONS {
            let mut r = StatusCode::NO_CONTENT.into_response();
            add_cors(r.headers_mut(), allow);
            let h = r.headers_mut();
            h.insert(
                header::ACCESS_CONTROL_ALLOW_METHODS,
                HeaderValue::from_static("GET, POST, OPTIONS"),
            );
            h.insert(
                header::ACCESS_CONTROL_ALLOW_HEADERS,
                HeaderValue::from_static("authorization, content-type"),
            );
            h.insert(
                header::ACCESS_CONTROL_MAX_AGE,
                HeaderValue::from_static("600"),
            );
            return r;
        }
        let mut r = checked_type(policy.keyless, req, next).await;
        add_cors(r.headers_mut(), allow);
        return r;
    }
    checked_type(policy.keyless, req, next).await
}

fn add_cors(h: &mut axum::http::HeaderMap, origin: Option<HeaderValue>) {
    if let Some(o) = origin {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o);
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
}

/// A `POST` to a server without keys must carry JSON.
async fn checked_type(keyless: bool, req: Request, next: Next) -> Response {
    if keyless && req.method() == Method::POST {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "unsupported_media_type",
                "The request body must be JSON, sent with `Content-Type: application/json`.",
            )
            .into_response();
        }
    }
    next.run(req).await
}
