//! Chat templates: a conversation rendered into the prompt text an
//! instruction-tuned model was trained on.
//!
//! The template is the model's own Jinja source: Hugging Face
//! `chat_template.jinja` or `tokenizer_config.json` `chat_template`, or
//! GGUF `tokenizer.chat_template`. It is rendered with `minijinja` (plus
//! its Python-compatible string methods, `tojson` and loop controls) the
//! way Hugging Face `apply_chat_template` renders it: `trim_blocks` and
//! `lstrip_blocks` on, and the context `messages` (`role`, `content`, in
//! that order), `add_generation_prompt`, `bos_token`, `eos_token`,
//! `raise_exception(message)` and `strftime_now(format)` (UTC). Tools and
//! the `{% generation %}` tag are not supported.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{context, Environment, Error, ErrorKind, Value};

use crate::{Result, TokenizerError};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"` (whatever the template knows).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Renders `template` for `messages`; with `add_generation_prompt` the
/// text ends where the assistant's reply begins.
///
/// `bos_token` / `eos_token`: the tokenizer's special-token texts (empty
/// when it has none). The result contains special-token text (e.g.
/// `<|im_start|>`): encode it with special tokens parsed.
///
/// Errors: [`TokenizerError::Tokenizer`] naming the template problem (syntax
/// error, a `raise_exception` from the template, an unknown filter).
pub fn apply_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let err = |e: Error| TokenizerError::Tokenizer(format!("chat template: {e}"));
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(err)?,
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
    env.add_template("chat", template).map_err(err)?;
    env.get_template("chat")
        .map_err(err)?
        .render(context! {
            messages => messages
                .iter()
                .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
                .collect::<Vec<Value>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(err)
}

/// Template instructions allowed per rendering (minijinja fuel): far
/// beyond any real chat template, small enough to stop a runaway one.
const FUEL: u64 = 50_000_000;

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

    /// ChatML with a default system prompt, as SmolLM2-Instruct ships it.
    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn chatml_with_and_without_generation_prompt() {
        let user = [ChatMessage::new("user", "Hi")];
        assert_eq!(
            apply_chat_template(CHATML, &user, true, "", "").unwrap(),
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let both = [
            ChatMessage::new("system", "Be brief"),
            ChatMessage::new("user", "Hi"),
        ];
        assert_eq!(
            apply_chat_template(CHATML, &both, false, "", "").unwrap(),
            "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    /// Hugging Face renders with trim_blocks and lstrip_blocks: block tags
    /// on their own (indented) lines leave no whitespace behind.
    #[test]
    fn block_lines_leave_no_whitespace_and_json_keeps_key_order() {
        let template = "{% for message in messages %}\n    {% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] }}\n    {% endif %}\n{% endfor %}\n{{ messages[0]|tojson }}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}";
        let out =
            apply_chat_template(template, &[ChatMessage::new("user", "Hi")], true, "", "").unwrap();
        // Python's json.dumps separators, as Hugging Face's `tojson`.
        assert_eq!(
            out,
            "<|user|>\nHi\n{\"role\": \"user\", \"content\": \"Hi\"}"
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
        let today = apply_chat_template("{{ strftime_now('%Y') }}", &[], true, "", "").unwrap();
        assert!(today.len() == 4 && today.starts_with("20"), "{today}");
    }

    #[test]
    fn a_runaway_template_stops() {
        let err = apply_chat_template(
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
    fn python_string_methods_bos_and_raise_exception() {
        let template = "{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}<{{ m.role }}>{{ m.content.strip() }}{{ eos_token }}{% endfor %}";
        let out = apply_chat_template(
            template,
            &[ChatMessage::new("user", "  x  ")],
            true,
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(out, "<s><user>x</s>");
        let err = apply_chat_template(template, &[ChatMessage::new("tool", "x")], true, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("bad role tool"), "{err}");
        let err = apply_chat_template("{% for %}", &[], true, "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("chat template"), "{err}");
    }
}
