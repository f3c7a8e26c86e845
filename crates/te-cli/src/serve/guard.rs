//! Request guards below the routes: the request body's deadline (a body
//! that has not arrived within `--body-read-timeout-secs` of its head
//! fails, and the handler answers 400).

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;
use axum::BoxError;
use futures_util::StreamExt;

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
