//! CPU kernel throughput for `cargo xtask bench`: RoPE and KV save at
//! Llama-7B-like shapes (32 heads, head dim 128, f32), for a 32-sequence
//! decode step and a 4096-token prefill, in GB/s of bytes read + written,
//! next to a memory copy of the same bytes measured in the same run (a
//! rayon-parallel `copy_from_slice` over 1 MiB chunks, the bandwidth the
//! kernels could reach). Target: at least 50% of the copy.

use std::time::{Duration, Instant};

use rayon::prelude::*;
use te_kernels::{
    apply_rope_cpu, save_kv_cpu, KvCacheLayout, KvStep, QkvFormat, RopeArgs, RopeConvention,
    RopeFreqs, RopeScaling, RopeTable,
};

const HEADS: usize = 32;
const HEAD_DIM: usize = 128;
const PAGE_SIZE: usize = 16;

/// Seconds per call: best of 5 rounds, each long enough to time.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let mut iters = 1usize;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        if t.elapsed() > Duration::from_millis(20) {
            break;
        }
        iters *= 2;
    }
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

/// GB/s of a parallel copy moving `bytes` (read + written) in total.
fn copy_gbps(bytes: usize) -> f64 {
    let n = bytes / 2 / 4;
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let chunk = (1 << 20) / 4;
    let s = time(|| {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
    });
    bytes as f64 / s / 1e9
}

fn row(op: &str, shape: &str, bytes: usize, secs: f64) -> String {
    let gbps = bytes as f64 / secs / 1e9;
    let copy = copy_gbps(bytes);
    format!(
        "| {op} | {shape} | {:.1} MB | {gbps:.1} | {copy:.1} | {:.0}% |",
        bytes as f64 / 1e6,
        100.0 * gbps / copy
    )
}

/// `(sequences, tokens per sequence, tokens already cached)` of the two steps.
const STEPS: [(&str, usize, usize, usize); 2] = [("decode", 32, 1, 1000), ("prefill", 1, 4096, 0)];

/// Markdown table (header included) of the CPU kernel benchmarks.
pub fn run() -> anyhow::Result<Vec<String>> {
    let mut rows = vec![
        "| op | step (h 32, d 128, f32) | bytes moved | GB/s | copy GB/s | % of copy |".to_string(),
        "|---|---|---|---|---|---|".to_string(),
    ];
    let table = RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: HEAD_DIM,
        max_positions: 8192,
        scaling: RopeScaling::None,
    })?;
    let row_elems = HEADS * HEAD_DIM;
    for (name, batch, len, cached) in STEPS {
        let cu: Vec<i32> = (0..=batch).map(|b| (b * len) as i32).collect();
        let t = batch * len;
        let shape = format!("{name}: {batch} x {len} tokens");

        // RoPE in place on thd Q: every element read and written once.
        let starts = vec![cached as i32; batch];
        let mut q: Vec<f32> = (0..t * row_elems).map(|i| (i % 97) as f32 * 0.01).collect();
        let args = RopeArgs::thd(RopeConvention::HalfSplit, HEADS, HEAD_DIM, &cu, &starts);
        let secs =
            time(|| apply_rope_cpu(&mut q, &table, &args).expect("rope arguments are valid"));
        rows.push(row("rope (in place)", &shape, 2 * 4 * q.len(), secs));

        // KV save into a paged cache: K and V each read and written once.
        let seqlens = vec![(cached + len) as i32; batch];
        let pages_per_seq = (cached + len).div_ceil(PAGE_SIZE);
        let page_table: Vec<i32> = (0..(batch * pages_per_seq) as i32).collect();
        let cache_elems = batch * pages_per_seq * PAGE_SIZE * row_elems;
        let (mut kc, mut vc) = (vec![0f32; cache_elems], vec![0f32; cache_elems]);
        let k = vec![0.5f32; t * row_elems];
        let layout = KvCacheLayout {
            num_heads_kv: HEADS,
            head_dim_k: HEAD_DIM,
            head_dim_v: HEAD_DIM,
            page_size: PAGE_SIZE,
            page_table: &page_table,
            max_pages_per_seq: pages_per_seq,
            cache_seqlens: &seqlens,
            ring_len: None,
        };
        let step = KvStep {
            format: QkvFormat::Thd,
            cu_seqlens: &cu,
            max_seqlen: len,
        };
        let secs = time(|| {
            save_kv_cpu(&k, &k, &mut kc, &mut vc, &layout, &step).expect("save arguments are valid")
        });
        rows.push(row(
            "kv save (paged, 16)",
            &shape,
            2 * 2 * 4 * k.len(),
            secs,
        ));
    }
    Ok(rows)
}
