//! `cargo xtask`: the project's build tooling (test, bench, kernels,
//! fetch-models, gpu-bundle, peers). One module per command.

mod bench;
mod bench_attention;
mod bench_context_parallel;
mod bench_engine;
mod bench_kernels;
mod bench_limits;
mod bench_matmul;
mod bench_models;
mod bench_peers;
mod bench_serve;
mod bench_speculative;
mod fetch_models;
mod gpu_bundle;
mod kernels;
mod peers;
mod test;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("help", &[][..]),
    };
    match cmd {
        "test" => test::run(rest),
        "bench" => bench::run(rest),
        "kernels" => kernels::run(rest),
        "fetch-models" => fetch_models::run(rest),
        "gpu-bundle" => gpu_bundle::run(rest),
        "peers" => peers::run(rest),
        _ => {
            eprintln!(
                "usage: cargo xtask <command>\n\n\
                 commands:\n  \
                 test [--gpu] [--long]  run the tests (fetches the test models first; --long adds the long ones)\n  \
                 bench [SECTION]    kernels, attention, models, engine, serve, context-parallel\n  \
                 bench --vs-llama-cpp [--threads N] [--rounds R] [--precision exact|int8]  te-rs and llama.cpp, same files, same run (2 threads, 3 rounds, exact)\n  \
                 kernels            compile crates/*/kernels/*.cu with NVRTC for sm_80 and sm_90\n  \
                 fetch-models [NAME...]  download and verify the test models (all, or those named) into $TE_HOME\n  \
                 gpu-bundle         GPU parity test binaries + run.sh for a GPU machine without Rust\n  \
                 peers              build llama.cpp once into $TE_HOME/peers (for bench --vs-llama-cpp)"
            );
            if cmd == "help" || cmd == "--help" {
                Ok(())
            } else {
                anyhow::bail!("unknown xtask command `{cmd}`")
            }
        }
    }
}

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Best wall time (seconds) of `reps` runs after one warm-up.
pub(crate) fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// The value of a bench's `--precision` option (te's `--precision`):
/// `exact` or `int8`, else an error naming the bench `what`.
pub fn precision_arg(what: &str, value: Option<&String>) -> anyhow::Result<String> {
    match value {
        Some(p) if p == "exact" || p == "int8" => Ok(p.clone()),
        other => anyhow::bail!("bench {what}: --precision takes exact or int8 (got {other:?})"),
    }
}

/// Builds the `te` binary (release, with cargo `features` of te-cli) and
/// returns its path.
pub fn build_te(features: &[&str]) -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context;
    let root = workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "--release", "-p", "te-cli"]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        anyhow::bail!("cargo build --release -p te-cli failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| root.join("target"), std::path::PathBuf::from);
    Ok(target.join("release").join("te"))
}
