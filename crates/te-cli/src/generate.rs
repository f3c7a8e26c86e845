//! `te generate`: batched generation with streaming output.

use std::io::Write;

use anyhow::{bail, Context};
use te_models::chat::ChatMessage;
use te_models::generate::{generate, Control, GenerationConfig, GenerationRequest};
use te_models::sampling::SamplingParams;

#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name
    /// (smollm2-135m, gemma3-270m).
    #[arg(long)]
    model: String,
    /// A prompt (repeat for a batch).
    #[arg(long)]
    prompt: Vec<String>,
    /// A file of prompts, one per line (added after --prompt ones).
    #[arg(long)]
    prompt_file: Option<std::path::PathBuf>,
    /// Most tokens to generate per prompt.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Keep generating past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object per prompt instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below min_p times the best one's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the generated text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Most sequences run together.
    #[arg(long, default_value_t = 16)]
    max_batch_size: usize,
    /// Send each prompt as a user message through the model's chat
    /// template (instruction-tuned models).
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message before each prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
}

struct Stream {
    /// Generated ids so far.
    tokens: Vec<u32>,
    /// Bytes of decoded text already printed.
    printed: usize,
    /// Text cut at the first stop string, once one appeared.
    stopped_text: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let mut prompts = args.prompt.clone();
    if let Some(path) = &args.prompt_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading prompt file {}", path.display()))?;
        prompts.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
    }
    if prompts.is_empty() {
        match &args.prompt_file {
            Some(path) => bail!("--prompt-file {} has no non-empty line", path.display()),
            None => bail!("no prompt given (use --prompt or --prompt-file)"),
        }
    }
    if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
        bail!("prompt {i} is empty");
    }
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop takes a non-empty string");
    }
    if args.max_batch_size == 0 {
        bail!("--max-batch-size must be at least 1");
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repeat_penalty,
        seed: args.seed,
    };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let loaded = crate::load(&args.model)?;
    let tokenizer = &loaded.tokenizer;
    let mut requests = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let ids = if args.chat {
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", p));
            tokenizer.encode_chat(&messages)
        } else {
            tokenizer.encode(p, true)
        }
        .with_context(|| format!("tokenizing prompt {i}"))?;
        requests.push(GenerationRequest {
            prompt_tokens: ids,
            max_new_tokens: args.max_new_tokens,
            sampling: sampling.clone(),
            ignore_eos: args.ignore_eos,
        });
    }
    let config = GenerationConfig {
        max_batch_size: args.max_batch_size,
        ..GenerationConfig::default()
    };
    // Stream text only for a single prompt; several are printed whole.
    let stream_stdout = !args.json && prompts.len() == 1;
    let mut streams: Vec<Stream> = (0..prompts.len())
        .map(|_| Stream {
            tokens: vec![],
            printed: 0,
            stopped_text: None,
        })
        .collect();
    let mut stdout = crate::stdout();
    let mut decode_error = None;
    let outputs = generate(&loaded.model, &requests, &config, |i, tok| {
        let s = &mut streams[i];
        s.tokens.push(tok);
        if args.stop.is_empty() && !stream_stdout {
            return Control::Continue;
        }
        let text = match tokenizer.decode(&s.tokens, !args.json) {
            Ok(t) => t,
            Err(e) => {
                decode_error = Some(e);
                return Control::Stop;
            }
        };
        let mut control = Control::Continue;
        let mut visible = text.as_str();
        if let Some(pos) = args
            .stop
            .iter()
            .filter_map(|st| text.find(st.as_str()))
            .min()
        {
            visible = &text[..pos];
            s.stopped_text = Some(visible.to_string());
            control = Control::Stop;
        }
        if stream_stdout {
            // Hold back an incomplete UTF-8 character and anything that may
            // be the start of a stop string.
            let mut end = visible.trim_end_matches('\u{FFFD}').len();
            if control == Control::Continue {
                let hold = args.stop.iter().map(|st| st.len().saturating_sub(1)).max();
                end = end.saturating_sub(hold.unwrap_or(0));
                while !visible.is_char_boundary(end) {
                    end -= 1;
                }
            }
            if end > s.printed {
                let _ = stdout.write_all(&visible.as_bytes()[s.printed..end]);
                let _ = stdout.flush();
                s.printed = end;
            }
        }
        control
    })?;
    if let Some(e) = decode_error {
        return Err(e).context("decoding generated tokens");
    }
    for (i, out) in outputs.iter().enumerate() {
        let text = match streams[i].stopped_text.take() {
            Some(t) => t,
            None => tokenizer.decode(&out.tokens, !args.json)?,
        };
        if args.json {
            let line = serde_json::json!({
                "prompt": prompts[i],
                "prompt_tokens": requests[i].prompt_tokens,
                "tokens": out.tokens,
                "text": text,
                "finish_reason": out.finish_reason.as_str(),
            });
            writeln!(stdout, "{line}")?;
        } else if stream_stdout {
            let rest = &text[streams[i].printed.min(text.len())..];
            writeln!(stdout, "{rest}")?;
        } else {
            // A completion continues its prompt; a chat reply stands alone.
            let echo = if args.chat { "" } else { prompts[i].as_str() };
            writeln!(stdout, "### prompt {i}: {}\n{echo}{text}\n", prompts[i])?;
        }
    }
    Ok(())
}
