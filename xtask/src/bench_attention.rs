//! CPU attention throughput against same-run baselines: prefill against a
//! plain f32 GEMM of the same FLOP count, decode against the measured
//! memory read bandwidth over the KV bytes it reads.
//!
//! Rows: `| case | time ms | attention | baseline | ratio | target |`.

use crate::best_of;
use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_kernels::{KvCacheLayout, KvCacheView, QkvFormat};

/// Deterministic values in [-1, 1).
fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// GFLOP/s of a square f32 GEMM (matrixmultiply) doing about `flops`.
fn gemm_gflops(flops: f64) -> f64 {
    let n = (flops / 2.0).cbrt().round() as usize;
    let a = fill(n * n, 1);
    let b = fill(n * n, 2);
    let mut c = vec![0f32; n * n];
    let t = best_of(2, || unsafe {
        // SAFETY: a, b, c are n x n row-major and live for the call.
        matrixmultiply::sgemm(
            n,
            n,
            n,
            1.0,
            a.as_ptr(),
            n as isize,
            1,
            b.as_ptr(),
            n as isize,
            1,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    });
    2.0 * (n * n * n) as f64 / t / 1e9
}

fn prefill() -> anyhow::Result<String> {
    let (s, h, d) = (2048usize, 32usize, 128usize);
    let attn = DotProductAttention::new(h, d)
        .with_attn_mask_type(AttnMaskType::Causal)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let q = fill(s * h * d, 3);
    let k = fill(s * h * d, 4);
    let v = fill(s * h * d, 5);
    let mut out = vec![0f32; s * h * d];
    let cu = [0, s as i32];
    let meta = AttnMetadata {
        batch: 1,
        max_seqlen_q: s,
        max_seqlen_kv: s,
        cu_seqlens_q: Some(&cu),
        cu_seqlens_kv: Some(&cu),
    };
    let mut result = Ok(());
    let t = best_of(2, || {
        result = attn.forward_cpu(&q, KvInput::Tensors { k: &k, v: &v }, &meta, &mut out, None);
    });
    result?;
    // q·k and p·v over the visible (causal) pairs.
    let flops = 4.0 * (d * h) as f64 * (s * (s + 1) / 2) as f64;
    let rate = flops / t / 1e9;
    let gemm = gemm_gflops(flops);
    Ok(format!(
        "| prefill 1 x {s} tokens, h {h}, d {d}, causal, f32 | {:.1} | {rate:.1} GFLOP/s | GEMM {gemm:.1} GFLOP/s | {:.0}% | 50% |",
        t * 1e3,
        100.0 * rate / gemm
    ))
}

fn decode() -> anyhow::Result<String> {
    let (b, skv, hq, hkv, d, page_size) = (32usize, 4096usize, 32usize, 8usize, 128usize, 16usize);
    let attn = DotProductAttention::new(hq, d)
        .with_num_gqa_groups(hkv)
        .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let pages_per_seq = skv / page_size;
    let num_pages = b * pages_per_seq;
    // Interleave the sequences' pages, as a paged cache filled together would.
    let page_table: Vec<i32> = (0..b)
        .flat_map(|s| (0..pages_per_seq).map(move |p| (p * b + s) as i32))
        .collect();
    let cache_seqlens = vec![skv as i32; b];
    let k_cache = fill(num_pages * page_size * hkv * d, 6);
    let v_cache = fill(num_pages * page_size * hkv * d, 7);
    let view = KvCacheView {
        k_cache: &k_cache,
        v_cache: &v_cache,
        layout: KvCacheLayout {
            num_heads_kv: hkv,
            head_dim_k: d,
            head_dim_v: d,
            page_size,
            page_table: &page_table,
            max_pages_per_seq: pages_per_seq,
            cache_seqlens: &cache_seqlens,
            ring_len: None,
        },
    };
    let q = fill(b * hq * d, 8);
    let mut out = vec![0f32; b * hq * d];
    let cu_q: Vec<i32> = (0..=b as i32).collect();
    let meta = AttnMetadata {
        batch: b,
        max_seqlen_q: 1,
        max_seqlen_kv: skv,
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_kv: None,
    };
    let mut result = Ok(());
    let t = best_of(3, || {
        result = attn.forward_cpu(&q, KvInput::Cache(view), &meta, &mut out, None);
    });
    result?;
    let bytes = std::mem::size_of_val(&k_cache[..]) + std::mem::size_of_val(&v_cache[..]);
    let rate = bytes as f64 / t / 1e9;
    let bandwidth = crate::bench_limits::read_bandwidth(&k_cache);
    Ok(format!(
        "| decode {b} seqs x 1 query, {skv} cached keys, h {hq}/{hkv}, d {d}, page {page_size}, f32 | {:.1} | {rate:.1} GB/s of KV | read bandwidth {bandwidth:.1} GB/s | {:.0}% | 50% |",
        t * 1e3,
        100.0 * rate / bandwidth
    ))
}

/// Runs the CPU attention benchmarks; one markdown row per case, columns
/// `| case | time ms | attention | baseline | ratio | target |`.
pub fn run() -> anyhow::Result<Vec<String>> {
    Ok(vec![prefill()?, decode()?])
}
