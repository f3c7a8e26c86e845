//! `te generate`: batched generation with streaming output.

use std::io::Write;

use anyhow::{bail, Context};
use te_engine::sampling::SamplingParams;
use te_engine::{Engine, EngineConfig, Event, FinishReason, Request};
use te_models::context_parallel::ContextParallel;
use te_models::loader::LoadedModel;
use te_ring::Communicator;
use te_tokenizer::chat::ChatMessage;

#[derive(clap::Args)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name (instruct:
    /// smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; base:
    /// gemma3-270m).
    #[arg(long)]
    model: String,
    /// A prompt (repeat for a batch). Without --prompt, --prompt-file or
    /// --prompts-file, a prompt piped on stdin is read.
    #[arg(long)]
    prompt: Vec<String>,
    /// A file whose whole text is one prompt (one final newline dropped);
    /// `-`: stdin. Added after the --prompt ones.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<String>,
    /// A file of prompts, one per non-blank line; `-`: stdin. Added after
    /// the --prompt and --prompt-file ones.
    #[arg(long, value_name = "FILE")]
    prompts_file: Option<String>,
    /// Most tokens to generate per prompt.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Keep generating past EOS.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object per prompt instead of streaming text.
    #[arg(long)]
    json: bool,
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
    /// KV cache capacity in tokens, all sequences together (default: the
    /// model's context, at most 32768). Sequences are admitted as pages
    /// free up and preempted (recomputed later) when they run out.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// Do not share the KV pages of common prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Print run statistics as one JSON object on stderr at the end.
    #[arg(long)]
    stats: bool,
    /// Context parallelism: split every sequence and its KV cache over N
    /// ranks (threads of this process), or `mpi`: one rank per MPI process
    /// (`mpirun -np N te generate --context-parallel mpi ...`, a build with
    /// `--features mpi`; rank 0 prints). --kv-cache-tokens is per rank.
    #[arg(long, value_name = "N|mpi", value_parser = parse_context_parallel)]
    context_parallel: Option<Ranks>,
    #[command(flatten)]
    draft: crate::draft::DraftArgs,
    #[command(flatten)]
    sampling: crate::sampling::SamplingArgs,
    #[command(flatten)]
    device: crate::DeviceArg,
    #[command(flatten)]
    threads: crate::Threads,
}

/// `--context-parallel`: ranks as threads, or one per MPI process.
#[derive(Clone, Copy, Debug)]
enum Ranks {
    Threads(usize),
    Mpi,
}

fn parse_context_parallel(s: &str) -> Result<Ranks, String> {
    if s == "mpi" {
        return Ok(Ranks::Mpi);
    }
    match s.parse::<usize>() {
        Ok(0) | Err(_) => Err(format!(
            "{s:?}: expected a number of ranks (at least 1) or `mpi`"
        )),
        Ok(n) => Ok(Ranks::Threads(n)),
    }
}

/// The text of `--prompt-file`/`--prompts-file` `path` (`-`: stdin).
fn read_text(flag: &str, path: &str) -> anyhow::Result<String> {
    if path == "-" {
        return std::io::read_to_string(std::io::stdin())
            .with_context(|| format!("{flag} -: reading stdin"));
    }
    std::fs::read_to_string(path).with_context(|| format!("{flag}: reading {path}"))
}

/// One final newline (`\n` or `\r\n`) dropped, as an editor ends a file.
fn without_final_newline(text: String) -> String {
    let cut = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .map(str::len);
    match cut {
        Some(n) => text[..n].to_string(),
        None => text,
    }
}

/// The prompts: `--prompt`s, then `--prompt-file`'s whole text, then
/// `--prompts-file`'s non-blank lines; with none of them, stdin when it is
/// not a terminal.
///
/// Errors: a file (or stdin) that cannot be read, no prompt at all, an
/// empty prompt, `-` given to both file flags.
fn prompts(args: &Args) -> anyhow::Result<Vec<String>> {
    use std::io::IsTerminal;
    if args.prompt_file.as_deref() == Some("-") && args.prompts_file.as_deref() == Some("-") {
        bail!("--prompt-file - and --prompts-file - cannot both read stdin");
    }
    let mut prompts = args.prompt.clone();
    if let Some(path) = &args.prompt_file {
        prompts.push(without_final_newline(read_text("--prompt-file", path)?));
    }
    if let Some(path) = &args.prompts_file {
        let text = read_text("--prompts-file", path)?;
        let before = prompts.len();
        prompts.extend(
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string),
        );
        if prompts.len() == before {
            bail!("--prompts-file {path} has no non-empty line");
        }
    }
    if prompts.is_empty() {
        if std::io::stdin().is_terminal() {
            bail!("no prompt given (use --prompt, --prompt-file, --prompts-file, or pipe one on stdin)");
        }
        let text = without_final_newline(read_text("stdin", "-")?);
        if text.trim().is_empty() {
            bail!("no prompt given (use --prompt, --prompt-file, --prompts-file, or pipe one on stdin)");
        }
        prompts.push(text);
    }
    if let Some(i) = prompts.iter().position(String::is_empty) {
        bail!("prompt {i} is empty");
    }
    Ok(prompts)
}

/// What one prompt has produced so far.
#[derive(Default)]
struct Output {
    tokens: Vec<u32>,
    text: String,
    finish_reason: Option<FinishReason>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    args.threads.init()?;
    let prompts = prompts(&args)?;
    if args.stop.iter().any(String::is_empty) {
        bail!("--stop takes a non-empty string");
    }
    if args.max_batch_size == 0 {
        bail!("--max-batch-size must be at least 1");
    }
    if args.kv_cache_tokens == Some(0) {
        bail!("--kv-cache-tokens must be at least 1");
    }
    let sampling = args.sampling.params(&SamplingParams::default())?;
    let mut device = args.device.clone();
    if args.context_parallel.is_some() {
        // Context parallelism runs on the CPU: `auto` means the CPU here.
        if matches!(device.device, te_models::cuda::Device::Cuda(_)) {
            bail!("--context-parallel runs on the CPU only: drop --device (or use --device cpu)");
        }
        device.device = te_models::cuda::Device::Cpu;
    }
    let placed = crate::load_on(&args.model, &device, args.kv_cache_tokens)?;
    let loaded = &placed.loaded;
    let tokenizer = &loaded.tokenizer;
    let mut prompt_tokens = Vec::with_capacity(prompts.len());
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
        prompt_tokens.push(ids);
    }
    if matches!(args.context_parallel, None | Some(Ranks::Threads(1))) {
        crate::interrupt::install()?;
    }
    let job = Job {
        args: &args,
        loaded,
        gpu: placed.gpu.clone(),
        prompts: &prompts,
        prompt_tokens: &prompt_tokens,
        sampling,
    };
    let result = match args.context_parallel {
        None | Some(Ranks::Threads(1)) => job.run(None, true),
        Some(Ranks::Threads(n)) => {
            let comms = te_ring::ThreadComm::ring(n)?;
            let results: Vec<anyhow::Result<()>> = std::thread::scope(|s| {
                let ranks: Vec<_> = comms
                    .into_iter()
                    .map(|comm| {
                        let job = &job;
                        s.spawn(move || {
                            let rank = comm.cp_rank();
                            job.run(Some(Box::new(comm)), rank == 0)
                                .with_context(|| format!("context-parallel rank {rank}"))
                        })
                    })
                    .collect();
                ranks
                    .into_iter()
                    .map(|r| r.join().unwrap_or_else(|_| bail!("a rank panicked")))
                    .collect()
            });
            let errors: Vec<String> = results
                .into_iter()
                .filter_map(|r| r.err().map(|e| format!("{e:#}")))
                .collect();
            if !errors.is_empty() {
                bail!("{}", errors.join("\n"));
            }
            Ok(())
        }
        Some(Ranks::Mpi) => run_mpi(&job),
    };
    // The process exits next, and the system takes its memory back at
    // once: freeing the model piece by piece (a 262k-piece vocabulary's
    // maps, ~50 ms) would only delay the exit.
    std::mem::forget(placed);
    result
}

#[cfg(feature = "mpi")]
fn run_mpi(job: &Job<'_>) -> anyhow::Result<()> {
    let comm = te_ring::MpiComm::world()?;
    let rank = comm.cp_rank();
    job.run(Some(Box::new(comm)), rank == 0)
        .with_context(|| format!("context-parallel rank {rank}"))
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Job<'_>) -> anyhow::Result<()> {
    bail!("--context-parallel mpi: this te was built without MPI (cargo build --release --features mpi)")
}

/// Shortest prompt input (all prompts together, in tokens) that shows a
/// prefill progress bar.
const PROGRESS_MIN_TOKENS: usize = 256;

/// A progress bar on stderr for the prefill of `total` prompt tokens: only
/// when `show`, stdout is a terminal, and the prompts are long enough to
/// take a while. Cleared when the first token comes.
fn prefill_progress(show: bool, total: usize) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !show || total < PROGRESS_MIN_TOKENS || !std::io::stdout().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "prefill {bar:30} {pos}/{len} tokens, {per_sec}, {elapsed}",
        )
        .expect("a valid template"),
    );
    Some(bar)
}

/// One rank's generation: everything `run` resolved.
struct Job<'a> {
    args: &'a Args,
    loaded: &'a LoadedModel,
    /// The model's weights on the GPU the steps run on (`None`: CPU).
    gpu: Option<std::sync::Arc<te_models::cuda::CudaModel>>,
    prompts: &'a [String],
    prompt_tokens: &'a [Vec<u32>],
    sampling: SamplingParams,
}

impl Job<'_> {
    /// Generates every prompt on this rank (`comm`: of a context-parallel
    /// group); `print`: this rank writes the output and notes.
    fn run(&self, comm: Option<Box<dyn Communicator>>, print: bool) -> anyhow::Result<()> {
        let (args, prompts) = (self.args, self.prompts);
        let tokenizer = &self.loaded.tokenizer;
        let config = EngineConfig {
            max_batch_size: args.max_batch_size,
            kv_cache_tokens: args.kv_cache_tokens,
            prefix_caching: !args.no_prefix_caching,
            gpu: self.gpu.clone(),
            ..EngineConfig::default()
        };
        let model = &self.loaded.model;
        // Context parallelism runs without drafting.
        let drafting = match comm {
            Some(_) => crate::draft::Drafting {
                config: None,
                model: None,
                kv_cache_tokens: None,
            },
            None => args.draft.load(self.loaded)?,
        };
        let mut engine = match comm {
            Some(comm) => Engine::with_context_parallel(
                model,
                Some(tokenizer),
                config,
                ContextParallel::new(comm)?,
            )?,
            None => drafting.engine(model, Some(tokenizer), config)?,
        };
        if print {
            let ranks = engine.context_parallel().map_or(1, |cp| cp.cp_size());
            crate::note(format_args!(
                "kv cache: {} tokens{}{}",
                engine.kv_capacity_tokens(),
                if ranks > 1 {
                    format!(" per rank, {ranks} ranks")
                } else {
                    String::new()
                },
                if engine.prefix_caching() {
                    ", prefix caching on"
                } else {
                    ""
                }
            ));
        }
        for (i, ids) in self.prompt_tokens.iter().enumerate() {
            let id = engine
                .add_request(Request {
                    prompt_tokens: ids.clone(),
                    max_new_tokens: args.max_new_tokens,
                    sampling: self.sampling.clone(),
                    ignore_eos: args.ignore_eos,
                    stop: args.stop.clone(),
                    skip_special_tokens: !args.json,
                    constraint: None,
                    cache_salt: None,
                    draft: te_engine::DraftLimits::default(),
                })
                .with_context(|| format!("prompt {i}"))?;
            // Ids are handed out in order from 0.
            debug_assert_eq!(id as usize, i);
        }
        // Stream text only for a single prompt; several are printed whole.
        let stream_stdout = print && !args.json && prompts.len() == 1;
        let mut outputs: Vec<Output> = (0..prompts.len()).map(|_| Output::default()).collect();
        // Only the printing rank takes stdout's lock (other ranks share it).
        let mut stdout = print.then(crate::stdout);
        let start = std::time::Instant::now();
        let total: usize = self.prompt_tokens.iter().map(Vec::len).sum();
        let progress = prefill_progress(print && !args.json, total);
        // Ctrl-C (the handler is installed without context parallelism):
        // the unfinished prompts end now, and what they generated is printed.
        let interruptible = engine.context_parallel().is_none();
        while engine.has_work() {
            if interruptible && crate::interrupt::take() {
                for (i, out) in outputs.iter().enumerate() {
                    if out.finish_reason.is_none() {
                        // A prompt that finished in the last step is no
                        // longer known: nothing to stop.
                        let _ = engine.abort(i as u64);
                    }
                }
            }
            let events = engine.step()?;
            if let Some(bar) = &progress {
                let s = engine.stats();
                let done = (s.prefill_tokens + s.prefix_hit_tokens).min(total);
                bar.set_position(done as u64);
                if done == total || !events.is_empty() {
                    bar.finish_and_clear();
                }
            }
            for event in events {
                let (id, text) = match event {
                    Event::Token {
                        id, token, text, ..
                    } => {
                        outputs[id as usize].tokens.push(token);
                        (id, text)
                    }
                    Event::Finished {
                        id, reason, text, ..
                    } => {
                        outputs[id as usize].finish_reason = Some(reason);
                        (id, text)
                    }
                };
                if let (true, Some(out)) = (stream_stdout, stdout.as_mut()) {
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                }
                outputs[id as usize].text.push_str(&text);
            }
        }
        let wall_s = start.elapsed().as_secs_f64();
        // A collective: every rank takes part.
        let kv_per_rank = engine.kv_per_rank()?;
        let Some(mut stdout) = stdout else {
            return Ok(());
        };
        for (i, out) in outputs.iter().enumerate() {
            let reason = out.finish_reason.map_or("length", FinishReason::as_str);
            if args.json {
                let line = serde_json::json!({
                    "prompt": prompts[i],
                    "prompt_tokens": self.prompt_tokens[i],
                    "tokens": out.tokens,
                    "text": out.text,
                    "finish_reason": reason,
                    "seed": self.sampling.seed,
                });
                writeln!(stdout, "{line}")?;
            } else if stream_stdout {
                writeln!(stdout)?;
            } else {
                // A completion continues its prompt; a chat reply stands alone.
                let echo = if args.chat { "" } else { prompts[i].as_str() };
                writeln!(
                    stdout,
                    "### prompt {i}: {}\n{echo}{}\n",
                    prompts[i], out.text
                )?;
            }
        }
        if args.stats {
            let s = engine.stats();
            let rate = |n: usize, t: f64| if t > 0.0 { n as f64 / t } else { 0.0 };
            let mut line = serde_json::json!({
                "requests": s.requests,
                "prompt_tokens": s.prompt_tokens,
                "prefix_hit_tokens": s.prefix_hit_tokens,
                "generated_tokens": s.generated_tokens,
                "prefill_tokens_per_s": rate(s.prefill_tokens, s.prefill_s),
                "decode_tokens_per_s": rate(s.decode_tokens, s.decode_s),
                "wall_s": wall_s,
                "kv_capacity_tokens": engine.kv_capacity_tokens(),
                "peak_kv_tokens": s.peak_kv_tokens,
                "peak_kv_bytes": s.peak_kv_bytes,
                "preemptions": s.preemptions,
                "seed": self.sampling.seed,
            });
            if args.draft.draft_ngram.is_some() || args.draft.model_draft.is_some() {
                if let (Some(l), serde_json::Value::Object(d)) =
                    (line.as_object_mut(), crate::draft::stats_json(s))
                {
                    l.extend(d);
                }
            }
            if let Some(per_rank) = kv_per_rank {
                let tokens: Vec<usize> = per_rank.iter().map(|r| r.tokens).collect();
                let bytes: Vec<usize> = per_rank.iter().map(|r| r.bytes).collect();
                line["context_parallel"] = serde_json::json!(per_rank.len());
                line["kv_tokens_per_rank"] = serde_json::json!(tokens);
                line["kv_bytes_per_rank"] = serde_json::json!(bytes);
            }
            crate::note(format_args!("{line}"));
        }
        Ok(())
    }
}
