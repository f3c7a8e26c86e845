//! Keeps docs/ARCHITECTURE.md's code map true: every crate has a `//!` doc,
//! every crate has a bullet in the map, and every source file the map names
//! exists in its crate.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_crate_root_starts_with_a_doc_comment() {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    crates.push(root().join("xtask"));
    for krate in crates {
        let lib = krate.join("src/lib.rs");
        let main = krate.join("src/main.rs");
        let path = if lib.exists() { lib } else { main };
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("//!"),
            "{} has no `//!` crate doc",
            path.display()
        );
    }
}

#[test]
fn code_map_names_every_crate_and_only_files_that_exist() {
    let map = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let bullets: Vec<&str> = map.split("\n- **`").skip(1).collect();
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let tag = format!("crates/{name}`**");
        assert!(
            bullets.iter().any(|b| b.starts_with(&tag)),
            "docs/ARCHITECTURE.md has no code-map entry for crates/{name}"
        );
    }
    for bullet in bullets.iter().filter(|b| b.starts_with("crates/")) {
        let krate = &bullet[..bullet.find('`').unwrap()];
        let mut files = Vec::new();
        rust_files(&root().join(krate).join("src"), &mut files);
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for (i, piece) in bullet.split('`').enumerate() {
            if i % 2 == 1 && piece.ends_with(".rs") {
                assert!(
                    names.iter().any(|n| n == piece),
                    "docs/ARCHITECTURE.md names {piece} under {krate}, which has no such file"
                );
            }
        }
    }
}
