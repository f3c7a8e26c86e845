//! Chat templates: a conversation rendered into the prompt text an
//! instruction-tuned model was trained on.
//!
//! The template is the model's own Jinja source: Hugging Face
//! `chat_template.jinja` or `tokenizer_config.json` `chat_template`, or
//! GGUF `tokenizer.chat_template`. It is rendered with `minijinja` (plus
//! its Python-compatible string methods and loop controls) the way Hugging
//! Face `apply_chat_template` renders it: `trim_blocks` and
//! `lstrip_blocks` on; the context `messages` (each a map of the
//! [`ChatMessage`] fields that are set, in field order), `tools` (the
//! function specs as given, or none), `documents` (none),
//! `add_generation_prompt`, `bos_token`, `eos_token`;
//! `raise_exception(message)` and `strftime_now(format)` (UTC); and
//! Hugging Face's `tojson` filter, Python's `json.dumps(x,
//! ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
//! with those keyword arguments (not minijinja's compact, HTML-escaping
//! one). Maps keep the order they were given in (serde_json's
//! `preserve_order`). The `{% generation %}` tag is not supported.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::{Result, TokenizerError};

/// One turn of a conversation, as OpenAI and Hugging Face write it.
///
/// Serializes (and so reaches the template) with only the fields that are
/// set, in this order: a message without `tool_calls` has no such key
/// (templates test `'tool_calls' in message`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"` or `"tool"` (whatever the
    /// template knows).
    pub role: String,
    /// The text; `None` for an assistant turn that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// An assistant turn's calls: `[{"type": "function", "function":
    /// {"name": ..., "arguments": {...} or a JSON string}}]`, passed to the
    /// template as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool result's function name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with text `content` and nothing else.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: Some(content.to_string()),
            ..Default::default()
        }
    }
}

/// What a chat template renders: Hugging Face `apply_chat_template`'s
/// arguments.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatTemplateArgs<'a> {
    /// The conversation.
    pub messages: &'a [ChatMessage],
    /// Function specs (`{"type": "function", "function": {"name",
    /// "description", "parameters"}}`) the template lists, or `None` (the
    /// template sees `tools` = none).
    pub tools: Option<&'a [serde_json::Value]>,
    /// End the text where the assistant's reply begins.
    pub add_generation_prompt: bool,
    /// The tokenizer's BOS text (empty when it has none).
    pub bos_token: &'a str,
    /// The tokenizer's EOS text (empty when it has none).
    pub eos_token: &'a str,
}

/// Renders `template` for `args` (see the module doc for what the
/// template sees).
///
/// The result contains special-token text (e.g. `<|im_start|>`): encode it
/// with special tokens parsed.
///
/// Errors: [`TokenizerError::Tokenizer`] naming the template problem (syntax
/// error, a `raise_exception` from the template, an unknown filter, a value
/// `tojson` cannot write).
pub fn apply_chat_template(template: &str, args: &ChatTemplateArgs<'_>) -> Result<String> {
    let err = |e: Error| TokenizerError::Tokenizer(format!("chat template: {e}"));
    let env = environment().map_err(err)?;
    let template = env.template_from_str(template).map_err(err)?;
    template
        .render(context! {
            messages => args.messages.iter().map(message_value).collect::<Vec<_>>(),
            tools => args.tools.map(|t| t.iter().map(json_value).collect::<Vec<_>>()),
            documents => (),
            add_generation_prompt => args.add_generation_prompt,
            bos_token => args.bos_token,
            eos_token => args.eos_token,
        })
        .map_err(err)
}

/// A message as the template sees it: a map of the fields that are set,
/// in field order.
fn message_value(m: &ChatMessage) -> Value {
    let mut fields = vec![("role", Value::from(m.role.as_str()))];
    if let Some(content) = &m.content {
        fields.push(("content", Value::from(content.as_str())));
    }
    if let Some(calls) = &m.tool_calls {
        fields.push(("tool_calls", json_value(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    if let Some(name) = &m.name {
        fields.push(("name", Value::from(name.as_str())));
    }
    Value::from_pairs(fields)
}

/// A JSON value as a template value, objects keeping their key order.
fn json_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(items) => {
            Value::from(items.iter().map(json_value).collect::<Vec<_>>())
        }
        serde_json::Value::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

/// Whether `template` reads the `tools` variable, i.e. has a branch that
/// lists function specs (Qwen2.5's, Llama 3.1's). A template that does
/// not would silently drop tools given to it; one that does not parse
/// reads nothing (false).
pub fn template_supports_tools(template: &str) -> bool {
    let Ok(env) = environment() else {
        return false;
    };
    env.template_from_str(template)
        .map(|t| t.undeclared_variables(false).contains("tools"))
        .unwrap_or(false)
}

/// The Jinja environment of Hugging Face `apply_chat_template`.
fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    // A runaway template stops with an error instead of eating memory.
    env.set_fuel(Some(FUEL));
    env.add_function("raise_exception", |message: String| -> Result<(), Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", |format: String| -> Result<String, Error> {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        strftime_utc(&format, secs).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
    });
    env.add_filter("tojson", tojson);
    Ok(env)
}

/// Hugging Face's `tojson` filter: `json.dumps(value,
/// ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// each overridable by keyword.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let bad = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    // Python: an int indents by that many spaces, a string by itself.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(
                i64::try_from(v)
                    .map_err(|_| bad("indent must be an integer or a string"))?
                    .max(0) as usize,
            ),
        }),
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => (
                    a.as_str().unwrap_or_default().to_string(),
                    b.as_str().unwrap_or_default().to_string(),
                ),
                _ => return Err(bad("separators must be two strings")),
            }
        }
        // Python's defaults: no space before a newline when indenting.
        _ if indent.is_some() => (",".into(), ": ".into()),
        _ => (", ".into(), ": ".into()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out)?;
    Ok(out)
}

/// `json.dumps` settings.
struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// Writes `value` as Python's `json.dumps` does.
fn write_json(value: &Value, opts: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    let not_json = |kind: ValueKind| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: a value of type {kind} is not JSON serializable"),
        )
    };
    let newline = |out: &mut String, level: usize| {
        if let Some(indent) = &opts.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    };
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => {
            let x = f64::try_from(value.clone()).map_err(|_| not_json(ValueKind::Number))?;
            out.push_str(&py_float_repr(x));
        }
        ValueKind::String => write_json_str(value.as_str().unwrap_or_default(), opts, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                write_json(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut items = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                // Python writes non-string keys as their JSON text.
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => match key.kind() {
                        ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                            let mut k = String::new();
                            write_json(&key, opts, level, &mut k)?;
                            k
                        }
                        kind => return Err(not_json(kind)),
                    },
                };
                items.push((key, item));
            }
            if opts.sort_keys {
                items.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if items.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, level + 1);
                write_json_str(key, opts, out);
                out.push_str(&opts.key_sep);
                write_json(item, opts, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        kind => return Err(not_json(kind)),
    }
    Ok(())
}

/// A JSON string as Python writes it: `"` `\\` and control characters
/// escaped (`\n`, `\u001b`, lower-case hex); with `ensure_ascii` every
/// non-ASCII character too (as UTF-16 `\uXXXX`).
fn write_json_str(s: &str, opts: &JsonOpts, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (opts.ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest text that reads back as `x`,
/// positional for exponents -5 < e < 16 (with `.0` when integral), else
/// `1.5e-07` / `1e+16`; `NaN`, `Infinity`, `-Infinity` as `json.dumps`.
fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip form: `-1.25e-7`.
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-5 < exp && exp < 16) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let text = if point <= 0 {
        format!("0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    };
    format!("{sign}{text}")
}

/// The work and memory a rendering may take (minijinja fuel): one fuel
/// pays for one instruction or for 64 bytes of strings, lists and maps
/// that operators (`~`, `+`, `*`, slicing), filters, functions and methods
/// create, or of output, each allocation's size charged before it is made.
/// So a rendering runs at most 4 Mi instructions and creates at most 256
/// MiB of values in all, whatever the template does (a string doubled in a
/// loop included). A real template over a long conversation takes a few
/// instructions per message and a few bytes per byte of content: a 32 MiB
/// conversation takes about 2 Mi fuel.
const FUEL: u64 = 4 << 20;

/// `format` (C `strftime` codes `%d %m %Y %y %b %B %a %A %H %M %S %j %%`)
/// of the UTC time `secs` after the Unix epoch.
fn strftime_utc(format: &str, secs: u64) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (secs / 86_400) as i64;
    let (hour, minute, second) = (secs / 3600 % 24, secs / 60 % 60, secs % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = before[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let (month_name, weekday) = (
        MONTHS[(month - 1) as usize],
        DAYS[days.rem_euclid(7) as usize],
    );
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(format!(
                    "strftime_now: unsupported code %{}",
                    other.map_or(String::new(), String::from)
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        apply_chat_template(
            template,
            &ChatTemplateArgs {
                messages,
                tools: None,
                add_generation_prompt,
                bos_token,
                eos_token,
            },
        )
    }

    /// ChatML with a default system prompt, as SmolLM2-Instruct ships it.
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn chatml_with_and_without_generation_prompt() {
        let user = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            render(CHATML, &user, true, "", "").unwrap(),
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let both = [
            ChatMessage::new("system", "Be brief"),
            ChatMessage::new("user", "Hi"),
        ];
        assert_eq!(
            render(CHATML, &both, false, "", "").unwrap(),
            "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    /// Hugging Face renders with trim_blocks and lstrip_blocks: block tags
    /// on their own (indented) lines leave no whitespace behind.
    #[test]
    fn block_lines_leave_no_whitespace_and_json_keeps_key_order() {
        let template = "{% for message in messages %}\n    {% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] }}\n    {% endif %}\n{% endfor %}\n{{ messages[0]|tojson }}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}";
        let out = render(template, &[ChatMessage::new("user", "Hi")], true, "", "").unwrap();
        // Python's json.dumps separators, as Hugging Face's `tojson`.
        assert_eq!(
            out,
            "<|user|>\nHi\n{\"role\": \"user\", \"content\": \"Hi\"}"
        );
    }

    /// Hugging Face's `tojson` is Python's `json.dumps`: its float
    /// reprs, separators, indents, key sorting, ASCII escapes, no HTML
    /// escaping (expected texts from transformers' own environment).
    #[test]
    fn tojson_is_python_json_dumps() {
        for (template, want) in [
            (
                r#"{{ {"b": 1, "a": [1.5, "é\u001b\u2028 😀"], "c": {}} | tojson(sort_keys=true, ensure_ascii=true, indent=2) }}"#,
                "{\n  \"a\": [\n    1.5,\n    \"\\u00e9\\u001b\\u2028 \\ud83d\\ude00\"\n  ],\n  \"b\": 1,\n  \"c\": {}\n}",
            ),
            (
                r#"{{ [1e-7, 1e16, 123456.0, -0.0, 0.1, 1e15, 12345678912345678] | tojson(separators=[",", ":"]) }}"#,
                "[1e-07,1e+16,123456.0,-0.0,0.1,1000000000000000.0,12345678912345678]",
            ),
            (
                r#"{{ {"k": [[], {}, none, true]} | tojson(indent="\t") }}"#,
                "{\n\t\"k\": [\n\t\t[],\n\t\t{},\n\t\tnull,\n\t\ttrue\n\t]\n}",
            ),
            (
                r#"{{ "</script> & 'x'" | tojson }}"#,
                "\"</script> & 'x'\"",
            ),
        ] {
            assert_eq!(render(template, &[], false, "", "").unwrap(), want, "{template}");
        }
        let err = render("{{ x | tojson }}", &[], false, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not JSON serializable"), "{err}");
        assert_eq!(py_float_repr(f64::NAN), "NaN");
        assert_eq!(py_float_repr(-f64::INFINITY), "-Infinity");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(0.00001), "1e-05");
        assert_eq!(py_float_repr(-1.5e300), "-1.5e+300");
    }

    /// Messages reach the template with only their set fields, tool calls
    /// as given (key order kept).
    #[test]
    fn messages_carry_tool_calls_in_order() {
        let call: serde_json::Value = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": 2}}}]"#,
        )
        .unwrap();
        let messages = [
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(call),
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: Some("3".into()),
                tool_call_id: Some("c1".into()),
                name: Some("f".into()),
                ..Default::default()
            },
        ];
        let out = render(
            "{% for m in messages %}{{ m|tojson }}|{{ 'content' in m }}\n{% endfor %}",
            &messages,
            false,
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"role\": \"assistant\", \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"z\": 1, \"a\": 2}}}]}|False\n\
             {\"role\": \"tool\", \"content\": \"3\", \"tool_call_id\": \"c1\", \"name\": \"f\"}|True\n"
        );
    }

    #[test]
    fn strftime_of_known_instants() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(
            strftime_utc("%d %b %Y %H:%M:%S %A %j %y %m %B %a %%", t).unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 24 02 February Thu %"
        );
        assert_eq!(strftime_utc("%d %B %Y", 0).unwrap(), "01 January 1970");
        assert!(strftime_utc("%Q", 0).unwrap_err().contains("%Q"));
        let today = render("{{ strftime_now('%Y') }}", &[], true, "", "").unwrap();
        assert!(today.len() == 4 && today.starts_with("20"), "{today}");
    }

    #[test]
    fn a_runaway_template_stops() {
        let err = render(
            "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
            &[],
            true,
            "",
            "",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("chat template"), "{err}");
    }

    #[test]
    fn a_template_that_doubles_a_string_stops_within_its_memory_bound() {
        // 2^60 bytes if it ran on; the fuel stops it at 256 MiB of values
        // in all (each concatenation's size is charged before it is made).
        let template = "{% set ns = namespace(s='x') %}{% for i in range(60) %}\
                        {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
        // The process's peak resident memory (Linux), in bytes.
        let peak = || -> Option<u64> {
            let status = std::fs::read_to_string("/proc/self/status").ok()?;
            let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
            Some(kb.split_whitespace().next()?.parse::<u64>().ok()? * 1024)
        };
        let before = peak();
        let err = render(template, &[], true, "", "").unwrap_err().to_string();
        assert!(
            err.contains("chat template") && err.contains("fuel"),
            "{err}"
        );
        if let (Some(before), Some(after)) = (before, peak()) {
            // 256 MiB of values at most, the doubling that would pass it
            // refused before it is allocated.
            assert!(
                after.saturating_sub(before) <= 512 << 20,
                "the peak grew by {} MiB",
                (after - before) >> 20
            );
        }
        // 20 doublings (1 MiB) are fine.
        let out = render(&template.replace("60", "20"), &[], true, "", "").unwrap();
        assert_eq!(out, (1 << 20).to_string());
    }

    #[test]
    fn python_string_methods_bos_and_raise_exception() {
        let template = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}<{{ m.role }}>{{ m.content.strip() }}{{ eos_token }}{% endfor %}";
        let out = render(
            template,
            &[ChatMessage::new("user", "  x  ")],
            true,
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(out, "<s><user>x</s>");
        let err = render(template, &[ChatMessage::new("tool", "x")], true, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad role tool"), "{err}");
        let err = render("{% for %}", &[], true, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("chat template"), "{err}");
    }
}
