//! `cargo xtask gpu-bundle`: the GPU parity tests as prebuilt binaries
//! plus one script, for a GPU machine that has no Rust toolchain (the
//! `device` tool's machines).
//!
//! Builds the test executables of te-kernels `cuda_parity` and
//! te-attention `gpu_parity` in release, copies them into
//! `target/gpu-bundle/` with `run.sh`, which runs each with
//! `--include-ignored` (the device tests are `#[ignore]`d for machines
//! without a GPU) and `TE_REQUIRE_GPU=1` (no GPU is a failure, not a
//! skip), writes the logs
//! to `$OUT` (or the bundle folder) and exits non-zero if any failed. The
//! kernels are compiled at run time by the machine's NVRTC (found on
//! `LD_LIBRARY_PATH`; the script adds the CUDA toolkit's and the pip
//! wheels' library folders it finds).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};

use crate::test::GPU_TESTS;

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs the te-rs GPU parity tests built by `cargo xtask gpu-bundle`.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$here}"
export TE_REQUIRE_GPU=1
# The driver, NVRTC and the CUDA runtime: the driver mount, the toolkit and any pip wheels.
for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
if command -v python3 >/dev/null; then
  for d in $(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in glob.glob(os.path.join(r, "nvidia", "*", "lib")):
        print(d)
PY
  ); do export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"; done
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$out/gpu.txt"
status=0
for t in TESTS; do
  echo "== $t"
  # The device tests are #[ignore]d (they need a GPU): run them too.
  "$here/$t" --include-ignored --test-threads=1 2>&1 | tee "$out/$t.log"
  rc=${PIPESTATUS[0]}
  echo "== $t: exit $rc"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
"#;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(a) = args.first() {
        bail!("unknown gpu-bundle argument `{a}`");
    }
    let root = crate::workspace_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
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
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, exe) in &exes {
        let dst = dir.join(name);
        // Stripped: the bundle travels to the GPU machine (64 MiB limit).
        let status = Command::new("objcopy")
            .args(["--strip-debug"])
            .arg(exe)
            .arg(&dst)
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            std::fs::copy(exe, &dst).with_context(|| format!("copying {}", exe.display()))?;
        }
    }
    let names: Vec<&str> = exes.iter().map(|(n, _)| n.as_str()).collect();
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH.replace("TESTS", &names.join(" ")))
        .with_context(|| format!("writing {}", script.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    }
    let bytes: u64 = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "{}: {} ({:.1} MiB); on the GPU machine run `bash target/gpu-bundle/run.sh`",
        dir.display(),
        names.join(", "),
        bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
