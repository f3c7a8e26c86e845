//! Dense CPU ops of the model forward that are not attention, RoPE or the
//! KV cache: linear layers (f32 GEMM through `matrixmultiply`), RMSNorm and
//! the gated activations. All f32, row-major.

use rayon::prelude::*;

use crate::quant::{dequantize_blocks, GgmlType};

/// Storage of a `[rows, cols]` weight matrix.
#[derive(Clone, Debug)]
pub enum WeightData {
    /// f32, row-major.
    F32(Vec<f32>),
    /// GGUF blocks of type `ty`, `cols / block_len` blocks per row, kept as
    /// stored and dequantized one row at a time when used (the values are
    /// exactly those of a full dequantization).
    Quantized { ty: GgmlType, data: Vec<u8> },
}

/// A linear layer: `y = x · Wᵀ (+ b)`.
///
/// `weight: [out_features, in_features]`, row-major (Hugging Face and GGUF
/// order: GGUF `ne[0]` is `in_features`), f32 or GGUF-quantized;
/// `bias: [out_features]` when the model has one (Hugging Face
/// `attention_bias` / `mlp_bias`).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: WeightData,
    /// Added to every output row.
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
}

impl Linear {
    /// Wraps a `[out_features, in_features]` weight (no bias); errors name
    /// `tensor` when the data does not hold that many elements.
    pub fn new(
        tensor: &str,
        weight: WeightData,
        out_features: usize,
        in_features: usize,
    ) -> crate::Result<Self> {
        let n = out_features * in_features;
        let ok = match &weight {
            WeightData::F32(w) => w.len() == n,
            WeightData::Quantized { ty, data } => {
                ty.block_layout().is_some_and(|(block_len, _)| {
                    in_features.is_multiple_of(block_len)
                        && ty.bytes_for(n as u64) == Some(data.len() as u64)
                })
            }
        };
        if !ok {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!("data does not hold a [{out_features}, {in_features}] matrix"),
            });
        }
        Ok(Linear {
            weight,
            bias: None,
            out_features,
            in_features,
        })
    }

    /// The layer with bias `bias: [out_features]` (tensor `tensor`, named
    /// in the error when its length is not `out_features`).
    pub fn with_bias(mut self, tensor: &str, bias: Vec<f32>) -> crate::Result<Self> {
        if bias.len() != self.out_features {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!(
                    "has {} values, expected {} (out_features)",
                    bias.len(),
                    self.out_features
                ),
            });
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// `x: [t, in_features]` -> `y: [t, out_features]`, bias added.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; t * self.out_features];
        self.forward_into(x, t, &mut y, &mut Vec::new());
        y
    }

    /// [`forward`](Self::forward) into `y: [t, out_features]`, with
    /// `scratch` reused across calls (the matrix-vector path's transposed
    /// output for `1 < t <= 32`, and dequantized weight rows): decode
    /// allocates nothing once `scratch` has grown.
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32], scratch: &mut Vec<f32>) {
        let (n, k) = (self.out_features, self.in_features);
        assert_eq!(
            y.len(),
            t * n,
            "Linear::forward_into: y is not [t, out_features]"
        );
        match &self.weight {
            WeightData::F32(w) => matmul_transposed_into(x, t, w, n, k, y, scratch),
            WeightData::Quantized { ty, data } => {
                matmul_quantized_into(x, t, *ty, data, n, k, y, scratch)
            }
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(n) {
                add_inplace(row, b);
            }
        }
    }

    /// Row `r` of the weight (an embedding lookup), as f32 into `out: [in_features]`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.in_features;
        match &self.weight {
            WeightData::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            WeightData::Quantized { ty, data } => {
                let rb = data.len() / self.out_features;
                dequantize_blocks(*ty, &data[r * rb..(r + 1) * rb], out);
            }
        }
    }

    /// The whole weight as f32 `[out_features, in_features]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = vec![0.0f32; self.out_features * self.in_features];
        w.par_chunks_mut(self.in_features)
            .enumerate()
            .for_each(|(r, row)| self.row_into(r, row));
        w
    }
}

/// Weight rows dequantized per task by [`matmul_quantized`] for prefill.
const DEQUANT_BLOCK_ROWS: usize = 256;

/// `y = x · wᵀ` for a quantized `w: [n, k]` (`row_bytes` bytes per row).
///
/// Decode (`t <=` [`GEMV_MAX_ROWS`]): each task reads one weight row at a
/// time and takes its dot products with every row of `x`, so memory
/// traffic is the quantized bytes; with AVX2 the row is decoded into
/// registers 32 values at a time (bit-identical to dequantizing it into
/// scratch, which the other CPUs and types do). Prefill: blocks of rows
/// are dequantized and multiplied with the f32 GEMM.
fn matmul_quantized_into(
    x: &[f32],
    t: usize,
    ty: GgmlType,
    data: &[u8],
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    assert_eq!(x.len(), t * k, "matmul_quantized: x is not [t, k]");
    let row_bytes = data.len() / n;
    if t <= GEMV_MAX_ROWS {
        gemv_into(t, n, y, scratch, |yt| {
            yt.par_chunks_mut(GEMV_BLOCK * t)
                .zip(data.par_chunks(GEMV_BLOCK * row_bytes))
                .for_each(|(yt, w)| gemv_quantized_block(x, t, k, ty, w, yt))
        });
        return;
    }
    scratch.resize(DEQUANT_BLOCK_ROWS * k, 0.0);
    for (b, rows) in data.chunks(DEQUANT_BLOCK_ROWS * row_bytes).enumerate() {
        let nb = rows.len() / row_bytes;
        let w = &mut scratch[..nb * k];
        w.par_chunks_mut(k)
            .zip(rows.par_chunks(row_bytes))
            .for_each(|(o, r)| dequantize_blocks(ty, r, o));
        // y[:, b*R .. b*R + nb] = x · wᵀ.
        gemm_xwt_into(x, t, k, w, nb, y, b * DEQUANT_BLOCK_ROWS, n);
    }
}

/// The matrix-vector path's output: `compute` fills `yt: [n, t]`, which is
/// `y` itself when `t == 1` (the layouts agree), else `scratch`, then
/// transposed into `y: [t, n]`.
fn gemv_into(
    t: usize,
    n: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
    compute: impl FnOnce(&mut [f32]),
) {
    if t == 1 {
        compute(y);
        return;
    }
    scratch.resize(n * t, 0.0);
    compute(&mut scratch[..n * t]);
    for (j, col) in scratch[..n * t].chunks_exact(t).enumerate() {
        for (i, v) in col.iter().enumerate() {
            y[i * n + j] = *v;
        }
    }
}

/// `yt[j, i] = x_i · w_j` for the quantized weight rows `w` of one block:
/// decoded in registers where the AVX2 decoders cover `ty`, else each row
/// dequantized into scratch first.
fn gemv_quantized_block(x: &[f32], t: usize, k: usize, ty: GgmlType, w: &[u8], yt: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { gemv_quantized_block_avx2(x, t, k, ty, w, yt) };
    }
    gemv_quantized_block_generic(x, t, k, ty, w, yt)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_quantized_block_avx2(
    x: &[f32],
    t: usize,
    k: usize,
    ty: GgmlType,
    w: &[u8],
    yt: &mut [f32],
) {
    if !crate::quant::avx2::available(ty) {
        return gemv_quantized_block_generic(x, t, k, ty, w, yt);
    }
    // Rows of x in groups of up to FUSED_ROWS; each group reads the
    // block's weights once. Every row's arithmetic is the same whatever
    // the group, so results do not depend on t.
    for r0 in (0..t).step_by(FUSED_ROWS) {
        let c = (t - r0).min(FUSED_ROWS);
        let xs = &x[r0 * k..(r0 + c) * k];
        match c {
            1 => gemv_quantized_block_fused::<1>(xs, k, ty, w, yt, t, r0),
            2 => gemv_quantized_block_fused::<2>(xs, k, ty, w, yt, t, r0),
            3 => gemv_quantized_block_fused::<3>(xs, k, ty, w, yt, t, r0),
            4 => gemv_quantized_block_fused::<4>(xs, k, ty, w, yt, t, r0),
            5 => gemv_quantized_block_fused::<5>(xs, k, ty, w, yt, t, r0),
            6 => gemv_quantized_block_fused::<6>(xs, k, ty, w, yt, t, r0),
            7 => gemv_quantized_block_fused::<7>(xs, k, ty, w, yt, t, r0),
            8 => gemv_quantized_block_fused::<8>(xs, k, ty, w, yt, t, r0),
            _ => unreachable!("groups of at most FUSED_ROWS"),
        }
    }
}

/// [`gemv_quantized_block`] for `T` rows of `x` (columns `col0 .. col0 +
/// T` of `yt: [rows, ld]`) and a type with an AVX2 decoder: each group of 32 weights is decoded into registers and
/// multiplied into the accumulators directly (no scratch row). The
/// products and sums are those of [`dot`] in the same order (lanes 0..8
/// and 8..16 of its 16 accumulators, multiply then add, no FMA), so the
/// results are bit-identical to dequantizing the row and calling [`dot`].
///
/// Compiled for exactly the decoders' features (no FMA), so that `groups`
/// can be inlined into them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
fn gemv_quantized_block_fused<const T: usize>(
    x: &[f32],
    k: usize,
    ty: GgmlType,
    w: &[u8],
    yt: &mut [f32],
    ld: usize,
    col0: usize,
) {
    use std::arch::x86_64::*;
    let row_bytes = w.len() / (yt.len() / ld);
    let xs: [&[f32]; T] = std::array::from_fn(|i| &x[i * k..(i + 1) * k]);
    for (w_row, out) in w.chunks_exact(row_bytes).zip(yt.chunks_exact_mut(ld)) {
        let out = &mut out[col0..col0 + T];
        // Per row of x: dot's accumulator lanes 0..8 and 8..16.
        let mut acc = [[_mm256_setzero_ps(); 2]; T];
        let groups = |e: usize, v: [__m256; 4]| {
            for (acc, x) in acc.iter_mut().zip(&xs) {
                let x = &x[e..e + 32];
                for (i, v) in v.into_iter().enumerate() {
                    // SAFETY: reads x[8·i .. 8·i + 8], inside the 32 of `x`.
                    let xi = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) };
                    acc[i % 2] = _mm256_add_ps(acc[i % 2], _mm256_mul_ps(xi, v));
                }
            }
        };
        // SAFETY: this function runs only with AVX2 and F16C; the caller
        // checked that `ty` has an AVX2 decoder.
        unsafe { crate::quant::avx2::for_each_group(ty, w_row, groups) };
        for (o, acc) in out.iter_mut().zip(acc) {
            let mut lanes = [0.0f32; 16];
            // SAFETY: writes lanes[0..8] and lanes[8..16].
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
            }
            // k is a whole number of 32-element groups: dot's tail is empty.
            *o = dot_finish(&lanes, std::iter::empty::<f32>().sum());
        }
    }
}

#[inline(always)]
fn gemv_quantized_block_generic(
    x: &[f32],
    t: usize,
    k: usize,
    ty: GgmlType,
    w: &[u8],
    yt: &mut [f32],
) {
    let row_bytes = w.len() / (yt.len() / t);
    let mut row = vec![0.0f32; k];
    for (w_row, out) in w.chunks_exact(row_bytes).zip(yt.chunks_exact_mut(t)) {
        dequantize_blocks(ty, w_row, &mut row);
        gemv_block_generic(x, t, k, &row, out);
    }
}

/// Columns `col0 .. col0 + n` of `y: [t, ldy]` = `x · wᵀ` with `x: [t, k]`,
/// `w: [n, k]` (f32 GEMM, `matrixmultiply`).
fn gemm_xwt_into(
    x: &[f32],
    t: usize,
    k: usize,
    w: &[f32],
    n: usize,
    y: &mut [f32],
    col0: usize,
    ldy: usize,
) {
    assert!(
        x.len() >= t * k && w.len() >= n * k,
        "gemm_xwt_into: short input"
    );
    assert!(
        col0 + n <= ldy && y.len() >= t * ldy,
        "gemm_xwt_into: short output"
    );
    // C[t, n] = A[t, k] · B[k, n] with B = wᵀ: B[kk, j] = w[j, kk], i.e. row
    // stride 1 and column stride k over w's storage; C starts at column col0
    // of y with row stride ldy.
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
            y.as_mut_ptr().add(col0),
            ldy as isize,
            1,
        );
    }
}

/// Up to this many rows of `x` (decode, batched decode), products run as
/// matrix-vector products, reading each weight row once per group of
/// [`FUSED_ROWS`] rows, with per-row arithmetic that does not depend on
/// the number of rows: a sequence's logits are bit-identical alone and in
/// a batch of up to 32. Above, as a packed GEMM (prefill).
const GEMV_MAX_ROWS: usize = 32;

/// Rows of `x` the fused quantized kernel keeps in registers at once.
#[cfg(target_arch = "x86_64")]
const FUSED_ROWS: usize = 8;

/// Weight rows per parallel task of the matrix-vector path.
const GEMV_BLOCK: usize = 64;

/// `y = x · wᵀ`: `x: [t, k]`, `w: [n, k]` -> `y: [t, n]`, f32.
pub fn matmul_transposed(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; t * n];
    matmul_transposed_into(x, t, w, n, k, &mut y, &mut Vec::new());
    y
}

/// [`matmul_transposed`] into `y: [t, n]`, `scratch` reused (see
/// [`Linear::forward_into`]).
fn matmul_transposed_into(
    x: &[f32],
    t: usize,
    w: &[f32],
    n: usize,
    k: usize,
    y: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    assert_eq!(x.len(), t * k, "matmul_transposed: x is not [t, k]");
    assert_eq!(w.len(), n * k, "matmul_transposed: w is not [n, k]");
    if t == 0 {
        return;
    }
    if t <= GEMV_MAX_ROWS {
        // One block of weight rows per task.
        gemv_into(t, n, y, scratch, |yt| {
            yt.par_chunks_mut(GEMV_BLOCK * t)
                .zip(w.par_chunks(GEMV_BLOCK * k))
                .for_each(|(yt, w)| gemv_block(x, t, k, w, yt))
        });
        return;
    }
    gemm_xwt_into(x, t, k, w, n, y, 0, n);
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
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (xa, xb) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * xb[l];
        }
    }
    dot_finish(&acc, tail)
}

/// The last step of [`dot`]: its accumulators summed in order, plus the
/// sum of the tail products.
#[inline(always)]
fn dot_finish(acc: &[f32; 16], tail: f32) -> f32 {
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

/// [`rms_norm`] of `x` into `y` (same length).
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    y.copy_from_slice(x);
    rms_norm_inplace(y, w, eps);
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

/// GELU, tanh approximation: `0.5 x (1 + tanh(u))`, `u = sqrt(2/π) (x +
/// 0.044715 x³)` (Hendrycks & Gimpel 2016; Gemma's `gelu_pytorch_tanh`),
/// computed as the identical `x / (1 + exp(-2u))` (`1 + tanh(u) = 2 /
/// (1 + exp(-2u))`): one `exp` instead of `tanh`, which costs two libm
/// calls. Large negative `u` gives `exp` = inf and the correct 0.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + (-2.0 * u).exp())
}

/// `x = x + y`, elementwise.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod activation_tests {
    use super::*;

    /// GELU-tanh and SiLU against their float64 formulas, over the range
    /// activations take and beyond. In the negative tails the result is
    /// `x e^(-a)` with `a` (`2u`, or `x`) computed in f32, so the relative
    /// error grows as `|a| ε`; the float64 tanh form itself rounds values
    /// below ~1e-17 to 0, hence the small absolute slack.
    #[test]
    fn activations_match_f64() {
        let mut x = -60.0f32;
        while x <= 60.0 {
            let xd = x as f64;
            let u = (2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd * xd * xd);
            let gelu = 0.5 * xd * (1.0 + u.tanh());
            let silu_want = xd / (1.0 + (-xd).exp());
            for (got, want, a, name) in [
                (gelu_tanh(x), gelu, 2.0 * u, "gelu"),
                (silu(x), silu_want, xd, "silu"),
            ] {
                let got = got as f64;
                let tol = 1e-6 * (1.0 + a.abs()) * want.abs() + 1e-15;
                assert!(
                    (got - want).abs() <= tol,
                    "{name}({x}) = {got}, want {want}"
                );
            }
            x += 0.0173;
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::quant::tests::{random_row, AVX2_TYPES};

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Decode-sized quantized products (fused AVX2 path) equal the f32
        /// product with the dequantized weight bit for bit, and a float64
        /// reference within rounding.
        #[test]
        fn quantized_gemv_matches_dequantized(
            seed: u64,
            t in 1usize..=GEMV_MAX_ROWS,
            n in 1usize..=150,
            blocks_per_row in 1usize..=3,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            for (ty, f16_at) in AVX2_TYPES {
                let (block_len, _) = ty.block_layout().expect("layout");
                let k = blocks_per_row * block_len;
                let data = random_row(ty, f16_at, n * blocks_per_row, &mut rng);
                let x: Vec<f32> = (0..t * k).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let mut w = vec![f32::NAN; n * k];
                crate::quant::dequantize("w", ty, &data, k, &mut w).expect("dequantize");
                let mut got = vec![0.0f32; t * n];
                matmul_quantized_into(&x, t, ty, &data, n, k, &mut got, &mut Vec::new());
                let want = matmul_transposed(&x, t, &w, n, k);
                for i in 0..t {
                    for j in 0..n {
                        let (g, e) = (got[i * n + j], want[i * n + j]);
                        prop_assert_eq!(g.to_bits(), e.to_bits(), "{:?} y[{}, {}]: {} vs {}", ty, i, j, g, e);
                        let pairs = x[i * k..(i + 1) * k].iter().zip(&w[j * k..(j + 1) * k]);
                        let (exact, mag) = pairs.fold((0.0f64, 0.0f64), |(s, m), (&a, &b)| {
                            (s + a as f64 * b as f64, m + (a as f64 * b as f64).abs())
                        });
                        prop_assert!((g as f64 - exact).abs() <= 1e-5 * mag + 1e-30, "{:?} y[{}, {}]: {} vs f64 {}", ty, i, j, g, exact);
                    }
                }
            }
        }
    }
}
