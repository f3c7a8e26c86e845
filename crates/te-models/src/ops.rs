//! Dense CPU ops of the model forward that are not attention, RoPE or the
//! KV cache: linear layers (f32 GEMM through `matrixmultiply`), RMSNorm and
//! the gated activations. All f32, row-major.

use rayon::prelude::*;

/// A linear layer without bias: `y = x · Wᵀ`.
///
/// `weight: [out_features, in_features]` f32, row-major (Hugging Face and
/// GGUF order: GGUF `ne[0]` is `in_features`).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Vec<f32>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear {
    /// Wraps a `[out_features, in_features]` weight; errors name `tensor`.
    pub fn new(
        tensor: &str,
        weight: Vec<f32>,
        out_features: usize,
        in_features: usize,
    ) -> crate::Result<Self> {
        if weight.len() != out_features * in_features {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!(
                    "has {} elements, expected [{out_features}, {in_features}]",
                    weight.len()
                ),
            });
        }
        Ok(Linear {
            weight,
            out_features,
            in_features,
        })
    }

    /// `x: [t, in_features]` -> `y: [t, out_features]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        matmul_transposed(x, t, &self.weight, self.out_features, self.in_features)
    }
}

/// Up to this many rows of `x`, [`matmul_transposed`] runs as
/// matrix-vector products (decode), reading each weight row once; above,
/// as a packed GEMM (prefill).
const GEMV_MAX_ROWS: usize = 8;

/// Weight rows per parallel task of the matrix-vector path.
const GEMV_BLOCK: usize = 64;

/// `y = x · wᵀ`: `x: [t, k]`, `w: [n, k]` -> `y: [t, n]`, f32.
pub fn matmul_transposed(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(x.len(), t * k, "matmul_transposed: x is not [t, k]");
    assert_eq!(w.len(), n * k, "matmul_transposed: w is not [n, k]");
    let mut y = vec![0.0f32; t * n];
    if t == 0 {
        return y;
    }
    if t <= GEMV_MAX_ROWS {
        // yt: [n, t], one block of weight rows per task, then transposed.
        let mut yt = vec![0.0f32; n * t];
        yt.par_chunks_mut(GEMV_BLOCK * t)
            .zip(w.par_chunks(GEMV_BLOCK * k))
            .for_each(|(yt, w)| gemv_block(x, t, k, w, yt));
        for (j, row) in yt.chunks_exact(t).enumerate() {
            for (i, v) in row.iter().enumerate() {
                y[i * n + j] = *v;
            }
        }
        return y;
    }
    // C[t, n] = A[t, k] · B[k, n] with B = wᵀ: B[kk, j] = w[j, kk], i.e. row
    // stride 1 and column stride k over w's storage.
    // SAFETY: the asserts above bound every index sgemm reads or writes.
    unsafe {
        matrixmultiply::sgemm(
            t,
            k,
            n,
            1.0,
            x.as_ptr(),
            k as isize,
            1,
            w.as_ptr(),
            1,
            k as isize,
            0.0,
            y.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    y
}

/// `yt[j, i] = x_i · w_j` for the weight rows `w: [rows, k]` of one block.
fn gemv_block(x: &[f32], t: usize, k: usize, w: &[f32], yt: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { gemv_block_avx2(x, t, k, w, yt) };
    }
    gemv_block_generic(x, t, k, w, yt)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemv_block_avx2(x: &[f32], t: usize, k: usize, w: &[f32], yt: &mut [f32]) {
    gemv_block_generic(x, t, k, w, yt)
}

#[inline(always)]
fn gemv_block_generic(x: &[f32], t: usize, k: usize, w: &[f32], yt: &mut [f32]) {
    for (w_row, out) in w.chunks_exact(k).zip(yt.chunks_exact_mut(t)) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = dot(&x[i * k..(i + 1) * k], w_row);
        }
    }
}

/// Dot product with 16 independent accumulators (vectorizes without
/// reassociating a single sum).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (xa, xb) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * xb[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// RMSNorm over rows of `x: [rows, dim]`: `y = x / sqrt(mean(x²) + eps) * w`.
///
/// `w` is the effective multiplier: for Gemma it already holds `1 + w`
/// (added in f32 at load time). Math: Zhang & Sennrich 2019.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut y = x.to_vec();
    rms_norm_inplace(&mut y, w, eps);
    y
}

/// In-place [`rms_norm`] over rows of length `w.len()`.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    x.par_chunks_mut(dim).for_each(|row| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    });
}

/// SiLU: `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`
/// (Hendrycks & Gimpel 2016; Gemma's `gelu_pytorch_tanh`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// `x = x + y`, elementwise.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
