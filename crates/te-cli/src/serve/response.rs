//! OpenAI response bodies: `text_completion` and `chat.completion`
//! objects, their streamed chunks (`chat.completion.chunk`), `usage`, and
//! `logprobs` in each endpoint's shape.

use serde_json::{json, Value};
use te_engine::{FinishReason, Usage};

use super::api::Endpoint;

/// What every response object and chunk of one request carries.
#[derive(Clone, Debug)]
pub struct Meta {
    pub endpoint: Endpoint,
    /// `cmpl-...` or `chatcmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, chunk: bool, choices: Value, usage: Option<Value>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

/// `system_fingerprint`: the server build.
const FINGERPRINT: &str = concat!("te-rs-", env!("CARGO_PKG_VERSION"));

/// OpenAI's `finish_reason`: `stop` for an end token or a stop string,
/// `length` for the token limit or a full context; `None` for an abort.
/// (A reply that called tools finishes with `tool_calls` instead of
/// `stop`: see [`super::completions`].)
pub fn finish_reason(reason: FinishReason) -> Option<&'static str> {
    match reason {
        FinishReason::Eos | FinishReason::Stop => Some("stop"),
        FinishReason::Length => Some("length"),
        FinishReason::Abort => None,
    }
}

/// The `usage` object.
pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// Token ids returned with `return_token_ids`.
#[derive(Clone, Copy, Debug)]
pub struct TokenIds<'a> {
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
}

/// OpenAI's stand-in for a log-probability of `-inf` (JSON has no
/// infinity).
const LOGPROB_FLOOR: f64 = -9999.0;

/// One generated token's log-probabilities, with token texts.
#[derive(Clone, Debug, PartialEq)]
pub struct LogprobEntry {
    /// The token's text (special tokens as written, e.g. `<|im_end|>`).
    pub token: String,
    pub logprob: f64,
    /// The most likely tokens, most likely first.
    pub top: Vec<(String, f64)>,
}

/// The `logprobs` object of a choice or chunk holding `entries`: chat's
/// `{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}`, or
/// completions' `{tokens, token_logprobs, top_logprobs, text_offset}` with
/// offsets (in characters) counted from `offset`.
pub fn logprobs(endpoint: Endpoint, entries: &[LogprobEntry], offset: usize) -> Value {
    let lp = |x: f64| x.max(LOGPROB_FLOOR);
    match endpoint {
        Endpoint::Chat => {
            let one =
                |t: &str, x: f64| json!({"token": t, "logprob": lp(x), "bytes": t.as_bytes()});
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let mut v = one(&e.token, e.logprob);
                    v["top_logprobs"] = e.top.iter().map(|(t, x)| one(t, *x)).collect();
                    v
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Endpoint::Completions => {
            let mut at = offset;
            let mut text_offset = Vec::with_capacity(entries.len());
            for e in entries {
                text_offset.push(at);
                at += e.token.chars().count();
            }
            let top: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let m: serde_json::Map<String, Value> = e
                        .top
                        .iter()
                        .map(|(t, x)| (t.clone(), json!(lp(*x))))
                        .collect();
                    Value::Object(m)
                })
                .collect();
            json!({
                "tokens": entries.iter().map(|e| e.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| lp(e.logprob)).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": text_offset,
            })
        }
    }
}

/// One finished choice of a whole response.
#[derive(Clone, Debug)]
pub struct ChoiceOut<'a> {
    pub text: &'a str,
    pub finish: &'a str,
    /// With `logprobs`: [`logprobs`] of the choice's tokens.
    pub logprobs: Option<Value>,
    /// With `return_token_ids`.
    pub ids: Option<TokenIds<'a>>,
    /// Chat: the message's `tool_calls` (its `content` is then null when
    /// empty).
    pub tool_calls: Option<Value>,
}

/// A whole (non-streamed) response: `choices` in index order and the
/// request's usage.
pub fn complete(meta: &Meta, choices: &[ChoiceOut<'_>], u: &Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, c)| {
            let mut choice = match meta.endpoint {
                Endpoint::Completions => json!({
                    "index": index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish,
                }),
                Endpoint::Chat => {
                    let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
                    if let Some(calls) = &c.tool_calls {
                        if c.text.is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = calls.clone();
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": c.logprobs,
                        "finish_reason": c.finish,
                    })
                }
            };
            if let Some(ids) = c.ids {
                choice["prompt_token_ids"] = json!(ids.prompt);
                choice["token_ids"] = json!(ids.completion);
            }
            choice
        })
        .collect();
    meta.wrap(false, Value::Array(choices), Some(usage(u)))
}

/// One streamed chunk of one choice.
#[derive(Clone, Debug, Default)]
pub struct Delta<'a> {
    /// The choice's index.
    pub index: usize,
    /// With `logprobs`: [`logprobs`] of the chunk's tokens.
    pub logprobs: Option<Value>,
    /// Chat: `delta.tool_calls` (OpenAI's pieces of calls).
    pub tool_calls: Option<Value>,
    /// New text (a chat chunk without text has an empty `delta`).
    pub text: Option<&'a str>,
    /// Chat's first chunk: `delta.role = "assistant"`.
    pub role: bool,
    pub finish: Option<&'a str>,
    /// With `return_token_ids`: the chunk's tokens (and, in the first
    /// chunk, the prompt's).
    pub token_ids: Option<&'a [u32]>,
    pub prompt_token_ids: Option<&'a [u32]>,
}

/// A chunk; with `include_usage` it has `"usage": null` (the usage comes
/// in a last chunk of its own, [`usage_chunk`]).
pub fn chunk(meta: &Meta, d: &Delta<'_>, include_usage: bool) -> Value {
    let mut choice = match meta.endpoint {
        Endpoint::Completions => json!({
            "index": d.index, "text": d.text.unwrap_or(""), "logprobs": d.logprobs, "finish_reason": d.finish,
        }),
        Endpoint::Chat => {
            let mut delta = json!({});
            if d.role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = d.text {
                delta["content"] = json!(t);
            }
            if let Some(calls) = &d.tool_calls {
                delta["tool_calls"] = calls.clone();
            }
            json!({"index": d.index, "delta": delta, "logprobs": d.logprobs, "finish_reason": d.finish})
        }
    };
    if let Some(ids) = d.token_ids {
        choice["token_ids"] = json!(ids);
    }
    if let Some(ids) = d.prompt_token_ids {
        choice["prompt_token_ids"] = json!(ids);
    }
    meta.wrap(true, json!([choice]), include_usage.then_some(Value::Null))
}

/// The last chunk under `stream_options.include_usage`: no choices, the
/// usage of the whole request.
pub fn usage_chunk(meta: &Meta, u: &Usage) -> Value {
    meta.wrap(true, json!([]), Some(usage(u)))
}

/// An SSE event: `data: <json>\n\n`.
pub fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The end of an OpenAI stream.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(endpoint: Endpoint) -> Meta {
        Meta {
            endpoint,
            id: "x-1".into(),
            created: 5,
            model: "m".into(),
        }
    }

    #[test]
    fn chat_chunks_and_usage() {
        let m = meta(Endpoint::Chat);
        let first = chunk(
            &m,
            &Delta {
                text: Some(""),
                role: true,
                ..Delta::default()
            },
            true,
        );
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["choices"][0]["delta"]["content"], "");
        assert!(first["choices"][0]["finish_reason"].is_null());
        assert!(first.get("usage").is_some_and(Value::is_null));
        let last = chunk(
            &m,
            &Delta {
                finish: Some("stop"),
                ..Delta::default()
            },
            false,
        );
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert!(last.get("usage").is_none());
        let u = Usage {
            prompt_tokens: 3,
            cached_prompt_tokens: 1,
            generated_tokens: 4,
        };
        let uc = usage_chunk(&m, &u);
        assert_eq!(uc["choices"], json!([]));
        assert_eq!(uc["usage"]["total_tokens"], 7);
        assert_eq!(uc["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        assert!(sse(&uc).starts_with("data: {") && sse(&uc).ends_with("}\n\n"));
    }

    #[test]
    fn whole_responses() {
        let u = Usage {
            prompt_tokens: 2,
            cached_prompt_tokens: 0,
            generated_tokens: 1,
        };
        let choice = |finish| ChoiceOut {
            text: "hi",
            finish,
            logprobs: None,
            ids: None,
            tool_calls: None,
        };
        let c = complete(&meta(Endpoint::Completions), &[choice("length")], &u);
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], "hi");
        assert_eq!(c["usage"]["completion_tokens"], 1);
        let ids = TokenIds {
            prompt: &[1, 2],
            completion: &[3],
        };
        let c = complete(
            &meta(Endpoint::Chat),
            &[
                ChoiceOut {
                    ids: Some(ids),
                    ..choice("stop")
                },
                choice("length"),
            ],
            &u,
        );
        assert_eq!(c["choices"][1]["index"], 1);
        assert_eq!(c["choices"][1]["finish_reason"], "length");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "hi");
        assert_eq!(c["choices"][0]["token_ids"], json!([3]));
        assert_eq!(finish_reason(FinishReason::Eos), Some("stop"));
        assert_eq!(finish_reason(FinishReason::Abort), None);
    }

    #[test]
    fn logprobs_in_both_shapes() {
        let e = [
            LogprobEntry {
                token: "é".into(),
                logprob: -0.5,
                top: vec![("é".into(), -0.5), ("x".into(), f64::NEG_INFINITY)],
            },
            LogprobEntry {
                token: "b".into(),
                logprob: -1.0,
                top: vec![],
            },
        ];
        let c = logprobs(Endpoint::Chat, &e, 0);
        assert_eq!(c["content"][0]["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(c["content"][0]["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(c["content"][1]["logprob"], -1.0);
        let c = logprobs(Endpoint::Completions, &e, 3);
        assert_eq!(c["tokens"], json!(["é", "b"]));
        assert_eq!(c["token_logprobs"], json!([-0.5, -1.0]));
        assert_eq!(c["text_offset"], json!([3, 4]));
        assert_eq!(c["top_logprobs"][0]["x"], -9999.0);
    }
}
