//! The router: the routes over the shared [`AppState`], the API-key and
//! request-counting middleware, and the small endpoints (`/health`,
//! `/v1/models`, `/metrics`, `/tokenize`, `/detokenize`, the chat page).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use te_tokenizer::TokenizerError;

use super::completions::{
    body_error, chat_completions, completions, enter, tokenize_holding, too_large,
};
use super::error::ApiError;
use super::state::{AppState, ClientKey};

/// Paths served without an API key: the health check and the chat page's
/// static files (the page asks for the key and sends it with its API
/// calls).
const PUBLIC_PATHS: [&str; 4] = ["/health", "/", "/chat.css", "/chat.js"];

const PAGE_HTML: &str = include_str!("static/index.html");
const PAGE_CSS: &str = include_str!("static/chat.css");
const PAGE_JS: &str = include_str!("static/chat.js");

/// Every route, behind the body limit, the API-key check and the request
/// counter (outermost, so refusals are counted too).
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models/{*model}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route(
            "/",
            get(|| async { static_file("text/html; charset=utf-8", PAGE_HTML) }),
        )
        .route(
            "/chat.css",
            get(|| async { static_file("text/css", PAGE_CSS) }),
        )
        .route(
            "/chat.js",
            get(|| async { static_file("text/javascript", PAGE_JS) }),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            declared_body_limit,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), require_key))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            super::guard::browser,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// A JSON body with `status`.
pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// Counts each response by route and status (499: the client left
/// before it).
async fn count(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "other".to_string(), |m| m.as_str().to_string());
    let counted = s.metrics.http_started(route);
    let response = next.run(req).await;
    counted.answered(response.status().as_u16());
    response
}

/// With API keys: `Authorization: Bearer KEY` (the scheme in any case)
/// on every path but [`PUBLIC_PATHS`], else 401; the key's index goes
/// with the request ([`ClientKey`]).
/// A request whose `Content-Length` says its body is over
/// `--max-body-bytes` gets its 413 at once, before the body is waited for
/// (or a `100 Continue` invites it).
async fn declared_body_limit(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match declared {
        Some(n) if n > s.max_body_bytes as u64 => too_large(s.max_body_bytes).into_response(),
        _ => next.run(req).await,
    }
}

async fn require_key(State(s): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    if s.api_keys.is_empty() || PUBLIC_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim());
    match given.map(|g| s.key_index(g)) {
        Some(Some(i)) => {
            req.extensions_mut().insert(ClientKey(i));
            next.run(req).await
        }
        Some(None) => unauthorized("Incorrect API key provided."),
        None => unauthorized(
            "You didn't provide an API key. You need to provide your API key in an \
             Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        ),
    }
}

fn unauthorized(message: &str) -> Response {
    ApiError::status(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        "invalid_api_key",
        message,
    )
    .into_response()
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::status(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown_url",
        format!("Unknown request URL: {method} {}.", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        format!("{method} is not allowed on {}.", uri.path()),
    )
}

/// `GET /health`: 200 while the engine runs, 503 once it has stopped or
/// the server is shutting down (a load balancer stops sending).
async fn health(State(s): State<Arc<AppState>>) -> Response {
    if !s.engine_alive.load(Ordering::SeqCst) {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "engine stopped"}),
        )
    } else if s.is_shutting_down() {
        json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"status": "shutting down"}),
        )
    } else {
        json_response(StatusCode::OK, &json!({"status": "ok"}))
    }
}

fn model_object(s: &AppState) -> serde_json::Value {
    json!({
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "te-rs",
        "max_model_len": s.context_tokens,
    })
}

/// `GET /v1/models`.
async fn models(State(s): State<Arc<AppState>>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": [model_object(&s)]}),
    )
}

/// `GET /v1/models/{model}`.
async fn model(State(s): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    if name == s.model_name {
        json_response(StatusCode::OK, &model_object(&s))
    } else {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
        .into_response()
    }
}

/// `GET /metrics` (see [`super::metrics`]).
async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let handle = s.handle.clone();
    let snapshot = tokio::task::spawn_blocking(move || handle.snapshot().ok())
        .await
        .ok()
        .flatten();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(snapshot.as_ref()),
    )
        .into_response()
}

/// A JSON object body, or a 400.
fn json_object(body: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(serde_json::Value::Object(o)) => Ok(o),
        Ok(v) => Err(ApiError::wrong_type("body", "an object", &v)),
        Err(e) => Err(ApiError::invalid(
            None,
            "invalid_json",
            format!("We could not parse the JSON body of your request ({e})."),
        )),
    }
}

/// `POST /tokenize` (llama.cpp's shape, vLLM's `prompt` accepted too):
/// `{"content": TEXT}` -> `{"tokens": [ids], "count", "max_model_len"}`,
/// the tokens a completion prompt of that text gets (BOS where the model
/// adds one, special-token text parsed). It holds a request slot while it
/// works (429 when `--max-concurrent-requests` are taken) and refuses a
/// text of more tokens than the context (400 naming the field), found
/// without encoding all of it.
async fn tokenize(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = body.map_err(|r| body_error(&r, s.max_body_bytes))?;
        let o = json_object(&body)?;
        let (name, text) = match (o.get("content"), o.get("prompt")) {
            (Some(v), _) => ("content", v),
            (None, Some(v)) => ("prompt", v),
            (None, None) => {
                return Err(ApiError::invalid(
                    Some("content"),
                    "missing_required_parameter",
                    "Missing required parameter: 'content'.",
                ))
            }
        };
        let text = text
            .as_str()
            .ok_or_else(|| ApiError::wrong_type(name, "a string", text))?
            .to_string();
        let in_flight = enter(&s)?;
        let st = s.clone();
        let limit = s.context_tokens;
        let (tokens, _in_flight) = tokenize_holding(in_flight, body.len(), move || {
            st.loaded.tokenizer.encode_limited(&text, true, limit)
        })
        .await?;
        let tokens = tokens.map_err(|e| match e {
            TokenizerError::TooLong { at_least, .. } => ApiError::too_long(
                name,
                format!(
                    "This model's maximum context length is {limit} tokens. However, your \
                     {name} resulted in at least {at_least} tokens."
                ),
            ),
            e => ApiError::bad_value(name, e.to_string()),
        })?;
        Ok::<_, ApiError>(json!({
            "tokens": tokens,
            "count": tokens.len(),
            "max_model_len": s.context_tokens,
        }))
    };
    match result.await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`: `{"tokens": [ids]}` -> `{"content": TEXT}`
/// (special tokens kept); an id outside the vocabulary is a 400 naming
/// `tokens`.
async fn detokenize(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = body.map_err(|r| body_error(&r, s.max_body_bytes))?;
        let o = json_object(&body)?;
        let v = o.get("tokens").ok_or_else(|| {
            ApiError::invalid(
                Some("tokens"),
                "missing_required_parameter",
                "Missing required parameter: 'tokens'.",
            )
        })?;
        let ids = v
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_u64().and_then(|u| u32::try_from(u).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| ApiError::wrong_type("tokens", "an array of token ids", v))?;
        let st = s.clone();
        let text = tokio::task::spawn_blocking(move || st.loaded.tokenizer.decode(&ids, false))
            .await
            .map_err(|e| ApiError::bad_value("tokens", e.to_string()))?
            .map_err(|e| ApiError::bad_value("tokens", format!("Invalid 'tokens': {e}.")))?;
        Ok::<_, ApiError>(json!({"content": text}))
    };
    match result.await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}
