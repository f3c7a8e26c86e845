//! `te bench`: prompt-processing and generation speed through the engine,
//! in llama.cpp's terms, so the figures compare one to one.
//!
//! **llama-bench mode** (default): one test per `-p N` and per `-n N`.
//! - `ppN`: one N-token prompt prefilled from an empty cache; the time is
//!   the prefill (up to and including the first token's logits and pick).
//! - `tgN`: N tokens generated one at a time from an empty cache: a 1-token
//!   prompt and N forward passes of one token (llama-bench's `test_gen`
//!   decodes N single tokens at positions 0..N).
//! - Each test runs once as warm-up (the whole prompt for pp, one token for
//!   tg, as llama-bench), then `-r` times, timed;
//!   `samples_ts[i] = (n_prompt + n_gen) / samples_ns[i]`, and
//!   `avg_ts`/`stddev_ts` are their mean and sample standard deviation
//!   (n - 1), as llama-bench reports them.
//!
//! **llama-batched-bench mode** (`--batched`): for every `(pp, tg, pl)`:
//! `pl` prompts of `pp` tokens prefilled together, then `tg` decode steps
//! of `pl` tokens (one per sequence). `t_pp` is the time until every
//! sequence has its first token, `t_tg` the rest; `speed_pp = pl*pp/t_pp`,
//! `speed_tg = pl*tg/t_tg`, `t = t_pp + t_tg`, `speed = pl*(pp+tg)/t`,
//! `n_kv = pl*(pp+tg)`. One run per configuration, as
//! llama-batched-bench, after one untimed warm-up step of the largest
//! shape the runs take (the largest `pl` prompts of the prefill chunk
//! together, and their first token): the engine's buffers and KV pages
//! grow on first use, where llama.cpp's context reserves its buffers when
//! it is created, so without it the first configuration paid for the
//! growth (Gemma 3's pp 128 at pl 1 measured ~0.6x its llama-bench
//! pp128). The warm-up costs one prefill of `pl * min(pp, 2048)` tokens,
//! for the largest `pl` and `pp`. With `--cuda-graphs` also one short
//! untimed run at each `pl`, so its decode graph is captured before the
//! timed runs.
//!
//! Prompts are fixed synthetic token ids (a seeded generator over the
//! vocabulary, BOS first when the model adds one, different for each
//! sequence), the same for every run; requests ignore EOS; prefix caching
//! is off; the KV pool holds exactly what the test needs. The engine runs
//! without a tokenizer (no text decoding).

use std::io::Write;
use std::time::Instant;

use crate::draft::Drafting;
use anyhow::{bail, Context};
use te_engine::sampling::SamplingParams;
use te_engine::{Engine, EngineConfig, Event, Request};
use te_models::model::Model;

/// Most tokens one step feeds in llama-bench mode: llama-bench's default
/// `n_batch`.
const N_BATCH: usize = 2048;

/// Tokens of the prompts the cuda-graph captures run (llama-batched-bench's
/// warm-up prompt length).
const WARMUP_TOKENS: usize = 16;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF file, Hugging Face directory, or known model name.
    #[arg(short = 'm', long)]
    model: String,
    /// Prompt lengths, one pp test each (comma-separated or repeated;
    /// default 512; 0: no pp test, as llama-bench's `-p 0`).
    #[arg(short = 'p', long = "n-prompt")]
    n_prompt: Vec<String>,
    /// Generation lengths, one tg test each (comma-separated or repeated;
    /// default 128; 0: no tg test, as llama-bench's `-n 0`).
    #[arg(short = 'n', long = "n-gen")]
    n_gen: Vec<String>,
    /// Timed repetitions of each test (after one warm-up run).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    repetitions: usize,
    /// Output: md (default), json (an array, llama-bench), or jsonl (one
    /// object per line; the only structured form with --batched).
    #[arg(short = 'o', long = "output", default_value = "md")]
    output: String,
    /// llama-batched-bench mode: many sequences prefilled and decoded together.
    #[arg(long)]
    batched: bool,
    /// With --batched: prompt lengths (comma-separated).
    #[arg(long)]
    npp: Vec<String>,
    /// With --batched: tokens generated per sequence (comma-separated).
    #[arg(long)]
    ntg: Vec<String>,
    /// With --batched: numbers of parallel sequences (comma-separated).
    #[arg(long)]
    npl: Vec<String>,
    #[command(flatten)]
    draft: crate::draft::DraftArgs,
    #[command(flatten)]
    device: crate::DeviceArg,
    #[command(flatten)]
    threads: crate::Threads,
}

/// Output formats.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Format {
    Md,
    Json,
    Jsonl,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let format = match args.output.as_str() {
        "md" => Format::Md,
        "json" => Format::Json,
        "jsonl" => Format::Jsonl,
        other => bail!("-o {other}: expected md, json or jsonl"),
    };
    if args.batched {
        if !args.n_prompt.is_empty() || !args.n_gen.is_empty() {
            bail!("-p/-n are for llama-bench mode; with --batched use --npp, --ntg and --npl");
        }
        if format == Format::Json {
            bail!("-o json: --batched writes md or jsonl (as llama-batched-bench)");
        }
        let npp = parse_list("--npp", &args.npp, None, false)?;
        let ntg = parse_list("--ntg", &args.ntg, None, false)?;
        let npl = parse_list("--npl", &args.npl, None, false)?;
        let threads = args.threads.init()?;
        // The RoPE positions a GPU run needs: the longest sequence, or the
        // warm-up's.
        let longest = npp.iter().max().unwrap_or(&0) + ntg.iter().max().unwrap_or(&0) + 1;
        let context = longest.max(WARMUP_TOKENS + 1);
        let placed = crate::load_on(&args.model, &args.device, Some(context))?;
        let drafting = args.draft.load(&placed.loaded)?;
        batched(&placed, &npp, &ntg, &npl, threads, format, &drafting)
    } else {
        if !args.npp.is_empty() || !args.ntg.is_empty() || !args.npl.is_empty() {
            bail!("--npp/--ntg/--npl need --batched");
        }
        // As llama-bench: a length of 0 names no test.
        let n_prompt = parse_list("-p", &args.n_prompt, Some(512), true)?;
        let n_gen = parse_list("-n", &args.n_gen, Some(128), true)?;
        if n_prompt.iter().chain(&n_gen).all(|&n| n == 0) {
            bail!("-p and -n are all 0: no test to run");
        }
        if args.repetitions == 0 {
            bail!("-r must be at least 1");
        }
        let threads = args.threads.init()?;
        let source = te_models::source::resolve_model(&args.model)?;
        let info = te_models::inspect::inspect(&source)?;
        // The RoPE positions a GPU run needs (see `test_engine`).
        let context = n_prompt.iter().max().unwrap_or(&0).max(&1)
            + n_gen.iter().max().unwrap_or(&0).max(&1)
            + 1;
        let placed = crate::load_on(&args.model, &args.device, Some(context))?;
        let drafting = args.draft.load(&placed.loaded)?;
        let desc = ModelDesc::new(&source, &info);
        let tests: Vec<(usize, usize)> = n_prompt
            .iter()
            .map(|&p| (p, 0))
            .chain(n_gen.iter().map(|&n| (0, n)))
            .filter(|&t| t != (0, 0))
            .collect();
        single(
            &placed,
            &desc,
            &tests,
            args.repetitions,
            threads,
            format,
            &drafting,
        )
    }
}

/// A comma-separated (or repeated) list of positive integers (or zeros,
/// with `zero`); `default` when the option was not given at all.
fn parse_list(
    flag: &str,
    given: &[String],
    default: Option<usize>,
    zero: bool,
) -> anyhow::Result<Vec<usize>> {
    if given.is_empty() {
        return match default {
            Some(d) => Ok(vec![d]),
            None => bail!("{flag} is required (a comma-separated list of positive integers)"),
        };
    }
    let what = if zero {
        "non-negative integer"
    } else {
        "positive integer"
    };
    let mut out = Vec::new();
    for part in given.iter().flat_map(|g| g.split(',')) {
        let part = part.trim();
        if part.is_empty() {
            bail!("{flag}: empty list entry (expected one {what} per comma-separated entry)");
        }
        match part.parse::<usize>() {
            Ok(0) if !zero => bail!("{flag}: 0 is not allowed (at least 1)"),
            Ok(v) => out.push(v),
            Err(_) => bail!("{flag}: `{part}` is not a {what}"),
        }
    }
    Ok(out)
}

/// What llama-bench says about the model.
struct ModelDesc {
    filename: String,
    /// `"<architecture> <parameters> <main weight type>"`, like
    /// llama.cpp's model description (`llama 135M Q4_1`).
    model_type: String,
    /// Bytes of tensor data as stored.
    size: u64,
    n_params: u64,
}

impl ModelDesc {
    fn new(source: &te_models::source::ModelSource, info: &te_models::inspect::ModelInfo) -> Self {
        let path = source.path();
        // The weight type most tensors have, leaving out the f32 norms.
        let main_type = info
            .tensor_dtypes
            .iter()
            .filter(|(t, _)| t.as_str() != "F32")
            .max_by_key(|(_, &n)| n)
            .map_or("F32", |(t, _)| t.as_str());
        let p = info.parameters as f64;
        let params = if p >= 1e9 {
            format!("{:.0}B", p / 1e9)
        } else {
            format!("{:.0}M", p / 1e6)
        };
        ModelDesc {
            filename: path.display().to_string(),
            model_type: format!("{} {params} {main_type}", info.config.architecture.name()),
            size: info.weights_stored_bytes,
            n_params: info.parameters,
        }
    }
}

/// Fixed synthetic prompt number `seq` of `n` tokens: BOS first when the
/// model adds one, then ids from a seeded generator (SplitMix64) over the
/// vocabulary.
fn synthetic_prompt(seq: u64, n: usize, vocab: usize, bos: Option<u32>) -> Vec<u32> {
    let mut state = 0x5eed_u64 ^ seq.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|i| match (i, bos) {
            (0, Some(b)) => b,
            _ => (next() % vocab as u64) as u32,
        })
        .collect()
}

/// The BOS id when the tokenizer adds one to a prompt.
fn added_bos(tokenizer: &te_tokenizer::tokenizer::Tokenizer) -> Option<u32> {
    let bos = tokenizer.bos_id()?;
    let with = tokenizer.encode("a", true).ok()?;
    (with.first() == Some(&bos)).then_some(bos)
}

fn request(prompt: Vec<u32>, max_new_tokens: usize) -> Request {
    Request {
        prompt_tokens: prompt,
        max_new_tokens,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        stop: Vec::new(),
        skip_special_tokens: true,
        constraint: None,
        cache_salt: None,
        draft: te_engine::DraftLimits::default(),
    }
}

/// Runs the engine until it is idle; returns the seconds from the first
/// step until every one of `n_seqs` sequences has had its first token, and
/// from then to the end.
fn run_timed(engine: &mut Engine, n_seqs: usize) -> anyhow::Result<(f64, f64)> {
    // The requests just added hold the last n_seqs ids (ids count up from 0).
    let id0 = engine.stats().requests - n_seqs;
    let mut first = vec![false; n_seqs];
    let mut have_first = 0;
    let start = Instant::now();
    let mut t_first = None;
    while engine.has_work() {
        for event in engine.step()? {
            if let Event::Token { id, .. } = event {
                let slot = (id as usize)
                    .checked_sub(id0)
                    .and_then(|i| first.get_mut(i))
                    .context("event of an unknown request")?;
                if !*slot {
                    *slot = true;
                    have_first += 1;
                }
            }
        }
        if t_first.is_none() && have_first == n_seqs {
            t_first = Some(start.elapsed().as_secs_f64());
        }
    }
    let total = start.elapsed().as_secs_f64();
    let t_first = t_first.context("a sequence ended without a token")?;
    Ok((t_first, total - t_first))
}

/// The model's context check for a test needing `tokens` positions.
fn check_context(model: &Model, tokens: usize, what: &str) -> anyhow::Result<()> {
    let ctx = model.config.max_position_embeddings;
    if tokens > ctx {
        bail!("{what} needs {tokens} positions, more than the model's context of {ctx}");
    }
    Ok(())
}

/// One llama-bench result.
struct TestResult {
    n_prompt: usize,
    n_gen: usize,
    samples_ns: Vec<u64>,
}

impl TestResult {
    fn samples_ts(&self) -> Vec<f64> {
        let n = (self.n_prompt + self.n_gen) as f64;
        self.samples_ns
            .iter()
            .map(|&ns| 1e9 * n / ns.max(1) as f64)
            .collect()
    }

    fn name(&self) -> String {
        match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, n) => format!("tg{n}"),
            (p, n) => format!("pp{p}+tg{n}"),
        }
    }
}

/// Mean and sample standard deviation (n - 1; 0 for one sample).
fn mean_stddev(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / n;
    if v.len() == 1 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// The engine for one llama-bench test: one sequence, a KV pool that
/// holds it, steps of up to [`N_BATCH`] tokens. The warm-up and every
/// repetition of the test reuse it (llama-bench reuses its context), so
/// the timed runs find their buffers allocated and touched.
fn test_engine<'m>(
    placed: &'m crate::Placed,
    n_prompt: usize,
    n_gen: usize,
    drafting: &'m Drafting,
) -> anyhow::Result<Engine<'m>> {
    let config = EngineConfig {
        max_batch_size: 1,
        prefill_chunk: N_BATCH,
        max_step_tokens: N_BATCH,
        kv_cache_tokens: Some(n_prompt.max(1) + n_gen.max(1) + 1),
        prefix_caching: false,
        gpu: placed.gpu.clone(),
        ..EngineConfig::default()
    };
    drafting.engine(&placed.loaded.model, None, config)
}

/// One timed run, in ns: `n_prompt` prompt tokens and their first token
/// (pp), or a 1-token prompt and `n_gen` tokens (tg; the 1-token prompt's
/// pass is the first of the `n_gen`).
fn measure(
    engine: &mut Engine,
    bos: Option<u32>,
    n_prompt: usize,
    n_gen: usize,
) -> anyhow::Result<u64> {
    let (prompt_len, new_tokens) = if n_prompt > 0 {
        (n_prompt, 1)
    } else {
        (1, n_gen)
    };
    let prompt = synthetic_prompt(0, prompt_len, engine.model().config.vocab_size, bos);
    engine
        .add_request(request(prompt, new_tokens))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (t_first, t_rest) = run_timed(engine, 1)?;
    Ok(((t_first + t_rest) * 1e9).round() as u64)
}

fn single(
    placed: &crate::Placed,
    desc: &ModelDesc,
    tests: &[(usize, usize)],
    reps: usize,
    threads: usize,
    format: Format,
    drafting: &Drafting,
) -> anyhow::Result<()> {
    let (model, tokenizer) = (&placed.loaded.model, &placed.loaded.tokenizer);
    for &(p, n) in tests {
        if p > 0 {
            check_context(model, p + 1, &format!("pp{p}"))?;
        } else {
            check_context(model, n + 1, &format!("tg{n}"))?;
        }
    }
    let bos = added_bos(tokenizer);
    let mut out = crate::stdout();
    match format {
        Format::Md => {
            writeln!(
                out,
                "| model | size | params | backend | threads | test | t/s |"
            )?;
            writeln!(out, "| --- | ---: | ---: | --- | ---: | ---: | ---: |")?;
        }
        Format::Json => writeln!(out, "[")?,
        Format::Jsonl => {}
    }
    out.flush()?;
    let cpu = cpu_info();
    // llama-bench's backend names.
    let backend = if placed.gpu.is_some() { "CUDA" } else { "CPU" };
    for (i, &(n_prompt, n_gen)) in tests.iter().enumerate() {
        let mut engine = test_engine(placed, n_prompt, n_gen, drafting)?;
        // Warm-up: the whole prompt for pp, one token for tg (llama-bench).
        if n_prompt > 0 {
            measure(&mut engine, bos, n_prompt, 0)?;
        } else {
            measure(&mut engine, bos, 0, 1)?;
        }
        let test_time = utc_now();
        let mut r = TestResult {
            n_prompt,
            n_gen,
            samples_ns: Vec::with_capacity(reps),
        };
        for _ in 0..reps {
            r.samples_ns
                .push(measure(&mut engine, bos, n_prompt, n_gen)?);
        }
        let ts = r.samples_ts();
        let (avg_ts, stddev_ts) = mean_stddev(&ts);
        let ns: Vec<f64> = r.samples_ns.iter().map(|&x| x as f64).collect();
        let (avg_ns, stddev_ns) = mean_stddev(&ns);
        crate::note(format_args!(
            "{}: {avg_ts:.2} ± {stddev_ts:.2} t/s",
            r.name()
        ));
        match format {
            Format::Md => writeln!(
                out,
                "| {} | {:.2} MiB | {:.2} M | {backend} | {threads} | {} | {avg_ts:.2} ± {stddev_ts:.2} |",
                desc.model_type,
                desc.size as f64 / (1024.0 * 1024.0),
                desc.n_params as f64 / 1e6,
                r.name()
            )?,
            Format::Json | Format::Jsonl => {
                let obj = serde_json::json!({
                    "build_commit": concat!("te-rs ", env!("CARGO_PKG_VERSION")),
                    "cpu_info": cpu,
                    "backends": backend,
                    "model_filename": desc.filename,
                    "model_type": desc.model_type,
                    "model_size": desc.size,
                    "model_n_params": desc.n_params,
                    "n_batch": N_BATCH,
                    "n_threads": threads,
                    "type_k": "f32",
                    "type_v": "f32",
                    "n_prompt": n_prompt,
                    "n_gen": n_gen,
                    "n_depth": 0,
                    "test_time": test_time,
                    "avg_ns": avg_ns.round() as u64,
                    "stddev_ns": stddev_ns.round() as u64,
                    "avg_ts": avg_ts,
                    "stddev_ts": stddev_ts,
                    "samples_ns": r.samples_ns,
                    "samples_ts": ts,
                });
                if format == Format::Json {
                    let sep = if i + 1 < tests.len() { "," } else { "" };
                    writeln!(out, "  {obj}{sep}")?;
                } else {
                    writeln!(out, "{obj}")?;
                }
            }
        }
        out.flush()?;
    }
    if format == Format::Json {
        writeln!(out, "]")?;
    }
    Ok(())
}

fn batched(
    placed: &crate::Placed,
    npp: &[usize],
    ntg: &[usize],
    npl: &[usize],
    threads: usize,
    format: Format,
    drafting: &Drafting,
) -> anyhow::Result<()> {
    let (model, tokenizer) = (&placed.loaded.model, &placed.loaded.tokenizer);
    for &pp in npp {
        for &tg in ntg {
            check_context(model, pp + tg + 1, &format!("--npp {pp} --ntg {tg}"))?;
        }
    }
    let bos = added_bos(tokenizer);
    let vocab = model.config.vocab_size;
    let page = EngineConfig::default().page_size;
    // One engine for every configuration (llama-batched-bench keeps one
    // context): room for the largest batch, every prompt prefilled in the
    // same steps (chunks of at most N_BATCH tokens per sequence, all
    // sequences in one step, so no sequence decodes while another is still
    // prefilling), and a KV pool for the largest pl * (pp + tg) (each
    // sequence caches pp + tg tokens: its last token is picked, never fed;
    // whole pages per sequence).
    let max_pl = *npl.iter().max().expect("--npl is not empty");
    let chunk = npp
        .iter()
        .max()
        .expect("--npp is not empty")
        .min(&N_BATCH)
        .to_owned();
    let per_seq = |pp: usize, tg: usize| (pp + tg + 1).div_ceil(page) * page;
    let kv = npp
        .iter()
        .flat_map(|&pp| ntg.iter().map(move |&tg| per_seq(pp, tg)))
        .max()
        .expect("lists are not empty")
        * max_pl;
    let config = EngineConfig {
        max_batch_size: max_pl,
        prefill_chunk: chunk,
        max_step_tokens: (max_pl * chunk).max(N_BATCH),
        kv_cache_tokens: Some(kv.max(per_seq(WARMUP_TOKENS, 1))),
        prefix_caching: false,
        gpu: placed.gpu.clone(),
        ..EngineConfig::default()
    };
    let n_batch = config.max_step_tokens;
    let mut engine = drafting.engine(model, None, config)?;
    // Warm-up: the largest step (max_pl prompts of one prefill chunk) and
    // their first token (see the module doc).
    for s in 0..max_pl {
        engine
            .add_request(request(synthetic_prompt(s as u64, chunk, vocab, bos), 1))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    run_timed(&mut engine, max_pl)?;
    if placed.gpu.as_ref().is_some_and(|g| g.graphs()) {
        let warmup = WARMUP_TOKENS.min(model.config.max_position_embeddings - 1);
        // Each batch size's decode graph is captured here rather than in a
        // timed run (a page table that outgrows the width it was captured
        // with is still captured again inside one).
        for &pl in npl {
            for s in 0..pl {
                engine
                    .add_request(request(synthetic_prompt(s as u64, warmup, vocab, bos), 3))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
            }
            run_timed(&mut engine, pl)?;
        }
    }
    let mut out = crate::stdout();
    if format == Format::Md {
        writeln!(
            out,
            "| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |"
        )?;
        writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        out.flush()?;
    }
    for &pp in npp {
        for &tg in ntg {
            for &pl in npl {
                let before = engine.stats().clone();
                for s in 0..pl {
                    engine
                        .add_request(request(synthetic_prompt(s as u64, pp, vocab, bos), tg + 1))
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                }
                let (t_pp, t_tg) = run_timed(&mut engine, pl)?;
                let stats = engine.stats();
                if stats.preemptions > before.preemptions {
                    bail!("pp {pp} tg {tg} pl {pl}: the engine preempted sequences (KV pool too small)");
                }
                if stats.generated_tokens - before.generated_tokens != pl * (tg + 1) {
                    bail!(
                        "pp {pp} tg {tg} pl {pl}: generated {} tokens, expected {}",
                        stats.generated_tokens - before.generated_tokens,
                        pl * (tg + 1)
                    );
                }
                let n_kv = pl * (pp + tg);
                let t = t_pp + t_tg;
                let speed_pp = (pl * pp) as f64 / t_pp;
                let speed_tg = (pl * tg) as f64 / t_tg;
                let speed = n_kv as f64 / t;
                crate::note(format_args!(
                    "pp {pp} tg {tg} pl {pl}: prefill {speed_pp:.2} t/s, generation {speed_tg:.2} t/s"
                ));
                match format {
                    Format::Md => writeln!(
                        out,
                        "| {pp} | {tg} | {pl} | {n_kv} | {t_pp:.3} | {speed_pp:.2} | {t_tg:.3} | {speed_tg:.2} | {t:.3} | {speed:.2} |"
                    )?,
                    _ => {
                        let obj = serde_json::json!({
                            "n_kv_max": engine.kv_capacity_tokens(),
                            "n_batch": n_batch,
                            "is_pp_shared": 0,
                            "n_threads": threads,
                            "n_threads_batch": threads,
                            "pp": pp,
                            "tg": tg,
                            "pl": pl,
                            "n_kv": n_kv,
                            "t_pp": t_pp,
                            "speed_pp": speed_pp,
                            "t_tg": t_tg,
                            "speed_tg": speed_tg,
                            "t": t,
                            "speed": speed,
                        });
                        writeln!(out, "{obj}")?;
                    }
                }
                out.flush()?;
            }
        }
    }
    Ok(())
}

/// The CPU's model name from /proc/cpuinfo (empty elsewhere).
fn cpu_info() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ` (llama-bench's `test_time`).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_reject_bad_entries() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse_list("-p", &s(&["128,512"]), Some(1), true).unwrap(),
            [128, 512]
        );
        assert_eq!(
            parse_list("-p", &s(&["1", "2"]), None, false).unwrap(),
            [1, 2]
        );
        assert_eq!(parse_list("-p", &[], Some(512), true).unwrap(), [512]);
        assert_eq!(parse_list("-n", &s(&["0,4"]), None, true).unwrap(), [0, 4]);
        assert!(parse_list("--npl", &[], None, false).is_err());
        assert!(parse_list("--npl", &s(&[""]), None, false).is_err());
        assert!(parse_list("--npl", &s(&["0"]), None, false).is_err());
        assert!(parse_list("-p", &s(&["1,,2"]), None, true).is_err());
        assert!(parse_list("-p", &s(&["x"]), None, true).is_err());
    }

    #[test]
    fn stddev_is_the_sample_one() {
        let (m, s) = mean_stddev(&[1.0, 2.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((s - 1.0).abs() < 1e-12);
        assert_eq!(mean_stddev(&[5.0]), (5.0, 0.0));
    }

    #[test]
    fn synthetic_prompts_are_fixed_and_in_range() {
        let a = synthetic_prompt(3, 50, 100, Some(7));
        assert_eq!(a, synthetic_prompt(3, 50, 100, Some(7)));
        assert_ne!(a, synthetic_prompt(4, 50, 100, Some(7)));
        assert_eq!(a[0], 7);
        assert!(a.iter().all(|&t| t < 100));
    }
}
