//! The decode path's vector primitives, one implementation per instruction
//! set: multi-row dot products `q_r · k` and row updates `o_r += p_r v`,
//! with K/V rows of any storage dtype widened to f32 in registers (bf16:
//! shift into the high half; f16: the hardware conversion). Written with
//! explicit intrinsics because the compiler vectorizes the portable loops
//! across rows instead of along the head dimension.
//!
//! Every method is `#[inline(always)]` and `unsafe`: it must be called from
//! code compiled for its instruction set (the kernel's `run_*` variants),
//! which is where it is inlined.

use te_kernels::Element;

use crate::tile_math;

/// Hints every cache line of `row` into L1 (x86-64; nothing elsewhere).
/// Results never depend on it.
#[inline(always)]
pub(crate) fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // From the line holding the first byte to the one holding the last.
        let start = row.as_ptr() as usize;
        let first = start & !63;
        let end = start + std::mem::size_of_val(row);
        for line in (first..end).step_by(64) {
            // SAFETY: a prefetch never faults (nor is the address read).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Vector primitives of one instruction set.
pub(crate) trait Simd {
    /// `[q_r · k for r < R]`; each `q_r` has at least `k.len()` elements.
    ///
    /// # Safety
    /// The CPU supports the instruction set and the caller is compiled for
    /// it.
    unsafe fn dots<T: Element, const R: usize>(q: [&[f32]; R], k: &[T]) -> [f32; R];

    /// `o_r += p[r] * v` for each row `r < p.len()` of `o: [p.len(),
    /// v.len()]` (row-major).
    ///
    /// # Safety
    /// As for [`Simd::dots`].
    unsafe fn axpy_rows<T: Element>(o: &mut [f32], p: &[f32], v: &[T]);
}

/// The portable loops of [`tile_math`] (baseline x86-64 and other
/// architectures); `FMA`: fused multiply-add available.
pub(crate) struct Portable<const FMA: bool>;

impl<const FMA: bool> Simd for Portable<FMA> {
    #[inline(always)]
    unsafe fn dots<T: Element, const R: usize>(q: [&[f32]; R], k: &[T]) -> [f32; R] {
        tile_math::dots::<T, R, FMA>(q, k)
    }

    #[inline(always)]
    unsafe fn axpy_rows<T: Element>(o: &mut [f32], p: &[f32], v: &[T]) {
        tile_math::axpy_rows::<T, FMA>(o, p, v)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use te_kernels::{DType, Element};

    use super::Simd;

    /// AVX-512F: 16 lanes.
    pub(crate) struct Avx512;

    /// AVX2 + FMA + F16C: 8 lanes.
    pub(crate) struct Avx2;

    /// 16 elements at `p` as f32.
    #[inline(always)]
    unsafe fn load16<T: Element>(p: *const T) -> __m512 {
        // SAFETY: the caller guarantees the instruction set (see the
        // module doc); every pointer access is in bounds of its slice.
        unsafe {
            match T::DTYPE {
                DType::F32 => _mm512_loadu_ps(p.cast()),
                DType::BF16 => {
                    let h = _mm256_loadu_si256(p.cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            }
        }
    }

    /// 8 elements at `p` as f32.
    #[inline(always)]
    unsafe fn load8<T: Element>(p: *const T) -> __m256 {
        // SAFETY: the caller guarantees the instruction set (see the
        // module doc); every pointer access is in bounds of its slice.
        unsafe {
            match T::DTYPE {
                DType::F32 => _mm256_loadu_ps(p.cast()),
                DType::BF16 => {
                    let h = _mm_loadu_si128(p.cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            }
        }
    }

    /// Sum of the 8 lanes.
    #[inline(always)]
    unsafe fn hsum8(x: __m256) -> f32 {
        // SAFETY: the caller guarantees the instruction set (see the
        // module doc); every pointer access is in bounds of its slice.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// The body of `dots` for one lane width: `$load` widens `$n` elements
    /// of `T`, two accumulators per row keep two FMA chains in flight.
    macro_rules! dots_body {
        ($q:ident, $k:ident, $n:expr, $zero:expr, $load:ident, $loadq:ident, $fma:ident, $add:ident, $sum:ident) => {{
            let d = $k.len();
            let q: [&[f32]; R] = std::array::from_fn(|r| &$q[r][..d]);
            let mut acc0 = [$zero; R];
            let mut acc1 = [$zero; R];
            let mut c = 0;
            while c + 2 * $n <= d {
                let k0 = $load($k.as_ptr().add(c));
                let k1 = $load($k.as_ptr().add(c + $n));
                for r in 0..R {
                    let qr = q[r].as_ptr().add(c);
                    acc0[r] = $fma($loadq(qr), k0, acc0[r]);
                    acc1[r] = $fma($loadq(qr.add($n)), k1, acc1[r]);
                }
                c += 2 * $n;
            }
            if c + $n <= d {
                let k0 = $load($k.as_ptr().add(c));
                for r in 0..R {
                    acc0[r] = $fma($loadq(q[r].as_ptr().add(c)), k0, acc0[r]);
                }
                c += $n;
            }
            let mut out: [f32; R] = std::array::from_fn(|r| $sum($add(acc0[r], acc1[r])));
            for p in c..d {
                let kp = $k[p].to_f32();
                for (o, qr) in out.iter_mut().zip(&q) {
                    *o = qr[p].mul_add(kp, *o);
                }
            }
            out
        }};
    }

    /// The body of `axpy_rows` for one lane width.
    macro_rules! axpy_body {
        ($o:ident, $p:ident, $v:ident, $n:expr, $load:ident, $loado:ident, $store:ident, $set1:ident, $fma:ident) => {{
            let d = $v.len();
            let o = &mut $o[..$p.len() * d];
            let mut c = 0;
            while c + $n <= d {
                let vv = $load($v.as_ptr().add(c));
                for (r, &pr) in $p.iter().enumerate() {
                    let dst = o.as_mut_ptr().add(r * d + c);
                    $store(dst, $fma($set1(pr), vv, $loado(dst)));
                }
                c += $n;
            }
            for c in c..d {
                let vc = $v[c].to_f32();
                for (r, &pr) in $p.iter().enumerate() {
                    o[r * d + c] = pr.mul_add(vc, o[r * d + c]);
                }
            }
        }};
    }

    impl Simd for Avx512 {
        #[inline(always)]
        unsafe fn dots<T: Element, const R: usize>(q: [&[f32]; R], k: &[T]) -> [f32; R] {
            // SAFETY: the caller guarantees AVX-512F; every vector access
            // reads lanes `c..c + 16 <= d` of a slice of at least `d`.
            unsafe {
                dots_body!(
                    q,
                    k,
                    16,
                    _mm512_setzero_ps(),
                    load16,
                    _mm512_loadu_ps,
                    _mm512_fmadd_ps,
                    _mm512_add_ps,
                    _mm512_reduce_add_ps
                )
            }
        }

        #[inline(always)]
        unsafe fn axpy_rows<T: Element>(o: &mut [f32], p: &[f32], v: &[T]) {
            // SAFETY: the caller guarantees AVX-512F; row `r < p.len()`,
            // lanes `c..c + 16 <= d`: inside `o[..p.len() * d]` and `v`.
            unsafe {
                axpy_body!(
                    o,
                    p,
                    v,
                    16,
                    load16,
                    _mm512_loadu_ps,
                    _mm512_storeu_ps,
                    _mm512_set1_ps,
                    _mm512_fmadd_ps
                )
            }
        }
    }

    impl Simd for Avx2 {
        #[inline(always)]
        unsafe fn dots<T: Element, const R: usize>(q: [&[f32]; R], k: &[T]) -> [f32; R] {
            // SAFETY: the caller guarantees AVX2, FMA and F16C; every vector
            // access reads lanes `c..c + 8 <= d` of a slice of at least `d`.
            unsafe {
                dots_body!(
                    q,
                    k,
                    8,
                    _mm256_setzero_ps(),
                    load8,
                    _mm256_loadu_ps,
                    _mm256_fmadd_ps,
                    _mm256_add_ps,
                    hsum8
                )
            }
        }

        #[inline(always)]
        unsafe fn axpy_rows<T: Element>(o: &mut [f32], p: &[f32], v: &[T]) {
            // SAFETY: the caller guarantees AVX2, FMA and F16C; row
            // `r < p.len()`, lanes `c..c + 8 <= d`: inside `o[..p.len() * d]`
            // and `v`.
            unsafe {
                axpy_body!(
                    o,
                    p,
                    v,
                    8,
                    load8,
                    _mm256_loadu_ps,
                    _mm256_storeu_ps,
                    _mm256_set1_ps,
                    _mm256_fmadd_ps
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use te_kernels::Element;

    use super::*;

    /// Values exactly representable in every storage dtype.
    fn vals<T: Element>(n: usize, mul: usize, modulo: usize) -> Vec<T> {
        (0..n)
            .map(|i| T::from_f32(((i * mul % modulo) as f32 - (modulo / 2) as f32) / 8.0))
            .collect()
    }

    /// `dots` and `axpy_rows` of `S` against float64 sums, every head
    /// dimension remainder of both lane widths.
    fn check<S: Simd, T: Element>() {
        for d in [1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 64, 130, 256] {
            let q: Vec<f32> = vals::<f32>(4 * d, 7, 13);
            let k: Vec<T> = vals(d, 5, 11);
            // SAFETY: the callers run this only where the CPU has S's set.
            let got = unsafe { S::dots::<T, 4>(std::array::from_fn(|r| &q[r * d..]), &k) };
            let one = unsafe { S::dots::<T, 1>([&q[2 * d..]], &k) };
            for r in 0..4 {
                let want: f64 = (0..d)
                    .map(|p| q[r * d + p] as f64 * k[p].to_f32() as f64)
                    .sum();
                assert!(
                    (got[r] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{} d {d} row {r}: {} vs {want}",
                    T::DTYPE,
                    got[r]
                );
            }
            assert!((one[0] - got[2]).abs() <= 1e-5 * (1.0 + got[2].abs()));

            for rows in 1..=5 {
                let p: Vec<f32> = (0..rows).map(|r| 0.5 - r as f32 * 0.375).collect();
                let o0: Vec<f32> = vals::<f32>(rows * d, 3, 17);
                let mut o = o0.clone();
                unsafe { S::axpy_rows::<T>(&mut o, &p, &k) };
                for r in 0..rows {
                    for c in 0..d {
                        let want = o0[r * d + c] as f64 + p[r] as f64 * k[c].to_f32() as f64;
                        assert_eq!(o[r * d + c] as f64, want, "{} d {d} [{r}, {c}]", T::DTYPE);
                    }
                }
            }
        }
    }

    fn check_all_dtypes<S: Simd>() {
        check::<S, f32>();
        check::<S, bf16>();
        check::<S, f16>();
    }

    #[test]
    fn portable_matches_f64() {
        check_all_dtypes::<Portable<false>>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_matches_f64() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("skipped: this CPU has no AVX2 + FMA + F16C");
            return;
        }
        check_all_dtypes::<Avx2>();
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_matches_f64() {
        if !is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        check_all_dtypes::<Avx512>();
    }
}
