//! Quantized matrix products (`Linear::forward_into`, te-kernels'
//! `matmul` kernel) against same-run baselines.
//!
//! Decode (`t` = 1, exact, and Q4_K and Q6_K also with 8-bit activations,
//! `--precision int8`): bytes of weights read per second against the read
//! bandwidth of a parallel sum over a buffer of the same size, measured in
//! the same run. The weights (~64 MiB, and a 178 MB row read from a file
//! map as a model's layers are) are larger than the last-level cache, as
//! a whole model's are in decode.
//!
//! Several rows (`t` = 32, 128, 512): GFLOP/s against the path this
//! kernel replaced, measured in the same run: the weight dequantized to
//! f32, then `matrixmultiply::sgemm`.

use crate::best_of;
use te_formats::{WeightBytes, WeightData};
use te_kernels::matmul::Precision;
use te_kernels::quant::{dequantize, GgmlType};
use te_models::ops::Linear;

/// The block types the two test models use, with their f16 field offsets.
const TYPES: [(GgmlType, &[usize]); 5] = [
    (GgmlType::Q4_1, &[0, 2]),
    (GgmlType::Q8_0, &[0]),
    (GgmlType::Q5_0, &[0]),
    (GgmlType::Q4_K, &[0, 2]),
    (GgmlType::Q6_K, &[208]),
];

/// Deterministic pseudo-random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect()
}

/// `n` rows of `k` weights of `ty` with random quants and small finite
/// f16 scales.
fn weights(ty: GgmlType, f16_at: &[usize], n: usize, k: usize) -> Vec<u8> {
    let (block_len, block_bytes) = ty.block_layout().expect("block type");
    let mut data = bytes(n * k / block_len * block_bytes, 7);
    for block in data.chunks_exact_mut(block_bytes) {
        for &at in f16_at {
            // 2^-8 and friends: finite, normal.
            let h = 0x1c00u16 | block[at] as u16;
            block[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    data
}

/// Markdown rows of the decode (bandwidth) table, header included: each
/// type at `k` = 2048 from the heap, then Gemma 3's output shape (Q8_0
/// `[262144, 640]`, 178 MB) read from a file map, as a model's layer
/// weights are read (the output projection itself is copied into 2 MiB
/// pages at load, `te_formats::gguf::GgufFile::tensor_weight_bytes`).
pub fn decode_rows() -> anyhow::Result<Vec<String>> {
    let mut rows = vec![
        "| weights | shape | bytes | t | ms | weights GB/s | read GB/s | % of read |".to_string(),
        "|---|---|---|---|---|---|---|---|".to_string(),
    ];
    let k = 2048;
    for (ty, f16_at) in TYPES {
        let (block_len, block_bytes) = ty.block_layout().expect("block type");
        let row_bytes = k / block_len * block_bytes;
        let n = (64 << 20) / row_bytes / 256 * 256;
        let data = weights(ty, f16_at, n, k);
        rows.push(decode_row(
            &ty.name(),
            ty,
            data.into(),
            n,
            k,
            Precision::Exact,
        )?);
    }
    // The K types again with 8-bit activations (`--precision int8`).
    for (ty, f16_at) in &TYPES[3..] {
        let (block_len, block_bytes) = ty.block_layout().expect("block type");
        let n = (64 << 20) / (k / block_len * block_bytes) / 256 * 256;
        let data = weights(*ty, f16_at, n, k);
        let label = format!("{} int8", ty.name());
        rows.push(decode_row(&label, *ty, data.into(), n, k, Precision::Int8)?);
    }
    let (ty, n, k) = (GgmlType::Q8_0, 262144, 640);
    let path = std::env::temp_dir().join(format!("te-bench-q8_0-{}.bin", std::process::id()));
    std::fs::write(&path, weights(ty, &[0], n, k))?;
    let file = std::fs::File::open(&path);
    // Unlinked at once (the open file keeps its bytes), whatever follows.
    std::fs::remove_file(&path)?;
    // SAFETY: the file is this process's own, unlinked, and not changed
    // while mapped.
    let map = unsafe { memmap2::Mmap::map(&file?)? };
    let len = map.len();
    let data = WeightBytes::mapped(std::sync::Arc::new(map), 0..len);
    rows.push(decode_row(
        "Q8_0 (file map)",
        ty,
        data,
        n,
        k,
        Precision::Exact,
    )?);
    Ok(rows)
}

/// One decode row: `lin.forward_into` at t = 1 on `[n, k]` weights of
/// `ty` in `precision`, against a parallel sum over as many bytes in the
/// same run.
fn decode_row(
    label: &str,
    ty: GgmlType,
    data: WeightBytes,
    n: usize,
    k: usize,
    precision: Precision,
) -> anyhow::Result<String> {
    let size = data.len();
    let mut lin = Linear::new("bench", WeightData::Quantized { ty, data }, n, k)?;
    lin.precision = precision;
    let x: Vec<f32> = (0..k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let mut y = vec![0f32; n];
    let mut scratch = te_kernels::matmul::Scratch::default();
    let secs = best_of(5, || lin.forward_into(&x, 1, &mut y, &mut scratch));
    let gbps = size as f64 / secs / 1e9;
    let read = crate::bench_limits::read_bandwidth(&vec![1.0f32; size / 4]);
    Ok(format!(
        "| {label} | [{n}, {k}] | {:.1} MB | 1 | {:.2} | {gbps:.1} | {read:.1} | {:.0}% |",
        size as f64 / 1e6,
        secs * 1e3,
        100.0 * gbps / read
    ))
}

/// Markdown rows of the several-rows (GFLOP/s) table, header included.
pub fn prefill_rows() -> anyhow::Result<Vec<String>> {
    let mut rows = vec![
        "| weights | shape | t | kernel ms | kernel GFLOP/s | dequantize + sgemm ms | ratio |"
            .to_string(),
        "|---|---|---|---|---|---|---|".to_string(),
    ];
    let (n, k) = (2048usize, 2048usize);
    for (ty, f16_at) in TYPES {
        let data = weights(ty, f16_at, n, k);
        let mut wf = vec![0f32; 256 * k];
        let lin = Linear::new(
            "bench",
            WeightData::Quantized {
                ty,
                data: data.into(),
            },
            n,
            k,
        )?;
        for t in [32usize, 128, 512] {
            let x: Vec<f32> = (0..t * k).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
            let mut y = vec![0f32; t * n];
            let mut scratch = te_kernels::matmul::Scratch::default();
            let secs = best_of(3, || lin.forward_into(&x, t, &mut y, &mut scratch));
            // The replaced path: blocks of 256 rows dequantized, then an
            // f32 GEMM into their columns of y.
            let WeightData::Quantized { data, .. } = &lin.weight else {
                unreachable!("quantized")
            };
            let row_bytes = data.len() / n;
            let base = best_of(3, || {
                for (b, rows) in data.chunks(256 * row_bytes).enumerate() {
                    let nb = rows.len() / row_bytes;
                    let w = &mut wf[..nb * k];
                    dequantize("bench", ty, rows, k, w).expect("dequantize");
                    // SAFETY: x [t, k]; w [nb, k] read as wᵀ; columns
                    // 256 b .. 256 b + nb of y [t, n]; all live.
                    unsafe {
                        matrixmultiply::sgemm(
                            t,
                            k,
                            nb,
                            1.0,
                            x.as_ptr(),
                            k as isize,
                            1,
                            w.as_ptr(),
                            1,
                            k as isize,
                            0.0,
                            y.as_mut_ptr().add(256 * b),
                            n as isize,
                            1,
                        );
                    }
                }
            });
            let gflops = 2.0 * (t * n * k) as f64 / secs / 1e9;
            rows.push(format!(
                "| {} | [{n}, {k}] | {t} | {:.2} | {gflops:.1} | {:.2} | {:.2}x |",
                ty.name(),
                secs * 1e3,
                base * 1e3,
                base / secs
            ));
        }
    }
    Ok(rows)
}
