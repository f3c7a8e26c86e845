//! te-ring over real MPI processes: runs the `mpi_ring` program under
//! `mpirun` on 2 and 3 ranks, with the default transports and with TCP
//! only, in each of its modes; and kills one rank mid-run to check that
//! `mpirun` tears the job down quickly, naming the rank. `mpirun` must be
//! installed (CI installs Open MPI): without it these tests fail.
#![cfg(feature = "mpi")]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

/// The ranks' program (te-ring's `mpi_ring` bin, built by cargo with
/// this test and the same features).
fn program() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_mpi_ring"))
}

/// `mpirun` with the flags every run needs (root in containers, more
/// ranks than cores).
fn mpirun(np: usize, btl: Option<&str>) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    if let Some(btl) = btl {
        c.args(["--mca", "btl", btl]);
    }
    c
}

#[test]
fn mpirun_is_installed() {
    let out = Command::new("mpirun").arg("--version").output();
    assert!(
        out.is_ok_and(|o| o.status.success()),
        "mpirun not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev)"
    );
}

#[test]
fn every_mode_passes_on_2_and_3_ranks_over_each_transport() {
    let exe = program();
    for np in [2, 3] {
        for btl in [None, Some("self,tcp")] {
            for mode in ["check", "mismatch", "gather-mismatch", "oversized"] {
                let start = Instant::now();
                let out = mpirun(np, btl)
                    .arg(&exe)
                    .arg(mode)
                    .output()
                    .expect("running mpirun");
                let (stdout, stderr) = (
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr),
                );
                let case = format!("np {np}, btl {btl:?}, mode {mode}");
                assert!(
                    out.status.success() && stdout.lines().any(|l| l == "ok"),
                    "{case}: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
                    out.status
                );
                // A failed ring gives up on unreceived sends after 2 s.
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "{case}: too slow"
                );
            }
        }
    }
}

#[test]
fn killing_a_rank_ends_the_job_quickly_naming_it() {
    let exe = program();
    for btl in [None, Some("self,tcp")] {
        let mut child = mpirun(3, btl)
            .arg(&exe)
            .arg("wait")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running mpirun");
        // Lines "rank R pid P waiting", read on a thread so the test can
        // time out instead of hanging.
        let (tx, rx) = channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut pids = Vec::new();
        while pids.len() < 3 {
            let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
                let _ = child.kill();
                panic!("btl {btl:?}: the ranks did not all start");
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["rank", r, "pid", p, "waiting"] = words[..] {
                pids.push((r.parse::<usize>().unwrap(), p.parse::<i32>().unwrap()));
            }
        }
        let (_, victim) = *pids.iter().find(|(r, _)| *r == 1).unwrap();
        let start = Instant::now();
        let killed = Command::new("kill")
            .args(["-KILL", &victim.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                panic!("btl {btl:?}: mpirun still running 10 s after the kill");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = start.elapsed();
        // mpirun's report, on either stream.
        let mut report = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut report).unwrap();
        while let Ok(line) = rx.recv_timeout(Duration::from_secs(1)) {
            report.push_str(&line);
            report.push('\n');
        }
        assert!(!status.success(), "btl {btl:?}: mpirun exited {status}");
        assert!(
            report.contains("process rank 1 ") && report.contains("signal 9"),
            "btl {btl:?}: mpirun's report does not name rank 1:\n{report}"
        );
        eprintln!("btl {btl:?}: mpirun exited {status} {elapsed:?} after the kill");
        // No rank outlives the job (a zombie awaiting its reaper counts as
        // gone; allow the kernel a moment to deliver mpirun's kills).
        for (r, pid) in pids {
            let running = || {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    !s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
            };
            let deadline = Instant::now() + Duration::from_secs(2);
            while running() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(
                !running(),
                "btl {btl:?}: rank {r} (pid {pid}) is still running"
            );
        }
    }
}
