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
//! download` the sdist, unpack it, then build [`TOOLS`] (Release, no curl,
//! no tests, no server, `-j` = the machine's cores) and smoke-test what was
//! built: a 16-token prompt and 16 generated tokens of `llama-bench` on
//! the SmolLM2 test model
//! ([`smoke_test`]). The first build tried is ggml's native one
//! (`GGML_NATIVE=ON`, in `build/`); when it fails to build or fails the
//! smoke test (some of these machines report AMX tiles, ggml's native
//! build then uses AMX instructions and llama.cpp dies with SIGILL), the
//! CPU features `/proc/cpuinfo` lists are named explicitly instead, never
//! AMX ([`cpu_flags`], in `build-portable/`). A build already there is
//! smoke-tested before anything is built. The build that passed and its
//! ggml CPU options (read back from its `CMakeCache.txt`) are recorded in
//! [`RECORD`], which later runs read and `bench --vs-llama-cpp` prints. The
//! cache is `$TE_HOME/peers/llama.cpp-<commit>/`; a second run finds the
//! record and only prints where the programs are. Not part of CI.

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

/// Where the built llama.cpp programs are, and how they were built.
pub struct LlamaCpp {
    /// `<build dir>/bin` inside the unpacked llama.cpp.
    pub bin: PathBuf,
    /// The build's ggml CPU options as its `CMakeCache.txt` holds them
    /// (`GGML_NATIVE=OFF GGML_AVX=ON ...`), for the bench tables.
    pub flags: String,
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
    println!(
        "llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON}), built with {}:",
        peers.flags
    );
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

/// The record of the build that passed the smoke test, in the cache
/// directory: one line, the build directory's name, a space, its ggml CPU
/// options.
const RECORD: &str = "build-flags.txt";

/// The recorded build, if the record is there and the build holds every
/// one of [`TOOLS`].
pub fn cached() -> Option<LlamaCpp> {
    let cache = cache_dir();
    let record = std::fs::read_to_string(cache.join(RECORD)).ok()?;
    let (dir, flags) = record.trim().split_once(' ')?;
    let bin = source_dir(&cache).join(dir).join("bin");
    has_tools(&bin).then(|| LlamaCpp {
        bin,
        flags: flags.to_string(),
    })
}

/// Whether `bin` holds every one of [`TOOLS`].
fn has_tools(bin: &Path) -> bool {
    TOOLS.iter().all(|t| bin.join(t).is_file())
}

/// One way of building llama.cpp: a build directory inside the source
/// and the ggml CPU options it is configured with.
struct Build {
    dir: &'static str,
    options: Vec<String>,
    /// How the messages name it.
    what: &'static str,
}

/// The builds tried, in order: ggml's native one, then the CPU features
/// named explicitly.
fn builds() -> [Build; 2] {
    [
        Build {
            dir: "build",
            options: vec!["-DGGML_NATIVE=ON".to_string()],
            what: "native (GGML_NATIVE=ON)",
        },
        Build {
            dir: "build-portable",
            options: cpu_flags(),
            what: "explicit CPU flags from /proc/cpuinfo",
        },
    ]
}

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

/// The ggml CPU options a configured build directory's `CMakeCache.txt`
/// holds (`GGML_NATIVE`, `GGML_AVX*`, `GGML_AMX*`, `GGML_FMA`,
/// `GGML_F16C`), as `NAME=VALUE` separated by spaces.
fn configured_flags(build: &Path) -> anyhow::Result<String> {
    let path = build.join("CMakeCache.txt");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(cache_options(&text).join(" "))
}

/// The ggml CPU options of a `CMakeCache.txt`'s text (`NAME:TYPE=VALUE`
/// lines), as `NAME=VALUE`, in the file's order: every option whose name
/// starts with one of the CPU prefixes.
fn cache_options(text: &str) -> Vec<String> {
    const CPU: [&str; 5] = [
        "GGML_NATIVE",
        "GGML_AVX",
        "GGML_AMX",
        "GGML_FMA",
        "GGML_F16C",
    ];
    text.lines()
        .filter_map(|l| {
            let (name, value) = l.split_once('=')?;
            let name = name.split_once(':').map_or(name, |(n, _)| n);
            CPU.iter()
                .any(|c| name.starts_with(c))
                .then(|| format!("{name}={value}"))
        })
        .collect()
}

fn source_dir(cache: &Path) -> PathBuf {
    cache
        .join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}"))
        .join("vendor")
        .join("llama.cpp")
}

/// Returns the recorded llama.cpp build, or finds or builds one that
/// passes [`smoke_test`] (the native build first, then the explicit CPU
/// flags) and records it (progress and tool output on stderr).
pub fn ensure_llama_cpp() -> anyhow::Result<LlamaCpp> {
    if let Some(found) = cached() {
        return Ok(found);
    }
    let cache = cache_dir();
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let builds = builds();
    // A build already there (an earlier run's) is tried before any is made.
    let src = source_dir(&cache);
    for b in &builds {
        let dir = src.join(b.dir);
        if has_tools(&dir.join("bin")) {
            if let Some(found) = accept(&cache, b, &dir)? {
                return Ok(found);
            }
        }
    }
    // cmake first: pip runs the sdist's backend, which looks for it.
    ensure_cmake()?;
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
    let mut failures = Vec::new();
    for b in &builds {
        let dir = src.join(b.dir);
        if has_tools(&dir.join("bin")) {
            // Built before and failed its smoke test above.
            failures.push(format!("{}: failed the smoke test", b.what));
            continue;
        }
        if let Err(e) = build(&src, b) {
            eprintln!("peers: the {} build failed: {e:#}", b.what);
            failures.push(format!("{}: {e:#}", b.what));
            continue;
        }
        if let Some(found) = accept(&cache, b, &dir)? {
            return Ok(found);
        }
        failures.push(format!("{}: failed the smoke test", b.what));
    }
    bail!(
        "no llama.cpp build in {} works: {}",
        src.display(),
        failures.join("; ")
    )
}

/// Smoke-tests build `b` in `dir`; when it passes, records it and returns
/// it, else says why on stderr and returns `None`.
fn accept(cache: &Path, b: &Build, dir: &Path) -> anyhow::Result<Option<LlamaCpp>> {
    let found = LlamaCpp {
        bin: dir.join("bin"),
        flags: configured_flags(dir)?,
    };
    eprintln!(
        "peers: smoke-testing the {} build ({})",
        b.what, found.flags
    );
    if let Err(e) = smoke_test(&found) {
        eprintln!("peers: the {} build failed its smoke test: {e:#}", b.what);
        return Ok(None);
    }
    eprintln!("peers: using the {} build: {}", b.what, found.flags);
    let record = cache.join(RECORD);
    std::fs::write(&record, format!("{} {}\n", b.dir, found.flags))
        .with_context(|| format!("writing {}", record.display()))?;
    Ok(Some(found))
}

/// Configures (unless already configured) and builds [`TOOLS`] of build
/// `b` in `src`.
fn build(src: &Path, b: &Build) -> anyhow::Result<()> {
    if !src.join(b.dir).join("CMakeCache.txt").is_file() {
        eprintln!(
            "peers: configuring llama.cpp in {}/{} ({})",
            src.display(),
            b.dir,
            b.options.join(" ")
        );
        run_cmd(
            Command::new("cmake")
                .current_dir(src)
                .args([
                    "-B",
                    b.dir,
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF",
                ])
                .args(&b.options),
            "cmake (configure)",
        )?;
    }
    let jobs = std::thread::available_parallelism().map_or(2, |n| n.get());
    eprintln!(
        "peers: building {} ({}) with -j {jobs} (minutes)",
        TOOLS.join(", "),
        b.what
    );
    run_cmd(
        Command::new("cmake")
            .current_dir(src)
            .args(["--build", b.dir, "-j", &jobs.to_string(), "--target"])
            .args(TOOLS),
        "cmake --build",
    )?;
    if !has_tools(&src.join(b.dir).join("bin")) {
        bail!(
            "the build finished but {}/bin lacks one of {}",
            b.dir,
            TOOLS.join(", ")
        );
    }
    Ok(())
}

/// The smoke test: `llama-bench -p 16 -n 16 -r 1 -t 2 -o json` on the
/// SmolLM2 test model (fetched if missing) must exit with success and
/// report a `pp16` and a `tg16` result above 0 tokens/s. A build that uses
/// instructions the processor lacks dies here (SIGILL). Both tests are
/// needed: a native build on an AMX-reporting processor here generated
/// 16 tokens and then died (SIGSEGV) on its first 16-token prompt.
pub fn smoke_test(llama: &LlamaCpp) -> anyhow::Result<()> {
    let name = "smollm2-135m";
    let model = te_formats::hub::known_model(name)?;
    let file = te_formats::hub::fetch_model(model).with_context(|| format!("fetching {name}"))?;
    let out = Command::new(llama.tool("llama-bench"))
        .arg("-m")
        .arg(&file)
        .args(["-p", "16", "-n", "16", "-r", "1", "-t", "2", "-o", "json"])
        .stdin(std::process::Stdio::null())
        .output()
        .context("running llama-bench")?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        bail!(
            "llama-bench -p 16 -n 16 on {name} failed ({}): {}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        );
    }
    let results = single_results(&String::from_utf8_lossy(&out.stdout))?;
    let ok = |want: &str| results.iter().any(|(t, avg, _)| t == want && *avg > 0.0);
    if !(ok("pp16") && ok("tg16")) {
        bail!("llama-bench -p 16 -n 16 on {name} reported {results:?}, not pp16 and tg16 results");
    }
    Ok(())
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

/// `(test name, avg_ts, stddev_ts)` of each object of a llama-bench JSON
/// array (test names as llama-bench's markdown: `pp128`, `tg64`).
pub fn single_results(json: &str) -> anyhow::Result<Vec<(String, f64, f64)>> {
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).context("parsing llama-bench JSON")?;
    let arr = v.as_array().context("llama-bench JSON is not an array")?;
    arr.iter()
        .map(|o| {
            let p = o["n_prompt"].as_u64().context("n_prompt")?;
            let n = o["n_gen"].as_u64().context("n_gen")?;
            let name = match (p, n) {
                (p, 0) => format!("pp{p}"),
                (0, n) => format!("tg{n}"),
                (p, n) => format!("pp{p}+tg{n}"),
            };
            Ok((name, json_f64(o, "avg_ts")?, json_f64(o, "stddev_ts")?))
        })
        .collect()
}

fn json_f64(o: &serde_json::Value, field: &str) -> anyhow::Result<f64> {
    o[field]
        .as_f64()
        .with_context(|| format!("field `{field}` missing or not a number"))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU options of a hand-written `CMakeCache.txt`, in its order;
    /// comments and other options left out.
    #[test]
    fn cache_options_keeps_the_cpu_options() {
        let text = "// comment\n\
                    GGML_AMX_TILE:BOOL=OFF\n\
                    GGML_AVX:BOOL=ON\n\
                    GGML_AVX512_VNNI:BOOL=ON\n\
                    GGML_CUDA:BOOL=OFF\n\
                    GGML_F16C:BOOL=ON\n\
                    GGML_FMA:BOOL=ON\n\
                    CMAKE_BUILD_TYPE:STRING=Release\n\
                    GGML_NATIVE:BOOL=OFF\n";
        assert_eq!(
            cache_options(text).join(" "),
            "GGML_AMX_TILE=OFF GGML_AVX=ON GGML_AVX512_VNNI=ON GGML_F16C=ON GGML_FMA=ON GGML_NATIVE=OFF"
        );
    }
}
