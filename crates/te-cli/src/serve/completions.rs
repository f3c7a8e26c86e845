//! `POST /v1/completions` and `POST /v1/chat/completions`: parse, build the
//! prompt (the chat template for chat), submit to the engine, and answer
//! whole or as server-sent events (`data: {chunk}` ... `data: [DONE]`).
//!
//! `n` choices are `n` engine requests on the same prompt tokens: the
//! engine's prefix sharing computes the prompt's whole pages once (the
//! later choices wait for the first's prefill and attach its pages), and
//! choice `i` samples with seed [`choice_seed`]`(seed, i)`, its own random
//! stream. `usage` counts the prompt once, the completion tokens of every
//! choice, and as cached the most prompt tokens any choice took from
//! shared pages. A seeded request's tokens are the same alone and among
//! any other requests (each sequence samples with its own RNG from its own
//! batch-invariant logits).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use te_engine::constraint::TokenConstraint;
use te_engine::sampling::SamplingParams;
use te_engine::{Event, FinishReason, Request, RequestError, Usage};
use te_tokenizer::TokenizerError;
use tokio::sync::mpsc;

use super::api::{self, Endpoint, GenerationRequest, Input, Prompt, ResponseFormat, ToolChoice};
use super::bridge::{self, Generation, SubmitError};
use super::error::ApiError;
use super::metrics::{InFlight, Metrics};
use super::response::{self, ChoiceOut, Delta, LogprobEntry, Meta, TokenIds};
use super::state::{unix_now, AppState, ClientKey};
use super::tools::{self, CallFormat, CallParser, ParsedCall};

/// Default `max_tokens` of `/v1/completions` (OpenAI's).
const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// A request body from which on the memory its prompt's tokenizing freed
/// is returned to the system at once.
const LARGE_BODY_BYTES: usize = 1 << 20;

/// A slot among the `--max-concurrent-requests` the server holds, kept
/// until the request's work (tokenizing included) ends; 429 when all are
/// taken.
pub(super) fn enter(s: &AppState) -> Result<InFlight, ApiError> {
    s.metrics
        .try_enter(s.max_concurrent_requests)
        .ok_or_else(|| {
            ApiError::status(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                format!(
                "The server holds {} requests already (--max-concurrent-requests); retry later.",
                s.max_concurrent_requests
            ),
            )
        })
}

/// Tokenizes off the async threads with the request's slot held to the
/// end of the work (a client that leaves does not free it early); after a
/// body of `LARGE_BODY_BYTES` or more, the tokenizer's freed memory goes
/// back to the system (glibc keeps it in the thread's arena otherwise).
pub(super) async fn tokenize_holding<T: Send + 'static>(
    in_flight: InFlight,
    body_bytes: usize,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<(T, InFlight), ApiError> {
    let large = body_bytes >= LARGE_BODY_BYTES;
    tokio::task::spawn_blocking(move || {
        let out = work();
        if large {
            crate::alloc_policy::release_free_memory();
        }
        (out, in_flight)
    })
    .await
    .map_err(|e| internal(format!("tokenizing failed: {e}")))
}

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
    if endpoint == Endpoint::Chat && s.loaded.tokenizer.chat_template().is_none() {
        return Err(ApiError::invalid(
            Some("messages"),
            "model_has_no_chat_template",
            format!(
                "The model `{}` has no chat template (a base model): it continues text but \
                 cannot answer chat messages. Use /v1/completions with a prompt.",
                s.model_name
            ),
        ));
    }
    let in_flight = enter(&s)?;
    let (prepared, in_flight) = {
        let s = s.clone();
        let input = req.clone();
        tokenize_holding(in_flight, body.len(), move || prepare(&s, &input)).await?
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
    let vocab = s.loaded.model.config.vocab_size;
    if let Some(&(bad, _)) = req
        .sampling
        .logit_bias
        .iter()
        .find(|b| b.0 as usize >= vocab)
    {
        return Err(ApiError::bad_value(
            "logit_bias",
            format!(
                "Invalid 'logit_bias': token id {bad} is outside the vocabulary of {vocab} tokens."
            ),
        ));
    }
    let call_format = (req.tool_choice != ToolChoice::None)
        .then(|| CallFormat::of_template(s.loaded.tokenizer.chat_template()));
    let constraint = {
        let (s, req) = (s.clone(), req.clone());
        tokio::task::spawn_blocking(move || request_constraint(&s, &req, call_format))
            .await
            .map_err(|e| internal(format!("compiling the grammar failed: {e}")))??
    };
    let cache_salt = s.cache_salt(key, req.cache_salt.as_deref());
    let mut choices = Vec::with_capacity(req.n);
    for i in 0..req.n {
        let request = Request {
            prompt_tokens: prepared.tokens.clone(),
            max_new_tokens,
            sampling: SamplingParams {
                seed: choice_seed(req.sampling.seed, i),
                ..req.sampling.clone()
            },
            ignore_eos: req.ignore_eos,
            stop: req.stop.clone(),
            skip_special_tokens: true,
            constraint: constraint.clone(),
            cache_salt: cache_salt.clone(),
            draft: req.draft,
        };
        let generation = bridge::submit(&s.handle, request)
            .await
            .map_err(|e| submit_error(e, param))?;
        choices.push(Choice {
            generation,
            generated: 0,
            done: false,
        });
    }
    let meta = Meta {
        endpoint,
        id: s.response_id(endpoint),
        created: unix_now(),
        model: s.model_name.clone(),
    };
    let run = Run {
        s,
        meta,
        req,
        prepared,
        timing: Timing {
            arrived,
            last: None,
            first: None,
        },
        choices,
        call_format,
        _in_flight: in_flight,
    };
    if run.req.stream {
        Ok(run.stream())
    } else {
        run.collect().await
    }
}

/// A call's `tool_calls` object, with a fresh id.
fn call_object(s: &AppState, c: &ParsedCall) -> Value {
    serde_json::json!({
        "id": format!("call_{:016x}", s.random_seed()),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// The streamed pieces of call number `index` of a reply, as OpenAI sends
/// them: the id, type and name with empty arguments, then the arguments.
fn call_deltas(s: &AppState, index: usize, c: &ParsedCall) -> [Value; 2] {
    let whole = call_object(s, c);
    [
        serde_json::json!([{
            "index": index,
            "id": whole["id"],
            "type": "function",
            "function": {"name": c.name, "arguments": ""},
        }]),
        serde_json::json!([{"index": index, "function": {"arguments": c.arguments}}]),
    ]
}

/// The seed of choice `i` of a request seeded with `seed`: `seed` itself
/// for the first, then steps of the golden-ratio constant (distinct
/// streams for every choice).
pub fn choice_seed(seed: u64, i: usize) -> u64 {
    seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The grammar a request's tokens must follow: its `tool_choice`'s
/// (`required`, a named function) or its `response_format`'s, if any.
///
/// Errors: both at once, and those of [`response_constraint`] and
/// [`tools::constraint`].
fn request_constraint(
    s: &AppState,
    req: &GenerationRequest,
    call_format: Option<CallFormat>,
) -> Result<Option<TokenConstraint>, ApiError> {
    let forced_call = matches!(
        req.tool_choice,
        ToolChoice::Required | ToolChoice::Function(_)
    );
    match (&req.response_format, call_format) {
        (Some(_), Some(_)) if forced_call => Err(ApiError::bad_value(
            "response_format",
            "Invalid 'response_format': it cannot be combined with a tool_choice that forces a call.",
        )),
        (_, Some(format)) if forced_call => {
            let grammars = s.grammars().map_err(|e| {
                ApiError::unsupported("tool_choice", &format!("constrained decoding with this model ({e})"))
            })?;
            tools::constraint(&grammars, format, &req.tools, &req.tool_choice)
        }
        (Some(f), _) => response_constraint(s, f.clone()).map(Some),
        (None, _) => Ok(None),
    }
}

/// The grammar of a `response_format`.
///
/// Errors: 400 naming the schema (with llguidance's message, which names
/// the keyword) when it does not compile or the model's vocabulary cannot
/// be used for constrained decoding.
fn response_constraint(s: &AppState, format: ResponseFormat) -> Result<TokenConstraint, ApiError> {
    let grammars = s.grammars().map_err(|e| {
        ApiError::unsupported(
            "response_format",
            &format!("constrained decoding with this model ({e})"),
        )
    })?;
    match format {
        ResponseFormat::JsonObject => grammars
            .json_schema(serde_json::json!({"type": "object"}))
            .map_err(|e| internal(e.to_string())),
        ResponseFormat::JsonSchema(schema) => grammars.json_schema(schema).map_err(|e| {
            let param = "response_format.json_schema.schema";
            ApiError::bad_value(param, format!("Invalid '{param}': {e}"))
        }),
    }
}

/// The prompt tokens of `input`.
///
/// Encoding stops once the prompt cannot fit the context (one token is
/// left for the completion).
fn prepare(s: &AppState, req: &GenerationRequest) -> Result<Prepared, ApiError> {
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
    match &req.input {
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
        Input::Chat { messages } if req.tool_choice != ToolChoice::None => {
            let (messages, tools) = tools::prompt(
                messages,
                &req.tools,
                &req.tool_choice,
                tokenizer.chat_template_supports_tools(),
                &s.model_name,
            )?;
            Ok(Prepared {
                tokens: tokenizer
                    .encode_chat_limited(&messages, tools.as_deref(), limit)
                    .map_err(|e| failed("messages", e))?,
                echo: None,
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
    meta: Meta,
    req: GenerationRequest,
    prepared: Prepared,
    timing: Timing,
    choices: Vec<Choice>,
    /// With tools: how the model writes its calls (parsed from the text).
    call_format: Option<CallFormat>,
    _in_flight: InFlight,
}

/// One choice (one engine request) of a run.
struct Choice {
    generation: Generation,
    /// Tokens received so far, and whether the `Finished` event came (a
    /// choice dropped before it counts as an abort).
    generated: usize,
    done: bool,
}

impl Drop for Run {
    fn drop(&mut self) {
        for (i, c) in self.choices.iter().enumerate() {
            if !c.done {
                // The client went away, the server shut down or the engine
                // stopped; dropping `generation` aborts the sequence.
                let prompt = if i == 0 {
                    self.prepared.tokens.len()
                } else {
                    0
                };
                self.s.metrics.finished("abort", prompt, c.generated);
            }
        }
        tracing::info!(
            id = %self.meta.id,
            route = self.meta.endpoint.path(),
            prompt_tokens = self.prepared.tokens.len(),
            generated_tokens = self.choices.iter().map(|c| c.generated).sum::<usize>(),
            ttft_ms = self.timing.first.map(|t| (t * 1000.0).round() as u64),
            status = 200,
            finish = if self.choices.iter().all(|c| c.done) {
                "done"
            } else {
                "abort"
            },
            "request"
        );
    }
}

/// What a generation delivered next, as the handlers see it.
enum Step {
    Token {
        index: usize,
        token: u32,
        text: String,
        logprobs: Option<LogprobEntry>,
    },
    Done {
        index: usize,
        reason: &'static str,
        text: String,
        usage: Usage,
    },
    Failed(ApiError),
}

/// Usage of a whole request from its choices': the prompt once.
#[derive(Default)]
struct UsageSum(Usage);

impl UsageSum {
    fn add(&mut self, u: &Usage) {
        self.0.prompt_tokens = u.prompt_tokens;
        self.0.cached_prompt_tokens = self.0.cached_prompt_tokens.max(u.cached_prompt_tokens);
        self.0.generated_tokens += u.generated_tokens;
    }
}

impl Run {
    /// Whether every choice has finished.
    fn all_done(&self) -> bool {
        self.choices.iter().all(|c| c.done)
    }

    /// The next step of any unfinished choice, or a failure on
    /// cancellation (shutdown grace over) or when the engine stopped.
    async fn next(&mut self) -> Step {
        if self.all_done() {
            // (Callers stop at the last `Done`; `select_all` needs a future.)
            return Step::Failed(internal("every choice has finished".into()));
        }
        let mut cancel = self.s.cancel.clone();
        let pending = self
            .choices
            .iter_mut()
            .enumerate()
            .filter(|(_, c)| !c.done)
            .map(|(i, c)| Box::pin(async move { (i, c.generation.next().await) }));
        // (Receiving is cancel-safe: the futures not chosen lose nothing.)
        let (index, event) = tokio::select! {
            ((i, e), _, _) = futures_util::future::select_all(pending) => (i, e),
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
            Some(Event::Token {
                token,
                text,
                logprobs,
                ..
            }) => {
                self.choices[index].generated += 1;
                self.timing.token(&self.s.metrics);
                let logprobs = logprobs.map(|lp| {
                    let text = |id: u32| {
                        self.s
                            .loaded
                            .tokenizer
                            .decode(&[id], false)
                            .unwrap_or_default()
                    };
                    LogprobEntry {
                        token: text(token),
                        logprob: lp.logprob,
                        top: lp.top.iter().map(|&(id, x)| (text(id), x)).collect(),
                    }
                });
                Step::Token {
                    index,
                    token,
                    text,
                    logprobs,
                }
            }
            Some(Event::Finished {
                reason,
                text,
                usage,
                ..
            }) => match response::finish_reason(reason) {
                Some(r) => {
                    self.choices[index].done = true;
                    self.s.metrics.finished(
                        if reason == FinishReason::Length {
                            "length"
                        } else {
                            "stop"
                        },
                        if index == 0 { usage.prompt_tokens } else { 0 },
                        usage.generated_tokens,
                    );
                    Step::Done {
                        index,
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
        let echo = self.prepared.echo.take().unwrap_or_default();
        let offset = echo.chars().count();
        let n = self.choices.len();
        let mut texts = vec![echo; n];
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut entries: Vec<Vec<LogprobEntry>> = vec![Vec::new(); n];
        let mut finish = vec![""; n];
        let mut usage = UsageSum::default();
        while !self.all_done() {
            match self.next().await {
                Step::Token {
                    index,
                    token,
                    text,
                    logprobs,
                } => {
                    tokens[index].push(token);
                    texts[index].push_str(&text);
                    entries[index].extend(logprobs);
                }
                Step::Done {
                    index,
                    reason,
                    text,
                    usage: u,
                } => {
                    texts[index].push_str(&text);
                    finish[index] = reason;
                    usage.add(&u);
                }
                Step::Failed(e) => return Err(e),
            }
        }
        let with_logprobs = self.req.sampling.logprobs.is_some();
        let mut tool_calls: Vec<Option<Value>> = vec![None; n];
        if let Some(format) = self.call_format {
            for i in 0..n {
                let mut parser = CallParser::new(format, &self.req.tools);
                let mut parsed = parser.push(&texts[i]);
                let rest = parser.finish();
                parsed.content.push_str(&rest.content);
                parsed.calls.extend(rest.calls);
                if !parsed.calls.is_empty() {
                    let calls: Vec<Value> = parsed
                        .calls
                        .iter()
                        .map(|c| call_object(&self.s, c))
                        .collect();
                    tool_calls[i] = Some(Value::Array(calls));
                    if finish[i] == "stop" {
                        finish[i] = "tool_calls";
                    }
                }
                texts[i] = parsed.content;
            }
        }
        let choices: Vec<ChoiceOut<'_>> = (0..n)
            .map(|i| ChoiceOut {
                text: &texts[i],
                finish: finish[i],
                tool_calls: tool_calls[i].take(),
                logprobs: with_logprobs
                    .then(|| response::logprobs(self.meta.endpoint, &entries[i], offset)),
                ids: self.req.return_token_ids.then_some(TokenIds {
                    prompt: &self.prepared.tokens,
                    completion: &tokens[i],
                }),
            })
            .collect();
        let body = response::complete(&self.meta, &choices, &usage.0);
        Ok((
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response())
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
        let endpoint = self.meta.endpoint;
        let send = |v: String| {
            let tx = tx.clone();
            async move { tx.send(Bytes::from(v)).await.is_ok() }
        };
        let chunk =
            |meta: &Meta, d: &Delta<'_>| response::sse(&response::chunk(meta, d, usage_too));
        // The opening chunks: chat's role, completions' echo, the prompt's ids.
        let echo = self.prepared.echo.take();
        let offset = echo.as_deref().map_or(0, |e| e.chars().count());
        let chat = endpoint == Endpoint::Chat;
        let n = self.choices.len();
        if chat || echo.is_some() || ids {
            let mut out = String::new();
            for index in 0..n {
                let open = Delta {
                    index,
                    text: Some(echo.as_deref().unwrap_or("")),
                    role: chat,
                    prompt_token_ids: ids.then_some(&self.prepared.tokens[..]),
                    ..Delta::default()
                };
                out.push_str(&chunk(&self.meta, &open));
            }
            if !send(out).await {
                return;
            }
        }
        // Per choice: logprobs of tokens whose text is held back, and the
        // text offset (completions) of the next token.
        let mut held: Vec<Vec<LogprobEntry>> = vec![Vec::new(); n];
        let mut offsets = vec![offset; n];
        let mut logprobs_of = |index: usize, held: &mut Vec<Vec<LogprobEntry>>| {
            let e = std::mem::take(&mut held[index]);
            let v = response::logprobs(endpoint, &e, offsets[index]);
            offsets[index] += e.iter().map(|x| x.token.chars().count()).sum::<usize>();
            v
        };
        let with_logprobs = self.req.sampling.logprobs.is_some();
        let mut usage = UsageSum::default();
        // With tools: each choice's call parser and calls so far.
        let mut parsers: Vec<Option<CallParser>> = (0..n)
            .map(|_| {
                self.call_format
                    .map(|f| CallParser::new(f, &self.req.tools))
            })
            .collect();
        let mut calls = vec![0usize; n];
        // Appends to `out` the chunks of the calls `parsed` completed for
        // choice `index`, numbered on from `calls` (which counts them).
        let call_chunks = |s: &AppState,
                           meta: &Meta,
                           out: &mut String,
                           index: usize,
                           calls: &mut usize,
                           parsed: &[ParsedCall]| {
            for c in parsed {
                for piece in call_deltas(s, *calls, c) {
                    let d = Delta {
                        index,
                        tool_calls: Some(piece),
                        ..Delta::default()
                    };
                    out.push_str(&chunk(meta, &d));
                }
                *calls += 1;
            }
        };
        loop {
            // A body that hyper dropped (the client went away) ends the
            // request even while no token comes (a long prompt).
            let step = tokio::select! {
                step = self.next() => step,
                _ = tx.closed() => return,
            };
            let ok = match step {
                Step::Token {
                    index,
                    token,
                    text,
                    logprobs,
                } => {
                    let token = [token];
                    held[index].extend(logprobs);
                    let (text, parsed) = match parsers[index].as_mut() {
                        Some(p) => {
                            let r = p.push(&text);
                            (r.content, r.calls)
                        }
                        None => (text, Vec::new()),
                    };
                    if text.is_empty() && parsed.is_empty() && !ids {
                        continue; // held back (incomplete character, possible stop or call)
                    }
                    let d = Delta {
                        index,
                        text: Some(&text),
                        token_ids: ids.then_some(&token[..]),
                        logprobs: with_logprobs.then(|| logprobs_of(index, &mut held)),
                        ..Delta::default()
                    };
                    let mut out = chunk(&self.meta, &d);
                    call_chunks(
                        &self.s,
                        &self.meta,
                        &mut out,
                        index,
                        &mut calls[index],
                        &parsed,
                    );
                    send(out).await
                }
                Step::Done {
                    index,
                    reason,
                    text,
                    usage: u,
                } => {
                    usage.add(&u);
                    let (text, parsed) = match parsers[index].as_mut() {
                        Some(p) => {
                            let mut r = p.push(&text);
                            let rest = p.finish();
                            r.content.push_str(&rest.content);
                            r.calls.extend(rest.calls);
                            (r.content, r.calls)
                        }
                        None => (text, Vec::new()),
                    };
                    let mut out = String::new();
                    if !text.is_empty() || !held[index].is_empty() {
                        let d = Delta {
                            index,
                            text: Some(&text),
                            logprobs: with_logprobs.then(|| logprobs_of(index, &mut held)),
                            ..Delta::default()
                        };
                        out.push_str(&chunk(&self.meta, &d));
                    }
                    call_chunks(
                        &self.s,
                        &self.meta,
                        &mut out,
                        index,
                        &mut calls[index],
                        &parsed,
                    );
                    let reason = if calls[index] > 0 && reason == "stop" {
                        "tool_calls"
                    } else {
                        reason
                    };
                    let last = Delta {
                        index,
                        finish: Some(reason),
                        text: (!chat).then_some(""),
                        ..Delta::default()
                    };
                    out.push_str(&chunk(&self.meta, &last));
                    if self.all_done() {
                        if usage_too {
                            out.push_str(&response::sse(&response::usage_chunk(
                                &self.meta, &usage.0,
                            )));
                        }
                        out.push_str(response::SSE_DONE);
                        let _ = send(out).await;
                        return;
                    }
                    send(out).await
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

/// The 413 of a body over `limit` bytes (`--max-body-bytes`).
pub(super) fn too_large(limit: usize) -> ApiError {
    ApiError::status(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        "request_too_large",
        format!("The request body is larger than the server's limit of {limit} bytes (--max-body-bytes)."),
    )
}

/// A body the server would not read: too large (413) or broken (400).
pub(super) fn body_error(r: &BytesRejection, limit: usize) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        too_large(limit)
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
