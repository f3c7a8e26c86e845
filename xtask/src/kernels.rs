//! `cargo xtask kernels`: compiles every `kernels/*.cu` with NVRTC for sm_80
//! and sm_90 (PTX for `compute_80`, `compute_90`) on a machine without a GPU,
//! and fails on any error with NVRTC's log.
//!
//! NVRTC and the CUDA headers come from the pip wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12`, downloaded once
//! into `$TE_HOME/cuda` (default `~/.cache/te/cuda`) with `python3 -m pip
//! download` and unpacked with `python3 -m zipfile`. cudarc opens
//! `libnvrtc.so.12` by name, and the dynamic loader reads `LD_LIBRARY_PATH`
//! only at process start, so the compile step runs in a child process
//! (`xtask kernels --compile <include dir>`) with the wheel's lib dir on it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

const WHEELS: [&str; 2] = ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"];
const ARCHS: [&str; 2] = ["compute_80", "compute_90"];

pub fn run(args: &[String]) -> anyhow::Result<()> {
    match args {
        [flag, include] if flag == "--compile" => compile_all(Path::new(include)),
        [] => {
            let cuda = te_home().join("cuda");
            let (lib_dir, include_dir) = fetch_wheels(&cuda)?;
            let mut ld = lib_dir.into_os_string();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                ld.push(":");
                ld.push(old);
            }
            let status = Command::new(std::env::current_exe()?)
                .args(["kernels", "--compile"])
                .arg(&include_dir)
                .env("LD_LIBRARY_PATH", ld)
                .status()
                .context("running the NVRTC compile step")?;
            if !status.success() {
                bail!("kernel compilation failed (see the NVRTC logs above)");
            }
            Ok(())
        }
        _ => bail!("usage: cargo xtask kernels"),
    }
}

/// NVRTC's lib dir from the wheel a previous `cargo xtask kernels`
/// unpacked into `$TE_HOME/cuda`, if it is there (nothing is downloaded).
pub fn cached_nvrtc_lib_dir() -> Option<PathBuf> {
    let dir = te_home().join("cuda/unpacked/nvidia/cuda_nvrtc/lib");
    dir.join("libnvrtc.so.12").exists().then_some(dir)
}

/// `$TE_HOME`, default `~/.cache/te`.
fn te_home() -> PathBuf {
    match std::env::var_os("TE_HOME") {
        Some(h) => PathBuf::from(h),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| ".".into())).join(".cache/te")
        }
    }
}

/// Downloads and unpacks the wheels unless already there; returns NVRTC's
/// lib dir and the CUDA include dir.
fn fetch_wheels(cuda: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let root = cuda.join("unpacked");
    let lib_dir = root.join("nvidia/cuda_nvrtc/lib");
    let include_dir = root.join("nvidia/cuda_runtime/include");
    if lib_dir.join("libnvrtc.so.12").exists() && include_dir.join("cuda_runtime.h").exists() {
        return Ok((lib_dir, include_dir));
    }
    let wheels = cuda.join("wheels");
    std::fs::create_dir_all(&wheels)?;
    eprintln!(
        "downloading {} into {}",
        WHEELS.join(", "),
        wheels.display()
    );
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
        ])
        .arg(&wheels)
        .args(WHEELS)
        .status()
        .context("running python3 -m pip download")?;
    if !status.success() {
        bail!("pip download of {} failed", WHEELS.join(", "));
    }
    for entry in std::fs::read_dir(&wheels)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            let status = Command::new("python3")
                .args(["-m", "zipfile", "-e"])
                .arg(&path)
                .arg(&root)
                .status()
                .context("running python3 -m zipfile")?;
            if !status.success() {
                bail!("unpacking {} failed", path.display());
            }
        }
    }
    if !lib_dir.join("libnvrtc.so.12").exists() || !include_dir.join("cuda_runtime.h").exists() {
        bail!(
            "the wheels in {} lack libnvrtc.so.12 or cuda_runtime.h",
            wheels.display()
        );
    }
    Ok((lib_dir, include_dir))
}

/// Child step: compiles every `kernels/*.cu` for every arch.
fn compile_all(include_dir: &Path) -> anyhow::Result<()> {
    let kernels = crate::workspace_root().join("kernels");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&kernels)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "cu"));
    files.sort();
    if files.is_empty() {
        bail!("no .cu files in {}", kernels.display());
    }
    let includes = [
        kernels.display().to_string(),
        include_dir.display().to_string(),
    ];
    let mut failed = 0;
    for file in &files {
        let name = file
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let src =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for arch in ARCHS {
            match te_kernels::cuda::compile_ptx(&name, &src, arch, &includes) {
                Ok(ptx) => println!(
                    "ok    kernels/{name} {arch} ({} bytes of PTX)",
                    ptx.to_src().len()
                ),
                Err(e) => {
                    failed += 1;
                    println!("FAIL  kernels/{name} {arch}\n{e}");
                }
            }
        }
    }
    if failed > 0 {
        bail!("{failed} kernel compilation(s) failed");
    }
    Ok(())
}
