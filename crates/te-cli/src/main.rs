//! `te`: the te-rs command line program.
//!
//! `te chat` holds a conversation in the terminal, `te generate` runs a
//! model on one or more prompts (batched, streaming), `te serve` answers OpenAI-compatible HTTP requests and serves a chat
//! page, `te tokenize` prints token ids, `te inspect` describes a model, `te
//! convert` writes a GGUF file as a Hugging Face directory, `te perplexity`
//! scores a text file, `te bench` measures prompt processing and
//! generation speed in llama-bench's and llama-batched-bench's terms.
//! Commands that compute take `--threads N` (`-t`, [`Threads`]). `--model` takes a GGUF file, a Hugging
//! Face model directory, or a known short name (`smollm2-135m`,
//! `gemma3-270m`) fetched into `$TE_HOME` on first use.

mod bench;
mod chat;
mod convert;
mod draft;
mod generate;
mod inspect;
mod interrupt;
mod perplexity;
mod sampling;
mod serve;
mod tokenize;

use std::io::Write;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "te",
    version,
    about = "te-rs: long-context, many-sequence LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Chat with a model in the terminal (streamed answers, /help for
    /// commands; raw completion for a model without a chat template).
    Chat(chat::Args),
    /// Generate text from one or more prompts (raw completions, or chat
    /// replies with --chat).
    Generate(generate::Args),
    /// Serve the model over an OpenAI-compatible HTTP API, with a chat page at /.
    Serve(serve::Args),
    /// Print the token ids of a text.
    Tokenize(tokenize::Args),
    /// Describe a model: architecture, config, parameters, dtypes, tokenizer, memory.
    Inspect(inspect::Args),
    /// Convert a GGUF file to a Hugging Face model directory.
    Convert(convert::Args),
    /// Perplexity over a text file, in windows like llama.cpp's llama-perplexity.
    Perplexity(perplexity::Args),
    /// Prompt-processing and generation speed, as llama-bench (or
    /// llama-batched-bench with --batched) measures it.
    Bench(bench::Args),
}

fn main() {
    alloc_policy::fixed_mmap_threshold();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Chat(args) => chat::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Bench(args) => bench::run(args),
    };
    if let Err(e) = result {
        // A reader that went away (`te tokenize ... | head -c 1`): exit
        // quietly, as Unix tools do.
        if is_broken_pipe(&e) {
            std::process::exit(1);
        }
        // One line: the error and its causes. Nothing to do if stderr
        // itself cannot be written.
        let _ = writeln!(std::io::stderr(), "error: {e:#}");
        std::process::exit(1);
    }
}

/// Whether `e` (or a cause) is a broken pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Standard output, locked, whose write errors say "writing to stdout"
/// (keeping their kind, so a broken pipe is still recognized). Commands
/// write through it with `writeln!(out, ...)?`: a full disk or a closed
/// pipe becomes an error, never a panic as `println!` gives.
pub struct Stdout(std::io::StdoutLock<'static>);

/// [`Stdout`] for this process.
pub fn stdout() -> Stdout {
    Stdout(std::io::stdout().lock())
}

fn stdout_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("writing to stdout: {e}"))
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf).map_err(stdout_error)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush().map_err(stdout_error)
    }
}

/// A progress note on stderr; a stderr that cannot be written is ignored.
fn note(text: std::fmt::Arguments) {
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// `--threads N` (`-t N`): the threads a computing command uses, for every
/// such command (flatten it into the command's arguments and call
/// [`Threads::init`] first thing).
#[derive(clap::Args, Clone, Debug)]
pub struct Threads {
    /// Compute threads (default: the cores this process may use).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
}

impl Threads {
    /// Sets up the process's compute threads once, before any computation,
    /// and returns their number: one rayon global pool of N threads, on
    /// which every matrix product, attention and norm runs, so at most N
    /// threads compute at a time.
    ///
    /// Errors: `--threads 0`, or a pool that cannot be built (already built,
    /// or the system refuses the threads).
    pub fn init(&self) -> anyhow::Result<usize> {
        let n = match self.threads {
            Some(0) => anyhow::bail!("--threads must be at least 1"),
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| anyhow::anyhow!("--threads {n}: cannot start the thread pool: {e}"))?;
        Ok(n)
    }
}

/// `--device`: where the model computes.
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArg {
    /// Where the model runs: `cpu` (default), `cuda` or `cuda:N` (GPU N:
    /// bf16 weights, KV cache in device memory; needs the NVIDIA driver and
    /// NVRTC, uses cuBLAS when it loads), or `auto` (cuda when a GPU and
    /// the libraries are usable, else cpu). The CUDA path passed its parity
    /// tests on one H200 run; CI does not run it (see docs/ARCHITECTURE.md).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: te_models::cuda::Device,
    /// Decode steps (one token per sequence, at most 128 sequences) replay
    /// a CUDA graph captured once per batch bucket (1, 2, 4, ..., 128; the
    /// batch padded up to it); prefill and mixed steps run launch by
    /// launch. Needs a GPU device (an error with `--device cpu`).
    #[arg(long)]
    pub cuda_graphs: bool,
    #[command(flatten)]
    pub precision: PrecisionArg,
}

/// `--precision`: how the CPU multiplies activations with quantized
/// weights.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct PrecisionArg {
    /// `exact` (default): f32 activations times each weight's exact value,
    /// the reference tests' arithmetic. `int8`: Q4_K and Q6_K matrices
    /// multiply activations rounded to 8 bits per block of 256 with integer
    /// dot products (llama.cpp's arithmetic for these types; other types
    /// stay exact): faster decode on CPUs bound by decoding the weights,
    /// logits moved by the rounding (docs/benchmarks.md gives how much).
    /// A row's logits stay bit-identical in any batch. CPU only.
    #[arg(long, default_value = "exact", value_parser = parse_precision)]
    pub precision: te_kernels::matmul::Precision,
}

fn parse_precision(s: &str) -> Result<te_kernels::matmul::Precision, String> {
    match s {
        "exact" => Ok(te_kernels::matmul::Precision::Exact),
        "int8" => Ok(te_kernels::matmul::Precision::Int8),
        _ => Err(format!("`{s}` is not a precision: use exact or int8")),
    }
}

fn parse_device(s: &str) -> Result<te_models::cuda::Device, String> {
    te_models::cuda::Device::parse(s).map_err(|e| e.to_string())
}

/// [`load`], then the model moved to `device.device` (a note says where,
/// which GEMM the GPU uses and whether decode steps use CUDA graphs).
/// The GPU is opened before the weights are read, so a missing library or
/// device fails at once.
/// On a GPU the RoPE tables cover `context` positions (the run's KV
/// capacity; `None`: the engine's default for the model).
/// Errors: the GPU (named), `--cuda-graphs` without a GPU.
fn load_on(spec: &str, device: &DeviceArg, context: Option<usize>) -> anyhow::Result<Placed> {
    if device.cuda_graphs && device.device == te_models::cuda::Device::Cpu {
        anyhow::bail!("--cuda-graphs needs a GPU: use --device cuda[:N] (not --device cpu)");
    }
    let gpu = device.device.open()?;
    if device.cuda_graphs && gpu.is_none() {
        anyhow::bail!("--cuda-graphs needs a GPU: --device auto found none");
    }
    let precision = device.precision.precision;
    if gpu.is_some() && precision != te_kernels::matmul::Precision::Exact {
        anyhow::bail!(
            "--precision int8 is a CPU mode: use --device cpu, or leave --precision exact"
        );
    }
    let loaded = load(spec, precision)?;
    let gpu = match gpu {
        None => None,
        Some(cuda) => {
            let positions = context
                .unwrap_or_else(|| te_engine::Engine::default_kv_cache_tokens(&loaded.model));
            let mut cm = te_models::cuda::CudaModel::upload(&loaded.model, cuda, positions)?;
            cm.set_graphs(device.cuda_graphs);
            note(format_args!(
                "running on cuda:{} (GEMM: {:?}{})",
                cm.ordinal(),
                cm.gemm_backend(),
                if device.cuda_graphs {
                    ", CUDA graphs for decode steps"
                } else {
                    ""
                }
            ));
            Some(std::sync::Arc::new(cm))
        }
    };
    Ok(Placed { loaded, gpu })
}

/// A loaded model, and its weights on the GPU its steps run on (`None`:
/// the CPU; set as the engines' `EngineConfig::gpu`).
pub(crate) struct Placed {
    pub loaded: te_models::loader::LoadedModel,
    pub gpu: Option<std::sync::Arc<te_models::cuda::CudaModel>>,
}

/// Resolves and loads `--model`, reporting progress on stderr, its
/// matrices set to multiply in `precision` on the CPU.
fn load(
    spec: &str,
    precision: te_kernels::matmul::Precision,
) -> anyhow::Result<te_models::loader::LoadedModel> {
    let source = te_models::source::resolve_model(spec)?;
    let start = std::time::Instant::now();
    let mut loaded = te_models::loader::load_model(&source)?;
    loaded.model.weights.set_precision(precision);
    alloc_policy::release_free_memory();
    note(format_args!(
        "loaded {} ({}, {} layers) in {:.1} s",
        spec,
        loaded.model.config.architecture.name(),
        loaded.model.config.num_hidden_layers,
        start.elapsed().as_secs_f64()
    ));
    Ok(loaded)
}

/// glibc malloc settings that keep the resident memory of a loaded model
/// down (no-ops with other C libraries).
///
/// Loading a model allocates and frees many large buffers (the GGUF
/// metadata, the tokenizer's vocabulary and merges). glibc serves a large
/// allocation from its own `mmap` until one such map is freed; then it
/// raises its threshold (up to 32 MiB) and carves later large buffers
/// (KV pool pages, scratch) out of the heap, reusing freed pages that
/// `calloc` must zero, so they become resident. Gemma 3 270M measured
/// ~100 MiB more peak RSS that way.
mod alloc_policy {
    /// Keeps glibc's mmap threshold at its 128 KiB default for good.
    pub(crate) fn fixed_mmap_threshold() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes malloc's parameters; called before
        // any other thread starts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        }
    }

    /// Returns the heap pages freed while loading to the system.
    pub(crate) fn release_free_memory() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only releases free memory; thread safe.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// README.md against the command definition: its `te ...` commands parse,
/// and every long option of every subcommand is documented.
#[cfg(test)]
mod readme {
    use clap::CommandFactory;

    fn readme() -> String {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        std::fs::read_to_string(path).expect("README.md")
    }

    /// Shell words of `line` (quotes removed; a `#` outside quotes starts a
    /// comment).
    fn words(line: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut word: Option<String> = None;
        let mut quote: Option<char> = None;
        for c in line.chars() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), c) => word.get_or_insert_with(String::new).push(c),
                (None, '\'' | '"') => {
                    quote = Some(c);
                    word.get_or_insert_with(String::new);
                }
                (None, '#') if word.is_none() => break,
                (None, c) if c.is_whitespace() => out.extend(word.take()),
                (None, c) => word.get_or_insert_with(String::new).push(c),
            }
        }
        out.extend(word);
        out
    }

    /// The `te ...` command lines of the README's shell code blocks, with
    /// `\` continuations joined.
    fn commands(text: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut in_block = false;
        let mut pending = String::new();
        for line in text.lines() {
            if line.starts_with("```") {
                in_block = !in_block && (line == "```sh" || line == "```bash");
                continue;
            }
            if !in_block {
                continue;
            }
            let line = line.trim();
            if let Some(head) = line.strip_suffix('\\') {
                pending.push_str(head);
                continue;
            }
            let full = std::mem::take(&mut pending) + line;
            if full.starts_with("te ") {
                out.push(full);
            }
        }
        out
    }

    #[test]
    fn readme_commands_parse() {
        let text = readme();
        let commands = commands(&text);
        assert!(commands.len() > 20, "found only {commands:?}");
        for c in commands {
            // A pipe's later commands are not te's.
            let c = c.split(" | ").next().unwrap_or_default();
            if let Err(e) = super::Cli::command().try_get_matches_from(words(c)) {
                panic!("README.md: `{c}` does not parse:\n{e}");
            }
        }
    }

    #[test]
    fn every_option_is_in_the_readme() {
        let text = readme();
        let mut missing = Vec::new();
        for sub in super::Cli::command().get_subcommands() {
            for arg in sub.get_arguments() {
                if let Some(long) = arg.get_long() {
                    if long != "help" && !text.contains(&format!("--{long}")) {
                        missing.push(format!("te {} --{long}", sub.get_name()));
                    }
                }
            }
        }
        assert!(
            missing.is_empty(),
            "README.md does not document {missing:?}"
        );
    }

    #[test]
    fn words_split_like_a_shell() {
        assert_eq!(
            words(r#"te a "b c" 'd "e"' f # g"#),
            ["te", "a", "b c", "d \"e\"", "f"]
        );
    }
}
