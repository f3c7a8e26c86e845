//! `POST /v1/completions` and `POST /v1/chat/completions`: parse, build the
//! prompt (the chat template for chat), submit to the engine, and answer
//! whole or as server-sent events (`data: {chunk}` ... `data: [DONE]`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use te_engine::{Event, FinishReason, Request, RequestError, Usage};
use te_tokenizer::TokenizerError;
use tokio::sync::mpsc;

use super::api::{self, Endpoint, GenerationRequest, Input, Prompt};
use super::bridge::{self, Generation, SubmitError};
use super::error::ApiError;
use super::metrics::{InFlight, Metrics};
use super::response::{self, Delta, Meta, TokenIds};
use super::state::{unix_now, AppState, ClientKey};

/// Default `max_tokens` of `/v1/completions` (OpenAI's).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A request body from which on the memory its prompt's tokenizing freed
/// is returned to the system at once.
const LARGE_BODY_BYTES: usize = 1 << 20;

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<Arc<AppState>>,
    key: Option<Extension<ClientKey>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, Endpoint::Completions, key.map(|k| k.0), body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(s): State<Arc<AppState>>,
    key: Option<Extension<ClientKey>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(s, Endpoint::Chat, key.map(|k| k.0), body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A prepared prompt.
struct Prepared {
    tokens: Vec<u32>,
    /// With `echo`: the prompt's text, sent before the completion.
    echo: Option<String>,
}

async fn generate(
    s: Arc<AppState>,
    endpoint: Endpoint,
    key: Option<ClientKey>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(|r| body_error(&r, s.max_body_bytes))?;
    if s.is_shutting_down() {
        return Err(shutting_down());
    }
    let req = api::parse(endpoint, &body, s.random_seed())?;
    if req.model != s.model_name {
        return Err(ApiError::invalid(
            Some("model"),
            "model_not_found",
            format!(
                "The model `{}` does not exist; this server serves `{}`.",
                req.model, s.model_name
            ),
        ));
    }
    let in_flight = s.metrics.try_enter(s.max_concurrent_requests).ok_or_else(|| {
        ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "rate_limit_exceeded",
            format!(
                "The server holds {} generation requests already (--max-concurrent-requests); retry later.",
                s.max_concurrent_requests
            ),
        )
    })?;
    // The request's slot travels with the tokenizing: a client that
    // leaves meanwhile does not free it before the work ends. After a
    // large prompt the tokenizer's freed memory goes back to the system
    // (glibc keeps it in the thread's arena otherwise).
    let large = body.len() >= LARGE_BODY_BYTES;
    let (prepared, in_flight) = {
        let s = s.clone();
        let input = req.input.clone();
        tokio::task::spawn_blocking(move || {
            let prepared = prepare(&s, &input);
            drop(input);
            if large {
                crate::alloc_policy::release_free_memory();
            }
            (prepared, in_flight)
        })
        .await
        .map_err(|e| internal(format!("tokenizing failed: {e}")))?
    };
    let prepared = prepared?;
    let param = req.prompt_param();
    let n = prepared.tokens.len();
    let ctx = s.context_tokens;
    if n >= ctx {
        return Err(ApiError::too_long(
            param,
            format!(
                "This model's maximum context length is {ctx} tokens. However, your {param} \
                 resulted in {n} tokens, which leaves no room for the completion."
            ),
        ));
    }
    if let (Some(m), Some(most)) = (req.max_tokens, s.max_tokens_limit) {
        if m > most {
            return Err(ApiError::bad_value(
                "max_tokens",
                format!("Invalid 'max_tokens': {m} is more than this server's limit of {most} (--max-tokens-limit)."),
            ));
        }
    }
    let max_new_tokens = match req.max_tokens {
        Some(m) if m > ctx - n => {
            return Err(ApiError::too_long(
                param,
                format!(
                    "This model's maximum context length is {ctx} tokens. However, you \
                     requested {} tokens ({n} in the {param}, {m} in the completion). Please \
                     reduce the length of the {param} or completion.",
                    n.saturating_add(m)
                ),
            ))
        }
        Some(m) => m,
        None => match endpoint {
            Endpoint::Completions => DEFAULT_COMPLETION_TOKENS.min(ctx - n),
            Endpoint::Chat => (ctx - n).min(s.max_tokens_limit.unwrap_or(usize::MAX)),
        },
    };
    let request = Request {
        prompt_tokens: prepared.tokens.clone(),
        max_new_tokens,
        sampling: req.sampling.clone(),
        ignore_eos: req.ignore_eos,
        stop: req.stop.clone(),
        skip_special_tokens: true,
        cache_salt: s.cache_salt(key, req.cache_salt.as_deref()),
    };
    let generation = bridge::submit(&s.handle, request)
        .await
        .map_err(|e| submit_error(e, param))?;
    let meta = Meta {
        endpoint,
        id: s.response_id(endpoint),
        created: unix_now(),
        model: s.model_name.clone(),
    };
    let run = Run {
        s,
        generation,
        meta,
        req,
        prepared,
        timing: Timing {
            arrived,
            last: None,
            first: None,
        },
        generated: 0,
        settled: false,
        _in_flight: in_flight,
    };
    if run.req.stream {
        Ok(run.stream())
    } else {
        run.collect().await
    }
}

/// The prompt tokens of `input`.
///
/// Encoding stops once the prompt cannot fit the context (one token is
/// left for the completion).
fn prepare(s: &AppState, input: &Input) -> Result<Prepared, ApiError> {
    let tokenizer = &s.loaded.tokenizer;
    let limit = s.context_tokens.saturating_sub(1);
    let failed = |param: &str, e: TokenizerError| match e {
        TokenizerError::TooLong { at_least, .. } => ApiError::too_long(
            param,
            format!(
                "This model's maximum context length is {} tokens. However, your {param} \
                 resulted in at least {at_least} tokens, which leaves no room for the completion.",
                s.context_tokens
            ),
        ),
        e => ApiError::bad_value(param, e.to_string()),
    };
    match input {
        Input::Completion { prompt, echo } => {
            let (tokens, text) = match prompt {
                Prompt::Text(t) => (
                    tokenizer
                        .encode_limited(t, true, limit)
                        .map_err(|e| failed("prompt", e))?,
                    t.clone(),
                ),
                Prompt::Tokens(ids) if ids.len() > limit => {
                    return Err(failed(
                        "prompt",
                        TokenizerError::TooLong {
                            at_least: ids.len(),
                            limit,
                        },
                    ))
                }
                Prompt::Tokens(ids) => {
                    let text = if *echo {
                        tokenizer
                            .decode(ids, true)
                            .map_err(|e| ApiError::bad_value("prompt", e.to_string()))?
                    } else {
                        String::new()
                    };
                    (ids.clone(), text)
                }
            };
            Ok(Prepared {
                tokens,
                echo: echo.then_some(text),
            })
        }
        Input::Chat { messages } => Ok(Prepared {
            tokens: tokenizer
                .encode_chat_limited(messages, None, limit)
                .map_err(|e| failed("messages", e))?,
            echo: None,
        }),
    }
}

/// Arrival and token times of one request, for the latency histograms.
struct Timing {
    arrived: Instant,
    last: Option<Instant>,
    /// Seconds to the first token.
    first: Option<f64>,
}

impl Timing {
    fn token(&mut self, metrics: &Metrics) {
        let now = Instant::now();
        match self.last {
            None => {
                let ttft = (now - self.arrived).as_secs_f64();
                self.first = Some(ttft);
                metrics.time_to_first_token(ttft);
            }
            Some(t) => metrics.inter_token_latency((now - t).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

/// One accepted request, from submission to its last byte.
struct Run {
    s: Arc<AppState>,
    generation: Generation,
    meta: Meta,
    req: GenerationRequest,
    prepared: Prepared,
    timing: Timing,
    /// Tokens received so far, and whether the `Finished` event came (a
    /// run dropped before it counts as an abort).
    generated: usize,
    settled: bool,
    _in_flight: InFlight,
}

impl Drop for Run {
    fn drop(&mut self) {
        if !self.settled {
            // The client went away, the server shut down or the engine
            // stopped; dropping `generation` aborts the sequence.
            self.s
                .metrics
                .finished("abort", self.prepared.tokens.len(), self.generated);
        }
        tracing::info!(
            id = %self.meta.id,
            route = self.meta.endpoint.path(),
            prompt_tokens = self.prepared.tokens.len(),
            generated_tokens = self.generated,
            ttft_ms = self.timing.first.map(|t| (t * 1000.0).round() as u64),
            status = 200,
            finish = if self.settled { "done" } else { "abort" },
            "request"
        );
    }
}

/// What a generation delivered next, as the handlers see it.
enum Step {
    Token {
        token: u32,
        text: String,
    },
    Done {
        reason: &'static str,
        text: String,
        usage: Usage,
    },
    Failed(ApiError),
}

impl Run {
    /// The next step, or a failure on cancellation (shutdown grace over)
    /// or when the engine stopped.
    async fn next(&mut self) -> Step {
        let mut cancel = self.s.cancel.clone();
        let event = tokio::select! {
            e = self.generation.next() => e,
            _ = cancel.wait_for(|c| *c) => {
                return Step::Failed(ApiError::status(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    "shutting_down",
                    "The server shut down before the request finished.",
                ));
            }
        };
        match event {
            Some(Event::Token { token, text, .. }) => {
                self.generated += 1;
                self.timing.token(&self.s.metrics);
                Step::Token { token, text }
            }
            Some(Event::Finished {
                reason,
                text,
                usage,
                ..
            }) => match response::finish_reason(reason) {
                Some(r) => {
                    self.settled = true;
                    self.s.metrics.finished(
                        if reason == FinishReason::Length {
                            "length"
                        } else {
                            "stop"
                        },
                        usage.prompt_tokens,
                        usage.generated_tokens,
                    );
                    Step::Done {
                        reason: r,
                        text,
                        usage,
                    }
                }
                // Counted as an abort when the run is dropped.
                None => Step::Failed(internal("The engine aborted the request.".into())),
            },
            None => Step::Failed(engine_stopped()),
        }
    }

    /// A whole response.
    async fn collect(mut self) -> Result<Response, ApiError> {
        let mut text = self.prepared.echo.take().unwrap_or_default();
        let mut tokens = Vec::new();
        loop {
            match self.next().await {
                Step::Token { token, text: t } => {
                    tokens.push(token);
                    text.push_str(&t);
                }
                Step::Done {
                    reason,
                    text: t,
                    usage,
                } => {
                    text.push_str(&t);
                    let ids = self.req.return_token_ids.then_some(TokenIds {
                        prompt: &self.prepared.tokens,
                        completion: &tokens,
                    });
                    let body = response::complete(&self.meta, &text, reason, &usage, ids);
                    return Ok((
                        [(header::CONTENT_TYPE, "application/json")],
                        body.to_string(),
                    )
                        .into_response());
                }
                Step::Failed(e) => return Err(e),
            }
        }
    }

    /// A server-sent event stream; a task feeds it, and stops (aborting
    /// the request) when the client goes away.
    fn stream(self) -> Response {
        let (tx, mut rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(self.feed(tx));
        let body = Body::from_stream(futures_util::stream::poll_fn(move |cx| {
            rx.poll_recv(cx).map(|b| b.map(Ok::<_, Infallible>))
        }));
        Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(body)
            .unwrap_or_else(|e| internal(e.to_string()).into_response())
    }

    async fn feed(mut self, tx: mpsc::Sender<Bytes>) {
        let usage_too = self.req.include_usage;
        let ids = self.req.return_token_ids;
        let send = |v: String| {
            let tx = tx.clone();
            async move { tx.send(Bytes::from(v)).await.is_ok() }
        };
        let chunk =
            |meta: &Meta, d: &Delta<'_>| response::sse(&response::chunk(meta, d, usage_too));
        // The opening chunk: chat's role, completions' echo, the prompt's ids.
        let echo = self.prepared.echo.take();
        let chat = self.meta.endpoint == Endpoint::Chat;
        if chat || echo.is_some() || ids {
            let open = Delta {
                text: Some(echo.as_deref().unwrap_or("")),
                role: chat,
                prompt_token_ids: ids.then_some(&self.prepared.tokens[..]),
                ..Delta::default()
            };
            if !send(chunk(&self.meta, &open)).await {
                return;
            }
        }
        loop {
            // A body that hyper dropped (the client went away) ends the
            // request even while no token comes (a long prompt).
            let step = tokio::select! {
                step = self.next() => step,
                _ = tx.closed() => return,
            };
            let ok = match step {
                Step::Token { token, text } => {
                    let token = [token];
                    if text.is_empty() && !ids {
                        continue; // held back (incomplete character or possible stop)
                    }
                    let d = Delta {
                        text: Some(&text),
                        token_ids: ids.then_some(&token[..]),
                        ..Delta::default()
                    };
                    send(chunk(&self.meta, &d)).await
                }
                Step::Done {
                    reason,
                    text,
                    usage,
                } => {
                    let mut out = String::new();
                    if !text.is_empty() {
                        let d = Delta {
                            text: Some(&text),
                            ..Delta::default()
                        };
                        out.push_str(&chunk(&self.meta, &d));
                    }
                    let last = Delta {
                        finish: Some(reason),
                        text: (!chat).then_some(""),
                        ..Delta::default()
                    };
                    out.push_str(&chunk(&self.meta, &last));
                    if usage_too {
                        out.push_str(&response::sse(&response::usage_chunk(&self.meta, &usage)));
                    }
                    out.push_str(response::SSE_DONE);
                    let _ = send(out).await;
                    return;
                }
                Step::Failed(e) => {
                    let _ = send(response::sse(&e.body())).await;
                    return;
                }
            };
            if !ok {
                // The client went away: dropping `self` aborts the request.
                return;
            }
        }
    }
}

/// A body the server would not read: too large (413) or broken (400).
fn body_error(r: &BytesRejection, limit: usize) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("The request body is larger than the server's limit of {limit} bytes (--max-body-bytes)."),
        )
    } else {
        ApiError::invalid(
            None,
            "invalid_body",
            format!("The request body could not be read: {}", r.body_text()),
        )
    }
}

fn submit_error(e: SubmitError, prompt_param: &str) -> ApiError {
    match e {
        SubmitError::Stopped => engine_stopped(),
        SubmitError::Rejected(RequestError::TooLong {
            tokens,
            limit,
            what,
        }) => ApiError::too_long(
            prompt_param,
            format!("Your {prompt_param} resulted in {tokens} tokens; with one generated token they do not fit the {limit} tokens of the {what}."),
        ),
        SubmitError::Rejected(RequestError::Invalid { field, reason }) => {
            let param = match field {
                "prompt_tokens" => prompt_param,
                f => f,
            };
            ApiError::bad_value(param, format!("Invalid '{param}': {reason}."))
        }
        SubmitError::Rejected(e @ RequestError::Unknown(_)) => internal(e.to_string()),
    }
}

pub fn shutting_down() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "shutting_down",
        "The server is shutting down.",
    )
}

fn engine_stopped() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "engine_stopped",
        "The generation engine has stopped; see the server's log.",
    )
}

fn internal(message: String) -> ApiError {
    ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "server_error",
        "internal_error",
        message,
    )
}
