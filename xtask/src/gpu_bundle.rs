//! `cargo xtask gpu-bundle`: one self-contained GPU check for a machine
//! that has no Rust toolchain and no network (the `device` tool's
//! machines): `target/gpu-bundle/` with stripped release binaries (`bin/te`
//! and the GPU test executables in `tests/`: te-kernels `cuda_parity`,
//! te-attention `gpu_parity`, te-engine `cuda_model`), `run.sh` and
//! `hf_baseline.py` (both from `xtask/gpu/`), and `gemma-7b.config.json`
//! (the `random:gemma-7b` preset's config, for the Hugging Face baseline),
//! under [`MAX_BUNDLE_BYTES`].
//!
//! `run.sh` runs the steps of issue 14 (kernel parity, tiny random models
//! cuda vs cpu, the Gemma-7B tutorial workload with and without CUDA
//! graphs, the Hugging Face baseline, decode tokens/s and bandwidth, a
//! final table; see the script's header); `run.sh --dry-run` runs the CPU
//! half of each on any machine and prints the plan of the GPU steps. The
//! kernels are compiled at run time by the machine's NVRTC (found on
//! `LD_LIBRARY_PATH`; the script adds the CUDA toolkit's and the pip
//! wheels' library folders it finds).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

use crate::test::GPU_TESTS;

/// The bundle must travel to the GPU machine (64 MiB transfer limit).
const MAX_BUNDLE_BYTES: u64 = 60 << 20;

/// Copies `exe` to `dst` without symbols (`objcopy --strip-all`), or as is
/// when objcopy is missing.
fn copy_stripped(exe: &Path, dst: &Path) -> anyhow::Result<()> {
    let status = Command::new("objcopy")
        .arg("--strip-all")
        .arg(exe)
        .arg(dst)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        std::fs::copy(exe, dst).with_context(|| format!("copying {}", exe.display()))?;
    }
    Ok(())
}

/// Bytes of every file under `dir`.
fn tree_bytes(dir: &Path) -> anyhow::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            tree_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown gpu-bundle argument `{a}`");
    }
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(&cargo)
        .current_dir(&root)
        .args(["build", "--release", "-p", "te-cli", "--bin", "te"])
        .status()
        .context("running cargo build -p te-cli")?;
    if !status.success() {
        bail!("building te failed ({status})");
    }
    let mut cmd = Command::new(&cargo);
    cmd.current_dir(&root).args([
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    for (package, test) in GPU_TESTS {
        cmd.args(["-p", package, "--test", test]);
    }
    let output = cmd.output().context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("building the GPU tests failed ({})", output.status);
    }
    // The executables, from cargo's build messages.
    let mut exes: Vec<(String, PathBuf)> = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = msg["target"]["name"].as_str().unwrap_or_default();
        if let (Some(exe), true) = (
            msg["executable"].as_str(),
            GPU_TESTS.iter().any(|(_, t)| *t == name),
        ) {
            exes.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    if exes.len() != GPU_TESTS.len() {
        bail!(
            "expected {} test executables, cargo built {exes:?}",
            GPU_TESTS.len()
        );
    }
    let dir = root.join("target").join("gpu-bundle");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    for sub in ["bin", "tests"] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    copy_stripped(&root.join("target/release/te"), &dir.join("bin/te"))?;
    for (name, exe) in &exes {
        copy_stripped(exe, &dir.join("tests").join(name))?;
    }
    for file in ["run.sh", "hf_baseline.py"] {
        let src = root.join("xtask/gpu").join(file);
        std::fs::copy(&src, dir.join(file))
            .with_context(|| format!("copying {}", src.display()))?;
    }
    let preset = te_models::random::PRESETS
        .iter()
        .find(|p| p.name == "gemma-7b")
        .context("the gemma-7b preset is missing from te_models::random::PRESETS")?;
    std::fs::write(dir.join("gemma-7b.config.json"), preset.config_json)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("run.sh"), std::fs::Permissions::from_mode(0o755))?;
    }
    let bytes = tree_bytes(&dir)?;
    let mib = bytes as f64 / (1 << 20) as f64;
    if bytes > MAX_BUNDLE_BYTES {
        bail!(
            "{} is {mib:.1} MiB, over the {} MiB limit",
            dir.display(),
            MAX_BUNDLE_BYTES >> 20
        );
    }
    let names: Vec<&str> = exes.iter().map(|(n, _)| n.as_str()).collect();
    println!(
        "{}: te, {} ({mib:.1} MiB); on the GPU machine run `bash target/gpu-bundle/run.sh` \
         (`--dry-run` here: the CPU half and the plan)",
        dir.display(),
        names.join(", "),
    );
    Ok(())
}
