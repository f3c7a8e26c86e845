//! `cargo xtask bench speculative`: decode speed of speculative decoding,
//! Qwen2.5-Coder 1.5B Instruct (Q4_K_M) as the target, on three
//! workloads: code completion, code editing (the answer rewrites a given
//! function, so it repeats much of the prompt) and free chat; te's plain
//! decode, prompt lookup (`--draft-ngram 3`, adaptive length) and the
//! 0.5B as draft model at batch 1 and 8, beside llama.cpp's `llama-completion` (plain),
//! `llama-speculative` (the 0.5B Instruct as draft, `--spec-draft-n-max 8`) and
//! `llama-lookup` (`--spec-draft-n-max 8`) at batch 1, same prompt files, same
//! run, greedy, `NEW_TOKENS` tokens, `--ignore-eos`.
//!
//! te's figure is `--stats`' `decode_tokens_per_s` (tokens generated in
//! decode steps over their seconds, prompt excluded); llama.cpp's the
//! `decoded ... speed` line of the speculative tools and the `eval time`
//! tokens per second of `llama-completion` (prompt excluded in both).
//! Batch 8 is eight copies of the prompt (their prompt pages shared).
//! te's draft model (`--model-draft`, the 0.5B, adaptive length) runs at
//! batch 1 and 8 as well. Prints a markdown table for
//! docs/benchmarks.md. Options: `--precision exact|int8` (te's
//! `--precision`, default exact; the draft model runs in the target's),
//! `--workload code-completion|code-editing|free-chat` (repeatable; all
//! three by default), `--smoke`: the code-editing workload only, 48
//! tokens, batch 1, te only (a check that the section runs). Not part of
//! CI.

use std::process::{Command, Stdio};

use anyhow::{bail, Context};
use serde_json::Value;

const TARGET: &str = "qwen2.5-coder-1.5b";
const DRAFT: &str = "qwen2.5-coder-0.5b";
const NEW_TOKENS: usize = 256;
const SMOKE_TOKENS: usize = 48;

/// A Qwen chat turn (the Instruct models' template, written out so that
/// both engines read the same text).
fn chat(user: &str) -> String {
    format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
}

const FUNCTION: &str = r#"def summarize(records, key, threshold=None):
    groups = {}
    for record in records:
        value = record.get(key)
        if value is None:
            continue
        if threshold is not None and record.get("score", 0) < threshold:
            continue
        groups.setdefault(value, []).append(record)
    result = []
    for value, items in sorted(groups.items()):
        scores = [item.get("score", 0) for item in items]
        total = sum(scores)
        mean = total / len(scores) if scores else 0
        best = max(items, key=lambda item: item.get("score", 0))
        result.append({
            "value": value,
            "count": len(items),
            "total": total,
            "mean": mean,
            "best": best.get("name"),
        })
    return result


def format_summary(rows, width=20):
    lines = []
    for row in rows:
        name = str(row["value"]).ljust(width)
        lines.append(f"{name} {row['count']:5d} {row['mean']:8.2f} {row['best']}")
    return "\n".join(lines)
"#;

/// The workloads: name and prompt text.
fn workloads() -> Vec<(&'static str, String)> {
    vec![
        (
            "code completion",
            format!("{}\n\ndef top_groups(rows, n=3):\n", FUNCTION),
        ),
        (
            "code editing",
            chat(&format!(
                "Add type hints to every function of this Python file and return the \
                 whole file:\n\n```python\n{FUNCTION}```"
            )),
        ),
        (
            "free chat",
            chat("Tell me a short story about a lighthouse keeper who befriends a whale."),
        ),
    ]
}

/// The workload names `--workload` takes: a workload's name with `-` for
/// spaces.
fn workload_arg(name: &str) -> String {
    name.replace(' ', "-")
}

pub fn run(args: &[String]) -> anyhow::Result<Vec<String>> {
    let mut smoke = false;
    let mut precision = "exact".to_string();
    let mut chosen: Vec<String> = Vec::new();
    let names: Vec<String> = workloads().iter().map(|(n, _)| workload_arg(n)).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--smoke" => smoke = true,
            "--precision" => precision = crate::precision_arg("speculative", it.next())?,
            "--workload" => match it.next() {
                Some(w) if names.contains(w) => chosen.push(w.clone()),
                other => bail!(
                    "bench speculative: --workload takes one of {} (got {other:?})",
                    names.join(", ")
                ),
            },
            other => bail!(
                "bench speculative: unknown argument `{other}` (takes --precision exact|int8, \
                 --workload NAME, --smoke)"
            ),
        }
    }
    if smoke {
        chosen = vec![workload_arg("code editing")];
    }
    crate::fetch_models::fetch(&[TARGET, DRAFT])?;
    let te = crate::build_te(&[])?;
    let llama = if smoke {
        None
    } else {
        Some(crate::peers::ensure_llama_cpp()?)
    };
    let gguf = |name: &str| -> anyhow::Result<String> {
        match te_models::source::resolve_model(name)? {
            te_models::source::ModelSource::Gguf(p) => Ok(p.display().to_string()),
            _ => bail!("{name} did not resolve to a GGUF file"),
        }
    };
    let (target, draft) = (gguf(TARGET)?, gguf(DRAFT)?);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t = threads.to_string();
    let new_tokens = if smoke { SMOKE_TOKENS } else { NEW_TOKENS };
    let n = new_tokens.to_string();
    let dir = std::env::temp_dir().join(format!("te-bench-speculative-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut rows = vec![
        format!(
            "{TARGET} target, {threads} threads, greedy, {new_tokens} new tokens, te-rs in \
             {precision} precision (`--precision {precision}`); decode tokens/s (prompt \
             excluded) and acceptance; ratios to te plain at the same batch.\n"
        ),
        "| workload | batch | engine | decode tok/s | vs te plain | acceptance | mean accepted |"
            .into(),
        "|---|---|---|---|---|---|---|".into(),
    ];
    for (name, prompt) in workloads() {
        if !chosen.is_empty() && !chosen.contains(&workload_arg(name)) {
            continue;
        }
        let file = dir.join(format!("{}.txt", workload_arg(name)));
        std::fs::write(&file, &prompt)?;
        for batch in if smoke { vec![1] } else { vec![1, 8] } {
            // (--prompt, repeated, keeps the prompt's newlines.)
            let te_run = |draft_args: &[&str]| -> anyhow::Result<Value> {
                let mut cmd = Command::new(&te);
                cmd.args([
                    "generate", "--model", &target, "-t", &t, "--json", "--stats",
                ])
                .args(["--precision", &precision])
                .args(["--ignore-eos", "--max-new-tokens", &n])
                .args(["--max-batch-size", &batch.to_string()]);
                for _ in 0..batch {
                    cmd.args(["--prompt", &prompt]);
                }
                cmd.args(draft_args);
                let err = stderr_of(&mut cmd, "te generate")?;
                let last = err.lines().last().unwrap_or_default();
                serde_json::from_str(last).with_context(|| format!("te --stats line {last:?}"))
            };
            let plain = te_run(&[])?;
            let plain_ts = num(&plain, "decode_tokens_per_s")?;
            push(
                &mut rows,
                format!("| {name} | {batch} | te plain | {plain_ts:.1} | 1.00x | | |"),
            );
            let spec = te_run(&["--draft-ngram", "3"])?;
            let ts = num(&spec, "decode_tokens_per_s")?;
            push(&mut rows, format!(
                "| {name} | {batch} | te prompt lookup (`--draft-ngram 3`) | {ts:.1} | {:.2}x | {:.0}% | {:.2} |",
                ts / plain_ts,
                100.0 * num(&spec, "acceptance_rate")?,
                num(&spec, "mean_accepted_length")?,
            ));
            let with_model = te_run(&["--model-draft", &draft])?;
            let ts = num(&with_model, "decode_tokens_per_s")?;
            push(
                &mut rows,
                format!(
                "| {name} | {batch} | te draft model (0.5B) | {ts:.1} | {:.2}x | {:.0}% | {:.2} |",
                ts / plain_ts,
                100.0 * num(&with_model, "acceptance_rate")?,
                num(&with_model, "mean_accepted_length")?,
            ),
            );
            let Some(llama) = llama.as_ref().filter(|_| batch == 1) else {
                continue;
            };
            let completion = stderr_of(
                Command::new(llama.tool("llama-completion"))
                    .args(["-m", &target, "-t", &t, "-n", &n, "-f"])
                    .arg(&file)
                    .args(["--temp", "0", "-no-cnv", "--ignore-eos"]),
                "llama-completion",
            )?;
            let l_plain = eval_tokens_per_s(&completion)?;
            push(
                &mut rows,
                format!(
                "| {name} | 1 | llama.cpp plain (`llama-completion`) | {l_plain:.1} | {:.2}x | | |",
                l_plain / plain_ts
            ),
            );
            for (tool, extra) in [
                ("llama-speculative", vec!["-md", draft.as_str()]),
                ("llama-lookup", vec![]),
            ] {
                let out = stderr_of(
                    Command::new(llama.tool(tool))
                        .args(["-m", &target, "-t", &t, "-n", &n, "-f"])
                        .arg(&file)
                        .args(["--temp", "0", "--spec-draft-n-max", "8", "--ignore-eos"])
                        .args(extra),
                    tool,
                )?;
                let (ts, accept) = speculative_figures(&out)?;
                push(
                    &mut rows,
                    format!(
                        "| {name} | 1 | llama.cpp `{tool}` | {ts:.1} | {:.2}x | {accept:.0}% | |",
                        ts / plain_ts
                    ),
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    rows.push(String::new());
    rows.push(format!(
        "Commands: `te generate --model FILE -t {t} --json --stats --precision {precision} \
         --ignore-eos --max-new-tokens {n} --max-batch-size B --prompt PROMPT` (B times) plain, with `--draft-ngram 3`, and with \
         `--model-draft DRAFT`; \
         `llama-completion -m FILE -t {t} -n {n} -f PROMPT --temp 0 -no-cnv --ignore-eos`; \
         `llama-speculative -m FILE -md DRAFT -t {t} -n {n} -f PROMPT --temp 0 --spec-draft-n-max 8 \
         --ignore-eos`; `llama-lookup` the same without `-md`."
    ));
    Ok(rows)
}

/// Adds a table row, and shows it at once (a later failure then loses
/// nothing measured).
fn push(rows: &mut Vec<String>, row: String) {
    eprintln!("bench: {row}");
    rows.push(row);
}

/// Stdout and stderr of `cmd` together (the tools log their speeds on
/// stderr); on failure an error with the end of it.
fn stderr_of(cmd: &mut Command, what: &str) -> anyhow::Result<String> {
    eprintln!("bench: {what} ...");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        let tail: Vec<&str> = err.lines().rev().take(5).collect();
        bail!(
            "{what} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        );
    }
    Ok(err)
}

fn num(o: &Value, field: &str) -> anyhow::Result<f64> {
    o[field]
        .as_f64()
        .with_context(|| format!("field `{field}` missing or not a number in {o}"))
}

/// The generation speed of llama.cpp's performance report: the tokens per
/// second of its `eval time` line (not `prompt eval time`).
fn eval_tokens_per_s(log: &str) -> anyhow::Result<f64> {
    let line = log
        .lines()
        .find(|l| l.contains(" eval time") && !l.contains("prompt eval time"))
        .context("no `eval time` line in llama-completion's log")?;
    let before = line
        .split(" tokens per second")
        .next()
        .context("no tokens per second")?;
    let value = before.rsplit([',', '(']).next().unwrap_or_default().trim();
    value
        .parse()
        .with_context(|| format!("tokens per second in {line:?}"))
}

/// `(decode tokens/s, acceptance %)` of `llama-speculative` or
/// `llama-lookup`: their `decoded N tokens in S seconds, speed: X t/s`
/// and `accept = Y%` lines.
fn speculative_figures(log: &str) -> anyhow::Result<(f64, f64)> {
    let field = |first: &str, after: &str, until: &str| -> anyhow::Result<f64> {
        let line = log
            .lines()
            // (Newer builds put a time and a level before the word:
            // `0.08.863.730 I decoded ...`.)
            .find(|l| l.split_whitespace().take(3).any(|w| w == first) && l.contains(after))
            .with_context(|| format!("no `{first}` line"))?;
        let rest = line
            .split(after)
            .nth(1)
            .with_context(|| format!("no `{after}` in {line:?}"))?;
        rest.split(until)
            .next()
            .unwrap_or_default()
            .trim()
            .parse()
            .with_context(|| format!("a number in {line:?}"))
    };
    Ok((
        field("decoded", "speed:", "t/s")?,
        field("accept", "=", "%")?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_logs_parse() {
        let log = "llama_perf_context_print: prompt eval time =  100.00 ms /  10 tokens ( 10.00 ms per token, 100.00 tokens per second)\n\
                   llama_perf_context_print:        eval time =  500.00 ms /  32 runs   ( 15.62 ms per token,  64.00 tokens per second)\n";
        assert_eq!(eval_tokens_per_s(log).unwrap(), 64.0);
        let log = "encoded  120 tokens in    1.000 seconds, speed:  120.000 t/s\n\
                   decoded  256 tokens in   20.000 seconds, speed:   12.800 t/s\n\
                   n_drafted = 300\nn_accept  = 276\naccept    = 92.000%\n";
        assert_eq!(speculative_figures(log).unwrap(), (12.8, 92.0));
        let log = "0.08.863.729 I encoded   13 tokens in    0.355 seconds, speed:   36.569 t/s\n\
                   0.08.863.730 I decoded   34 tokens in    2.206 seconds, speed:   15.412 t/s\n\
                   0.08.863.731 I n_accept  = 29\n0.08.863.732 I accept    = 90.625%\n";
        assert_eq!(speculative_figures(log).unwrap(), (15.412, 90.625));
    }
}
