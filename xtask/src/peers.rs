//! `cargo xtask peers`: build the peer we measure against, llama.cpp, once
//! into a cache, for `cargo xtask bench --vs-llama-cpp` (and its
//! `llama-tokenize`, which makes the token ids of `tests/refs/`).
//!
//! The copy of llama.cpp is the one vendored in the `llama-cpp-python`
//! source distribution on the Python package index ([`LLAMA_CPP_PYTHON`]),
//! so it comes through pip like the test models and its version is pinned
//! by the package's. Steps (each skipped when its output is there): install
//! cmake with apt-get and scikit-build-core (the sdist's build backend, which
//! pip runs even to download it) with pip if they are missing, `pip
//! download` the sdist, unpack
//! it, configure with cmake (Release, no curl, no tests, no server; the
//! CPU features named explicitly from `/proc/cpuinfo`, never
//! `GGML_NATIVE`: some of these machines report AMX tiles without the AMX
//! instructions ggml's native build then uses, and llama.cpp dies with
//! SIGILL; see [`cpu_flags`]) into `build-portable/` and build [`TOOLS`] with `-j` = the machine's cores. The cache
//! is `$TE_HOME/peers/llama.cpp-<commit>/`; a second run finds the
//! binaries and only prints where they are. Not part of CI.

use anyhow::{bail, Context};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The `llama-cpp-python` release whose sdist vendors the llama.cpp we build.
pub const LLAMA_CPP_PYTHON: &str = "0.3.36";

/// The llama.cpp commit that release vendors (names the cache directory).
pub const LLAMA_CPP_COMMIT: &str = "0c1e57098";

/// The llama.cpp programs we build: the comparison runs the first four,
/// `cargo xtask bench speculative` also the speculative ones;
/// `llama-tokenize` makes the reference token ids in `tests/refs/`.
pub const TOOLS: [&str; 7] = [
    "llama-bench",
    "llama-batched-bench",
    "llama-perplexity",
    "llama-completion",
    "llama-speculative",
    "llama-lookup",
    "llama-tokenize",
];

/// Where the built llama.cpp programs are.
pub struct LlamaCpp {
    /// `build/bin` inside the unpacked llama.cpp.
    pub bin: PathBuf,
}

impl LlamaCpp {
    /// The path of one of [`TOOLS`].
    pub fn tool(&self, name: &str) -> PathBuf {
        self.bin.join(name)
    }
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    if let Some(arg) = args.first() {
        bail!("peers takes no arguments, got `{arg}`");
    }
    let peers = ensure_llama_cpp()?;
    println!("llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON}):");
    for t in TOOLS {
        println!("  {}", peers.tool(t).display());
    }
    Ok(())
}

/// The cache directory: `$TE_HOME/peers/llama.cpp-<commit>`.
pub fn cache_dir() -> PathBuf {
    te_formats::hub::te_home()
        .join("peers")
        .join(format!("llama.cpp-{LLAMA_CPP_COMMIT}"))
}

/// The built llama.cpp, if the cache already holds every one of [`TOOLS`].
pub fn cached() -> Option<LlamaCpp> {
    let bin = source_dir(&cache_dir()).join(BUILD_DIR).join("bin");
    TOOLS
        .iter()
        .all(|t| bin.join(t).is_file())
        .then_some(LlamaCpp { bin })
}

/// The build directory inside the llama.cpp source (not `build/`, which
/// an earlier `GGML_NATIVE=ON` configuration may hold).
const BUILD_DIR: &str = "build-portable";

/// ggml's CPU options for this machine: `GGML_NATIVE=OFF`, AVX, AVX2,
/// FMA, F16C and the AVX-512 subsets `/proc/cpuinfo` lists (AVX-512F,
/// BW, DQ, VL, CD together; VBMI, VNNI, BF16 each), never AMX.
fn cpu_flags() -> Vec<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: std::collections::HashSet<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default();
    let has = |f: &[&str]| f.iter().all(|x| flags.contains(x));
    let mut out = vec!["-DGGML_NATIVE=OFF".to_string()];
    for (option, needs) in [
        ("GGML_AVX", &["avx"][..]),
        ("GGML_AVX2", &["avx2"]),
        ("GGML_FMA", &["fma"]),
        ("GGML_F16C", &["f16c"]),
        (
            "GGML_AVX512",
            &["avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"],
        ),
        ("GGML_AVX512_VBMI", &["avx512vbmi"]),
        ("GGML_AVX512_VNNI", &["avx512_vnni"]),
        ("GGML_AVX512_BF16", &["avx512_bf16"]),
    ] {
        let on = if has(needs) { "ON" } else { "OFF" };
        out.push(format!("-D{option}={on}"));
    }
    out.extend(
        [
            "-DGGML_AMX_TILE=OFF",
            "-DGGML_AMX_INT8=OFF",
            "-DGGML_AMX_BF16=OFF",
        ]
        .map(String::from),
    );
    out
}

fn source_dir(cache: &Path) -> PathBuf {
    cache
        .join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}"))
        .join("vendor")
        .join("llama.cpp")
}

/// Returns the cached llama.cpp build, building it first if needed
/// (progress and tool output on stderr).
pub fn ensure_llama_cpp() -> anyhow::Result<LlamaCpp> {
    if let Some(found) = cached() {
        return Ok(found);
    }
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    // cmake first: pip runs the sdist's backend, which looks for it.
    ensure_cmake()?;
    let src = source_dir(&cache);
    if !src.join("CMakeLists.txt").is_file() {
        let sdist = download_sdist(&cache)?;
        eprintln!("peers: unpacking {}", sdist.display());
        run_cmd(
            Command::new("tar")
                .arg("xzf")
                .arg(&sdist)
                .arg("-C")
                .arg(&cache),
            "tar",
        )?;
        if !src.join("CMakeLists.txt").is_file() {
            bail!(
                "{} has no vendor/llama.cpp/CMakeLists.txt (sdist layout changed?)",
                sdist.display()
            );
        }
    }
    let build = src.join(BUILD_DIR);
    if !build.join("CMakeCache.txt").is_file() {
        let flags = cpu_flags();
        eprintln!(
            "peers: configuring llama.cpp in {} ({})",
            src.display(),
            flags.join(" ")
        );
        run_cmd(
            Command::new("cmake")
                .current_dir(&src)
                .args([
                    "-B",
                    BUILD_DIR,
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF",
                ])
                .args(&flags),
            "cmake (configure)",
        )?;
    }
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    eprintln!(
        "peers: building {} with -j {jobs} (minutes)",
        TOOLS.join(", ")
    );
    run_cmd(
        Command::new("cmake")
            .current_dir(&src)
            .args(["--build", BUILD_DIR, "-j", &jobs.to_string(), "--target"])
            .args(TOOLS),
        "cmake --build",
    )?;
    cached().with_context(|| {
        format!(
            "the build finished but {} lacks one of {}",
            build.join("bin").display(),
            TOOLS.join(", ")
        )
    })
}

/// `pip download`s the sdist into `<cache>/download` (once) and returns it.
fn download_sdist(cache: &Path) -> anyhow::Result<PathBuf> {
    let dl = cache.join("download");
    let find = |dl: &Path| -> Option<PathBuf> {
        std::fs::read_dir(dl)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("llama_cpp_python-") && n.ends_with(".tar.gz"))
            })
    };
    if let Some(found) = find(&dl) {
        return Ok(found);
    }
    // pip prepares an sdist's metadata even to download it, with the
    // package's build backend; --no-build-isolation makes it use the
    // installed one.
    let have_backend = Command::new("python3")
        .args(["-c", "import scikit_build_core"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_backend {
        eprintln!("peers: installing scikit-build-core (llama-cpp-python's build backend)");
        run_cmd(
            Command::new("python3").args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "scikit-build-core",
            ]),
            "pip install scikit-build-core",
        )?;
    }
    eprintln!("peers: downloading the llama-cpp-python=={LLAMA_CPP_PYTHON} sdist");
    run_cmd(
        Command::new("python3")
            .args(["-m", "pip", "download", "--no-deps", "--no-binary", ":all:"])
            .args(["--no-build-isolation", "--disable-pip-version-check", "-d"])
            .arg(&dl)
            .arg(format!("llama-cpp-python=={LLAMA_CPP_PYTHON}")),
        "pip download",
    )?;
    find(&dl).with_context(|| {
        format!(
            "pip download left no llama_cpp_python-*.tar.gz in {}",
            dl.display()
        )
    })
}

/// Installs cmake with apt-get when it is not on the PATH.
fn ensure_cmake() -> anyhow::Result<()> {
    if have("cmake") {
        return Ok(());
    }
    if !have("apt-get") {
        bail!("cmake is not installed and there is no apt-get to install it: install cmake");
    }
    eprintln!("peers: installing cmake with apt-get");
    run_cmd(Command::new("apt-get").arg("update"), "apt-get update")?;
    run_cmd(
        Command::new("apt-get").args(["install", "-y", "cmake"]),
        "apt-get install cmake",
    )
}

/// Whether `prog` runs (is on the PATH).
pub fn have(prog: &str) -> bool {
    Command::new(prog)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok()
}

fn run_cmd(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}
