//! `cargo xtask bench --vs-llama-cpp [--threads N] [--rounds R] [--model
//! NAME]...`: te-rs against llama.cpp on the same GGUF files, the same
//! threads, in one run.
//!
//! For each model ([`MODELS`], or those `--model` names), in `R` rounds (default 3), each round alternating
//! which engine goes first: llama.cpp's `llama-bench -p 128,512 -n 64 -r 3
//! -o json` and `te bench` with the same arguments; `llama-batched-bench
//! -npp 128 -ntg 128 -npl 1,8,32 --output-format jsonl` and `te bench
//! --batched` with the same; then once the peak resident memory
//! (`/usr/bin/time -f %M`) of a short greedy completion,
//! `llama-completion` against `te generate`, same file, same context; then
//! the time to first token of a 5-token prompt, as the wall time from
//! start to exit of a one-token completion (model load included), median
//! of [`TTFT_RUNS`] runs each, alternating. Before each model's runs it
//! measures the machine's limits ([`crate::bench_limits`]): read bandwidth
//! over as many bytes as a generated token reads, and the f32 FMA peak;
//! each throughput row states the share of its limit both engines reach
//! (tg: weight bytes per second over the read bandwidth; pp and batched tg
//! with more than one sequence: FLOP per second over the FMA peak, 2 per
//! multiply-add of the matrices' weights, attention not counted).
//! Prints one markdown table with every figure and its ratio (te-rs /
//! llama.cpp) and a table of the limits, for docs/benchmarks.md; the
//! header names llama.cpp's build flags ([`crate::peers::LlamaCpp::flags`]): with one round llama-bench's `avg ±
//! stddev`, with more each engine's median over the rounds and its range,
//! and the ratio of the medians. The rounds interleave the two engines
//! over the run's minutes: on a shared machine the others' load comes and
//! goes over minutes, and a single pair of runs could put one engine in a
//! quiet minute and the other in a busy one (one te-rs repetition of
//! Gemma 3's pp512 at half speed moved its ratio from ~1.2x to 1.08x).
//! llama.cpp comes from `cargo xtask peers` (built on first use); `te` is
//! built here. Not part of CI.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use serde_json::Value;

use crate::bench_limits::TokenCost;

/// The models compared by default.
const MODELS: [&str; 3] = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b"];

/// llama-bench's tests, and its repetitions.
const N_PROMPT: &str = "128,512";
const N_GEN: &str = "64";
const REPS: &str = "3";

/// llama-batched-bench's configuration.
const NPP: usize = 128;
const NTG: usize = 128;
const NPL: [usize; 3] = [1, 8, 32];

/// Context (KV tokens) and length of the memory run.
const MEM_CTX: usize = 4096;
const MEM_NEW_TOKENS: usize = 16;
const MEM_PROMPT: &str = "The capital of France is";

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut threads = 2usize;
    let mut rounds = 3usize;
    let mut models: Vec<String> = Vec::new();
    let mut precision = "exact".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--vs-llama-cpp" => {}
            "--threads" | "-t" => threads = positive(a, it.next())?,
            "--rounds" => rounds = positive(a, it.next())?,
            "--precision" => precision = crate::precision_arg("--vs-llama-cpp", it.next())?,
            "--model" | "-m" => match it.next() {
                Some(m) if MODELS.contains(&m.as_str()) => models.push(m.clone()),
                other => bail!(
                    "bench --vs-llama-cpp: --model takes one of {} (got {other:?})",
                    MODELS.join(", ")
                ),
            },
            other => bail!(
                "bench --vs-llama-cpp: unknown argument `{other}` (takes --threads N, --rounds R, \
                 --model NAME, --precision exact|int8)"
            ),
        }
    }
    if !Path::new("/usr/bin/time").is_file() {
        bail!("/usr/bin/time is missing (the memory comparison needs it): apt-get install -y time");
    }
    let llama = crate::peers::ensure_llama_cpp()?;
    let te = crate::build_te(&[])?;
    if models.is_empty() {
        models = MODELS.iter().map(|m| m.to_string()).collect();
    }
    let names: Vec<&str> = models.iter().map(String::as_str).collect();
    crate::fetch_models::fetch(&names)?;
    let t = threads.to_string();
    println!("## te-rs and llama.cpp, same run\n");
    println!(
        "llama.cpp {} (llama-cpp-python {}, built with {}), {threads} threads, te-rs in {precision} precision (`--precision {precision}`), both engines on the same GGUF file, {}.\n",
        crate::peers::LLAMA_CPP_COMMIT,
        crate::peers::LLAMA_CPP_PYTHON,
        llama.flags,
        if rounds == 1 {
            "one round: llama-bench's avg ± stddev".to_string()
        } else {
            format!("{rounds} interleaved rounds: each engine's median (min-max over the rounds)")
        }
    );
    // The machine's load says how far to trust the figures: ggml's threads
    // spin at their barriers and suffer more than rayon's when other work
    // takes the cores.
    eprintln!("bench: load average at start: {}", load_average());
    println!(
        "| model | test | llama.cpp | te-rs | te-rs / llama.cpp | llama.cpp of limit | te-rs of limit |\n\
         |---|---|---|---|---|---|---|"
    );
    let mut limit_rows = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let source = te_models::source::resolve_model(name)?;
        let te_models::source::ModelSource::Gguf(file) = source else {
            bail!("{name} did not resolve to a GGUF file");
        };
        // The machine's limits, measured now, and what a token costs.
        let cost = TokenCost::of_gguf(&file)?;
        let read_gbps = crate::bench_limits::read_bandwidth_over(cost.bytes as usize, threads)?;
        let peak = crate::bench_limits::fma_peak(threads);
        let mix = crate::bench_limits::tile_mix_peak(threads);
        let mix_text = mix.map_or("-".to_string(), |g| format!("{g:.1}"));
        let read = Limit::Read {
            bytes: cost.bytes as f64,
            gbps: read_gbps,
        };
        let prompt = Limit::Fma {
            flops: 2.0 * cost.layer_macs as f64,
            gflops: peak,
        };
        let generated = Limit::Fma {
            flops: 2.0 * (cost.layer_macs + cost.output_macs) as f64,
            gflops: peak,
        };
        // On stderr at once too: a run stopped before the end keeps them.
        eprintln!(
            "bench: {name}: {:.1} MB of weights per token, {:.3} / {:.3} GFLOP per prompt / \
             generated token, read {read_gbps:.1} GB/s, FMA peak {peak:.1} GFLOP/s, with the \
             tile's loads {mix_text} GFLOP/s",
            cost.bytes as f64 / 1e6,
            2.0 * cost.layer_macs as f64 / 1e9,
            2.0 * (cost.layer_macs + cost.output_macs) as f64 / 1e9,
        );
        limit_rows.push(format!(
            "| {name} | {:.1} MB | {:.3} / {:.3} | {read_gbps:.1} | {peak:.1} | {mix_text} |",
            cost.bytes as f64 / 1e6,
            2.0 * cost.layer_macs as f64 / 1e9,
            2.0 * (cost.layer_macs + cost.output_macs) as f64 / 1e9,
        ));
        let file = file.display().to_string();
        let te_first = i % 2 == 1;
        let mut rows = Vec::new();

        // llama-bench and te bench.
        let bench_args = [
            "-m", &file, "-t", &t, "-p", N_PROMPT, "-n", N_GEN, "-r", REPS, "-o", "json",
        ];
        let run_llama = || -> anyhow::Result<Vec<(String, f64, f64)>> {
            crate::peers::single_results(&capture(
                Command::new(llama.tool("llama-bench")).args(bench_args),
                "llama-bench",
            )?)
        };
        let run_te = || -> anyhow::Result<Vec<(String, f64, f64)>> {
            crate::peers::single_results(&capture(
                Command::new(&te)
                    .arg("bench")
                    .args(bench_args)
                    .args(["--precision", &precision]),
                "te bench",
            )?)
        };
        let (l, r) = interleave(rounds, te_first, run_llama, run_te)?;
        for (test, _, _) in &l[0] {
            // The engine's figure over the rounds, and its text: with one
            // round llama-bench's `avg ± stddev`, else `median (min-max)`.
            let figure = |runs: &[Vec<(String, f64, f64)>], who: &str| {
                let per_round = runs
                    .iter()
                    .map(|run| {
                        run.iter()
                            .find(|(n, _, _)| n == test)
                            .map(|&(_, avg, sd)| (avg, sd))
                            .with_context(|| format!("{who} has no {test} result"))
                    })
                    .collect::<anyhow::Result<Vec<(f64, f64)>>>()?;
                let avgs: Vec<f64> = per_round.iter().map(|&(avg, _)| avg).collect();
                let f = Figure::new(&avgs);
                let text = match per_round[..] {
                    [(avg, sd)] => format!("{avg:.1} ± {sd:.1}"),
                    _ => f.to_string(),
                };
                anyhow::Ok((f, text))
            };
            let (lf, l_text) = figure(&l, "llama-bench")?;
            let (tf, t_text) = figure(&r, "te bench")?;
            // llama-bench's prompt tests compute the last token's logits only.
            let limit = if test.starts_with("pp") {
                &prompt
            } else {
                &read
            };
            rows.push(format!(
                "| {name} | {test} t/s | {l_text} | {t_text} | {:.2}x | {} | {} |",
                tf.median / lf.median,
                limit.share(lf.median),
                limit.share(tf.median)
            ));
        }

        // llama-batched-bench and te bench --batched.
        let npp = NPP.to_string();
        let ntg = NTG.to_string();
        let npl = NPL.map(|n| n.to_string()).join(",");
        let max_pl = *NPL.iter().max().expect("NPL is not empty");
        // Non-unified KV: each of max_pl sequences gets ctx / max_pl.
        let ctx = (max_pl * (NPP + NTG + 1)).div_ceil(256) * 256;
        let run_llama = || -> anyhow::Result<Vec<Value>> {
            let mut cmd = Command::new(llama.tool("llama-batched-bench"));
            cmd.args(["-m", &file, "-t", &t, "-c", &ctx.to_string()])
                .args([
                    "-npp",
                    &npp,
                    "-ntg",
                    &ntg,
                    "-npl",
                    &npl,
                    "--output-format",
                    "jsonl",
                ]);
            jsonl(&capture(&mut cmd, "llama-batched-bench")?)
        };
        let run_te = || -> anyhow::Result<Vec<Value>> {
            let mut cmd = Command::new(&te);
            cmd.args(["bench", "--batched", "-m", &file, "-t", &t])
                .args(["--npp", &npp, "--ntg", &ntg, "--npl", &npl, "-o", "jsonl"])
                .args(["--precision", &precision]);
            jsonl(&capture(&mut cmd, "te bench --batched")?)
        };
        let (l, r) = interleave(rounds, te_first, run_llama, run_te)?;
        let mut te_tg = Vec::new();
        for pl in NPL {
            // (speed_pp, speed_tg) over the rounds.
            let find = |runs: &[Vec<Value>], who: &str| -> anyhow::Result<(Figure, Figure)> {
                let mut pp = Vec::new();
                let mut tg = Vec::new();
                for v in runs {
                    let row = v
                        .iter()
                        .find(|o| o["pl"].as_u64() == Some(pl as u64))
                        .with_context(|| format!("{who} has no pl {pl} result"))?;
                    pp.push(num(row, "speed_pp")?);
                    tg.push(num(row, "speed_tg")?);
                }
                Ok((Figure::new(&pp), Figure::new(&tg)))
            };
            let (l_pp, l_tg) = find(&l, "llama-batched-bench")?;
            let (t_pp, t_tg) = find(&r, "te bench --batched")?;
            te_tg.push(t_tg.median);
            // One sequence's decode reads every weight per token; more
            // sequences share each read, and the products bound them.
            let tg_limit = if pl == 1 { &read } else { &generated };
            rows.push(format!(
                "| {name} | batched pp {NPP} pl {pl}: speed_pp t/s | {l_pp} | {t_pp} | {:.2}x | {} | {} |",
                t_pp.median / l_pp.median,
                prompt.share(l_pp.median),
                prompt.share(t_pp.median)
            ));
            rows.push(format!(
                "| {name} | batched tg {NTG} pl {pl}: speed_tg t/s | {l_tg} | {t_tg} | {:.2}x | {} | {} |",
                t_tg.median / l_tg.median,
                tg_limit.share(l_tg.median),
                tg_limit.share(t_tg.median)
            ));
        }
        if let (Some(first), Some(last)) = (te_tg.first(), te_tg.last()) {
            rows.push(format!(
                "| {name} | te-rs speed_tg pl {max_pl} / pl {} | | {:.2}x | | | |",
                NPL[0],
                last / first
            ));
        }

        // Peak resident memory of a short completion.
        let n = MEM_NEW_TOKENS.to_string();
        let c = MEM_CTX.to_string();
        let run_llama = || -> anyhow::Result<u64> {
            let mut cmd = Command::new(llama.tool("llama-completion"));
            cmd.args(["-m", &file, "-t", &t, "-c", &c, "-n", &n, "-p", MEM_PROMPT])
                .args(["--temp", "0", "-no-cnv"]);
            peak_rss_kb(cmd, "llama-completion")
        };
        let run_te = || -> anyhow::Result<u64> {
            let mut cmd = Command::new(&te);
            cmd.args([
                "generate",
                "--model",
                &file,
                "-t",
                &t,
                "--kv-cache-tokens",
                &c,
            ])
            .args(["--max-new-tokens", &n, "--prompt", MEM_PROMPT])
            .args(["--precision", &precision]);
            peak_rss_kb(cmd, "te generate")
        };
        let (l, r) = alternate(te_first, run_llama, run_te)?;
        rows.push(format!(
            "| {name} | peak RSS, {MEM_NEW_TOKENS}-token completion, ctx {MEM_CTX} | {:.0} MiB | {:.0} MiB | {:.2}x | | |",
            l as f64 / 1024.0,
            r as f64 / 1024.0,
            r as f64 / l as f64
        ));

        // Time to first token: start to exit of a one-token completion.
        let run_llama = || -> anyhow::Result<f64> {
            let mut cmd = Command::new(llama.tool("llama-completion"));
            cmd.args(["-m", &file, "-t", &t, "-c", &c, "-n", "1", "-p", MEM_PROMPT])
                .args(["--temp", "0", "-no-cnv"]);
            wall_seconds(&mut cmd, "llama-completion -n 1")
        };
        let run_te = || -> anyhow::Result<f64> {
            let mut cmd = Command::new(&te);
            cmd.args(["generate", "--model", &file, "-t", &t])
                .args(["--kv-cache-tokens", &c, "--max-new-tokens", "1"])
                .args(["--prompt", MEM_PROMPT, "--precision", &precision]);
            wall_seconds(&mut cmd, "te generate --max-new-tokens 1")
        };
        let (l, r) = interleave(TTFT_RUNS, te_first, run_llama, run_te)?;
        let (l, r) = (Figure::new(&l), Figure::new(&r));
        rows.push(format!(
            "| {name} | time to first token, 5-token prompt, s (start to exit, {TTFT_RUNS} runs) | {l:.2} | {r:.2} | {:.2}x | | |",
            r.median / l.median
        ));
        for row in rows {
            println!("{row}");
        }
    }
    println!(
        "\nThe limits, measured before each model's runs: read bandwidth of a parallel sum over \
         as many bytes as a generated token reads (every weight tensor, the token embedding only \
         when it is the output projection), and the f32 FMA peak ({threads} threads of independent \
         FMA chains). A tg row's share is weight bytes per second over the read bandwidth; a pp \
         row's and a batched tg row's (more than one sequence) are multiply-adds per second \
         (2 FLOP each: the matrices' weights per token, the output projection for generated \
         tokens only, attention not counted) over the FMA peak. The last column is the same FMAs \
         fed by the AVX-512 register tile's loads (10 L1-resident 64-byte loads per 24 FMAs): \
         where it is well below the peak, loads cost this core's FMAs (another tenant on its \
         sibling hyperthread) and the shares above understate the kernels.\n"
    );
    println!(
        "| model | weights read per token | GFLOP per prompt / generated token | read GB/s | FMA peak GFLOP/s | FMA with the tile's loads GFLOP/s |\n\
         |---|---|---|---|---|---|"
    );
    for row in limit_rows {
        println!("{row}");
    }
    println!(
        "\nLoad average (1, 5, 15 min) at the end: {}.",
        load_average()
    );
    println!(
        "\nCommands (each round, engines alternating): `llama-bench -m FILE -t {t} -p {N_PROMPT} -n {N_GEN} -r {REPS} -o json` and \
         `te bench` with the same arguments; `llama-batched-bench -m FILE -t {t} -c {} -npp {NPP} \
         -ntg {NTG} -npl {} --output-format jsonl` and `te bench --batched -m FILE -t {t} --npp {NPP} \
         --ntg {NTG} --npl {}`; `/usr/bin/time -f %M` of `llama-completion -m FILE -t {t} -c {MEM_CTX} \
         -n {MEM_NEW_TOKENS} -p \"{MEM_PROMPT}\" --temp 0 -no-cnv` and `te generate --model FILE -t {t} \
         --kv-cache-tokens {MEM_CTX} --max-new-tokens {MEM_NEW_TOKENS} --prompt \"{MEM_PROMPT}\"`.",
        (NPL.iter().max().copied().unwrap_or(1) * (NPP + NTG + 1)).div_ceil(256) * 256,
        NPL.map(|n| n.to_string()).join(","),
        NPL.map(|n| n.to_string()).join(","),
    );
    Ok(())
}

/// Runs of the time-to-first-token measurement per engine.
const TTFT_RUNS: usize = 3;

/// A limit of the machine and what a token costs against it.
enum Limit {
    /// `bytes` of weights read per token, at `gbps` GB/s.
    Read { bytes: f64, gbps: f64 },
    /// `flops` per token, at a peak of `gflops` GFLOP/s.
    Fma { flops: f64, gflops: f64 },
}

impl Limit {
    /// The share of the limit `tokens_per_s` reaches: `61% of read`,
    /// `78% of FMA`.
    fn share(&self, tokens_per_s: f64) -> String {
        match *self {
            Limit::Read { bytes, gbps } => {
                format!("{:.0}% of read", 100.0 * tokens_per_s * bytes / 1e9 / gbps)
            }
            Limit::Fma { flops, gflops } => {
                format!("{:.0}% of FMA", 100.0 * tokens_per_s * flops / 1e9 / gflops)
            }
        }
    }
}

/// Wall seconds of `cmd` run to its end (its output discarded); an error
/// with the end of its stderr when it fails.
fn wall_seconds(cmd: &mut Command, what: &str) -> anyhow::Result<f64> {
    let start = std::time::Instant::now();
    capture(cmd, what)?;
    Ok(start.elapsed().as_secs_f64())
}

/// The positive integer after flag `flag`; an error naming the flag and
/// what was given otherwise.
fn positive(flag: &str, value: Option<&String>) -> anyhow::Result<usize> {
    let value = value.with_context(|| format!("{flag} takes a positive integer, got nothing"))?;
    value
        .parse()
        .ok()
        .filter(|&n: &usize| n > 0)
        .with_context(|| format!("{flag} takes a positive integer, got `{value}`"))
}

/// `/proc/loadavg`'s three load averages ("unknown" elsewhere).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".into(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

/// Runs `llama` and `te` one after the other, `te` first when `te_first`,
/// and returns (llama's, te's).
fn alternate<A, B>(
    te_first: bool,
    llama: impl FnOnce() -> anyhow::Result<A>,
    te: impl FnOnce() -> anyhow::Result<B>,
) -> anyhow::Result<(A, B)> {
    if te_first {
        let b = te()?;
        Ok((llama()?, b))
    } else {
        let a = llama()?;
        Ok((a, te()?))
    }
}

/// `rounds` rounds of `llama` and `te`, [`alternate`]d, the first round
/// starting with `te` when `te_first` and each next round with the other
/// engine: (llama's results, te's results), one per round.
fn interleave<A, B>(
    rounds: usize,
    te_first: bool,
    mut llama: impl FnMut() -> anyhow::Result<A>,
    mut te: impl FnMut() -> anyhow::Result<B>,
) -> anyhow::Result<(Vec<A>, Vec<B>)> {
    let (mut ls, mut ts) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let (a, b) = alternate(te_first ^ (round % 2 == 1), &mut llama, &mut te)?;
        ls.push(a);
        ts.push(b);
    }
    Ok((ls, ts))
}

/// One engine's figure over the rounds: the median (of an even count, the
/// mean of the middle two) and the range.
struct Figure {
    median: f64,
    min: f64,
    max: f64,
}

impl Figure {
    /// `values` must not be empty.
    fn new(values: &[f64]) -> Figure {
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        Figure {
            median: (v[(n - 1) / 2] + v[n / 2]) / 2.0,
            min: v[0],
            max: v[n - 1],
        }
    }
}

impl std::fmt::Display for Figure {
    /// `median` alone for one value, else `median (min-max)`, with the
    /// format's precision (1 decimal by default).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = f.precision().unwrap_or(1);
        if self.min == self.max {
            write!(f, "{:.p$}", self.median)
        } else {
            write!(f, "{:.p$} ({:.p$}-{:.p$})", self.median, self.min, self.max)
        }
    }
}

/// Stdout of `cmd`; on failure, an error with the end of its stderr.
fn capture(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    eprintln!("bench: {what} ...");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        bail!(
            "{what} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The JSON objects among `text`'s lines (llama-batched-bench mixes its
/// jsonl with log lines).
fn jsonl(text: &str) -> anyhow::Result<Vec<Value>> {
    let rows: Vec<Value> = text
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if rows.is_empty() {
        bail!("no JSON lines in the output");
    }
    Ok(rows)
}

fn num(o: &Value, field: &str) -> anyhow::Result<f64> {
    o[field]
        .as_f64()
        .with_context(|| format!("field `{field}` missing or not a number"))
}

/// Peak resident memory of `cmd`, in KiB, through `/usr/bin/time -f %M`.
fn peak_rss_kb(cmd: Command, what: &str) -> anyhow::Result<u64> {
    let report = std::env::temp_dir().join(format!("te-peak-rss-{}.txt", std::process::id()));
    let mut timed = Command::new("/usr/bin/time");
    timed
        .args(["-f", "%M", "-o"])
        .arg(&report)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    capture(&mut timed, what)?;
    let text = std::fs::read_to_string(&report).context("reading /usr/bin/time's report")?;
    let _ = std::fs::remove_file(&report);
    text.lines()
        .rev()
        .find_map(|l| l.trim().parse().ok())
        .with_context(|| format!("no peak memory in /usr/bin/time's report: {text:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Medians and ranges by hand: odd and even counts, one value.
    #[test]
    fn figure_median_and_range() {
        let f = Figure::new(&[3.0, 1.0, 2.0]);
        assert_eq!((f.median, f.min, f.max), (2.0, 1.0, 3.0));
        assert_eq!(f.to_string(), "2.0 (1.0-3.0)");
        let f = Figure::new(&[4.0, 1.0, 2.0, 10.0]);
        assert_eq!((f.median, f.min, f.max), (3.0, 1.0, 10.0));
        assert_eq!(Figure::new(&[5.25]).to_string(), "5.2");
        assert_eq!(
            format!("{:.2}", Figure::new(&[1.0, 2.5])),
            "1.75 (1.00-2.50)"
        );
    }

    /// Rounds alternate which engine goes first, starting as asked.
    #[test]
    fn rounds_alternate_the_first_engine() {
        for te_first in [false, true] {
            let order = std::cell::RefCell::new(Vec::new());
            let (l, t) = interleave(
                4,
                te_first,
                || {
                    order.borrow_mut().push('l');
                    Ok(1)
                },
                || {
                    order.borrow_mut().push('t');
                    Ok(2)
                },
            )
            .unwrap();
            assert_eq!((l, t), (vec![1; 4], vec![2; 4]));
            let want = if te_first { "tllttllt" } else { "lttllttl" };
            assert_eq!(order.into_inner().into_iter().collect::<String>(), want);
        }
    }
}
