//! Dense f32 building blocks of the CPU kernel: a register-blocked tile
//! product, dot and axpy, and a vectorizable `exp`. All `#[inline(always)]`:
//! they are compiled into the caller, which the kernel compiles twice
//! (baseline x86-64 and AVX2+FMA, chosen at run time).

/// Row block and column block of the register tile of [`gemm`].
use te_kernels::Element;

const MR: usize = 4;
const NR: usize = 16;

/// `c[m, n] (+)= a[m, k] · b[k, n]`, all row-major with leading dims
/// `lda`, `ldb`, `ldc` (elements); accumulates into `c` when `accumulate`,
/// overwrites it otherwise. `FMA`: the caller is compiled with FMA.
#[inline(always)]
pub fn gemm<const FMA: bool>(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let mut r = 0;
    while r + MR <= m {
        block::<MR, FMA>(r, n, k, a, lda, b, ldb, c, ldc, accumulate);
        r += MR;
    }
    while r < m {
        block::<1, FMA>(r, n, k, a, lda, b, ldb, c, ldc, accumulate);
        r += 1;
    }
}

/// `a * b + c`, fused when the caller is compiled with FMA (a libm call
/// otherwise, hence the switch).
#[inline(always)]
pub fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Rows `r0..r0 + R` of the product: `R x NR` register tiles, then the
/// remaining columns one at a time.
#[inline(always)]
fn block<const R: usize, const FMA: bool>(
    r0: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let a_rows: [&[f32]; R] = std::array::from_fn(|i| &a[(r0 + i) * lda..][..k]);
    let n_full = n / NR * NR;
    for c0 in (0..n_full).step_by(NR) {
        let mut t = [[0f32; NR]; R];
        if accumulate {
            for (i, ti) in t.iter_mut().enumerate() {
                ti.copy_from_slice(&c[(r0 + i) * ldc + c0..][..NR]);
            }
        }
        for p in 0..k {
            let b_row: &[f32; NR] = b[p * ldb + c0..][..NR].try_into().unwrap();
            for (ti, a_row) in t.iter_mut().zip(&a_rows) {
                let av = a_row[p];
                for (tj, &bj) in ti.iter_mut().zip(b_row) {
                    *tj = madd::<FMA>(av, bj, *tj);
                }
            }
        }
        for (i, ti) in t.iter().enumerate() {
            c[(r0 + i) * ldc + c0..][..NR].copy_from_slice(ti);
        }
    }
    for (i, a_row) in a_rows.iter().enumerate() {
        for col in n_full..n {
            let mut s = if accumulate {
                c[(r0 + i) * ldc + col]
            } else {
                0.0
            };
            for (p, &av) in a_row.iter().enumerate() {
                s = madd::<FMA>(av, b[p * ldb + col], s);
            }
            c[(r0 + i) * ldc + col] = s;
        }
    }
}

/// `sum_i a[i] * b[i]` with `b` converted to f32; eight partial sums so
/// it vectorizes.
#[inline(always)]
pub fn dot<T: Element, const FMA: bool>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for ((s, &xi), &yi) in acc.iter_mut().zip(x).zip(y) {
            *s = madd::<FMA>(xi, yi.to_f32(), *s);
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (&xi, &yi) in ar.iter().zip(br) {
        sum = madd::<FMA>(xi, yi.to_f32(), sum);
    }
    sum
}

/// `y[i] += alpha * x[i]` with `x` converted to f32.
#[inline(always)]
pub fn axpy<T: Element, const FMA: bool>(alpha: f32, x: &[T], y: &mut [f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi = madd::<FMA>(alpha, xi.to_f32(), *yi);
    }
}

/// `exp(x)` for `x <= 88`, within 2 ulp; exactly 0 for `x < -87.3`
/// (including -inf). Range reduction `x = n ln2 + r`, `|r| <= ln2 / 2`,
/// then a degree-7 polynomial for `e^r` (Cephes `expf` coefficients), then
/// `2^n` through the exponent bits. Branch-free so it vectorizes.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.3 {
        0.0
    } else {
        er * two_n
    }
}

/// `row[j] = exp(row[j] - max)`, returns the sum (f32).
#[inline(always)]
pub fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
    // Eight partial sums so the reduction vectorizes.
    let mut acc = [0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for ch in &mut chunks {
        for (a, x) in acc.iter_mut().zip(ch.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut sum: f32 = chunks
        .into_remainder()
        .iter_mut()
        .map(|x| {
            *x = exp(*x - max);
            *x
        })
        .sum();
    sum += acc.iter().sum::<f32>();
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64() {
        let mut x = -90.0f32;
        while x <= 10.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            if x < -87.3 {
                assert_eq!(got, 0.0, "x = {x}");
            } else {
                assert!(
                    (got - want).abs() <= 3e-7 * want,
                    "x = {x}: {got} vs {want}"
                );
            }
            x += 0.0137;
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn gemm_matches_f64_reference() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (4, 16, 8),
            (7, 37, 13),
            (9, 48, 130),
            (64, 128, 64),
        ] {
            for accumulate in [false, true] {
                let a: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                    .collect();
                let b: Vec<f32> = (0..k * n)
                    .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                    .collect();
                let c0: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
                let mut c = c0.clone();
                gemm::<false>(m, n, k, &a, k, &b, n, &mut c, n, accumulate);
                for i in 0..m {
                    for j in 0..n {
                        let mut want = if accumulate {
                            c0[i * n + j] as f64
                        } else {
                            0.0
                        };
                        for p in 0..k {
                            want += a[i * k + p] as f64 * b[p * n + j] as f64;
                        }
                        let got = c[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
