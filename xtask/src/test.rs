//! `cargo xtask test [--gpu] [--long] [cargo test args]`: fetches the test
//! models, then runs every test of the workspace (unit, property, doc,
//! end-to-end on real models).
//!
//! The long end-to-end checks (the Qwen2.5-Coder 1.5B's, whole perplexity
//! texts, the heaviest memory-pressure and draft runs: tens of minutes on
//! two cores, repeating on a larger model or a longer run what a default
//! test checks) are `#[ignore = "long: cargo xtask test --long"]`, all in
//! te-cli's tests (the tidy test holds that): a plain run lists them as
//! ignored; `--long` runs them after the others (`cargo test -p te-cli
//! --tests -- --ignored`).
//!
//! The device tests (te-kernels `cuda_parity`, te-attention `gpu_parity`)
//! are `#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]`, so a plain
//! run lists them as ignored, never as passed. `--gpu` first runs them
//! (`-- --include-ignored`, with `TE_REQUIRE_GPU=1`): without a usable GPU
//! they fail, and the command stops there; then the whole workspace runs
//! with `TE_REQUIRE_GPU=1`, under which the NVRTC compile checks fail rather
//! than skip when libnvrtc cannot be loaded.
//!
//! With MPI installed (`mpicc` and `mpirun` on PATH) the workspace builds
//! with `--features te-cli/mpi,te-ring/mpi`, so te-ring's MPI transport
//! and its tests under `mpirun` (te-ring `mpi`, te-cli
//! `context_parallel_mpi`) build and run in the same run; without it they
//! are not built, and the command says so (under `CI` it fails instead).
//!
//! If `cargo xtask kernels` has unpacked the NVRTC wheel into
//! `$TE_HOME/cuda`, its lib dir is put on `LD_LIBRARY_PATH`, so the NVRTC
//! compile checks (no GPU needed) run instead of skipping.

use std::process::Command;

use anyhow::{bail, Context};

/// The package whose tests hold every long test (and no GPU test).
const LONG_TESTS_PACKAGE: &str = "te-cli";

/// The features that build the MPI transport and its tests.
const MPI_FEATURES: &str = "te-cli/mpi,te-ring/mpi";

/// `(package, test target)` of the tests that need a GPU.
pub const GPU_TESTS: [(&str, &str); 3] = [
    ("te-kernels", "cuda_parity"),
    ("te-attention", "gpu_parity"),
    ("te-engine", "cuda_model"),
];

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut gpu = false;
    let mut long = false;
    let mut extra = Vec::new();
    for a in args {
        match a.as_str() {
            "--gpu" => gpu = true,
            "--long" => long = true,
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
    let mpi = have_mpi();
    let mut cmd = command(&["test", "--workspace"]);
    if mpi {
        eprintln!("MPI found: the MPI tests build and run (--features {MPI_FEATURES})");
        cmd.args(["--features", MPI_FEATURES]);
    } else if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false") {
        bail!("CI without MPI: install mpicc and mpirun (.ci/run installs OpenMPI)");
    } else {
        eprintln!(
            "no mpicc and mpirun on PATH: the MPI tests (te-ring mpi, te-cli \
             context_parallel_mpi) are not built; install OpenMPI to run them"
        );
    }
    cmd.args(&extra);
    let status = cmd.status().context("running cargo test")?;
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    if long {
        let mut cmd = command(&["test", "-p", LONG_TESTS_PACKAGE, "--tests"]);
        if mpi {
            // The same build as above: without them cargo would build again.
            cmd.args(["--features", MPI_FEATURES]);
        }
        cmd.args(&extra);
        if !extra.iter().any(|a| a == "--") {
            cmd.arg("--");
        }
        cmd.arg("--ignored");
        let status = cmd.status().context("running the long tests")?;
        if !status.success() {
            bail!("the long tests failed ({status})");
        }
    }
    Ok(())
}

/// Whether `mpicc` and `mpirun` run (`--version`).
fn have_mpi() -> bool {
    ["mpicc", "mpirun"].iter().all(|p| {
        Command::new(p)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}
