//! OpenAI response bodies: `text_completion` and `chat.completion`
//! objects, their streamed chunks (`chat.completion.chunk`), and `usage`.

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

/// A whole (non-streamed) response.
pub fn complete(
    meta: &Meta,
    text: &str,
    finish: &str,
    u: &Usage,
    ids: Option<TokenIds<'_>>,
) -> Value {
    let mut choice = match meta.endpoint {
        Endpoint::Completions => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
        }),
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": null},
            "logprobs": null,
            "finish_reason": finish,
        }),
    };
    if let Some(ids) = ids {
        choice["prompt_token_ids"] = json!(ids.prompt);
        choice["token_ids"] = json!(ids.completion);
    }
    meta.wrap(false, json!([choice]), Some(usage(u)))
}

/// One streamed chunk of one choice.
#[derive(Clone, Debug, Default)]
pub struct Delta<'a> {
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
            "index": 0, "text": d.text.unwrap_or(""), "logprobs": null, "finish_reason": d.finish,
        }),
        Endpoint::Chat => {
            let mut delta = json!({});
            if d.role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = d.text {
                delta["content"] = json!(t);
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": d.finish})
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
        let c = complete(&meta(Endpoint::Completions), "hi", "length", &u, None);
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["choices"][0]["text"], "hi");
        assert_eq!(c["usage"]["completion_tokens"], 1);
        let ids = TokenIds {
            prompt: &[1, 2],
            completion: &[3],
        };
        let c = complete(&meta(Endpoint::Chat), "hi", "stop", &u, Some(ids));
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["choices"][0]["message"]["content"], "hi");
        assert_eq!(c["choices"][0]["token_ids"], json!([3]));
        assert_eq!(finish_reason(FinishReason::Eos), Some("stop"));
        assert_eq!(finish_reason(FinishReason::Abort), None);
    }
}
