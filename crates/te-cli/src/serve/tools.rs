//! Tool calling: the prompt that shows a request's `tools` to the model,
//! the grammar that makes `tool_choice: required` or a named function
//! yield a valid call, and the parser that turns the model's text into
//! OpenAI's `tool_calls`, whole or while streaming.
//!
//! - **Call format**, chosen by the model's chat template: Qwen/Hermes
//!   (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//!   templates that write `<tool_call>`), or Llama 3.x (the reply is one
//!   JSON object `{"name": ..., "parameters": {...}}`, templates that know
//!   `<|python_tag|>`). Other templates that read `tools` get the Hermes
//!   format.
//! - **Prompt**: the tools go through the template's own `tools` branch.
//!   A template without one answers 400 naming `tools` for `auto`; for
//!   `required` or a named function the server describes the tools in a
//!   system message in the Hermes format instead (the output is
//!   constrained, so it is a valid call either way).
//! - **Constrained calls** (`required`, named): exactly one call, its
//!   format's markers around a JSON object whose `name` is a listed
//!   function (the named one) and whose arguments are valid against that
//!   function's `parameters` schema (llguidance, [`te_engine::constraint`]).
//! - **Parsing** ([`CallParser`]): text outside calls is the message
//!   `content` (whitespace-only content is dropped); a call that does not
//!   parse as `{"name": string, "arguments"/"parameters": object}` stays
//!   content. A reply that is nothing but such an object, bare or in a
//!   Markdown code fence, naming a listed function, is a call in either
//!   format (small Qwen2.5-Coder models answer so instead of writing
//!   `<tool_call>`). Streaming holds back text that may begin a call (a
//!   reply beginning with `{` or a fence, until its end).

use serde_json::{json, Value};
use te_engine::constraint::{Grammars, TokenConstraint};
use te_tokenizer::chat::ChatMessage;

use super::api::ToolChoice;
use super::error::ApiError;

/// How a model writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallFormat {
    /// Qwen, Hermes: `<tool_call>\n{"name", "arguments"}\n</tool_call>`.
    Hermes,
    /// Llama 3.x: the reply is `{"name", "parameters"}`.
    LlamaJson,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl CallFormat {
    /// The format of a chat template (see the module doc).
    pub fn of_template(template: Option<&str>) -> CallFormat {
        match template {
            Some(t) if !t.contains(OPEN) && t.contains("<|python_tag|>") => CallFormat::LlamaJson,
            _ => CallFormat::Hermes,
        }
    }
}

/// The messages and tools to render for a request with tools (`choice`
/// not `None`): the template's own `tools` when it reads them, else a
/// system message describing them (Hermes format) for `required` or a
/// named function.
///
/// Errors: `auto` with a template that does not read `tools` (400 naming
/// `tools` and the model).
pub fn prompt(
    messages: &[ChatMessage],
    tools: &[Value],
    choice: &ToolChoice,
    template_reads_tools: bool,
    model: &str,
) -> Result<(Vec<ChatMessage>, Option<Vec<Value>>), ApiError> {
    if template_reads_tools {
        return Ok((messages.to_vec(), Some(tools.to_vec())));
    }
    if *choice == ToolChoice::Auto {
        return Err(ApiError::bad_value(
            "tools",
            format!(
                "The chat template of model `{model}` does not support tools; use tool_choice \
                 'required' or a named function (decoding is then constrained to a call), or a \
                 model whose template reads 'tools'."
            ),
        ));
    }
    let mut listing = String::from(
        "You may call one of these functions. Their signatures, within <tools></tools>:\n<tools>",
    );
    for t in tools {
        listing.push('\n');
        listing.push_str(&t.to_string());
    }
    listing.push_str(
        "\n</tools>\n\nWrite a call as a JSON object with the function name and arguments within \
         <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": \
         <args-json-object>}\n</tool_call>",
    );
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(m) if m.role == "system" => {
            let c = m.content.get_or_insert_with(String::new);
            c.push_str("\n\n");
            c.push_str(&listing);
        }
        _ => out.insert(0, ChatMessage::new("system", &listing)),
    }
    Ok((out, None))
}

/// The constraint of `required` or a named function: one call of a
/// listed function (the named one) with arguments valid against its
/// schema, in `format`. `None` for `auto` and `none`.
///
/// Errors: a `parameters` schema llguidance refuses (400 naming `tools`,
/// its message naming the keyword).
pub fn constraint(
    grammars: &Grammars,
    format: CallFormat,
    tools: &[Value],
    choice: &ToolChoice,
) -> Result<Option<TokenConstraint>, ApiError> {
    let wanted: Vec<&Value> = match choice {
        ToolChoice::None | ToolChoice::Auto => return Ok(None),
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => tools
            .iter()
            .filter(|t| t["function"]["name"] == name.as_str())
            .collect(),
    };
    let args_key = match format {
        CallFormat::Hermes => "arguments",
        CallFormat::LlamaJson => "parameters",
    };
    let calls: Vec<Value> = wanted
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({
                "type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: f["parameters"]},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = match <[Value; 1]>::try_from(calls) {
        Ok([one]) => one,
        Err(calls) => json!({"anyOf": calls}),
    };
    let compiled = match format {
        CallFormat::Hermes => {
            grammars.json_between(&format!("{OPEN}\n"), schema, &format!("\n{CLOSE}"))
        }
        CallFormat::LlamaJson => grammars.json_between("", schema, ""),
    };
    compiled.map(Some).map_err(|e| {
        ApiError::bad_value(
            "tools",
            format!("Invalid 'tools': a function's parameters schema: {e}"),
        )
    })
}

/// A parsed call: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What the parser released: content text and completed calls.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// Splits generated text into content and calls, incrementally (see the
/// module doc).
pub struct CallParser {
    format: CallFormat,
    /// The listed functions' names (a bare reply must name one).
    names: Vec<String>,
    /// Text not yet released.
    buf: String,
    /// Hermes: inside `<tool_call>`.
    in_call: bool,
    /// `Some(true)` while the reply may be a bare call (buffered to the
    /// end), `Some(false)` once it is not; `None` before its first
    /// non-blank character.
    bare: Option<bool>,
    /// Whitespace held until content follows it.
    pending_space: String,
    /// Whether any content was released.
    any_content: bool,
}

impl CallParser {
    /// A parser for `format`; `tools` are the request's tools.
    pub fn new(format: CallFormat, tools: &[Value]) -> Self {
        CallParser {
            format,
            names: tools
                .iter()
                .filter_map(|t| t["function"]["name"].as_str().map(str::to_string))
                .collect(),
            buf: String::new(),
            in_call: false,
            bare: None,
            pending_space: String::new(),
            any_content: false,
        }
    }

    /// Takes the next piece of text; returns what can be released.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.buf.push_str(text);
        let mut out = Parsed::default();
        self.step(&mut out, false);
        out
    }

    /// The end of the text: releases everything held.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        self.step(&mut out, true);
        out
    }

    fn step(&mut self, out: &mut Parsed, end: bool) {
        if self.bare.is_none() {
            self.bare = match self.buf.trim_start().chars().next() {
                Some('{' | '`') => Some(true),
                Some(_) => Some(false),
                None if !end => return,
                None => Some(false),
            };
        }
        if self.bare == Some(true) {
            if !end {
                return;
            }
            self.bare = Some(false);
            if let Some(c) = parse_bare(&self.buf, &self.names) {
                self.buf.clear();
                out.calls.push(c);
                return;
            }
        }
        match self.format {
            CallFormat::Hermes => self.hermes(out, end),
            CallFormat::LlamaJson => {
                let text = std::mem::take(&mut self.buf);
                self.content(out, &text);
            }
        }
        if end {
            self.pending_space.clear();
        }
    }

    fn hermes(&mut self, out: &mut Parsed, end: bool) {
        loop {
            if self.in_call {
                let (body, rest) = match self.buf.find(CLOSE) {
                    Some(j) => (
                        self.buf[..j].to_string(),
                        self.buf[j + CLOSE.len()..].to_string(),
                    ),
                    // An unterminated last call.
                    None if end => (std::mem::take(&mut self.buf), String::new()),
                    None => return,
                };
                self.in_call = false;
                self.buf = rest;
                match parse_call(&body) {
                    Some(c) => out.calls.push(c),
                    None => {
                        let closed = if end && self.buf.is_empty() {
                            ""
                        } else {
                            CLOSE
                        };
                        self.content(out, &format!("{OPEN}{body}{closed}"));
                    }
                }
            } else if let Some(i) = self.buf.find(OPEN) {
                let before = self.buf[..i].to_string();
                self.content(out, &before);
                self.buf.drain(..i + OPEN.len());
                self.in_call = true;
            } else {
                // Hold back a tail that may begin a call.
                let keep = if end {
                    0
                } else {
                    partial_suffix(&self.buf, OPEN)
                };
                let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.content(out, &text);
                return;
            }
        }
    }

    /// Releases `text` as content, holding whitespace until content
    /// follows it (and leading whitespace for good).
    fn content(&mut self, out: &mut Parsed, text: &str) {
        if text.trim().is_empty() {
            if self.any_content {
                self.pending_space.push_str(text);
            }
            return;
        }
        let text = if self.any_content {
            text
        } else {
            text.trim_start()
        };
        out.content
            .push_str(&std::mem::take(&mut self.pending_space));
        let body = text.trim_end();
        out.content.push_str(body);
        self.pending_space.push_str(&text[body.len()..]);
        self.any_content = true;
    }
}

/// The length of the longest proper suffix of `s` that begins `marker`
/// (at a character boundary).
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

/// A whole reply that is one call of a function in `names`: a call
/// object, bare or in a Markdown code fence.
fn parse_bare(text: &str, names: &[String]) -> Option<ParsedCall> {
    let mut t = text.trim();
    if let Some(rest) = t.strip_prefix("```") {
        // The fence's info string (`json`) runs to the end of its line.
        t = rest.split_once('\n')?.1.trim_end().strip_suffix("```")?;
    }
    parse_call(t).filter(|c| names.contains(&c.name))
}

/// `{"name": string, "arguments" or "parameters": object or JSON text}`.
fn parse_call(text: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => {
            // Some models write the arguments as a JSON string.
            let inner: Value = serde_json::from_str(s).ok()?;
            inner.is_object().then(|| inner.to_string())?
        }
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(format: CallFormat, pieces: &[&str]) -> Parsed {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather"}}),
            json!({"type": "function", "function": {"name": "f"}}),
        ];
        let mut p = CallParser::new(format, &tools);
        let mut out = Parsed::default();
        for piece in pieces {
            let r = p.push(piece);
            out.content += &r.content;
            out.calls.extend(r.calls);
        }
        let r = p.finish();
        out.content += &r.content;
        out.calls.extend(r.calls);
        out
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn hermes_calls_whole_and_split_anywhere() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let want = Parsed {
            content: "Let me check.".into(),
            calls: vec![call("get_weather", r#"{"city":"Paris"}"#), call("f", "{}")],
        };
        assert_eq!(all(CallFormat::Hermes, &[text]), want);
        // Every split point, one character at a time too.
        for i in 1..text.len() {
            assert_eq!(
                all(CallFormat::Hermes, &[&text[..i], &text[i..]]),
                want,
                "split {i}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(all(CallFormat::Hermes, &pieces), want);
    }

    #[test]
    fn text_that_is_not_a_call_stays_content() {
        let p = all(CallFormat::Hermes, &["a <tool", "_cal", "x> b"]);
        assert_eq!(p.content, "a <tool_calx> b");
        assert!(p.calls.is_empty());
        let p = all(
            CallFormat::Hermes,
            &["x <tool_call>{not json}</tool_call> y"],
        );
        assert_eq!(p.content, "x <tool_call>{not json}</tool_call> y");
        // An unterminated call at the end still parses.
        let p = all(
            CallFormat::Hermes,
            &["<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}"],
        );
        assert_eq!(p.calls, vec![call("f", r#"{"a":1}"#)]);
        assert_eq!(p.content, "");
        assert_eq!(
            all(CallFormat::Hermes, &["  hi  ", " there \n"]).content,
            "hi   there"
        );
        // "<" alone is held back, then released.
        let mut parser = CallParser::new(CallFormat::Hermes, &[]);
        assert_eq!(parser.push("a <").content, "a");
        assert_eq!(parser.push("b").content, " <b");
    }

    #[test]
    fn llama_json_calls() {
        let p = all(
            CallFormat::LlamaJson,
            &[
                " {\"name\": \"get_weather\", ",
                "\"parameters\": {\"city\": \"Oslo\"}}",
            ],
        );
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Oslo"}"#)]);
        assert_eq!(p.content, "");
        let p = all(CallFormat::LlamaJson, &["It is ", "sunny."]);
        assert_eq!((p.content.as_str(), p.calls.len()), ("It is sunny.", 0));
        let p = all(CallFormat::LlamaJson, &["{\"a\": 1}"]);
        assert_eq!((p.content.as_str(), p.calls.len()), ("{\"a\": 1}", 0));
    }

    #[test]
    fn bare_and_fenced_replies_of_listed_functions_are_calls() {
        let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
        for format in [CallFormat::Hermes, CallFormat::LlamaJson] {
            for text in [
                fenced,
                "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            ] {
                let (a, b) = text.split_at(7);
                let p = all(format, &[a, b]);
                assert_eq!(
                    p.calls,
                    vec![call("get_weather", r#"{"city":"Paris"}"#)],
                    "{text}"
                );
                assert_eq!(p.content, "");
            }
            // Not a listed function, or not alone: content.
            let other = "{\"name\": \"rm_rf\", \"arguments\": {}}";
            assert_eq!(all(format, &[other]).content, other);
            let p = all(format, &["```python\nprint(1)\n```"]);
            assert_eq!(
                (p.content.as_str(), p.calls.len()),
                ("```python\nprint(1)\n```", 0)
            );
        }
    }

    #[test]
    fn formats_follow_the_template() {
        assert_eq!(
            CallFormat::of_template(Some("..<tool_call>..")),
            CallFormat::Hermes
        );
        assert_eq!(
            CallFormat::of_template(Some("{{ '<|python_tag|>' }}")),
            CallFormat::LlamaJson
        );
        assert_eq!(CallFormat::of_template(None), CallFormat::Hermes);
    }

    #[test]
    fn templates_without_tools() {
        let msgs = [ChatMessage::new("user", "hi")];
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let e = prompt(&msgs, &tools, &ToolChoice::Auto, false, "m").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools"));
        assert!(e.message.contains("`m`"));
        let (m, t) = prompt(&msgs, &tools, &ToolChoice::Required, false, "m").unwrap();
        assert!(t.is_none());
        assert_eq!(m[0].role, "system");
        assert!(m[0].content.as_deref().unwrap().contains("\"name\":\"f\""));
        let (m, t) = prompt(&msgs, &tools, &ToolChoice::Auto, true, "m").unwrap();
        assert_eq!((m.len(), t.map(|t| t.len())), (1, Some(1)));
    }
}
