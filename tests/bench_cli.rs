//! `te bench` on SmolLM2-135M: llama-bench's JSON fields (`-o json`) and
//! llama-batched-bench's (`--batched -o jsonl`), positive and consistent
//! numbers, speculative decoding in both, and one-line errors for bad
//! arguments. Tiny sizes: this checks
//! the measurement, not the speed.

mod common;

use common::te;
use serde_json::Value;

const MODEL: &str = "smollm2-135m";

fn num(o: &Value, f: &str) -> f64 {
    o[f].as_f64()
        .unwrap_or_else(|| panic!("field {f} missing or not a number in {o}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()) + 1e-9
}

#[test]
fn llama_bench_mode_reports_llama_bench_fields() {
    let (ok, stdout, stderr) = te(&[
        "bench", "--model", MODEL, "-p", "16", "-n", "4", "-r", "2", "-t", "2", "-o", "json",
    ]);
    assert!(ok, "te bench failed:\n{stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("one JSON array");
    let tests = v.as_array().expect("an array");
    assert_eq!(tests.len(), 2, "pp16 and tg4: {stdout}");
    for (t, (p, n)) in tests.iter().zip([(16u64, 0u64), (0, 4)]) {
        assert_eq!(t["n_prompt"].as_u64(), Some(p));
        assert_eq!(t["n_gen"].as_u64(), Some(n));
        assert_eq!(t["n_threads"].as_u64(), Some(2));
        assert!(t["model_filename"].as_str().unwrap().ends_with(".gguf"));
        assert!(t["model_type"].as_str().unwrap().starts_with("llama "));
        assert!(t["model_size"].as_u64().unwrap() > 0);
        assert!(t["model_n_params"].as_u64().unwrap() > 0);
        let ns: Vec<f64> = t["samples_ns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let ts: Vec<f64> = t["samples_ts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(ns.len(), 2, "-r 2 gives two samples");
        assert_eq!(ts.len(), 2);
        for (ns, ts) in ns.iter().zip(&ts) {
            assert!(*ns > 0.0 && *ts > 0.0);
            // samples_ts = (n_prompt + n_gen) / samples_ns, in seconds.
            assert!(close(*ts, 1e9 * (p + n) as f64 / ns), "{ts} vs {ns}");
        }
        let avg_ts = num(t, "avg_ts");
        assert!(close(avg_ts, (ts[0] + ts[1]) / 2.0));
        // Sample standard deviation of two values: |a - b| / sqrt(2).
        assert!(close(
            num(t, "stddev_ts"),
            (ts[0] - ts[1]).abs() / 2f64.sqrt()
        ));
        assert!((num(t, "avg_ns") - (ns[0] + ns[1]) / 2.0).abs() <= 1.0);
        assert!(num(t, "stddev_ns") >= 0.0);
    }
    // The markdown table: llama-bench's columns and test names.
    let (ok, stdout, stderr) = te(&["bench", "-m", MODEL, "-p", "8", "-n", "2", "-r", "1"]);
    assert!(ok, "te bench -o md failed:\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines[0],
        "| model | size | params | backend | threads | test | t/s |"
    );
    assert!(
        lines[2].contains("| pp8 |") && lines[3].contains("| tg2 |"),
        "{stdout}"
    );
}

#[test]
fn batched_mode_reports_llama_batched_bench_fields() {
    let (ok, stdout, stderr) = te(&[
        "bench",
        "--model",
        MODEL,
        "--batched",
        "--npp",
        "8",
        "--ntg",
        "4",
        "--npl",
        "1,2",
        "-t",
        "2",
        "-o",
        "jsonl",
    ]);
    assert!(ok, "te bench --batched failed:\n{stderr}");
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for (r, pl) in rows.iter().zip([1u64, 2]) {
        assert_eq!(r["pp"].as_u64(), Some(8));
        assert_eq!(r["tg"].as_u64(), Some(4));
        assert_eq!(r["pl"].as_u64(), Some(pl));
        assert_eq!(r["n_kv"].as_u64(), Some(pl * 12));
        assert_eq!(r["n_threads"].as_u64(), Some(2));
        let pl = pl as f64;
        let (t_pp, t_tg, t) = (num(r, "t_pp"), num(r, "t_tg"), num(r, "t"));
        assert!(t_pp > 0.0 && t_tg > 0.0);
        assert!(close(t, t_pp + t_tg));
        assert!(close(num(r, "speed_pp"), pl * 8.0 / t_pp));
        assert!(close(num(r, "speed_tg"), pl * 4.0 / t_tg));
        assert!(close(num(r, "speed"), pl * 12.0 / t));
        assert!(r["n_kv_max"].as_u64().unwrap() >= 2 * 12);
    }
}

/// Speculative decoding (`--draft-ngram`, and `--model-draft` with SmolLM2
/// drafting for itself) in both modes: the same tests and token counts
/// as without.
#[test]
fn speculative_decoding_runs_in_both_modes() {
    for draft in [["--draft-ngram", "1"], ["--model-draft", MODEL]] {
        let mut args = vec![
            "bench", "-m", MODEL, "-p", "0", "-n", "8", "-r", "1", "-o", "json",
        ];
        args.extend(draft);
        let (ok, stdout, stderr) = te(&args);
        assert!(ok, "te {args:?} failed:\n{stderr}");
        let v: Value = serde_json::from_str(&stdout).expect("one JSON array");
        let tests = v.as_array().expect("an array");
        assert_eq!(tests.len(), 1, "{stdout}");
        assert_eq!(tests[0]["n_gen"].as_u64(), Some(8), "{stdout}");
        assert!(num(&tests[0], "avg_ts") > 0.0);
        let mut args = vec![
            "bench",
            "-m",
            MODEL,
            "--batched",
            "--npp",
            "8",
            "--ntg",
            "8",
            "--npl",
            "2",
            "-o",
            "jsonl",
        ];
        args.extend(draft);
        let (ok, stdout, stderr) = te(&args);
        assert!(ok, "te {args:?} failed:\n{stderr}");
        let r: Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
        assert_eq!(r["n_kv"].as_u64(), Some(2 * 16), "{stdout}");
        assert!(close(num(&r, "speed_tg"), 2.0 * 8.0 / num(&r, "t_tg")));
    }
}

#[test]
fn a_zero_length_names_no_test_as_in_llama_bench() {
    let (ok, stdout, stderr) = te(&[
        "bench", "--model", MODEL, "-p", "0", "-n", "2", "-r", "1", "-t", "2", "-o", "json",
    ]);
    assert!(ok, "te bench failed:\n{stderr}");
    let v: Value = serde_json::from_str(&stdout).expect("one JSON array");
    let tests = v.as_array().expect("an array");
    assert_eq!(tests.len(), 1, "only tg2: {stdout}");
    assert_eq!(tests[0]["n_prompt"].as_u64(), Some(0));
    assert_eq!(tests[0]["n_gen"].as_u64(), Some(2));
}

#[test]
fn bad_bench_arguments_give_one_line_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["-p", "0", "-n", "0"], "no test"),
        (&["-p", "16,,32"], "-p"),
        (&["-n", "x"], "-n"),
        (&["-r", "0"], "-r"),
        (&["-t", "0"], "--threads"),
        (&["-o", "csv"], "-o"),
        (
            &["--batched", "--npp", "8", "--ntg", "4", "--npl", ""],
            "--npl",
        ),
        (&["--batched", "--npp", "8", "--ntg", "4"], "--npl"),
        (
            &["--batched", "--npp", "8", "--ntg", "0", "--npl", "1"],
            "--ntg",
        ),
        (
            &[
                "--batched",
                "-p",
                "8",
                "--npp",
                "8",
                "--ntg",
                "4",
                "--npl",
                "1",
            ],
            "-p",
        ),
        (&["--npl", "4"], "--batched"),
        (&["-p", "100000"], "context"),
    ];
    for (args, needle) in cases {
        let mut all = vec!["bench", "--model", MODEL];
        all.extend_from_slice(args);
        let (ok, stdout, stderr) = te(&all);
        assert!(!ok, "te {all:?} should fail");
        assert!(stdout.is_empty(), "te {all:?} printed {stdout:?}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
        assert_eq!(errors.len(), 1, "te {all:?}: {stderr}");
        assert!(errors[0].contains(needle), "te {all:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "te {all:?}: {stderr}");
    }
}
