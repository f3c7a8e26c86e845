//! GPU parity: `forward_cuda` against `forward_cpu` (itself checked against
//! the float64 reference in `properties.rs`) and against that reference,
//! on random inputs with NaN-poisoned outputs: every Q format, K/V tensors
//! in every format and contiguous/paged/ring caches (page sizes 1, 16, 64),
//! every mask type, windows, GQA/MQA, softcap, `d_qk != d_v`, forced and
//! heuristic KV splits; bf16, f16 and f32.
//!
//! The device tests are `#[ignore = "needs a CUDA GPU: ..."]`: a plain
//! `cargo test` lists them as ignored, with the reason; `cargo xtask test
//! --gpu` (or `-- --ignored`) runs them, and then a missing GPU fails them.
//! The NVRTC compile check needs no GPU and is an ordinary test (it skips,
//! saying so, where libnvrtc cannot be loaded, unless `TE_REQUIRE_GPU=1`).

mod common;

use common::{check, inputs, Case, Data, KvSource, PackedKv, Run};
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_attention::cuda::{CudaAttnOutput, CudaKvInput};
use te_attention::AttnMaskType;
use te_kernels::cuda::{gpu_test_device, CudaDevice, CudaElement};
use te_kernels::QkvFormat;

const FORMATS: [QkvFormat; 3] = [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd];

/// Runs the case through `forward_cuda_with_splits` with NaN-poisoned `out`
/// and `lse` (each with one poisoned element past its end, checked to stay
/// NaN); without `with_lse` no lse is asked for and `lse` stays NaN.
fn run_gpu<T: CudaElement>(
    dev: &CudaDevice,
    case: &Case,
    data: &Data,
    splits: Option<usize>,
    with_lse: bool,
) -> Run<T> {
    let inp = inputs::<T>(case, data);
    let meta = inp.meta(case);
    let rows = inp.q_rows(case);
    let s = dev.stream();
    let n_out = rows * case.h_q() * case.d_v;
    let q = up(dev, &inp.q);
    let mut out = up(dev, &vec![T::from_f32(f32::NAN); n_out]);
    let mut lse = up(dev, &vec![f32::NAN; rows * case.h_q()]);
    let (k, v) = match &inp.kv {
        PackedKv::Tensors { k, v } => (k, v),
        PackedKv::Cache {
            k_cache, v_cache, ..
        } => (k_cache, v_cache),
    };
    let (k_len, v_len) = (k.len(), v.len());
    let (k, v) = (up(dev, k), up(dev, v));
    let kv = match inp.layout(case) {
        None => CudaKvInput::Tensors {
            k: k.slice(..k_len),
            v: v.slice(..v_len),
        },
        Some(layout) => CudaKvInput::Cache {
            k_cache: k.slice(..k_len),
            v_cache: v.slice(..v_len),
            layout,
        },
    };
    case.attention()
        .forward_cuda_with_splits(
            dev,
            &q.slice(..inp.q.len()),
            &kv,
            &meta,
            CudaAttnOutput {
                out: out.slice_mut(..n_out),
                lse: with_lse.then(|| lse.slice_mut(..rows * case.h_q())),
            },
            splits,
        )
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    let mut out = s.clone_dtoh(&out).unwrap();
    let mut lse = s.clone_dtoh(&lse).unwrap();
    let past_out = out.pop().map(|x| x.to_f32());
    let past_lse = lse.pop();
    assert!(
        past_out.is_some_and(f32::is_nan) && past_lse.is_some_and(f32::is_nan),
        "{case:?}: written past the end of out or lse"
    );
    Run { out, lse }
}

/// Uploads `x` plus one trailing poison element (no zero-size allocation
/// for empty batches); callers view the first `x.len()` elements.
fn up<T: CudaElement>(dev: &CudaDevice, x: &[T]) -> CudaSlice<T> {
    let mut padded = x.to_vec();
    padded.push(T::from_f32(f32::NAN));
    dev.stream().clone_htod(&padded).unwrap()
}

/// GPU vs CPU: `|gpu - cpu| <= atol + rtol |cpu|` on every output, lse
/// within `1e-4 (1 + |cpu|)` or both -inf; then GPU vs the float64
/// reference with the same tolerances.
fn parity<T: CudaElement>(
    dev: &CudaDevice,
    case: &Case,
    splits: Option<usize>,
    atol: f64,
    rtol: f64,
) {
    let data = case.data::<T>();
    let gpu = run_gpu::<T>(dev, case, &data, splits, true);
    let cpu = common::run::<T, T>(case, &data);
    // Without lse the output is the same.
    let no_lse = run_gpu::<T>(dev, case, &data, splits, false);
    assert!(
        no_lse
            .out
            .iter()
            .zip(&gpu.out)
            .all(|(a, b)| a.to_f32() == b.to_f32())
            && no_lse.lse.iter().all(|x| x.is_nan()),
        "{:?} splits {splits:?} {case:?}: output without lse differs",
        T::DTYPE
    );
    for (n, (g, c)) in gpu.out.iter().zip(&cpu.out).enumerate() {
        let (g, c) = (g.to_f32() as f64, c.to_f32() as f64);
        assert!(
            (g - c).abs() <= atol + rtol * c.abs(),
            "{:?} splits {splits:?} {case:?}: out[{n}]: gpu {g}, cpu {c}",
            T::DTYPE
        );
    }
    for (n, (&g, &c)) in gpu.lse.iter().zip(&cpu.lse).enumerate() {
        let ok = if c == f32::NEG_INFINITY {
            g == f32::NEG_INFINITY
        } else {
            (g - c).abs() <= 1e-4 * (1.0 + c.abs())
        };
        assert!(
            ok,
            "{:?} splits {splits:?} {case:?}: lse[{n}]: gpu {g}, cpu {c}",
            T::DTYPE
        );
    }
    if let Err(e) = check(case, &data, &gpu, atol, rtol.max(1e-4)) {
        panic!(
            "{:?} splits {splits:?} {case:?}: vs reference: {e}",
            T::DTYPE
        );
    }
}

/// Runs `parity` in bf16 and f16 (atol 1e-2, rtol 1e-3) and f32 (1e-4).
fn parity_all_dtypes(dev: &CudaDevice, case: &Case, splits: Option<usize>) {
    parity::<bf16>(dev, case, splits, 1e-2, 1e-3);
    parity::<f16>(dev, case, splits, 1e-2, 1e-3);
    parity::<f32>(dev, case, splits, 1e-4, 1e-4);
}

/// Where K/V come from: 0..3 tensors in FORMATS, 3 contiguous cache,
/// 4 paged cache, 5 paged sliding-window ring.
fn kv_source(kind: usize, page_size: usize, rng: &mut StdRng) -> KvSource {
    match kind {
        0..=2 => KvSource::Tensors(FORMATS[kind]),
        3 => KvSource::Cache {
            page_size: 0, // contiguous: one page per sequence, set later
            ring_len: None,
        },
        4 => KvSource::Cache {
            page_size,
            ring_len: None,
        },
        _ => KvSource::Cache {
            page_size,
            ring_len: Some(page_size * rng.gen_range(1..=3)),
        },
    }
}

/// A random case of the given kind; lengths up to `max_len` (ragged where
/// the format or mask allows, some empty), random window, GQA, dims.
fn random_case(
    q_format: QkvFormat,
    kv: KvSource,
    mask: AttnMaskType,
    max_len: usize,
    seed: u64,
) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let batch = rng.gen_range(1..=4);
    let len = |rng: &mut StdRng, max: usize| match rng.gen_range(0..5) {
        0 => 0,
        1 => 1,
        _ => rng.gen_range(0..=max),
    };
    let ragged_q = q_format == QkvFormat::Thd || mask.is_padding();
    let max_seqlen_q = rng.gen_range(1..=max_len);
    let sq: Vec<usize> = (0..batch)
        .map(|_| {
            if ragged_q {
                len(&mut rng, max_seqlen_q)
            } else {
                max_seqlen_q
            }
        })
        .collect();
    let max_seqlen_kv = rng.gen_range(1..=max_len);
    let skv: Vec<usize> = match kv {
        KvSource::Cache { .. } => sq.iter().map(|&s| s + len(&mut rng, max_len)).collect(),
        KvSource::Tensors(f) if f == QkvFormat::Thd || mask.is_padding() => {
            (0..batch).map(|_| len(&mut rng, max_seqlen_kv)).collect()
        }
        KvSource::Tensors(_) => vec![max_seqlen_kv; batch],
    };
    let kv = match kv {
        KvSource::Cache { page_size: 0, .. } => KvSource::Cache {
            page_size: skv.iter().copied().max().unwrap_or(1).max(1),
            ring_len: None,
        },
        other => other,
    };
    let right = if mask.is_causal() {
        [0, -1][rng.gen_range(0..2)]
    } else {
        rng.gen_range(0..8)
    };
    let left = rng.gen_range(0..24i64);
    let window = match rng.gen_range(0..4) {
        0 => None,
        1 => Some((left, right)),
        2 => Some((-1, right)),
        _ => Some((left, -1)),
    };
    let (d_qk, d_v) = [(64, 64), (128, 128), (128, 64), (40, 24), (256, 256)][rng.gen_range(0..5)];
    Case {
        q_format,
        kv,
        mask,
        window,
        softcap: rng.gen_bool(0.3).then_some(5.0),
        softmax_scale: rng.gen_bool(0.3).then_some(0.3),
        h_kv: rng.gen_range(1..=2),
        group: [1, 2, 4, 5][rng.gen_range(0..4)],
        d_qk,
        d_v,
        sq,
        skv,
        max_seqlen_q,
        max_seqlen_kv,
        seed,
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn every_format_source_and_mask_matches_cpu() {
    let dev = gpu_test_device();
    for case in every_kind_of_case(1) {
        parity_all_dtypes(&dev, &case, None);
        // Split KV (the combine kernel) with every Q format.
        parity::<bf16>(&dev, &case, Some(3), 1e-2, 1e-3);
    }
}

/// One random case (`random_case`, lengths up to 40) of every Q format,
/// K/V source and mask, seeded `seed + 1`, `seed + 2`, ...
fn every_kind_of_case(seed: u64) -> Vec<Case> {
    let mut cases = Vec::new();
    for q_format in FORMATS {
        for kind in 0..6 {
            for mask in AttnMaskType::ALL {
                let seed = seed + 1 + cases.len() as u64;
                let mut rng = StdRng::seed_from_u64(seed);
                let page_size = [1, 16, 64][rng.gen_range(0..3)];
                let kv = kv_source(kind, page_size, &mut rng);
                cases.push(random_case(q_format, kv, mask, 40, seed));
            }
        }
    }
    cases
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn paged_and_ring_caches_of_every_page_size_match_cpu() {
    let dev = gpu_test_device();
    let mut seed = 1000u64;
    for page_size in [1, 16, 64] {
        for kind in [4, 5] {
            for mask in [AttnMaskType::CausalBottomRight, AttnMaskType::NoMask] {
                seed += 1;
                let mut rng = StdRng::seed_from_u64(seed);
                let kv = kv_source(kind, page_size, &mut rng);
                let case = random_case(QkvFormat::Thd, kv, mask, 100, seed);
                parity_all_dtypes(&dev, &case, None);
                parity::<bf16>(&dev, &case, Some(3), 1e-2, 1e-3);
            }
        }
    }
}

/// Decode over long caches: one query per sequence (and a few), GQA, every
/// page size, ring caches; split 1, forced splits and the heuristic.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn split_kv_decode_matches_cpu() {
    let dev = gpu_test_device();
    let mut seed = 2000u64;
    for page_size in [1, 16, 64] {
        for ring in [None, Some(256)] {
            for sq_max in [1usize, 3] {
                seed += 1;
                let mut rng = StdRng::seed_from_u64(seed);
                let batch = rng.gen_range(1..=3);
                let sq: Vec<usize> = (0..batch).map(|_| rng.gen_range(1..=sq_max)).collect();
                let skv: Vec<usize> = sq.iter().map(|&s| s + rng.gen_range(0..900)).collect();
                let case = Case {
                    q_format: QkvFormat::Thd,
                    kv: KvSource::Cache {
                        page_size,
                        ring_len: ring,
                    },
                    mask: AttnMaskType::PaddingCausalBottomRight,
                    window: ring.map(|r| (r as i64 - 1, 0)),
                    softcap: rng.gen_bool(0.5).then_some(30.0),
                    softmax_scale: None,
                    h_kv: 2,
                    group: 4,
                    d_qk: 128,
                    d_v: 128,
                    sq,
                    skv,
                    max_seqlen_q: sq_max,
                    max_seqlen_kv: 0,
                    seed,
                };
                for splits in [Some(1), Some(2), Some(7), None] {
                    parity::<bf16>(&dev, &case, splits, 1e-2, 1e-3);
                }
                parity::<f32>(&dev, &case, Some(5), 1e-4, 1e-4);
            }
        }
    }
}

/// The decode kernels (`attn_decode<R>`, at most 8 (query, head-in-group)
/// rows per sequence and KV head): random cases of every Q format, K/V
/// source and mask cut to 1-8 rows, with groups of 1, 3, 4, 7 and 8 (each
/// of R = 1, 4, 8 and the boundaries between them); then long caches at
/// one query, MHA at d 256 (Gemma-7B's shape) and GQA 7 at d 128
/// (Qwen2.5-7B's), split 1, forced and heuristic.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn decode_kernels_match_cpu() {
    let dev = gpu_test_device();
    let mut seed = 4000u64;
    for mut case in every_kind_of_case(seed) {
        seed = case.seed;
        case.group = [1, 3, 4, 7, 8][seed as usize % 5];
        case.max_seqlen_q = case.max_seqlen_q.min(8 / case.group);
        for s in &mut case.sq {
            *s = (*s).min(case.max_seqlen_q);
        }
        parity_all_dtypes(&dev, &case, None);
        parity::<bf16>(&dev, &case, Some(3), 1e-2, 1e-3);
    }
    for (group, d) in [(1, 256), (7, 128)] {
        for ring in [None, Some(1024)] {
            seed += 1;
            let mut rng = StdRng::seed_from_u64(seed);
            let batch = rng.gen_range(1..=4);
            let skv: Vec<usize> = (0..batch).map(|_| rng.gen_range(1..=3000)).collect();
            let case = Case {
                q_format: QkvFormat::Thd,
                kv: KvSource::Cache {
                    page_size: 16,
                    ring_len: ring,
                },
                mask: AttnMaskType::PaddingCausalBottomRight,
                window: ring.map(|r| (r as i64 - 1, 0)),
                softcap: (group == 1).then_some(50.0),
                softmax_scale: None,
                h_kv: 2,
                group,
                d_qk: d,
                d_v: d,
                sq: vec![1; batch],
                skv,
                max_seqlen_q: 1,
                max_seqlen_kv: 0,
                seed,
            };
            for splits in [Some(1), Some(5), None] {
                parity::<bf16>(&dev, &case, splits, 1e-2, 1e-3);
            }
            parity::<f32>(&dev, &case, None, 1e-4, 1e-4);
        }
    }
}

/// Prefill at awkward sizes: several row tiles and key tiles, MQA with a
/// group larger than a block's rows, ragged thd batch of 17.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn larger_prefill_matches_cpu() {
    let dev = gpu_test_device();
    let mut rng = StdRng::seed_from_u64(3000);
    let sq: Vec<usize> = (0..17).map(|_| rng.gen_range(0..=97)).collect();
    let case = Case {
        q_format: QkvFormat::Thd,
        kv: KvSource::Tensors(QkvFormat::Thd),
        mask: AttnMaskType::PaddingCausal,
        window: None,
        softcap: None,
        softmax_scale: None,
        h_kv: 1,
        group: 20,
        d_qk: 64,
        d_v: 64,
        skv: sq.clone(),
        sq,
        max_seqlen_q: 97,
        max_seqlen_kv: 97,
        seed: 3000,
    };
    parity::<bf16>(&dev, &case, None, 1e-2, 1e-3);
    parity::<bf16>(&dev, &case, Some(4), 1e-2, 1e-3);
    let case = Case {
        q_format: QkvFormat::Bshd,
        kv: KvSource::Tensors(QkvFormat::Sbhd),
        mask: AttnMaskType::CausalBottomRight,
        window: Some((50, 0)),
        softcap: Some(50.0),
        softmax_scale: None,
        h_kv: 4,
        group: 2,
        d_qk: 256,
        d_v: 256,
        sq: vec![150; 2],
        skv: vec![300; 2],
        max_seqlen_q: 150,
        max_seqlen_kv: 300,
        seed: 3001,
    };
    parity_all_dtypes(&dev, &case, None);
}

/// The embedded source (with `common.cuh` spliced in) compiles with no
/// include path, as it does at run time, for sm_80 and sm_90. Runs wherever
/// libnvrtc loads (e.g. with `LD_LIBRARY_PATH` pointing at the wheel
/// `cargo xtask kernels` fetched).
#[test]
fn embedded_source_compiles() {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        if std::env::var("TE_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TE_REQUIRE_GPU=1 but libnvrtc is not loadable");
        }
        eprintln!("skipping NVRTC compile test: libnvrtc not found");
        return;
    }
    let src = te_attention::cuda::ATTENTION_CU;
    for arch in ["compute_80", "compute_90"] {
        te_kernels::cuda::compile_ptx(src.name, &src.resolved(), arch, &[]).unwrap();
    }
}
