//! Row-wise CPU ops of the transformer block, f32, row-major: RMSNorm
//! (Zhang & Sennrich 2019) and the residual add. Each row's result is the
//! same whichever thread computes it and however many rows run together.

use rayon::prelude::*;

use crate::lanes;

/// RMSNorm over rows of `x: [rows, dim]`: `y = x / sqrt(mean(x²) + eps) * w`.
///
/// `w` is the effective multiplier: for Gemma it already holds `1 + w`
/// (added in f32 at load time). Math: Zhang & Sennrich 2019.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_inplace(&mut y, w, eps);
    y
}

/// [`rms_norm`] of `x` into `y` (same length).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    y.copy_from_slice(x);
    rms_norm_inplace(y, w, eps);
}

/// Below this many values an elementwise or row-wise op runs on the
/// calling thread: handing a few thousand values to the pool costs more
/// than computing them (decode steps run ~7 such ops per layer). The
/// result is the same either way (each value is computed alone).
pub const SERIAL_MAX: usize = 16 * 1024;

/// In-place [`rms_norm`] over rows of length `w.len()`.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    let norm = |row: &mut [f32]| {
        let ms = sum_squares(row) / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    };
    if x.len() <= SERIAL_MAX {
        x.chunks_mut(dim).for_each(norm);
    } else {
        x.par_chunks_mut(dim).for_each(norm);
    }
}

/// `Σ v²` over `row` in 16 lanes (lane `l` sums the squares of the
/// elements `≡ l (mod 16)` in order, each a multiply then an add), then
/// the lanes as [`crate::lanes`]' fixed tree: independent chains, so it
/// vectorizes, where one running sum waits on every add.
fn sum_squares(row: &[f32]) -> f32 {
    let mut a = [0.0f32; 16];
    let chunks = row.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in a.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    for (a, v) in a.iter_mut().zip(tail) {
        *a += v * v;
    }
    lanes::reduce16(&a)
}

/// `x = x + y`, elementwise.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod norm_tests {
    use super::*;

    /// By hand: 1² + ... + 20² = 2870 (exact in f32 in any order).
    #[test]
    fn sum_squares_by_hand() {
        let row: Vec<f32> = (1..=20).map(|v| v as f32).collect();
        assert_eq!(sum_squares(&row), 2870.0);
        assert_eq!(sum_squares(&[]), 0.0);
    }

    /// RMSNorm against its float64 formula for row lengths around the
    /// 16 lanes and the models' widths, several rows at once (the pooled
    /// path included).
    #[test]
    fn rms_norm_matches_f64() {
        for dim in [1usize, 15, 16, 17, 64, 256, 640, 2047] {
            let rows = 40_000 / dim + 1;
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 0.01)
                .collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
            let y = rms_norm(&x, &w, 1e-6);
            for (r, (xr, yr)) in x.chunks(dim).zip(y.chunks(dim)).enumerate() {
                let ms = xr.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + 1e-6).sqrt();
                for (c, ((&xv, &yv), &g)) in xr.iter().zip(yr).zip(&w).enumerate() {
                    let want = xv as f64 * inv * g as f64;
                    assert!(
                        (yv as f64 - want).abs() <= 1e-6 * want.abs() + 1e-12,
                        "dim {dim} row {r} col {c}: {yv} vs {want}"
                    );
                }
            }
        }
    }
}
