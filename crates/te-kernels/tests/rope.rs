//! RoPE against a naive float64 reference written here, hand-computed known
//! values, and batched-vs-alone runs.

use half::{bf16, f16};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use te_kernels::{
    apply_rope_cpu, apply_rope_cpu_out, Element, KernelError, QkvFormat, RopeArgs, RopeConvention,
    RopeFreqs, RopeScaling, RopeTable, TensorStrides,
};

/// One random RoPE problem.
#[derive(Clone, Debug)]
struct Case {
    format: QkvFormat,
    convention: RopeConvention,
    lens: Vec<usize>,
    max_seqlen: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    starts: Vec<i32>,
    base: f64,
    cp_size: usize,
    cp_rank: usize,
    seed: u64,
}

impl Case {
    fn batch(&self) -> usize {
        self.lens.len()
    }
    fn cu_seqlens(&self) -> Vec<i32> {
        let mut cu = vec![0i32];
        for &l in &self.lens {
            cu.push(cu.last().unwrap() + l as i32);
        }
        cu
    }
    /// Tokens `(b, i)` with their row in the contiguous tensor.
    fn tokens(&self, cu: &[i32]) -> Vec<(usize, usize, usize)> {
        let mut out = vec![];
        for b in 0..self.batch() {
            let n = if self.format == QkvFormat::Thd {
                self.lens[b]
            } else {
                self.max_seqlen
            };
            for i in 0..n {
                out.push((
                    b,
                    i,
                    self.format
                        .token_row(b, i, self.batch(), self.max_seqlen, cu),
                ));
            }
        }
        out
    }
    fn rows(&self) -> usize {
        match self.format {
            QkvFormat::Thd => self.lens.iter().sum(),
            _ => self.batch() * self.max_seqlen,
        }
    }
    /// Position of token i of sequence b, written from docs/ARCHITECTURE.md, "Context parallelism" directly:
    /// the full sequence is 2 * cp_size chunks, this rank holds chunks
    /// cp_rank and 2 * cp_size - 1 - cp_rank.
    fn position(&self, b: usize, i: usize) -> usize {
        let local = if self.format == QkvFormat::Thd {
            self.lens[b]
        } else {
            self.max_seqlen
        };
        let chunk = local / 2;
        let global = if self.cp_size == 1 {
            i
        } else {
            let chunks = [self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank];
            chunks[i / chunk] * chunk + i % chunk
        };
        self.starts[b] as usize + global
    }
    fn max_position(&self) -> usize {
        let cu = self.cu_seqlens();
        self.tokens(&cu)
            .iter()
            .map(|&(b, i, _)| self.position(b, i))
            .max()
            .unwrap_or(0)
    }
    fn args<'a>(&self, cu: &'a [i32], starts: &'a [i32]) -> RopeArgs<'a> {
        RopeArgs {
            format: self.format,
            convention: self.convention,
            num_heads: self.heads,
            head_dim: self.head_dim,
            batch: self.batch(),
            max_seqlen: self.max_seqlen,
            cu_seqlens: if self.format == QkvFormat::Thd {
                cu
            } else {
                &[]
            },
            start_positions: starts,
            cp_size: self.cp_size,
            cp_rank: self.cp_rank,
            strides: None,
        }
    }
}

/// Naive f64 RoPE of one head vector at position `pos`.
fn rope_ref(x: &[f64], pos: usize, rotary_dim: usize, base: f64, conv: RopeConvention) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = rotary_dim / 2;
    for i in 0..half {
        let theta = pos as f64 * base.powf(-2.0 * i as f64 / rotary_dim as f64);
        let (a, b) = match conv {
            RopeConvention::HalfSplit => (i, i + half),
            RopeConvention::Interleaved => (2 * i, 2 * i + 1),
        };
        y[a] = x[a] * theta.cos() - x[b] * theta.sin();
        y[b] = x[b] * theta.cos() + x[a] * theta.sin();
    }
    y
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let dims = prop_oneof![
        6 => (1usize..=16).prop_flat_map(|d| (Just(d), 1usize..=(d / 2).max(1))),
        1 => Just((128usize, 64usize)),
        1 => Just((256usize, 128usize)),
        1 => Just((256usize, 32usize)),
    ]
    .prop_filter("rotary dim needs head_dim >= 2", |&(d, _)| d >= 2);
    (
        prop_oneof![
            Just(QkvFormat::Bshd),
            Just(QkvFormat::Sbhd),
            Just(QkvFormat::Thd)
        ],
        prop_oneof![
            Just(RopeConvention::HalfSplit),
            Just(RopeConvention::Interleaved)
        ],
        proptest::collection::vec(0usize..7, 1..5),
        1usize..4,
        dims,
        prop_oneof![Just(1usize), Just(2), Just(3)],
        any::<u64>(),
        prop_oneof![Just(10000.0f64), Just(500000.0), 100.0f64..1e6],
    )
        .prop_map(
            |(format, convention, lens, heads, (head_dim, half_rot), cp_size, seed, base)| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                // Context parallelism needs even local lengths.
                let lens: Vec<usize> = lens
                    .iter()
                    .map(|&l| if cp_size > 1 { 2 * l } else { l })
                    .collect();
                let max_seqlen =
                    lens.iter()
                        .copied()
                        .max()
                        .unwrap_or(0)
                        .max(if cp_size > 1 { 2 } else { 1 });
                let lens = if format == QkvFormat::Thd {
                    lens
                } else {
                    vec![max_seqlen; lens.len()]
                };
                let small = head_dim <= 16;
                let lens: Vec<usize> = if small {
                    lens
                } else {
                    lens.into_iter().take(2).collect()
                };
                let starts = lens.iter().map(|_| rng.gen_range(0..100)).collect();
                Case {
                    format,
                    convention,
                    lens,
                    max_seqlen,
                    heads: if small { heads } else { 1 },
                    head_dim,
                    rotary_dim: 2 * half_rot,
                    starts,
                    base,
                    cp_size,
                    cp_rank: rng.gen_range(0..cp_size),
                    seed,
                }
            },
        )
}

fn random_vec<T: Element>(n: usize, seed: u64) -> Vec<T> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-2.0f32..2.0)))
        .collect()
}

/// Checks `out` (contiguous in the case's format) against the f64 reference
/// computed from `x` (contiguous too).
fn check_against_ref<T: Element>(
    case: &Case,
    x: &[T],
    out: &[T],
    rtol: f64,
) -> Result<(), TestCaseError> {
    let cu = case.cu_seqlens();
    let d = case.head_dim;
    for (b, i, row) in case.tokens(&cu) {
        let pos = case.position(b, i);
        for h in 0..case.heads {
            let off = (row * case.heads + h) * d;
            let xin: Vec<f64> = x[off..off + d].iter().map(|v| v.to_f32() as f64).collect();
            let want = rope_ref(&xin, pos, case.rotary_dim, case.base, case.convention);
            for e in 0..d {
                let got = out[off + e].to_f32() as f64;
                let tol = rtol * want[e].abs().max(1.0);
                prop_assert!(
                    (got - want[e]).abs() <= tol,
                    "{:?} seq {b} token {i} head {h} elem {e}: got {got}, want {}",
                    T::DTYPE,
                    want[e]
                );
            }
        }
    }
    Ok(())
}

fn table(case: &Case) -> RopeTable {
    RopeTable::new(&RopeFreqs {
        base: case.base,
        rotary_dim: case.rotary_dim,
        max_positions: case.max_position() + 1,
        scaling: RopeScaling::None,
    })
    .unwrap()
}

fn run_dtype<T: Element>(case: &Case, rtol: f64) -> Result<(), TestCaseError> {
    let cu = case.cu_seqlens();
    let table = table(case);
    let args = case.args(&cu, &case.starts);
    let n = case.rows() * case.heads * case.head_dim;
    let x: Vec<T> = random_vec(n, case.seed);
    // Out of place, into a poisoned buffer.
    let mut out = vec![T::from_f32(f32::NAN); n];
    apply_rope_cpu_out(&x, &mut out, &table, &args).unwrap();
    check_against_ref(case, &x, &out, rtol)?;
    // In place.
    let mut y = x.clone();
    apply_rope_cpu(&mut y, &table, &args).unwrap();
    check_against_ref(case, &x, &y, rtol)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn rope_matches_f64_reference(case in case_strategy()) {
        run_dtype::<f32>(&case, 1e-5)?;
        run_dtype::<bf16>(&case, 1.6e-2)?;
        run_dtype::<f16>(&case, 2e-3)?;
    }

    /// Non-contiguous input: the tensor sits inside a bigger buffer with
    /// padded head, token and batch strides in a permuted order.
    #[test]
    fn rope_strided_matches_contiguous(case in case_strategy(), pad in 0usize..3, swap in any::<bool>()) {
        let cu = case.cu_seqlens();
        let table = table(&case);
        let (h, d) = (case.heads, case.head_dim);
        let n = case.rows() * h * d;
        let x: Vec<f32> = random_vec(n, case.seed);
        // Physical layout: [.., h, d + pad] rows, tokens padded by `pad`.
        let head = d + pad;
        let tok = h * head + pad;
        let strides = match case.format {
            QkvFormat::Thd => TensorStrides { batch: 0, seq: tok, head, dim: 1 },
            _ if swap => TensorStrides { batch: tok, seq: case.batch() * tok + pad, head, dim: 1 },
            _ => TensorStrides { batch: case.max_seqlen * tok + pad, seq: tok, head, dim: 1 },
        };
        let mut args = case.args(&cu, &case.starts);
        args.strides = Some(strides);
        let len = case.batch().max(1) * case.max_seqlen.max(1) * tok * 2 + case.rows() * tok + 64;
        let mut buf = vec![777.0f32; len];
        let mut elems = vec![];
        for (b, i, row) in case.tokens(&cu) {
            let base = match case.format {
                QkvFormat::Thd => (cu[b] as usize + i) * strides.seq,
                _ => b * strides.batch + i * strides.seq,
            };
            for hh in 0..h {
                for e in 0..d {
                    let at = base + hh * head + e;
                    buf[at] = x[(row * h + hh) * d + e];
                    elems.push((at, (row * h + hh) * d + e));
                }
            }
        }
        let mut out = vec![f32::NAN; n];
        apply_rope_cpu_out(&buf, &mut out, &table, &args).unwrap();
        check_against_ref(&case, &x, &out, 1e-5)?;
        let mut inplace = buf.clone();
        apply_rope_cpu(&mut inplace, &table, &args).unwrap();
        let mut gathered = vec![0f32; n];
        for &(at, idx) in &elems {
            gathered[idx] = inplace[at];
        }
        check_against_ref(&case, &x, &gathered, 1e-5)?;
        // Everything outside the tensor is untouched.
        let mut mask = vec![false; len];
        for &(at, _) in &elems { mask[at] = true; }
        prop_assert!(inplace.iter().zip(&mask).all(|(&v, &m)| m || v == 777.0));
    }

    /// A table's entries do not depend on how many positions it covers: a
    /// smaller table is a bitwise prefix of a larger one (what lets a model
    /// grow its tables as sequences lengthen without changing a result).
    #[test]
    fn smaller_table_is_a_bitwise_prefix(n in 1usize..300, extra in 1usize..300, half in 1usize..9, base in 2.0f64..1e6) {
        let build = |max_positions| RopeTable::new(&RopeFreqs { base, rotary_dim: 2 * half, max_positions, scaling: RopeScaling::None }).unwrap();
        let (small, big) = (build(n), build(n + extra));
        prop_assert_eq!(small.cos(), &big.cos()[..n * half]);
        prop_assert_eq!(small.sin(), &big.sin()[..n * half]);
    }

    /// A thd batch rotated with start_positions equals each sequence rotated alone.
    #[test]
    fn thd_batch_equals_sequences_alone(lens in proptest::collection::vec(0usize..9, 1..6), seed in any::<u64>()) {
        let (h, d) = (3, 8);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let starts: Vec<i32> = lens.iter().map(|_| rng.gen_range(0..200)).collect();
        let mut cu = vec![0i32];
        for &l in &lens { cu.push(cu.last().unwrap() + l as i32); }
        let table = RopeTable::new(&RopeFreqs { base: 10000.0, rotary_dim: 6, max_positions: 256, scaling: RopeScaling::None }).unwrap();
        let x: Vec<f32> = random_vec(*cu.last().unwrap() as usize * h * d, seed);
        let mut batched = x.clone();
        apply_rope_cpu(&mut batched, &table, &RopeArgs::thd(RopeConvention::HalfSplit, h, d, &cu, &starts)).unwrap();
        for b in 0..lens.len() {
            let (lo, hi) = (cu[b] as usize * h * d, cu[b + 1] as usize * h * d);
            let mut alone = x[lo..hi].to_vec();
            let one_cu = [0, lens[b] as i32];
            apply_rope_cpu(&mut alone, &table, &RopeArgs::thd(RopeConvention::HalfSplit, h, d, &one_cu, &starts[b..b + 1])).unwrap();
            prop_assert_eq!(&alone[..], &batched[lo..hi]);
        }
    }
}

#[test]
fn known_values_head_dim_4_position_1() {
    let table = RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 4,
        max_positions: 2,
        scaling: RopeScaling::None,
    })
    .unwrap();
    let cu = [0, 1];
    for (conv, want) in [
        (
            RopeConvention::HalfSplit,
            [-1.984111, 1.959901, 2.462378, 4.019800],
        ),
        (
            RopeConvention::Interleaved,
            [-1.142640, 1.922076, 2.959851, 4.029800],
        ),
    ] {
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        apply_rope_cpu(&mut x, &table, &RopeArgs::thd(conv, 1, 4, &cu, &[1])).unwrap();
        for (g, w) in x.iter().zip(want) {
            assert!(
                (*g as f64 - w).abs() < 1e-6,
                "{conv:?}: got {x:?}, want {want:?}"
            );
        }
    }
}

#[test]
fn large_positions_stay_within_f32_tolerance() {
    let case = Case {
        format: QkvFormat::Thd,
        convention: RopeConvention::HalfSplit,
        lens: vec![3, 2],
        max_seqlen: 3,
        heads: 2,
        head_dim: 128,
        rotary_dim: 128,
        starts: vec![32000, 16381],
        base: 10000.0,
        cp_size: 1,
        cp_rank: 0,
        seed: 7,
    };
    run_dtype::<f32>(&case, 1e-5).unwrap();
}

#[test]
fn position_past_table_names_the_sequence() {
    let table = RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 4,
        max_positions: 10,
        scaling: RopeScaling::None,
    })
    .unwrap();
    let cu = [0, 2, 5];
    let mut x = vec![1.0f32; 5 * 4];
    let before = x.clone();
    let err = apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &cu, &[0, 8]),
    )
    .unwrap_err();
    assert_eq!(
        err,
        KernelError::PositionOutOfRange {
            op: "rope",
            seq: 1,
            position: 10,
            max_positions: 10
        }
    );
    assert_eq!(x, before, "nothing is written on error");
    assert!(err.to_string().contains("sequence 1"));
}

#[test]
fn bad_arguments_are_errors() {
    let table = RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 4,
        max_positions: 10,
        scaling: RopeScaling::None,
    })
    .unwrap();
    let mut x = vec![1.0f32; 8];
    // Head dim smaller than the rotary dim.
    assert!(apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 2, &[0, 4], &[])
    )
    .is_err());
    // Buffer too short.
    assert!(apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &[0, 3], &[])
    )
    .is_err());
    // Negative start, wrong start count, bad cu_seqlens.
    assert!(apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &[0, 2], &[-1])
    )
    .is_err());
    assert!(apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &[0, 2], &[0, 0])
    )
    .is_err());
    assert!(apply_rope_cpu(
        &mut x,
        &table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &[0, 2, 1], &[])
    )
    .is_err());
    // Overlapping in-place strides.
    let mut args = RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &[0, 2], &[]);
    args.strides = Some(TensorStrides {
        batch: 0,
        seq: 2,
        head: 4,
        dim: 1,
    });
    assert!(apply_rope_cpu(&mut x, &table, &args).is_err());
    // Odd rotary dim.
    assert!(RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 3,
        max_positions: 4,
        scaling: RopeScaling::None
    })
    .is_err());
}

#[test]
fn scaled_frequencies() {
    let plain = RopeFreqs {
        base: 500000.0,
        rotary_dim: 128,
        max_positions: 4,
        scaling: RopeScaling::None,
    };
    let f = plain.inv_freqs();
    // Linear: every frequency divided by the factor.
    let lin = RopeFreqs {
        scaling: RopeScaling::Linear { factor: 4.0 },
        ..plain
    }
    .inv_freqs();
    assert!(f
        .iter()
        .zip(&lin)
        .all(|(a, b)| (a / 4.0 - b).abs() <= 1e-15 * a));
    // Llama 3.1 (factor 8, low 1, high 4, original 8192): wavelengths below
    // 8192 / 4 = 2048 keep their frequency, above 8192 are divided by 8, and
    // in between smooth = (8192 / wavelen - 1) / 3 blends the two.
    let l3 = RopeFreqs {
        scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        ..plain
    }
    .inv_freqs();
    for i in 0..64 {
        let wavelen = 2.0 * std::f64::consts::PI / f[i];
        let want = if wavelen < 2048.0 {
            f[i]
        } else if wavelen > 8192.0 {
            f[i] / 8.0
        } else {
            let s = (8192.0 / wavelen - 1.0) / 3.0;
            (1.0 - s) * f[i] / 8.0 + s * f[i]
        };
        assert!((l3[i] - want).abs() <= 1e-15 * want, "freq {i}");
    }
    assert_eq!(l3[0], 1.0);
    assert!((l3[63] - f[63] / 8.0).abs() <= 1e-18);
    // The table holds cos/sin of position * frequency.
    let t = RopeTable::new(&RopeFreqs {
        max_positions: 3000,
        ..plain
    })
    .unwrap();
    let (pos, i) = (2999, 10);
    assert!((t.cos()[pos * 64 + i] as f64 - (pos as f64 * f[i]).cos()).abs() < 1e-7);
    assert!((t.sin()[pos * 64 + i] as f64 - (pos as f64 * f[i]).sin()).abs() < 1e-7);
}
