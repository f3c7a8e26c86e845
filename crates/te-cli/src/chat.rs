//! `te chat`: a conversation with a model in the terminal.
//!
//! Each line typed is a user message, rendered with the model's chat
//! template; the answer streams as it is generated. A line ending in `\`
//! continues on the next line, and a line of `"""` opens (and another
//! closes) a block pasted as is. Commands start with `/` ([`HELP`]).
//! Ctrl-C stops the current answer (the part generated stays in the
//! conversation) or clears the line being typed; Ctrl-D quits.
//!
//! The conversation stays in the engine's prefix cache (pages of one
//! token), and each turn's prompt is the tokens already computed followed
//! by the tokens of the new text only, so a turn prefills only what is new
//! (`/stats`). A model without a chat template (a base model) runs in
//! raw-completion mode: the text typed is appended to the conversation
//! text, which the model continues.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context};
use rustyline::error::ReadlineError;
use te_engine::sampling::SamplingParams;
use te_engine::{Engine, EngineConfig, Event, FinishReason, Request};
use te_tokenizer::chat::ChatMessage;
use te_tokenizer::Tokenizer;

#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name
    /// (smollm2-135m, qwen2.5-coder-0.5b, ...; see `te inspect`).
    #[arg(long)]
    model: String,
    /// A system message at the start of the conversation (also `/system`).
    #[arg(long)]
    system: Option<String>,
    /// Raw-completion mode even when the model has a chat template: the
    /// text typed is appended to the conversation, which the model continues.
    #[arg(long)]
    raw: bool,
    /// Most tokens in one answer.
    #[arg(long, default_value_t = 1024)]
    max_new_tokens: usize,
    /// KV cache capacity in tokens: the longest conversation (default: the
    /// model's context, at most 32768).
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    #[command(flatten)]
    sampling: crate::sampling::SamplingArgs,
    #[command(flatten)]
    device: crate::DeviceArg,
    #[command(flatten)]
    threads: crate::Threads,
}

/// The commands, as `/help` prints them.
const HELP: &str = "\
commands:
  /system TEXT  set the system message (the conversation starts again)
  /reset        start the conversation again (keeps the system message)
  /save FILE    write the conversation as JSON messages
  /load FILE    read a conversation written by /save (or any JSON list of
                {\"role\", \"content\"} messages)
  /stats        prompt, prefill and speed of the last answer, and totals
  /help         this list
input: a line ending in \\ continues on the next line; a line of \"\"\" starts
and ends a pasted block. Ctrl-C stops an answer, Ctrl-D quits.";

/// Sampling defaults that suit small chat models.
fn chat_defaults() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        repetition_penalty: 1.1,
        ..SamplingParams::default()
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.threads.init()?;
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    if args.kv_cache_tokens == Some(0) {
        bail!("--kv-cache-tokens must be at least 1");
    }
    let sampling = args.sampling.params(&chat_defaults())?;
    let placed = crate::load_on(&args.model, &args.device, args.kv_cache_tokens)?;
    let loaded = &placed.loaded;
    let tokenizer = &loaded.tokenizer;
    let raw = args.raw || tokenizer.chat_template().is_none();
    if raw && !args.raw {
        crate::note(format_args!(
            "{} has no chat template: it is a base model, which continues text rather than \
             answering. Running in raw-completion mode (what you type is appended to the \
             text and the model continues it); for a conversation use an instruct model \
             such as smollm2-135m or qwen2.5-coder-0.5b.",
            args.model
        ));
    }
    let config = EngineConfig {
        max_batch_size: 1,
        // One token per page: the prefix cache then keeps every computed
        // token of the conversation, not only whole pages of 16.
        page_size: 1,
        kv_cache_tokens: args.kv_cache_tokens,
        prefix_caching: true,
        gpu: placed.gpu.clone(),
        ..EngineConfig::default()
    };
    let engine = Engine::new(&loaded.model, Some(tokenizer), config)?;
    let mut chat = Chat {
        engine,
        tokenizer,
        raw,
        sampling,
        max_new_tokens: args.max_new_tokens,
        system: args.system.clone(),
        messages: Vec::new(),
        computed_text: String::new(),
        computed: Vec::new(),
        fed: 0,
        last: None,
    };
    crate::interrupt::install()?;
    crate::note(format_args!(
        "{} mode, temperature {}, seed {}, kv cache {} tokens{}. /help for commands, Ctrl-D quits.",
        if raw { "raw-completion" } else { "chat" },
        chat.sampling.temperature,
        chat.sampling.seed,
        chat.engine.kv_capacity_tokens(),
        if chat.engine.prefix_caching() {
            ""
        } else {
            " (no prefix cache for this model: each turn prefills the whole conversation)"
        }
    ));
    let mut history = Vec::new();
    while let Some(input) = read_input(&mut history)? {
        let trimmed = input.trim();
        if trimmed.is_empty() {
            continue;
        }
        if trimmed.starts_with('/') {
            if let Err(e) = chat.command(trimmed) {
                crate::note(format_args!("error: {e:#}"));
            }
            continue;
        }
        if let Err(e) = chat.turn(&input) {
            crate::note(format_args!("error: {e:#}"));
        }
    }
    Ok(())
}

/// One message from the user: a line, lines joined by trailing `\`, or a
/// `"""` block; `None` at Ctrl-D. Ctrl-C drops what was typed. `history`:
/// the messages so far (the up arrow recalls them), this one added.
///
/// The editor lives only while a message is typed: it takes over SIGINT
/// while it exists, and Ctrl-C must reach [`crate::interrupt`] while an
/// answer is generated.
fn read_input(history: &mut Vec<String>) -> anyhow::Result<Option<String>> {
    // No cursor-position query before the prompt (answers end with a
    // newline): its reply races with keys typed early.
    let config = rustyline::Config::builder()
        .check_cursor_position(false)
        .build();
    let mut editor =
        rustyline::DefaultEditor::with_config(config).context("starting the line editor")?;
    for h in history.iter() {
        editor
            .add_history_entry(h.as_str())
            .context("line editor history")?;
    }
    let mut text = String::new();
    let mut block = false;
    loop {
        let prompt = if block || !text.is_empty() {
            "... "
        } else {
            ">>> "
        };
        let line = match editor.readline(prompt) {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                text.clear();
                block = false;
                continue;
            }
            Err(ReadlineError::Eof) => return Ok(None),
            Err(e) => return Err(e).context("reading input"),
        };
        if line.trim() == "\"\"\"" {
            if block {
                break;
            }
            block = true;
            continue;
        }
        if block {
            text.push_str(&line);
            text.push('\n');
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            text.push_str(head);
            text.push('\n');
            continue;
        }
        text.push_str(&line);
        break;
    }
    let text = text.trim_end_matches('\n').to_string();
    if !text.trim().is_empty() {
        history.push(text.clone());
    }
    Ok(Some(text))
}

/// What the last answer cost (`/stats`).
#[derive(Clone, Copy, Debug)]
struct TurnStats {
    /// Tokens of the turn's prompt (the whole conversation so far).
    prompt_tokens: usize,
    /// Of those, tokens computed in earlier turns.
    reused_tokens: usize,
    /// Tokens of the prompt the engine computed (the rest came from its
    /// prefix cache).
    prefilled_tokens: usize,
    /// Tokens the prefix cache supplied.
    cache_hit_tokens: usize,
    generated_tokens: usize,
    /// Time to the first token, seconds.
    ttft_s: f64,
    /// Seconds from the first token to the last.
    decode_s: f64,
    finish: Option<FinishReason>,
}

/// A conversation on one engine.
struct Chat<'a> {
    engine: Engine<'a>,
    tokenizer: &'a Tokenizer,
    /// Raw-completion mode (no chat template).
    raw: bool,
    sampling: SamplingParams,
    max_new_tokens: usize,
    system: Option<String>,
    /// The conversation (without the system message).
    messages: Vec<ChatMessage>,
    /// The text of `computed` (the template's rendering with the answers).
    computed_text: String,
    /// The tokens of the conversation: the last prompt and its answer.
    computed: Vec<u32>,
    /// How many of `computed` have their keys and values in the prefix
    /// cache: all but the answer's last token (sampled, never fed).
    fed: usize,
    last: Option<TurnStats>,
}

impl Chat<'_> {
    /// The messages as the template sees them: the system message first.
    fn all_messages(&self) -> Vec<ChatMessage> {
        let mut all = Vec::with_capacity(self.messages.len() + 1);
        if let Some(s) = &self.system {
            all.push(ChatMessage::new("system", s));
        }
        all.extend(self.messages.iter().cloned());
        all
    }

    /// Forgets the computed tokens (the next prompt is encoded whole; the
    /// prefix cache still supplies what matches).
    fn forget_computed(&mut self) {
        self.computed.clear();
        self.computed_text.clear();
        self.fed = 0;
    }

    fn command(&mut self, line: &str) -> anyhow::Result<()> {
        let (name, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let rest = rest.trim();
        match name {
            "/help" => crate::note(format_args!("{HELP}")),
            "/system" => {
                self.system = (!rest.is_empty()).then(|| rest.to_string());
                self.messages.clear();
                self.forget_computed();
                crate::note(format_args!(
                    "{} (conversation cleared)",
                    if rest.is_empty() {
                        "system message removed"
                    } else {
                        "system message set"
                    }
                ));
            }
            "/reset" => {
                self.messages.clear();
                self.forget_computed();
                crate::note(format_args!("conversation cleared"));
            }
            "/save" => {
                if rest.is_empty() {
                    bail!("/save needs a file name");
                }
                let json = serde_json::to_string_pretty(&self.all_messages())?;
                std::fs::write(rest, json + "\n").with_context(|| format!("writing {rest}"))?;
                crate::note(format_args!(
                    "saved {} messages to {rest}",
                    self.all_messages().len()
                ));
            }
            "/load" => {
                if rest.is_empty() {
                    bail!("/load needs a file name");
                }
                let text =
                    std::fs::read_to_string(rest).with_context(|| format!("reading {rest}"))?;
                let messages: Vec<ChatMessage> =
                    serde_json::from_str(&text).with_context(|| {
                        format!(
                            "{rest}: expected a JSON list of {{\"role\", \"content\"}} messages"
                        )
                    })?;
                self.system = None;
                self.messages.clear();
                for m in messages {
                    if m.role == "system" && self.messages.is_empty() && self.system.is_none() {
                        self.system = m.content;
                    } else {
                        self.messages.push(m);
                    }
                }
                self.forget_computed();
                crate::note(format_args!(
                    "loaded {} messages from {rest}",
                    self.messages.len() + usize::from(self.system.is_some())
                ));
                for m in &self.messages {
                    crate::note(format_args!(
                        "[{}] {}",
                        m.role,
                        m.content.as_deref().unwrap_or("")
                    ));
                }
            }
            "/stats" => self.print_stats(),
            _ => bail!("unknown command {name} (/help lists them)"),
        }
        Ok(())
    }

    fn print_stats(&self) {
        let s = self.engine.stats();
        let Some(t) = self.last else {
            crate::note(format_args!("no answer yet"));
            return;
        };
        let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        crate::note(format_args!(
            "last turn: prompt {} tokens = {} from earlier turns + {} new; prefilled {} \
             ({} from the prefix cache); generated {} ({}); time to first token {:.3} s, \
             {:.1} tokens/s",
            t.prompt_tokens,
            t.reused_tokens,
            t.prompt_tokens - t.reused_tokens,
            t.prefilled_tokens,
            t.cache_hit_tokens,
            t.generated_tokens,
            t.finish.map_or("length", FinishReason::as_str),
            t.ttft_s,
            rate(t.generated_tokens.saturating_sub(1), t.decode_s),
        ));
        crate::note(format_args!(
            "totals: {} turns, {} prompt tokens ({} from the prefix cache), {} generated; \
             prefill {:.1} tokens/s, decode {:.1} tokens/s; conversation {} tokens of {}; \
             seed {}",
            s.requests,
            s.prompt_tokens,
            s.prefix_hit_tokens,
            s.generated_tokens,
            rate(s.prefill_tokens, s.prefill_s),
            rate(s.decode_tokens, s.decode_s),
            self.computed.len(),
            self.engine.kv_capacity_tokens(),
            self.sampling.seed,
        ));
    }

    /// The prompt of a turn whose new user text is `input`: its text, its
    /// tokens, and how many of them were computed in earlier turns.
    fn prompt(&self, input: &str) -> anyhow::Result<(String, Vec<u32>, usize)> {
        let text = if self.raw {
            format!("{}{input}", self.computed_text)
        } else {
            let mut all = self.all_messages();
            all.push(ChatMessage::new("user", input));
            self.tokenizer.render_chat(&all, None)?
        };
        let tokens = match text.strip_prefix(self.computed_text.as_str()) {
            Some(new) if !self.computed.is_empty() => {
                // The new text alone, without the BOS `encode` may add.
                let bos = self.tokenizer.encode("", true)?;
                let ids = self.tokenizer.encode(new, !self.raw)?;
                let ids = ids.strip_prefix(bos.as_slice()).unwrap_or(&ids);
                [self.computed.as_slice(), ids].concat()
            }
            _ if self.raw => self.tokenizer.encode(&text, false)?,
            _ => self.tokenizer.encode_chat(&{
                let mut all = self.all_messages();
                all.push(ChatMessage::new("user", input));
                all
            })?,
        };
        let reused = tokens
            .iter()
            .zip(&self.computed[..self.fed])
            .take_while(|(a, b)| a == b)
            .count();
        Ok((text, tokens, reused))
    }

    /// Answers `input`, streaming the answer to stdout.
    fn turn(&mut self, input: &str) -> anyhow::Result<()> {
        let (text, prompt, reused) = self.prompt(input)?;
        let before = self.engine.stats().clone();
        let start = Instant::now();
        let id = self
            .engine
            .add_request(Request {
                prompt_tokens: prompt.clone(),
                max_new_tokens: self.max_new_tokens,
                sampling: self.sampling.clone(),
                ignore_eos: false,
                stop: Vec::new(),
                skip_special_tokens: true,
                constraint: None,
                cache_salt: None,
                draft: te_engine::DraftLimits::default(),
            })
            .map_err(|e| {
                anyhow::anyhow!("{e} (/reset starts a new conversation, /save keeps this one)")
            })?;
        // A Ctrl-C at the prompt is not meant for this answer.
        crate::interrupt::take();
        let mut out = crate::stdout();
        let mut answer = String::new();
        let mut generated = Vec::new();
        let mut first_token: Option<Instant> = None;
        let mut finish = None;
        if self.raw {
            // The answer continues what was typed.
            write!(out, "{input}")?;
        }
        while self.engine.has_work() {
            if crate::interrupt::take() {
                self.engine.abort(id)?;
            }
            for event in self.engine.step()? {
                let text = match event {
                    Event::Token { token, text, .. } => {
                        first_token.get_or_insert_with(Instant::now);
                        generated.push(token);
                        text
                    }
                    Event::Finished { reason, text, .. } => {
                        finish = Some(reason);
                        text
                    }
                };
                out.write_all(text.as_bytes())?;
                out.flush()?;
                answer.push_str(&text);
            }
        }
        if finish == Some(FinishReason::Abort) {
            write!(out, " [stopped]")?;
        }
        writeln!(out)?;
        out.flush()?;
        let cache_hit = self.engine.stats().prefix_hit_tokens - before.prefix_hit_tokens;
        let now = Instant::now();
        self.last = Some(TurnStats {
            prompt_tokens: prompt.len(),
            reused_tokens: reused,
            prefilled_tokens: prompt.len() - cache_hit,
            cache_hit_tokens: cache_hit,
            generated_tokens: generated.len(),
            ttft_s: first_token.map_or(0.0, |t| (t - start).as_secs_f64()),
            decode_s: first_token.map_or(0.0, |t| (now - t).as_secs_f64()),
            finish,
        });
        self.computed_text = text + &self.tokenizer.decode(&generated, false)?;
        // (An answer stopped before its first token may have left part of
        // the prompt uncomputed: count none of it.)
        self.fed = match generated.len() {
            0 => 0,
            n => prompt.len() + n - 1,
        };
        self.computed = [prompt.as_slice(), &generated].concat();
        self.messages.push(ChatMessage::new("user", input));
        self.messages.push(ChatMessage::new("assistant", &answer));
        Ok(())
    }
}
