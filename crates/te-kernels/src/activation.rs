//! The gated MLP's activations, `g = act(g) · u` elementwise over f32
//! rows, with an `exp` of our own that the scalar code and the AVX-512
//! and AVX2 kernels compute with the same IEEE operations, so a value is
//! bit-identical whichever path computes it (and on every CPU).
//!
//! `exp` (Cody & Waite's range reduction, Cephes' `expf` polynomial as
//! published in Moshier, *Methods and Programs for Mathematical
//! Functions*, 1989): `n = round(x log2 e)` (ties to even), `r = x - n
//! ln 2` in two fused multiply-adds (`ln 2 = LN2_HI + LN2_LO`, `LN2_HI`
//! with few enough bits that `n · LN2_HI` is exact), `e^r = 1 + r + r² P(r)`
//! (P of degree 5, Horner with fused multiply-adds), then `· 2^n` as two
//! exact power-of-two multiplies (`2^⌊n/2⌋ · 2^(n - ⌊n/2⌋)`, each a normal
//! float). Below `ln(f32::MIN_POSITIVE)` the result is 0 (it would be
//! subnormal); above ~88.72 it overflows to inf; NaN gives NaN (its
//! payload is not part of the contract). Measured against float64 `exp`:
//! within 1 ulp over the normal range (the test allows 2).

use rayon::prelude::*;

use crate::norm::SERIAL_MAX;

/// Feed-forward activation of the gated MLP `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU), Llama.
    Silu,
    /// GELU, tanh approximation (GeGLU), Gemma.
    GeluTanh,
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = LN2_HI + LN2_LO`; `LN2_HI` has 9 significant bits.
const LN2_HI: f32 = 355.0 / 512.0;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `P(r)`, highest power first: `e^r ≈ 1 + r + r² P(r)` on `|r| <= ln2 / 2`.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];
/// `ln(f32::MIN_POSITIVE)`: below it, `exp` returns 0.
const EXP_MIN: f32 = -87.336_54;
/// Inputs are clamped here (`e^88.8` overflows to inf, as every larger one).
const EXP_CLAMP: f32 = 88.8;
/// `sqrt(2 / π)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `e^x` in f32 (the module's algorithm; within 1 ulp of the exact value
/// over the normal range).
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x < EXP_MIN {
        return 0.0;
    }
    let x = x.min(EXP_CLAMP);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = P[0];
    for c in &P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    let n = n as i32;
    let n1 = n >> 1;
    y * pow2(n1) * pow2(n - n1)
}

/// `2^n` for `-126 <= n <= 127`.
fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// SiLU: `x · sigmoid(x) = x / (1 + e^-x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(u))`, `u = sqrt(2/π) (x +
/// 0.044715 x³)` (Hendrycks & Gimpel 2016; Gemma's `gelu_pytorch_tanh`),
/// computed as the identical `x / (1 + e^(-2u))` (`1 + tanh(u) = 2 /
/// (1 + e^(-2u))`). Large negative `u` gives `e^(-2u)` = inf and the
/// correct 0.
pub fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp(-2.0 * u))
}

/// `g[i] = act(g[i]) · u[i]` for every `i` (`g` and `u` of one length:
/// `[rows, intermediate_size]` gate and up projections), on the pool
/// above 16384 values ([`SERIAL_MAX`]).
pub fn gated_act_inplace(act: Activation, g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "gated_act_inplace: gate and up lengths");
    /// Values per parallel task (a multiple of 16).
    const CHUNK: usize = 4096;
    if g.len() <= SERIAL_MAX {
        gated_chunk(act, g, u);
    } else {
        g.par_chunks_mut(CHUNK)
            .zip(u.par_chunks(CHUNK))
            .for_each(|(g, u)| gated_chunk(act, g, u));
    }
}

/// The code that computes [`gated_act_inplace`]; every one gives the same
/// bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// 16 lanes, the last group masked.
    Avx512,
    /// 8 lanes (AVX2 + FMA), the last few values scalar.
    Avx2,
    /// The scalar functions (fused multiply-adds in software where the CPU
    /// has none: slow, but the same bits).
    Scalar,
}

impl Path {
    /// The fastest path this CPU runs.
    fn detect() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Path::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Path::Avx2;
            }
        }
        Path::Scalar
    }
}

/// [`gated_act_inplace`] on the calling thread.
fn gated_chunk(act: Activation, g: &mut [f32], u: &[f32]) {
    gated_on(Path::detect(), act, g, u);
}

/// [`gated_chunk`] on `path` (which the CPU must run).
fn gated_on(path: Path, act: Activation, g: &mut [f32], u: &[f32]) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512F (the caller's path); one length.
        Path::Avx512 => unsafe { avx512::gated(act, g, u) },
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => {
            let split = g.len() / 8 * 8;
            let (gv, gs) = g.split_at_mut(split);
            // SAFETY: the CPU has AVX2 and FMA (the caller's path); one
            // length, a multiple of 8.
            unsafe { avx2::gated(act, gv, &u[..split]) };
            gated_scalar(act, gs, &u[split..]);
        }
        _ => gated_scalar(act, g, u),
    }
}

fn gated_scalar(act: Activation, g: &mut [f32], u: &[f32]) {
    let f = match act {
        Activation::Silu => silu,
        Activation::GeluTanh => gelu_tanh,
    };
    for (g, u) in g.iter_mut().zip(u) {
        *g = f(*g) * u;
    }
}

/// The scalar functions above, 16 lanes at a time: the same operations in
/// the same order (`_mm512_fmadd_ps` where they call `mul_add`).
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::*;

    /// [`super::gated_chunk`] for 16 values at a time; the last group
    /// masked.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `g.len() == u.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gated(act: Activation, g: &mut [f32], u: &[f32]) {
        debug_assert_eq!(g.len(), u.len());
        for i in (0..g.len()).step_by(16) {
            let m: __mmask16 = if g.len() - i >= 16 {
                u16::MAX
            } else {
                (1u16 << (g.len() - i)) - 1
            };
            // SAFETY: lanes past the end are masked off (not accessed).
            let (gp, up) = unsafe { (g.as_mut_ptr().add(i), u.as_ptr().add(i)) };
            // SAFETY: as above.
            let (x, uv) = unsafe { (_mm512_maskz_loadu_ps(m, gp), _mm512_maskz_loadu_ps(m, up)) };
            let a = match act {
                Activation::Silu => silu(x),
                Activation::GeluTanh => gelu_tanh(x),
            };
            // SAFETY: as above.
            unsafe { _mm512_mask_storeu_ps(gp, m, _mm512_mul_ps(a, uv)) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn splat(v: f32) -> __m512 {
        _mm512_set1_ps(v)
    }

    /// [`super::silu`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn silu(x: __m512) -> __m512 {
        let minus_x = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(x),
            _mm512_set1_epi32(i32::MIN),
        ));
        let e = exp(minus_x);
        _mm512_div_ps(x, _mm512_add_ps(splat(1.0), e))
    }

    /// [`super::gelu_tanh`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn gelu_tanh(x: __m512) -> __m512 {
        let x3 = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(splat(0.044715), x), x), x);
        let u = _mm512_mul_ps(splat(SQRT_2_OVER_PI), _mm512_add_ps(x, x3));
        let e = exp(_mm512_mul_ps(splat(-2.0), u));
        _mm512_div_ps(x, _mm512_add_ps(splat(1.0), e))
    }

    /// [`super::exp`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp(x: __m512) -> __m512 {
        let xc = _mm512_min_ps(x, splat(EXP_CLAMP));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, splat(LOG2E)),
        );
        let r = _mm512_fmadd_ps(n, splat(-LN2_HI), xc);
        let r = _mm512_fmadd_ps(n, splat(-LN2_LO), r);
        let mut p = splat(P[0]);
        for c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, splat(*c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), splat(1.0));
        let n = _mm512_cvtps_epi32(n);
        let n1 = _mm512_srai_epi32::<1>(n);
        let n2 = _mm512_sub_epi32(n, n1);
        let pow2 = |n: __m512i| {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n,
                _mm512_set1_epi32(127),
            )))
        };
        let v = _mm512_mul_ps(_mm512_mul_ps(y, pow2(n1)), pow2(n2));
        // Below EXP_MIN (or -inf): 0; NaN: the input.
        let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, splat(EXP_MIN));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let v = _mm512_mask_blend_ps(tiny, v, _mm512_setzero_ps());
        _mm512_mask_blend_ps(nan, v, x)
    }
}

/// [`avx512`]'s kernel in 8 lanes: the same operations in the same order.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    /// `g = act(g) · u` for `g.len()` a multiple of 8.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `g.len() == u.len()`, a
    /// multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gated(act: Activation, g: &mut [f32], u: &[f32]) {
        debug_assert!(g.len() == u.len() && g.len().is_multiple_of(8));
        for (g, u) in g.chunks_exact_mut(8).zip(u.chunks_exact(8)) {
            // SAFETY: 8 floats each.
            let (x, uv) = unsafe { (_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr())) };
            let a = match act {
                Activation::Silu => silu(x),
                Activation::GeluTanh => gelu_tanh(x),
            };
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(g.as_mut_ptr(), _mm256_mul_ps(a, uv)) };
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn splat(v: f32) -> __m256 {
        _mm256_set1_ps(v)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn silu(x: __m256) -> __m256 {
        let e = exp(_mm256_xor_ps(x, splat(-0.0)));
        _mm256_div_ps(x, _mm256_add_ps(splat(1.0), e))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn gelu_tanh(x: __m256) -> __m256 {
        let x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(splat(0.044715), x), x), x);
        let u = _mm256_mul_ps(splat(SQRT_2_OVER_PI), _mm256_add_ps(x, x3));
        let e = exp(_mm256_mul_ps(splat(-2.0), u));
        _mm256_div_ps(x, _mm256_add_ps(splat(1.0), e))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let xc = _mm256_min_ps(x, splat(EXP_CLAMP));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, splat(LOG2E)),
        );
        let r = _mm256_fmadd_ps(n, splat(-LN2_HI), xc);
        let r = _mm256_fmadd_ps(n, splat(-LN2_LO), r);
        let mut p = splat(P[0]);
        for c in &P[1..] {
            p = _mm256_fmadd_ps(p, r, splat(*c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), splat(1.0));
        let n = _mm256_cvtps_epi32(n);
        let n1 = _mm256_srai_epi32::<1>(n);
        let n2 = _mm256_sub_epi32(n, n1);
        let pow2 = |n: __m256i| {
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                n,
                _mm256_set1_epi32(127),
            )))
        };
        let v = _mm256_mul_ps(_mm256_mul_ps(y, pow2(n1)), pow2(n2));
        // Below EXP_MIN (or -inf): 0; NaN: the input.
        let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, splat(EXP_MIN));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let v = _mm256_blendv_ps(v, _mm256_setzero_ps(), tiny);
        _mm256_blendv_ps(v, x, nan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Ulps between two finite f32 of one sign (or both zero).
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    /// `exp` against float64 `exp` rounded to f32, over the whole normal
    /// range in small steps, and at its edges.
    #[test]
    fn exp_within_two_ulp_of_f64() {
        let mut x = EXP_MIN;
        while x <= 88.72 {
            let want = (x as f64).exp() as f32;
            let got = exp(x);
            assert!(ulps(got, want) <= 2, "exp({x}) = {got:e}, want {want:e}");
            x += 0.001_37;
        }
        for (x, want) in [
            (0.0, 1.0),
            (-0.0, 1.0),
            (1.0, std::f32::consts::E),
            (88.8, f32::INFINITY),
            (1e30, f32::INFINITY),
            (f32::INFINITY, f32::INFINITY),
            (-87.4, 0.0),
            (-1e30, 0.0),
            (f32::NEG_INFINITY, 0.0),
        ] {
            assert!(
                ulps(exp(x), want) <= 1,
                "exp({x}) = {}, want {want}",
                exp(x)
            );
        }
        assert!(exp(f32::NAN).is_nan());
    }

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

    /// The largest f32 below `x` (finite, nonzero `x`).
    fn next_down(x: f32) -> f32 {
        if x > 0.0 {
            f32::from_bits(x.to_bits() - 1)
        } else {
            f32::from_bits(x.to_bits() + 1)
        }
    }

    /// The paths this CPU runs, with a note for those it cannot.
    fn available() -> Vec<Path> {
        let mut v = vec![Path::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Path::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Path::Avx2);
            }
        }
        if v.len() < 3 {
            println!("note: this CPU runs only {v:?} of the activation paths");
        }
        v
    }

    proptest! {
        /// The pooled, vectorized `g = act(g) · u` equals the scalar
        /// functions value for value, bit for bit, for every length (the
        /// masked last group included) and for special values.
        #[test]
        fn gated_act_equals_the_scalar_functions(
            len in 0usize..40_000,
            seed: u64,
            gelu: bool,
        ) {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            // Around exp's cut-off and clamp, for either sign (SiLU's
            // exp argument is -x, GELU's about -1.6 x).
            let specials = [
                0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 100.0, -100.0,
                EXP_MIN, -EXP_MIN, next_down(EXP_MIN), -next_down(EXP_MIN),
                87.4, -87.4, 88.72, -88.72, EXP_CLAMP, -EXP_CLAMP, 54.4, -54.4, 54.9, -54.9,
                f32::MAX, f32::MIN, f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 1e-40, -1e-40,
            ];
            let g: Vec<f32> = (0..len)
                .map(|i| if i % 97 == 0 { specials[i / 97 % specials.len()] }
                     else { rng.gen_range(-30.0f32..30.0) })
                .collect();
            let u: Vec<f32> = (0..len).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            let (act, f): (_, fn(f32) -> f32) = if gelu {
                (Activation::GeluTanh, gelu_tanh)
            } else {
                (Activation::Silu, silu)
            };
            let mut got = g.clone();
            gated_act_inplace(act, &mut got, &u);
            let mut runs = vec![(Path::detect(), got)];
            for path in available() {
                let mut got = g.clone();
                gated_on(path, act, &mut got, &u);
                runs.push((path, got));
            }
            for (path, got) in runs {
                for i in 0..len {
                    let want = f(g[i]) * u[i];
                    prop_assert!(
                        got[i].to_bits() == want.to_bits() || (got[i].is_nan() && want.is_nan()),
                        "{path:?} {act:?}({}) * {} = {} at {i}, scalar {}", g[i], u[i], got[i], want
                    );
                }
            }
        }
    }
}
