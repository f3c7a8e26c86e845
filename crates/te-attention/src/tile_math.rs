//! Dense f32 building blocks of the CPU kernel: a register-blocked tile
//! product over rows read in place, multi-row dot products, and a
//! vectorizable `exp`. All `#[inline(always)]`: they are compiled into the
//! caller, which the kernel compiles once per instruction set (baseline
//! x86-64, AVX2+FMA, AVX-512, chosen at run time), with the register tile
//! `MR x NR` picked for that set.

use te_kernels::Element;

/// Lanes of the dot-product accumulators (one AVX-512 register, two AVX2).
const LANES: usize = 16;

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

/// The output of [`gemm`]: `c`, f32 row-major with leading dimension
/// `ldc` (elements between rows), accumulated into or overwritten.
pub struct GemmOut<'c> {
    /// At least `(m - 1) * ldc + n` elements.
    pub c: &'c mut [f32],
    /// Elements from one row of `c` to the next (at least `n`).
    pub ldc: usize,
    /// Add the product to `c` (`true`) or overwrite `c` with it.
    pub accumulate: bool,
}

/// `c[i, j] (+)= sum_p a_i[p * a_cs] * b_p[j]` for `i < m`, `j < n`,
/// `p < k`: `a_row(i)` is row `i` of A read with column stride `a_cs`
/// (1: a plain row; the row count of a transposed operand otherwise),
/// `b_row(p)` is row `p` of B (at least `n` elements); both are converted
/// to f32. `out.c` is row-major with leading dim `out.ldc`; accumulates
/// into it when `out.accumulate`, overwrites it otherwise. Register tiles
/// of `MR x NR` (then 4 and 1 rows, and single columns for the
/// remainders).
#[inline(always)]
pub fn gemm<'a, 'b, Ta: Element, Tb: Element, const MR: usize, const NR: usize, const FMA: bool>(
    m: usize,
    n: usize,
    k: usize,
    a_row: impl Fn(usize) -> &'a [Ta],
    a_cs: usize,
    b_row: impl Fn(usize) -> &'b [Tb],
    mut out: GemmOut<'_>,
) {
    let mut r = 0;
    while r + MR <= m {
        block::<Ta, Tb, MR, NR, FMA>(r, n, k, &a_row, a_cs, &b_row, &mut out);
        r += MR;
    }
    while MR > 4 && r + 4 <= m {
        block::<Ta, Tb, 4, NR, FMA>(r, n, k, &a_row, a_cs, &b_row, &mut out);
        r += 4;
    }
    while r < m {
        block::<Ta, Tb, 1, NR, FMA>(r, n, k, &a_row, a_cs, &b_row, &mut out);
        r += 1;
    }
}

/// Rows `r0..r0 + R` of [`gemm`]: `R x NR` register tiles, then the
/// remaining columns one at a time.
#[inline(always)]
fn block<'a, 'b, Ta: Element, Tb: Element, const R: usize, const NR: usize, const FMA: bool>(
    r0: usize,
    n: usize,
    k: usize,
    a_row: &impl Fn(usize) -> &'a [Ta],
    a_cs: usize,
    b_row: &impl Fn(usize) -> &'b [Tb],
    out: &mut GemmOut<'_>,
) {
    let (c, ldc, accumulate) = (&mut *out.c, out.ldc, out.accumulate);
    if k == 0 {
        if !accumulate {
            for i in 0..R {
                c[(r0 + i) * ldc..][..n].fill(0.0);
            }
        }
        return;
    }
    // Exactly the elements read, so the loops below need no length checks
    // beyond what the optimizer can prove.
    let a_rows: [&[Ta]; R] = std::array::from_fn(|i| &a_row(r0 + i)[..(k - 1) * a_cs + 1]);
    let n_full = n / NR * NR;
    for c0 in (0..n_full).step_by(NR) {
        let mut t = [[0f32; NR]; R];
        if accumulate {
            for (i, ti) in t.iter_mut().enumerate() {
                ti.copy_from_slice(&c[(r0 + i) * ldc + c0..][..NR]);
            }
        }
        for p in 0..k {
            let b: &[Tb; NR] = b_row(p)[c0..c0 + NR].try_into().unwrap();
            let bv: [f32; NR] = std::array::from_fn(|j| b[j].to_f32());
            for (ti, a) in t.iter_mut().zip(&a_rows) {
                let av = a[p * a_cs].to_f32();
                for (tj, &bj) in ti.iter_mut().zip(&bv) {
                    *tj = madd::<FMA>(av, bj, *tj);
                }
            }
        }
        for (i, ti) in t.iter().enumerate() {
            c[(r0 + i) * ldc + c0..][..NR].copy_from_slice(ti);
        }
    }
    for col in n_full..n {
        let mut t = [0f32; R];
        if accumulate {
            for (i, ti) in t.iter_mut().enumerate() {
                *ti = c[(r0 + i) * ldc + col];
            }
        }
        for p in 0..k {
            let bv = b_row(p)[col].to_f32();
            for (ti, a) in t.iter_mut().zip(&a_rows) {
                *ti = madd::<FMA>(a[p * a_cs].to_f32(), bv, *ti);
            }
        }
        for (i, &ti) in t.iter().enumerate() {
            c[(r0 + i) * ldc + col] = ti;
        }
    }
}

/// `[q_r · k for r < R]` (`q_r`: f32, at least `k.len()` elements; `k`
/// converted to f32): `k` is loaded once for the `R` rows, `LANES` partial
/// sums per row.
#[inline(always)]
pub fn dots<T: Element, const R: usize, const FMA: bool>(q: [&[f32]; R], k: &[T]) -> [f32; R] {
    let d = k.len();
    let q: [&[f32]; R] = std::array::from_fn(|r| &q[r][..d]);
    let mut acc = [[0f32; LANES]; R];
    let full = d / LANES * LANES;
    for c0 in (0..full).step_by(LANES) {
        let kc: &[T; LANES] = k[c0..c0 + LANES].try_into().unwrap();
        let kv: [f32; LANES] = std::array::from_fn(|l| kc[l].to_f32());
        for (a, qr) in acc.iter_mut().zip(&q) {
            let qc: &[f32; LANES] = qr[c0..c0 + LANES].try_into().unwrap();
            for l in 0..LANES {
                a[l] = madd::<FMA>(qc[l], kv[l], a[l]);
            }
        }
    }
    let mut out: [f32; R] = std::array::from_fn(|r| hsum(acc[r]));
    for p in full..d {
        let kp = k[p].to_f32();
        for (o, qr) in out.iter_mut().zip(&q) {
            *o = madd::<FMA>(qr[p], kp, *o);
        }
    }
    out
}

/// `o_r += p[r] * v` for each row `r < p.len()` of `o: [p.len(), v.len()]`
/// (row-major f32; `v` converted to f32): each `LANES` chunk of `v` is
/// loaded and converted once for all rows.
#[inline(always)]
pub fn axpy_rows<T: Element, const FMA: bool>(o: &mut [f32], p: &[f32], v: &[T]) {
    let d = v.len();
    let full = d / LANES * LANES;
    for c0 in (0..full).step_by(LANES) {
        let vc: &[T; LANES] = v[c0..c0 + LANES].try_into().unwrap();
        let vv: [f32; LANES] = std::array::from_fn(|l| vc[l].to_f32());
        for (o_row, &pr) in o.chunks_exact_mut(d).zip(p) {
            let oc: &mut [f32; LANES] = (&mut o_row[c0..c0 + LANES]).try_into().unwrap();
            for l in 0..LANES {
                oc[l] = madd::<FMA>(pr, vv[l], oc[l]);
            }
        }
    }
    for c in full..d {
        let vc = v[c].to_f32();
        for (o_row, &pr) in o.chunks_exact_mut(d).zip(p) {
            o_row[c] = madd::<FMA>(pr, vc, o_row[c]);
        }
    }
}

/// Sum of the lanes, as a tree (vector halves) rather than a serial chain.
#[inline(always)]
fn hsum(a: [f32; LANES]) -> f32 {
    let b: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    let c: [f32; 4] = std::array::from_fn(|l| b[l] + b[l + 4]);
    (c[0] + c[2]) + (c[1] + c[3])
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

    fn check_gemm<const MR: usize, const NR: usize>() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (4, 16, 8),
            (7, 37, 13),
            (9, 48, 130),
            (13, 64, 5),
            (64, 128, 64),
            (3, 5, 0),
        ] {
            for a_cs in [1, 3] {
                for accumulate in [false, true] {
                    // a: element (i, p) at a[i + p * a_cs * m'] style
                    // strides: row i starts at i * (k * a_cs) when a_cs = 1,
                    // at i (column-major, a_cs = m) otherwise.
                    let (a_cs, row_start): (usize, Box<dyn Fn(usize) -> usize>) = if a_cs == 1 {
                        (1, Box::new(move |i| i * k))
                    } else {
                        (m, Box::new(|i| i))
                    };
                    let a: Vec<f32> = (0..m * k.max(1))
                        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                        .collect();
                    let b: Vec<f32> = (0..k * n)
                        .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                        .collect();
                    let c0: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
                    let mut c = c0.clone();
                    gemm::<f32, f32, MR, NR, false>(
                        m,
                        n,
                        k,
                        |i| &a[row_start(i)..],
                        a_cs,
                        |p| &b[p * n..],
                        GemmOut {
                            c: &mut c,
                            ldc: n,
                            accumulate,
                        },
                    );
                    for i in 0..m {
                        for j in 0..n {
                            let mut want = if accumulate {
                                c0[i * n + j] as f64
                            } else {
                                0.0
                            };
                            for p in 0..k {
                                want += a[row_start(i) + p * a_cs] as f64 * b[p * n + j] as f64;
                            }
                            let got = c[i * n + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{MR}x{NR} {m}x{n}x{k} [{i},{j}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn gemm_matches_f64_reference() {
        check_gemm::<4, 8>();
        check_gemm::<4, 16>();
        check_gemm::<8, 32>();
    }

    #[test]
    fn dots_match_f64_reference() {
        for d in [1, 15, 16, 17, 64, 130] {
            let q: Vec<f32> = (0..4 * d)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let k: Vec<f32> = (0..d).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
            let got = dots::<f32, 4, false>(std::array::from_fn(|r| &q[r * d..]), &k);
            let one = dots::<f32, 1, false>([&q[d..]], &k);
            for r in 0..4 {
                let want: f64 = (0..d).map(|p| q[r * d + p] as f64 * k[p] as f64).sum();
                assert!((got[r] as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()));
            }
            assert_eq!(one[0], got[1]);
        }
    }

    #[test]
    fn axpy_rows_match_f64_reference() {
        for d in [1, 15, 16, 17, 64, 130] {
            for rows in [1, 3, 4] {
                let v: Vec<f32> = (0..d).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
                let p: Vec<f32> = (0..rows).map(|r| [0.25, 0.0, -1.5, 2.0][r]).collect();
                let o0: Vec<f32> = (0..rows * d)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                    .collect();
                let mut o = o0.clone();
                axpy_rows::<f32, false>(&mut o, &p, &v);
                for r in 0..rows {
                    for c in 0..d {
                        let want = o0[r * d + c] as f64 + p[r] as f64 * v[c] as f64;
                        let got = o[r * d + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                            "{rows}x{d} [{r},{c}]"
                        );
                    }
                }
            }
        }
    }
}
