//! `cargo xtask test [--gpu]`: fetches the test models, then runs every
//! test of the workspace (unit, property, end-to-end on real models).
//! `--gpu` sets `TE_REQUIRE_GPU=1`, which turns the GPU parity tests' skip
//! (no GPU present) into a failure.

use std::process::Command;

use anyhow::{bail, Context};

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
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(crate::workspace_root())
        .args(["test", "--workspace"])
        .args(&extra);
    if gpu {
        cmd.env("TE_REQUIRE_GPU", "1");
    }
    let status = cmd.status().context("running cargo test")?;
    if !status.success() {
        bail!("cargo test failed ({status})");
    }
    Ok(())
}
