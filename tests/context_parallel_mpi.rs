//! `te generate --context-parallel mpi` under `mpirun` (a build with
//! `--features mpi`, which `cargo xtask test` makes where `mpicc` and
//! `mpirun` are found; `.ci/run` installs OpenMPI): the reference greedy
//! tokens at 2 and 3 ranks, over the default transport and TCP (and
//! Qwen2.5-Coder 0.5B's at 2 ranks), and a
//! killed rank ends the job within 10 s naming it.

#![cfg(feature = "mpi")]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn mpirun(np: usize, btl: Option<&str>) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    if let Some(b) = btl {
        c.args(["--mca", "btl", b]);
    }
    c.arg(env!("CARGO_BIN_EXE_te"));
    c
}

#[test]
fn reference_tokens_on_2_and_3_processes_over_each_transport() {
    let every: &[(usize, Option<&str>)] = &[
        (2, None),
        (3, None),
        (2, Some("self,tcp")),
        (3, Some("self,tcp")),
    ];
    // Qwen2 once: its 1,020-token prompt makes each run long.
    let qwen: &[(usize, Option<&str>)] = &[(2, None)];
    for (model, runs) in [
        ("smollm2-135m", every),
        ("gemma3-270m", every),
        ("qwen2.5-coder-0.5b", qwen),
    ] {
        let lines = read_jsonl(model, "greedy.jsonl");
        for &(np, btl) in runs {
            let mut cmd = mpirun(np, btl);
            cmd.args([
                "generate",
                "--context-parallel",
                "mpi",
                "-t",
                "1",
                "--model",
                model,
            ])
            .args(["--json", "--max-new-tokens", "32", "--ignore-eos"]);
            for line in &lines {
                cmd.args(["--prompt", line["prompt"].as_str().unwrap()]);
            }
            let out = cmd.output().expect("mpirun (apt-get install openmpi-bin)");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{model} -np {np} {btl:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            // Rank 0 prints, the others stay silent.
            let got: Vec<serde_json::Value> = stdout
                .lines()
                .map(|l| serde_json::from_str(l).expect("a JSON line"))
                .collect();
            assert_eq!(got.len(), lines.len(), "{stdout}");
            for (o, line) in got.iter().zip(&lines) {
                assert_eq!(
                    ids(&o["tokens"]),
                    ids(&line["tokens"]),
                    "{model} -np {np} {btl:?}, prompt {}",
                    line["prompt"]
                );
            }
        }
    }
}

#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let mut child = mpirun(2, None)
        .args(["generate", "--context-parallel", "mpi", "-t", "1"])
        .args(["--model", "smollm2-135m", "--max-new-tokens", "100000"])
        .args(["--ignore-eos", "--prompt", "Once upon a time"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    // Wait until both ranks generate, then kill rank 1 (the younger te).
    std::thread::sleep(Duration::from_secs(8));
    let pids = Command::new("pgrep")
        .args(["-P", &child.id().to_string(), "-f", "context-parallel"])
        .output()
        .unwrap();
    let pids: Vec<String> = String::from_utf8_lossy(&pids.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(pids.len(), 2, "the two ranks' processes: {pids:?}");
    let victim = pids
        .iter()
        .max_by_key(|p| p.parse::<u32>().unwrap())
        .unwrap();
    let killed_at = Instant::now();
    assert!(Command::new("kill")
        .args(["-KILL", victim])
        .status()
        .unwrap()
        .success());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if killed_at.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("mpirun still running 10 s after a rank was killed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rank 1"), "{stderr}");
}
