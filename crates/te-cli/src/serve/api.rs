//! OpenAI request bodies: `POST /v1/completions` and `POST
//! /v1/chat/completions`, parsed field by field from the JSON so that each
//! error names its field (`param`) the way OpenAI's do.
//!
//! Field names, types, ranges and defaults follow OpenAI's API reference:
//! `temperature` in [0, 2] (default 1), `top_p` in (0, 1] (default 1),
//! `max_tokens` (completions default 16; chat default: the rest of the
//! context; `max_completion_tokens` wins over it), `stop` (a string or up
//! to 4 of at most [`MAX_STOP_BYTES`] bytes), `n` (1 to [`MAX_N`]),
//! `seed`, `stream`, `stream_options.include_usage`, `presence_penalty`
//! and `frequency_penalty` (in [-2, 2]), `logit_bias` (token id -> bias in
//! [-100, 100], at most [`MAX_LOGIT_BIAS`] entries; ids outside the
//! vocabulary are refused by the handler, which knows it), chat's
//! `logprobs` + `top_logprobs` (0 to 20) and completions' `logprobs` (0 to
//! 5), `response_format` (`text`, `json_object`, `json_schema` within
//! [`MAX_SCHEMA_BYTES`] and [`MAX_SCHEMA_DEPTH`]), chat's `tools` (at most
//! [`MAX_TOOLS`]) and `tool_choice`, and `tool` messages and assistant
//! `tool_calls` in `messages`. Extensions as vLLM names them: `top_k` (0 or -1 = off), `min_p`,
//! `repetition_penalty`, `ignore_eos`, `return_token_ids` (the prompt's and
//! the completion's token ids in each choice); as llama.cpp's server names
//! them, `speculative.n_max` (most drafted tokens per verification, 0: no
//! drafting; bounded by the server's setting) and `speculative.n_min`
//! (shortest draft verified). OpenAI features te-rs does
//! not have (suffix, best_of > 1, audio, content parts other than text,
//! the deprecated `functions`) are refused with a 400 that names the field, never silently ignored;
//! fields it does not know are ignored.

use serde_json::{Map, Value};
use te_engine::sampling::SamplingParams;
use te_engine::DraftLimits;
use te_tokenizer::chat::ChatMessage;

use super::error::ApiError;

/// Which endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The route's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// A completion prompt: text, or token ids.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// What to continue.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// `/v1/completions`; `echo` puts the prompt before the completion.
    Completion { prompt: Prompt, echo: bool },
    /// `/v1/chat/completions`, rendered with the model's chat template.
    Chat { messages: Vec<ChatMessage> },
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    pub model: String,
    pub input: Input,
    /// `None`: the endpoint's default (see the module doc).
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub return_token_ids: bool,
    /// Choices to generate (`n`), each with its own random stream.
    pub n: usize,
    /// `response_format`: JSON output by constrained decoding.
    pub response_format: Option<ResponseFormat>,
    /// vLLM's `cache_salt`: the prompt shares cached pages only with
    /// requests of the same salt.
    pub cache_salt: Option<String>,
    /// Chat's `tools`: `{"type": "function", "function": {"name",
    /// "description"?, "parameters"}}` (parameters defaulted to any
    /// object).
    pub tools: Vec<Value>,
    /// Whether and how the model calls them (`None` without tools).
    pub tool_choice: ToolChoice,
    /// llama.cpp's `speculative.n_max` and `speculative.n_min`.
    pub draft: DraftLimits,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No call: the tools are not shown to the model.
    None,
    /// The model decides; calls are parsed from its output.
    Auto,
    /// Exactly one call of a listed function (constrained decoding).
    Required,
    /// Exactly one call of this function (constrained decoding).
    Function(String),
}

/// Most `tools` per request.
pub const MAX_TOOLS: usize = 64;

/// A `response_format` other than text.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    /// `{"type": "json_object"}`: any JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`:
    /// JSON valid against `schema`.
    JsonSchema(Value),
}

/// Largest JSON schema, in bytes of its JSON text.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;

/// Deepest nesting of objects and arrays in a JSON schema.
pub const MAX_SCHEMA_DEPTH: usize = 24;

impl GenerationRequest {
    /// The field a prompt-length error names.
    pub fn prompt_param(&self) -> &'static str {
        match self.input {
            Input::Completion { .. } => "prompt",
            Input::Chat { .. } => "messages",
        }
    }
}

/// Most stop sequences per request (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// Longest stop sequence, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;

/// Most choices per request (`n`).
pub const MAX_N: i64 = 16;

/// Most `top_logprobs` of chat (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Most `logprobs` of completions (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// Most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Parses and validates a request body sent to `endpoint`. `random_seed`
/// is the seed used when the request gives none.
///
/// Errors: a 400 [`ApiError`] for invalid UTF-8, malformed JSON, a body
/// that is not an object, or any field of the wrong type or out of range.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    random_seed: u64,
) -> Result<GenerationRequest, ApiError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        ApiError::invalid(
            None,
            "invalid_encoding",
            format!("The request body is not valid UTF-8 ({e})."),
        )
    })?;
    let value: Value = serde_json::from_str(text).map_err(|e| {
        ApiError::invalid(
            None,
            "invalid_json",
            format!("We could not parse the JSON body of your request ({e})."),
        )
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid(
            None,
            "invalid_json",
            format!(
                "The request body must be a JSON object, not {}.",
                super::error::json_type(&value)
            ),
        ));
    };
    let f = Fields(&obj);
    let model = f
        .string("model")?
        .ok_or_else(|| missing("model"))?
        .to_string();
    let mut logprobs = None;
    let (mut tools, mut tool_choice) = (Vec::new(), ToolChoice::None);
    let input = match endpoint {
        Endpoint::Completions => {
            let prompt = parse_prompt(obj.get("prompt").unwrap_or(&Value::Null))?;
            if let Some(s) = f.string("suffix")? {
                if !s.is_empty() {
                    return Err(ApiError::unsupported("suffix", "a suffix"));
                }
            }
            if let Some(b) = f.int("best_of")? {
                if b != 1 {
                    return Err(ApiError::unsupported("best_of", "best_of other than 1"));
                }
            }
            logprobs = f.int("logprobs")?;
            if let Some(k) = logprobs {
                int_range("logprobs", k, 0, MAX_COMPLETION_LOGPROBS)?;
            }
            Input::Completion {
                prompt,
                echo: f.bool("echo")?.unwrap_or(false),
            }
        }
        Endpoint::Chat => {
            let messages = parse_messages(obj.get("messages").unwrap_or(&Value::Null))?;
            let top = f.int("top_logprobs")?;
            if let Some(k) = top {
                int_range("top_logprobs", k, 0, MAX_TOP_LOGPROBS)?;
            }
            if f.bool("logprobs")? == Some(true) {
                logprobs = Some(top.unwrap_or(0));
            } else if top.is_some() {
                return Err(ApiError::bad_value(
                    "top_logprobs",
                    "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used.",
                ));
            }
            match f.get("functions") {
                None => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(_) => {
                    return Err(ApiError::unsupported(
                        "functions",
                        "the deprecated 'functions' (use 'tools')",
                    ))
                }
            }
            tools = parse_tools(f.get("tools"))?;
            tool_choice = parse_tool_choice(f.get("tool_choice"), &tools)?;
            if let Some(Value::Array(m)) = f.get("modalities") {
                if m.iter().any(|x| x.as_str() != Some("text")) {
                    return Err(ApiError::unsupported(
                        "modalities",
                        "output other than text",
                    ));
                }
            }
            if f.get("audio").is_some() {
                return Err(ApiError::unsupported("audio", "audio output"));
            }
            Input::Chat { messages }
        }
    };
    let logit_bias = parse_logit_bias(f.get("logit_bias"))?;
    let mut penalties = [0.0f32; 2];
    for (name, out) in ["presence_penalty", "frequency_penalty"]
        .into_iter()
        .zip(&mut penalties)
    {
        if let Some(x) = f.number(name)? {
            range(name, x, -2.0, 2.0)?;
            *out = x as f32;
        }
    }
    let [presence_penalty, frequency_penalty] = penalties;

    let n = f.int("n")?.unwrap_or(1);
    int_range("n", n, 1, MAX_N)?;

    // For chat, `max_completion_tokens` replaces the deprecated `max_tokens`
    // (and wins when both are given).
    let (min_tokens, names): (i64, &[&str]) = match endpoint {
        Endpoint::Completions => (0, &["max_tokens"]),
        Endpoint::Chat => (1, &["max_tokens", "max_completion_tokens"]),
    };
    let mut max_tokens = None;
    for &name in names {
        if let Some(m) = f.int(name)? {
            if m < min_tokens {
                return Err(ApiError::bad_value(
                    name,
                    format!(
                        "Invalid '{name}': integer below minimum value. Expected a value >= \
                         {min_tokens}, but got {m} instead."
                    ),
                ));
            }
            max_tokens = Some(usize::try_from(m).unwrap_or(usize::MAX));
        }
    }

    let temperature = f.number("temperature")?.unwrap_or(1.0);
    range("temperature", temperature, 0.0, 2.0)?;
    let top_p = f.number("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_value(
            "top_p",
            format!("Invalid 'top_p': expected a value in (0, 1], but got {top_p} instead."),
        ));
    }
    let top_k = f.int("top_k")?.unwrap_or(0);
    if top_k < -1 {
        return Err(ApiError::bad_value(
            "top_k",
            format!("Invalid 'top_k': expected -1 or 0 (off) or a positive integer, but got {top_k} instead."),
        ));
    }
    let min_p = f.number("min_p")?.unwrap_or(0.0);
    range("min_p", min_p, 0.0, 1.0)?;
    let repetition_penalty = f.number("repetition_penalty")?.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty <= 10.0) {
        return Err(ApiError::bad_value(
            "repetition_penalty",
            format!(
                "Invalid 'repetition_penalty': expected a value in (0, 10], but got \
                 {repetition_penalty} instead."
            ),
        ));
    }
    let seed = match f.get("seed") {
        None => random_seed,
        // Any 64-bit integer, negative ones by their bits.
        Some(v) => match (v.as_u64(), v.as_i64()) {
            (Some(u), _) => u,
            (None, Some(i)) => i as u64,
            _ => return Err(ApiError::wrong_type("seed", "an integer", v)),
        },
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k: top_k.max(0) as usize,
        top_p: top_p as f32,
        min_p: min_p as f32,
        repetition_penalty: repetition_penalty as f32,
        seed,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        logprobs: logprobs.map(|k| k as usize),
    };

    let stop = parse_stop(f.get("stop"))?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad_value(
                    "stream_options",
                    "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                ));
            }
            let g = Fields(o);
            g.bool_named("include_usage", "stream_options.include_usage")?
                .unwrap_or(false)
        }
        Some(v) => return Err(ApiError::wrong_type("stream_options", "an object", v)),
    };
    Ok(GenerationRequest {
        model,
        input,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        return_token_ids: f.bool("return_token_ids")?.unwrap_or(false),
        n: n as usize,
        response_format: parse_response_format(f.get("response_format"))?,
        cache_salt: match f.get("cache_salt") {
            None => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(Value::String(_)) => {
                return Err(ApiError::bad_value(
                    "cache_salt",
                    "Invalid 'cache_salt': an empty string.",
                ))
            }
            Some(v) => return Err(ApiError::wrong_type("cache_salt", "a string", v)),
        },
        tools,
        tool_choice,
        draft: DraftLimits {
            n_max: draft_len(&f, "speculative.n_max")?,
            n_min: draft_len(&f, "speculative.n_min")?,
        },
    })
}

/// A draft length field: a non-negative integer.
fn draft_len(f: &Fields<'_>, name: &str) -> Result<Option<usize>, ApiError> {
    match f.int(name)? {
        None => Ok(None),
        Some(n) => {
            int_range(name, n, 0, i64::MAX)?;
            Ok(Some(usize::try_from(n).unwrap_or(usize::MAX)))
        }
    }
}

/// `response_format`: `text` (None), `json_object`, or `json_schema` with
/// its schema within [`MAX_SCHEMA_BYTES`] and [`MAX_SCHEMA_DEPTH`].
fn parse_response_format(v: Option<&Value>) -> Result<Option<ResponseFormat>, ApiError> {
    let name = "response_format";
    let o = match v {
        None => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(ApiError::wrong_type(name, "an object", v)),
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let param = "response_format.json_schema";
            let js = match o.get("json_schema") {
                Some(Value::Object(js)) => js,
                None | Some(Value::Null) => return Err(missing(param)),
                Some(v) => return Err(ApiError::wrong_type(param, "an object", v)),
            };
            let param = "response_format.json_schema.schema";
            let schema = match js.get("schema") {
                // OpenAI's default: any JSON object.
                None | Some(Value::Null) => serde_json::json!({"type": "object"}),
                Some(v @ (Value::Object(_) | Value::Bool(_))) => v.clone(),
                Some(v) => return Err(ApiError::wrong_type(param, "an object", v)),
            };
            schema_limits(param, &schema)?;
            Ok(Some(ResponseFormat::JsonSchema(schema)))
        }
        Some(other) => Err(ApiError::bad_value(
            "response_format.type",
            format!("Invalid 'response_format.type': '{other}'. Supported values are: 'text', 'json_object' and 'json_schema'."),
        )),
        None => Err(missing("response_format.type")),
    }
}

/// A schema within [`MAX_SCHEMA_BYTES`] and [`MAX_SCHEMA_DEPTH`], else a
/// 400 naming `param`.
pub fn schema_limits(param: &str, schema: &Value) -> Result<(), ApiError> {
    let bytes = schema.to_string().len();
    if bytes > MAX_SCHEMA_BYTES {
        return Err(ApiError::bad_value(
            param,
            format!("Invalid '{param}': the schema is {bytes} bytes; at most {MAX_SCHEMA_BYTES} are allowed."),
        ));
    }
    let depth = json_depth(schema);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(ApiError::bad_value(
            param,
            format!("Invalid '{param}': the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed."),
        ));
    }
    Ok(())
}

/// Nesting depth of objects and arrays (a scalar is 0), without
/// recursion.
fn json_depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        deepest = deepest.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    deepest
}

/// `logit_bias`: an object from token ids (decimal strings) to biases in
/// [-100, 100]; `(id, bias)` sorted by id.
fn parse_logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let name = "logit_bias";
    let o = match v {
        None => return Ok(Vec::new()),
        Some(Value::Object(o)) => o,
        Some(v) => return Err(ApiError::wrong_type(name, "an object", v)),
    };
    if o.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::bad_value(
            name,
            format!(
                "Invalid 'logit_bias': {} entries; at most {MAX_LOGIT_BIAS} are allowed.",
                o.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(o.len());
    for (k, b) in o {
        let id: u32 = k.parse().map_err(|_| {
            ApiError::bad_value(
                name,
                format!("Invalid 'logit_bias': key '{k}' is not a token id."),
            )
        })?;
        let b = b
            .as_f64()
            .ok_or_else(|| ApiError::wrong_type(name, "an object of numbers", b))?;
        range(name, b, -100.0, 100.0)?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// An integer `x` in `[lo, hi]`, else OpenAI's range message.
fn int_range(name: &str, x: i64, lo: i64, hi: i64) -> Result<(), ApiError> {
    if x < lo {
        Err(ApiError::bad_value(
            name,
            format!("Invalid '{name}': integer below minimum value. Expected a value >= {lo}, but got {x} instead."),
        ))
    } else if x > hi {
        Err(ApiError::bad_value(
            name,
            format!("Invalid '{name}': integer above maximum value. Expected a value <= {hi}, but got {x} instead."),
        ))
    } else {
        Ok(())
    }
}

/// Typed access to an object's fields; JSON `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn string(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::wrong_type(name, "a string", v)),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.bool_named(name, name)
    }

    fn bool_named(&self, name: &str, param: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::wrong_type(param, "a boolean", v)),
        }
    }

    /// An integer (a JSON number without fraction or exponent).
    fn int(&self, name: &str) -> Result<Option<i64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match (v.as_i64(), v.as_u64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(_)) => Ok(Some(i64::MAX)),
                _ => Err(ApiError::wrong_type(name, "an integer", v)),
            },
        }
    }

    /// Any JSON number.
    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| ApiError::wrong_type(name, "a number", v)),
        }
    }
}

fn missing(name: &str) -> ApiError {
    ApiError::invalid(
        Some(name),
        "missing_required_parameter",
        format!("Missing required parameter: '{name}'."),
    )
}

/// `x` in `[lo, hi]`, else OpenAI's range message.
fn range(name: &str, x: f64, lo: f64, hi: f64) -> Result<(), ApiError> {
    if x < lo {
        Err(ApiError::bad_value(
            name,
            format!("Invalid '{name}': decimal below minimum value. Expected a value >= {lo}, but got {x} instead."),
        ))
    } else if x > hi || x.is_nan() {
        Err(ApiError::bad_value(
            name,
            format!("Invalid '{name}': decimal above maximum value. Expected a value <= {hi}, but got {x} instead."),
        ))
    } else {
        Ok(())
    }
}

/// `prompt`: a string, token ids, or a list holding one of either.
fn parse_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let expected = "a string, an array of token ids, or an array of one of these";
    match v {
        Value::Null => Err(missing("prompt")),
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(ApiError::bad_value("prompt", "The prompt is empty."));
            }
            if items.iter().all(|x| x.is_number()) {
                return token_ids(items).map(Prompt::Tokens);
            }
            if items.len() > 1 {
                if items.iter().all(|x| x.is_string() || x.is_array()) {
                    return Err(ApiError::unsupported(
                        "prompt",
                        "more than one prompt per request",
                    ));
                }
                return Err(ApiError::wrong_type("prompt", expected, v));
            }
            match &items[0] {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(ids) => token_ids(ids).map(Prompt::Tokens),
                other => Err(ApiError::wrong_type("prompt", expected, other)),
            }
        }
        other => Err(ApiError::wrong_type("prompt", expected, other)),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| {
                    ApiError::bad_value(
                        "prompt",
                        format!(
                            "Invalid token id {x} in 'prompt': expected a non-negative integer."
                        ),
                    )
                })
        })
        .collect()
}

/// `messages`: a non-empty list of `{role, content}` objects; content is a
/// string or a list of text parts.
fn parse_messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        Value::Null => return Err(missing("messages")),
        Value::Array(items) => items,
        other => return Err(ApiError::wrong_type("messages", "an array", other)),
    };
    if items.is_empty() {
        return Err(ApiError::bad_value(
            "messages",
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Value::Object(obj) = m else {
            return Err(ApiError::wrong_type(&param, "an object", m));
        };
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            None | Some(Value::Null) => return Err(missing(&format!("{param}.role"))),
            Some(other) => {
                return Err(ApiError::wrong_type(
                    &format!("{param}.role"),
                    "a string",
                    other,
                ))
            }
        };
        // OpenAI's "developer" messages are what templates call "system".
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            "function" => {
                return Err(ApiError::unsupported(
                    &format!("{param}.role"),
                    "the deprecated 'function' role (use 'tool')",
                ))
            }
            other => {
                return Err(ApiError::bad_value(
                    &format!("{param}.role"),
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'system', 'developer', 'user' and 'assistant'."
                    ),
                ))
            }
        };
        let content_param = format!("{param}.content");
        let content = match obj.get("content") {
            Some(Value::String(s)) => s.clone(),
            // An assistant turn may come without content (calling tools).
            None | Some(Value::Null) if role == "assistant" => String::new(),
            None | Some(Value::Null) => return Err(missing(&content_param)),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    let part_param = format!("{content_param}[{j}]");
                    let kind = part.get("type").and_then(Value::as_str);
                    match (kind, part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        (Some("text"), _) => {
                            return Err(missing(&format!("{part_param}.text")));
                        }
                        (Some(other), _) => {
                            return Err(ApiError::unsupported(
                                &part_param,
                                &format!("content of type '{other}'"),
                            ))
                        }
                        (None, _) => return Err(missing(&format!("{part_param}.type"))),
                    }
                }
                text
            }
            Some(other) => {
                return Err(ApiError::wrong_type(
                    &content_param,
                    "a string or an array of content parts",
                    other,
                ))
            }
        };
        let mut message = ChatMessage::new(role, &content);
        if let Some(calls) = obj.get("tool_calls").filter(|t| !t.is_null()) {
            if role != "assistant" {
                return Err(ApiError::bad_value(
                    &format!("{param}.tool_calls"),
                    "Only assistant messages may have 'tool_calls'.",
                ));
            }
            message.tool_calls = Some(parse_tool_calls(&format!("{param}.tool_calls"), calls)?);
            if content.is_empty() {
                message.content = None;
            }
        }
        if role == "tool" {
            match obj.get("tool_call_id") {
                Some(Value::String(id)) => message.tool_call_id = Some(id.clone()),
                None | Some(Value::Null) => return Err(missing(&format!("{param}.tool_call_id"))),
                Some(v) => {
                    return Err(ApiError::wrong_type(
                        &format!("{param}.tool_call_id"),
                        "a string",
                        v,
                    ))
                }
            }
            if let Some(Value::String(name)) = obj.get("name") {
                message.name = Some(name.clone());
            }
        }
        out.push(message);
    }
    Ok(out)
}

/// An assistant message's `tool_calls`, as templates read them: each
/// `{"id", "type": "function", "function": {"name", "arguments"}}` with
/// `arguments` (a JSON string in OpenAI's API) parsed into its object.
fn parse_tool_calls(param: &str, v: &Value) -> Result<Value, ApiError> {
    let Value::Array(calls) = v else {
        return Err(ApiError::wrong_type(param, "an array", v));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (i, call) in calls.iter().enumerate() {
        let p = format!("{param}[{i}].function");
        let f = call.get("function").ok_or_else(|| missing(&p))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| missing(&format!("{p}.name")))?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(a)) => serde_json::from_str(a).map_err(|e| {
                ApiError::bad_value(
                    &format!("{p}.arguments"),
                    format!("Invalid '{p}.arguments': not JSON ({e})."),
                )
            })?,
            Some(a) => a.clone(),
        };
        let mut c = serde_json::json!({
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            c["id"] = Value::String(id.to_string());
        }
        out.push(c);
    }
    Ok(Value::Array(out))
}

/// `tools`: at most [`MAX_TOOLS`] `{"type": "function", "function":
/// {"name", "description"?, "parameters"?}}`, names unique and of
/// `[A-Za-z0-9_-]{1,64}`, parameters a JSON schema within the limits of
/// [`schema_limits`] (absent: any object).
fn parse_tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let tools = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(ApiError::wrong_type("tools", "an array", v)),
    };
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::bad_value(
            "tools",
            format!(
                "Invalid 'tools': array too long. Expected an array with maximum length {MAX_TOOLS}, but got an array with length {} instead.",
                tools.len()
            ),
        ));
    }
    let mut out: Vec<Value> = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let param = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad_value(
                &format!("{param}.type"),
                format!("Invalid '{param}.type': only 'function' tools are supported."),
            ));
        }
        let f = match t.get("function") {
            Some(Value::Object(f)) => f,
            None | Some(Value::Null) => return Err(missing(&format!("{param}.function"))),
            Some(v) => {
                return Err(ApiError::wrong_type(
                    &format!("{param}.function"),
                    "an object",
                    v,
                ))
            }
        };
        let name_param = format!("{param}.function.name");
        let name = match f.get("name") {
            Some(Value::String(n)) => n,
            None | Some(Value::Null) => return Err(missing(&name_param)),
            Some(v) => return Err(ApiError::wrong_type(&name_param, "a string", v)),
        };
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid {
            return Err(ApiError::bad_value(
                &name_param,
                format!("Invalid '{name_param}': '{name}' does not match ^[a-zA-Z0-9_-]{{1,64}}$."),
            ));
        }
        if out.iter().any(|o| o["function"]["name"] == name.as_str()) {
            return Err(ApiError::bad_value(
                &name_param,
                format!("Invalid '{name_param}': the function '{name}' is listed twice."),
            ));
        }
        let params_param = format!("{param}.function.parameters");
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name.clone()));
        if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
            if !d.is_string() {
                return Err(ApiError::wrong_type(
                    &format!("{param}.function.description"),
                    "a string",
                    d,
                ));
            }
            function.insert("description".into(), d.clone());
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(v) => return Err(ApiError::wrong_type(&params_param, "an object", v)),
        };
        schema_limits(&params_param, &parameters)?;
        function.insert("parameters".into(), parameters);
        out.push(serde_json::json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// `tool_choice` against the listed `tools`: the default is `auto` with
/// tools and `none` without.
fn parse_tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let name = "tool_choice";
    let choice = match v {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_value(
                    name,
                    format!("Invalid 'tool_choice': '{other}'. Supported values are: 'none', 'auto', 'required' and a named function."),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let f = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| missing("tool_choice.function.name"))?;
            if !tools.iter().any(|t| t["function"]["name"] == f) {
                return Err(ApiError::bad_value(
                    name,
                    format!("Invalid 'tool_choice': the function '{f}' is not among 'tools'."),
                ));
            }
            ToolChoice::Function(f.to_string())
        }
        Some(v) => return Err(ApiError::wrong_type(name, "a string or an object", v)),
    };
    match choice {
        ToolChoice::Required if tools.is_empty() => Err(ApiError::bad_value(
            name,
            "Invalid 'tool_choice': 'required' needs 'tools'.",
        )),
        _ if tools.is_empty() => Ok(ToolChoice::None),
        c => Ok(c),
    }
}

/// `stop`: null, a string, or a list of at most [`MAX_STOP`] strings.
fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let stops = match v {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.clone()),
                other => Err(ApiError::wrong_type(
                    "stop",
                    "a string or an array of strings",
                    other,
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::wrong_type(
                "stop",
                "a string or an array of strings",
                other,
            ))
        }
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::bad_value(
            "stop",
            format!(
                "Invalid 'stop': array too long. Expected an array with maximum length {MAX_STOP}, but got an array with length {} instead.",
                stops.len()
            ),
        ));
    }
    if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad_value(
            "stop",
            format!(
                "Invalid 'stop': a stop sequence of {} bytes; at most {MAX_STOP_BYTES} are allowed.",
                long.len()
            ),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::bad_value(
            "stop",
            "Invalid 'stop': stop sequences must not be empty.",
        ));
    }
    Ok(stops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(body: Value) -> Result<GenerationRequest, ApiError> {
        parse(Endpoint::Chat, body.to_string().as_bytes(), 7)
    }

    fn completion(body: Value) -> Result<GenerationRequest, ApiError> {
        parse(Endpoint::Completions, body.to_string().as_bytes(), 7)
    }

    fn err_param(r: Result<GenerationRequest, ApiError>) -> (String, Option<&'static str>) {
        let e = r.expect_err("should be refused");
        assert_eq!(e.status, 400, "{e:?}");
        (e.param.unwrap_or_default(), e.code)
    }

    #[test]
    fn defaults_follow_openai() {
        let r = completion(json!({"model": "m", "prompt": "Hi"})).unwrap();
        assert_eq!(
            r.input,
            Input::Completion {
                prompt: Prompt::Text("Hi".into()),
                echo: false
            }
        );
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_eq!(r.sampling.seed, 7, "the random seed when none is given");
        assert!(!r.stream && !r.include_usage && r.stop.is_empty());
    }

    #[test]
    fn chat_fields_parse() {
        let r = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]},
                {"role": "assistant", "content": null},
            ],
            "max_tokens": 5, "max_completion_tokens": 9, "temperature": 0, "top_k": -1,
            "min_p": 0.1, "repetition_penalty": 1.1, "seed": -1, "stop": ["a", "b"],
            "stream": true, "stream_options": {"include_usage": true}, "n": 1,
            "logprobs": false, "unknown_field": {"is": "ignored"},
        }))
        .unwrap();
        let Input::Chat { messages } = &r.input else {
            panic!("chat input")
        };
        assert_eq!(messages[0], ChatMessage::new("system", "Be brief."));
        assert_eq!(messages[1], ChatMessage::new("user", "Hello!"));
        assert_eq!(messages[2], ChatMessage::new("assistant", ""));
        assert_eq!(r.max_tokens, Some(9), "max_completion_tokens wins");
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.top_k, 0);
        assert_eq!(r.sampling.seed, u64::MAX);
        assert_eq!(r.stop, vec!["a", "b"]);
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn speculative_fields_parse_as_llama_cpp_names_them() {
        let r = completion(json!({"model": "m", "prompt": "x"})).unwrap();
        assert_eq!(r.draft, DraftLimits::default());
        let r = completion(json!({
            "model": "m", "prompt": "x", "speculative.n_max": 0, "speculative.n_min": 2,
        }))
        .unwrap();
        assert_eq!(
            r.draft,
            DraftLimits {
                n_max: Some(0),
                n_min: Some(2)
            }
        );
        for bad in [json!(-1), json!(1.5), json!("4")] {
            let body = json!({"model": "m", "prompt": "x", "speculative.n_max": bad});
            assert_eq!(err_param(completion(body)).0, "speculative.n_max");
        }
    }

    #[test]
    fn prompts_in_every_form() {
        for (p, want) in [
            (json!("x"), Prompt::Text("x".into())),
            (json!(["x"]), Prompt::Text("x".into())),
            (json!([1, 2]), Prompt::Tokens(vec![1, 2])),
            (json!([[3]]), Prompt::Tokens(vec![3])),
        ] {
            let r = completion(json!({"model": "m", "prompt": p})).unwrap();
            assert!(matches!(r.input, Input::Completion { prompt, .. } if prompt == want));
        }
        assert_eq!(
            err_param(completion(json!({"model": "m", "prompt": ["a", "b"]}))),
            ("prompt".into(), Some("unsupported_parameter"))
        );
        assert_eq!(
            err_param(completion(json!({"model": "m", "prompt": [1, -2]}))).0,
            "prompt"
        );
        assert_eq!(
            err_param(completion(json!({"model": "m", "prompt": 5}))),
            ("prompt".into(), Some("invalid_type"))
        );
        assert_eq!(
            err_param(completion(json!({"model": "m"}))),
            ("prompt".into(), Some("missing_required_parameter"))
        );
    }

    #[test]
    fn bad_fields_name_their_param() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base.clone();
            b[k] = v;
            chat(b)
        };
        let cases = [
            ("temperature", json!(5), "invalid_value"),
            ("temperature", json!(-0.1), "invalid_value"),
            ("temperature", json!("hot"), "invalid_type"),
            ("top_p", json!(0), "invalid_value"),
            ("top_p", json!(1.5), "invalid_value"),
            ("top_k", json!(-2), "invalid_value"),
            ("top_k", json!(1.5), "invalid_type"),
            ("min_p", json!(2), "invalid_value"),
            ("repetition_penalty", json!(0), "invalid_value"),
            ("max_tokens", json!(-1), "invalid_value"),
            ("max_tokens", json!(0), "invalid_value"),
            ("max_tokens", json!("16"), "invalid_type"),
            ("max_completion_tokens", json!(-5), "invalid_value"),
            ("n", json!(17), "invalid_value"),
            ("n", json!(0), "invalid_value"),
            ("top_logprobs", json!(21), "invalid_value"),
            ("top_logprobs", json!(-1), "invalid_value"),
            ("top_logprobs", json!(3), "invalid_value"),
            ("logprobs", json!(3), "invalid_type"),
            ("frequency_penalty", json!(-2.5), "invalid_value"),
            ("logit_bias", json!({"1": 101}), "invalid_value"),
            ("logit_bias", json!({"x": 1}), "invalid_value"),
            ("logit_bias", json!({"1": "a"}), "invalid_type"),
            ("logit_bias", json!([1]), "invalid_type"),
            ("stop", json!(["a".repeat(1025)]), "invalid_value"),
            ("seed", json!(1.5), "invalid_type"),
            ("stop", json!(["a", "b", "c", "d", "e"]), "invalid_value"),
            ("stop", json!([""]), "invalid_value"),
            ("stop", json!(3), "invalid_type"),
            ("stream", json!("yes"), "invalid_type"),
            (
                "stream_options",
                json!({"include_usage": true}),
                "invalid_value",
            ),
            ("tools", json!({"type": "function"}), "invalid_type"),
            ("tool_choice", json!("required"), "invalid_value"),
            ("tool_choice", json!("sometimes"), "invalid_value"),
            ("presence_penalty", json!(3), "invalid_value"),
            ("model", json!(3), "invalid_type"),
        ];
        for (field, value, code) in cases {
            let (param, got) = err_param(with(field, value.clone()));
            assert_eq!(
                (param.as_str(), got),
                (field, Some(code)),
                "{field} = {value}"
            );
        }
        let msg = with("temperature", json!(5)).unwrap_err().message;
        assert!(msg.contains("<= 2"), "{msg}");
    }

    #[test]
    fn tools_and_tool_messages() {
        let weather = json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let body = |tools: Value, choice: Value| {
            json!({"model": "m", "tools": tools, "tool_choice": choice, "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ]})
        };
        let r = chat(body(
            json!([weather]),
            json!({"type": "function", "function": {"name": "get_weather"}}),
        ))
        .unwrap();
        assert_eq!(r.tool_choice, ToolChoice::Function("get_weather".into()));
        assert_eq!(r.tools[0]["function"]["name"], "get_weather");
        let Input::Chat { messages } = &r.input else {
            panic!("chat")
        };
        // Arguments reach the template as an object; the tool result keeps its id.
        assert_eq!(
            messages[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(messages[1].content, None);
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(
            chat(body(json!([weather]), Value::Null))
                .unwrap()
                .tool_choice,
            ToolChoice::Auto
        );
        assert_eq!(
            chat(body(json!([]), json!("auto"))).unwrap().tool_choice,
            ToolChoice::None
        );
        let bad_name = json!([{"type": "function", "function": {"name": "get weather"}}]);
        let twice = json!([weather, weather]);
        let many: Vec<Value> = (0..65)
            .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
            .collect();
        for (tools, choice, param) in [
            (
                json!([weather]),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (bad_name, json!("auto"), "tools[0].function.name"),
            (twice, json!("auto"), "tools[1].function.name"),
            (json!(many), json!("auto"), "tools"),
            (
                json!([{"type": "retrieval"}]),
                json!("auto"),
                "tools[0].type",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                json!("auto"),
                "tools[0].function.parameters",
            ),
        ] {
            assert_eq!(err_param(chat(body(tools, choice))).0, param);
        }
        let no_id = json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]});
        assert_eq!(err_param(chat(no_id)).0, "messages[0].tool_call_id");
    }

    #[test]
    fn response_formats_and_their_limits() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let with = |v: Value| {
            let mut b = base.clone();
            b["response_format"] = v;
            chat(b)
        };
        assert_eq!(with(json!({"type": "text"})).unwrap().response_format, None);
        assert_eq!(
            with(json!({"type": "json_object"}))
                .unwrap()
                .response_format,
            Some(ResponseFormat::JsonObject)
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            with(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
                .unwrap()
                .response_format,
            Some(ResponseFormat::JsonSchema(schema))
        );
        let mut deep = json!({"type": "string"});
        for _ in 0..30 {
            deep = json!({"type": "array", "items": deep});
        }
        let big: Map<String, Value> = (0..2000)
            .map(|i| (format!("field_{i}"), json!({"type": "string"})))
            .collect();
        let schema_param = "response_format.json_schema.schema";
        for (v, param, code) in [
            (
                json!({"type": "xml"}),
                "response_format.type",
                "invalid_value",
            ),
            (
                json!({}),
                "response_format.type",
                "missing_required_parameter",
            ),
            (json!("json"), "response_format", "invalid_type"),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
                "missing_required_parameter",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                schema_param,
                "invalid_type",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": deep}}),
                schema_param,
                "invalid_value",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": big}}}),
                schema_param,
                "invalid_value",
            ),
        ] {
            assert_eq!(
                err_param(with(v.clone())),
                (param.into(), Some(code)),
                "{v}"
            );
        }
    }

    #[test]
    fn bad_messages_name_the_message() {
        let cases = [
            (json!(null), "messages"),
            (json!([]), "messages"),
            (json!("hi"), "messages"),
            (json!([3]), "messages[0]"),
            (json!([{"content": "x"}]), "messages[0].role"),
            (
                json!([{"role": "wizard", "content": "x"}]),
                "messages[0].role",
            ),
            (
                json!([{"role": "function", "content": "x"}]),
                "messages[0].role",
            ),
            (json!([{"role": "user"}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": 5}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                "messages[0].content[0]",
            ),
        ];
        for (messages, param) in cases {
            let (got, _) = err_param(chat(json!({"model": "m", "messages": messages.clone()})));
            assert_eq!(got, param, "{messages}");
        }
    }

    #[test]
    fn malformed_bodies() {
        for (body, code) in [
            (&b"{\"model\": "[..], "invalid_json"),
            (b"[1, 2]", "invalid_json"),
            (b"", "invalid_json"),
            (b"{\"model\": \"\xff\xfe\"}", "invalid_encoding"),
        ] {
            let e = parse(Endpoint::Chat, body, 0).unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, Some(code)));
            assert_eq!(e.param, None);
        }
        assert_eq!(
            err_param(chat(
                json!({"messages": [{"role": "user", "content": "x"}]})
            )),
            ("model".into(), Some("missing_required_parameter"))
        );
    }
}
