//! Chat templates render byte-identically to Hugging Face: every case of
//! `tests/refs/chat_templates/*.json` (Qwen2.5 and Llama 3.1 templates;
//! plain, system, multi-turn, tools, tool calls with object and string
//! arguments, tool results), made by `tests/refs/make_chat_template_refs.py`
//! with transformers' `render_jinja_template`.

use std::path::PathBuf;

use serde_json::Value;
use te_tokenizer::chat::{
    apply_chat_template, template_supports_tools, ChatMessage, ChatTemplateArgs,
};

fn refs_dir() -> PathBuf {
    let base = match std::env::var_os("TE_REFS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/refs"),
    };
    base.join("chat_templates")
}

fn reference_files() -> Vec<PathBuf> {
    let dir = refs_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

#[test]
fn chat_templates_render_as_hugging_face() {
    let files = reference_files();
    assert!(files.len() >= 3, "{files:?}");
    let mut failures = Vec::new();
    let mut n = 0;
    for path in files {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let template = doc["template"].as_str().unwrap();
        assert!(template_supports_tools(template), "{}", path.display());
        for case in doc["cases"].as_array().unwrap() {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(case["messages"].clone()).unwrap();
            let tools: Option<Vec<Value>> = serde_json::from_value(case["tools"].clone()).unwrap();
            let args = ChatTemplateArgs {
                messages: &messages,
                tools: tools.as_deref(),
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                bos_token: case["bos_token"].as_str().unwrap(),
                eos_token: case["eos_token"].as_str().unwrap(),
            };
            let want = case["expected"].as_str().unwrap();
            let name = format!("{} / {}", path.display(), case["name"]);
            match apply_chat_template(template, &args) {
                Ok(got) if got == want => {}
                Ok(got) => failures.push(format!("{name}:\n--- got\n{got}\n--- want\n{want}")),
                Err(e) => failures.push(format!("{name}: {e}")),
            }
            n += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(n >= 30, "{n} cases");
}

#[test]
fn templates_without_tools_say_so() {
    let chatml =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    assert!(!template_supports_tools(chatml));
    assert!(template_supports_tools(
        "{% if tools %}{{ tools|tojson }}{% endif %}"
    ));
    assert!(!template_supports_tools("{% for %}"));
}
