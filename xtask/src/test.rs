//! `cargo xtask test [--gpu] [cargo test args]`: fetches the test models,
//! then runs every test of the workspace (unit, property, doc, end-to-end on
//! real models).
//!
//! The device tests (te-kernels `cuda_parity`, te-attention `gpu_parity`)
//! are `#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]`, so a plain
//! run lists them as ignored, never as passed. `--gpu` first runs them
//! (`-- --include-ignored`, with `TE_REQUIRE_GPU=1`): without a usable GPU
//! they fail, and the command stops there; then the whole workspace runs
//! with `TE_REQUIRE_GPU=1`, under which the NVRTC compile checks fail rather
//! than skip when libnvrtc cannot be loaded.
//!
//! If `cargo xtask kernels` has unpacked the NVRTC wheel into
//! `$TE_HOME/cuda`, its lib dir is put on `LD_LIBRARY_PATH`, so the NVRTC
//! compile checks (no GPU needed) run instead of skipping.

use std::process::Command;

use anyhow::{bail, Context};

/// `(package, test target)` of the tests that need a GPU.
pub const GPU_TESTS: [(&str, &str); 3] = [
    ("te-kernels", "cuda_parity"),
    ("te-attention", "gpu_parity"),
    ("te-engine", "cuda_model"),
];

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut gpu = false;
    let mut extra = Vec::new();
    for a in args {
        match a.as_str() {
            "--gpu" => gpu = true,
            _ => extra.push(a.clone()),
        }
    }
    crate::fetch_models::run(&[])?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let ld_library_path = match crate::kernels::cached_nvrtc_lib_dir() {
        Some(dir) => {
            eprintln!("NVRTC compile checks use {}", dir.display());
            let mut ld = dir.into_os_string();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                ld.push(":");
                ld.push(old);
            }
            Some(ld)
        }
        None => {
            eprintln!(
                "no NVRTC wheel from `cargo xtask kernels` in $TE_HOME/cuda: the NVRTC \
                 compile checks skip unless libnvrtc is on LD_LIBRARY_PATH"
            );
            None
        }
    };
    let command = |args: &[&str]| {
        let mut cmd = Command::new(&cargo);
        cmd.current_dir(crate::workspace_root()).args(args);
        if let Some(ld) = &ld_library_path {
            cmd.env("LD_LIBRARY_PATH", ld);
        }
        if gpu {
            cmd.env("TE_REQUIRE_GPU", "1");
        }
        cmd
    };
    if gpu {
        // Every GPU test reports, not only those before the first failure.
        let mut args = vec!["test", "--no-fail-fast"];
        for (package, test) in GPU_TESTS {
            args.extend(["-p", package, "--test", test]);
        }
        args.extend(["--", "--include-ignored"]);
        let status = command(&args).status().context("running the GPU tests")?;
        if !status.success() {
            bail!("the GPU tests failed ({status}); without a usable GPU, `--gpu` always fails");
        }
    }
    let mut cmd = command(&["test", "--workspace"]);
    cmd.args(&extra);
    let status = cmd.status().context("running cargo test")?;
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    Ok(())
}
