//! Context-parallel prefill: one prompt of 8192 tokens (Gemma 3 270M, its
//! context is 32k) through `te generate --context-parallel` at 1, 2 and 4
//! ranks on threads and at 2 MPI processes (when `mpirun` is installed),
//! one generated token each, in the same invocation. Rows give the wall
//! time, prefill tokens/s and each rank's KV tokens and bytes (`--stats`).

use std::process::Command;

use anyhow::{bail, Context};

const MODEL: &str = "gemma3-270m";
const PROMPT_TOKENS: usize = 8192;

/// Markdown rows: `| ranks | transport | prompt tokens | wall s | prefill tok/s | KV tokens per rank | KV MiB per rank |`.
pub fn run() -> anyhow::Result<Vec<String>> {
    let mpi = Command::new("mpirun").arg("--version").output().is_ok();
    let te = crate::build_te(if mpi { &["mpi"] } else { &[] })?;
    let prompt = prompt_file()?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    let mut runs: Vec<(usize, &str)> = vec![(1, "threads"), (2, "threads"), (4, "threads")];
    if mpi {
        runs.push((2, "mpi"));
    }
    for (ranks, transport) in runs {
        let args = |cmd: &mut Command| {
            cmd.args(["generate", "--model", MODEL, "--max-new-tokens", "1"])
                .args(["--ignore-eos", "--json", "--stats", "--prompt-file"])
                .arg(&prompt);
        };
        let mut cmd = if transport == "mpi" {
            let mut c = Command::new("mpirun");
            c.args(["--allow-run-as-root", "--oversubscribe", "-np"])
                .arg(ranks.to_string())
                .arg(&te);
            args(&mut c);
            // Each process gets its share of the cores.
            c.args(["--context-parallel", "mpi", "-t"])
                .arg((threads / ranks).max(1).to_string());
            c
        } else {
            let mut c = Command::new(&te);
            args(&mut c);
            c.args(["--context-parallel", &ranks.to_string()]);
            c
        };
        eprintln!("bench: context parallel, {ranks} ranks on {transport} ...");
        let out = cmd.output().context("running te generate")?;
        if !out.status.success() {
            bail!(
                "te generate, {ranks} ranks on {transport}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stats: serde_json::Value = stderr
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .context("no --stats line")?;
        let per_rank = |key: &str, scale: f64| -> String {
            match stats[key].as_array() {
                Some(v) => v
                    .iter()
                    .map(|x| format!("{:.0}", x.as_f64().unwrap_or(0.0) / scale))
                    .collect::<Vec<_>>()
                    .join(" / "),
                None => format!(
                    "{:.0}",
                    stats[if key == "kv_tokens_per_rank" {
                        "peak_kv_tokens"
                    } else {
                        "peak_kv_bytes"
                    }]
                    .as_f64()
                    .unwrap_or(0.0)
                        / scale
                ),
            }
        };
        rows.push(format!(
            "| {ranks} | {transport} | {} | {:.1} | {:.0} | {} | {} |",
            stats["prompt_tokens"],
            stats["wall_s"].as_f64().unwrap_or(0.0),
            stats["prefill_tokens_per_s"].as_f64().unwrap_or(0.0),
            per_rank("kv_tokens_per_rank", 1.0),
            per_rank("kv_bytes_per_rank", 1024.0 * 1024.0),
        ));
    }
    Ok(rows)
}

/// A text of about [`PROMPT_TOKENS`] tokens for the model, in a file under
/// the target directory.
fn prompt_file() -> anyhow::Result<std::path::PathBuf> {
    let source = te_models::source::resolve_model(MODEL)?;
    let loaded = te_models::loader::load_model(&source)?;
    let sentence = "The committee met on Tuesdays, and the minutes were always late; \
                    nobody knew why the clock in the hall ran eleven minutes fast. ";
    let mut text = sentence.repeat(PROMPT_TOKENS / 20);
    // Trim to the token count (one line: the prompt file's lines are prompts).
    let ids = loaded.tokenizer.encode(&text, true)?;
    if ids.len() > PROMPT_TOKENS {
        text = loaded.tokenizer.decode(&ids[1..PROMPT_TOKENS], true)?;
    }
    let path = crate::workspace_root().join("target/bench-context-parallel-prompt.txt");
    std::fs::write(&path, text.replace('\n', " "))?;
    Ok(path)
}
