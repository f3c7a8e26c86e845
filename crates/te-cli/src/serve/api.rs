//! OpenAI request bodies: `POST /v1/completions` and `POST
//! /v1/chat/completions`, parsed field by field from the JSON so that each
//! error names its field (`param`) the way OpenAI's do.
//!
//! Field names, types, ranges and defaults follow OpenAI's API reference:
//! `temperature` in [0, 2] (default 1), `top_p` in (0, 1] (default 1),
//! `max_tokens` (completions default 16; chat default: the rest of the
//! context; `max_completion_tokens` wins over it), `stop` (a string or up
//! to 4), `n` (only 1), `seed`, `stream`, `stream_options.include_usage`.
//! Extensions as vLLM names them: `top_k` (0 or -1 = off), `min_p`,
//! `repetition_penalty`, `ignore_eos`, `return_token_ids` (the prompt's and
//! the completion's token ids in each choice). OpenAI features te-rs does
//! not have (logprobs, tools, logit bias, presence/frequency penalties,
//! suffix, best_of > 1, non-text response formats or content parts) are
//! refused with a 400 that names the field, never silently ignored; fields
//! it does not know are ignored.

use serde_json::{Map, Value};
use te_engine::sampling::SamplingParams;
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
    /// vLLM's `cache_salt`: the prompt shares cached pages only with
    /// requests of the same salt.
    pub cache_salt: Option<String>,
}

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
            if let Some(lp) = f.get("logprobs") {
                if !lp.is_i64() && !lp.is_u64() {
                    return Err(ApiError::wrong_type("logprobs", "an integer", lp));
                }
                return Err(ApiError::unsupported("logprobs", "logprobs"));
            }
            Input::Completion {
                prompt,
                echo: f.bool("echo")?.unwrap_or(false),
            }
        }
        Endpoint::Chat => {
            let messages = parse_messages(obj.get("messages").unwrap_or(&Value::Null))?;
            if f.bool("logprobs")? == Some(true) {
                return Err(ApiError::unsupported("logprobs", "logprobs"));
            }
            if f.get("top_logprobs").is_some() {
                return Err(ApiError::unsupported("top_logprobs", "top_logprobs"));
            }
            for name in ["tools", "functions"] {
                match f.get(name) {
                    None => {}
                    Some(Value::Array(a)) if a.is_empty() => {}
                    Some(Value::Array(_)) => {
                        return Err(ApiError::unsupported(name, "tool calling"))
                    }
                    Some(v) => return Err(ApiError::wrong_type(name, "an array", v)),
                }
            }
            match f.get("tool_choice") {
                None => {}
                Some(Value::String(s)) if s == "none" || s == "auto" => {}
                Some(_) => return Err(ApiError::unsupported("tool_choice", "tool calling")),
            }
            match f.get("response_format") {
                None => {}
                Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("text") => {
                }
                Some(Value::Object(_)) => {
                    return Err(ApiError::unsupported(
                        "response_format",
                        "a response format other than text",
                    ))
                }
                Some(v) => return Err(ApiError::wrong_type("response_format", "an object", v)),
            }
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
    match f.get("logit_bias") {
        None => {}
        Some(Value::Object(o)) if o.is_empty() => {}
        Some(Value::Object(_)) => return Err(ApiError::unsupported("logit_bias", "logit bias")),
        Some(v) => return Err(ApiError::wrong_type("logit_bias", "an object", v)),
    }
    for name in ["presence_penalty", "frequency_penalty"] {
        if let Some(x) = f.number(name)? {
            range(name, x, -2.0, 2.0)?;
            if x != 0.0 {
                return Err(ApiError::unsupported(
                    name,
                    "a non-zero value (use repetition_penalty)",
                ));
            }
        }
    }

    let n = f.int("n")?.unwrap_or(1);
    if n < 1 {
        return Err(ApiError::bad_value(
            "n",
            format!("Invalid 'n': integer below minimum value. Expected a value >= 1, but got {n} instead."),
        ));
    }
    if n > 1 {
        return Err(ApiError::unsupported("n", "more than one choice (n > 1)"));
    }

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
    })
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
            "tool" | "function" => {
                return Err(ApiError::unsupported(&format!("{param}.role"), "tool messages"))
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
            // An assistant turn may come without content.
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
        if obj.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(ApiError::unsupported(
                &format!("{param}.tool_calls"),
                "tool calls",
            ));
        }
        out.push(ChatMessage::new(role, &content));
    }
    Ok(out)
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
            ("n", json!(2), "unsupported_parameter"),
            ("n", json!(0), "invalid_value"),
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
            ("logprobs", json!(true), "unsupported_parameter"),
            (
                "tools",
                json!([{"type": "function"}]),
                "unsupported_parameter",
            ),
            ("presence_penalty", json!(1), "unsupported_parameter"),
            ("presence_penalty", json!(3), "invalid_value"),
            ("logit_bias", json!({"1": 5}), "unsupported_parameter"),
            (
                "response_format",
                json!({"type": "json_object"}),
                "unsupported_parameter",
            ),
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
                json!([{"role": "tool", "content": "x"}]),
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
