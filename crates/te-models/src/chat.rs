//! Chat templates: a conversation rendered into the prompt text an
//! instruction-tuned model was trained on.
//!
//! The template is the model's own Jinja source: Hugging Face
//! `tokenizer_config.json` `chat_template`, or GGUF
//! `tokenizer.chat_template`. It is rendered with `minijinja` (plus its
//! Python-compatible string methods) in the context Hugging Face
//! `apply_chat_template` provides: `messages` (`role`, `content`),
//! `add_generation_prompt`, `bos_token`, `eos_token` and
//! `raise_exception(message)`.

use std::collections::BTreeMap;

use minijinja::{context, Environment, Error, ErrorKind, Value};

use crate::error::{ModelError, Result};

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
/// Errors: [`ModelError::Tokenizer`] naming the template problem (syntax
/// error, a `raise_exception` from the template, an unknown filter).
pub fn apply_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    let err = |e: Error| ModelError::Tokenizer(format!("chat template: {e:#}"));
    let mut env = Environment::new();
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<(), Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_template("chat", template).map_err(err)?;
    env.get_template("chat")
        .map_err(err)?
        .render(context! {
            messages => messages
                .iter()
                .map(|m| Value::from(BTreeMap::from([("role", m.role.clone()), ("content", m.content.clone())])))
                .collect::<Vec<Value>>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        })
        .map_err(err)
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
