//! GPU parity: every CUDA op against its CPU twin (itself checked against
//! float64 references in `rope.rs` and `kv_save.rs`) on random inputs, with
//! poisoned outputs, all formats, conventions and dtypes.
//!
//! The device tests are `#[ignore = "needs a CUDA GPU: ..."]`: a plain
//! `cargo test` lists them as ignored, with the reason; `cargo xtask test
//! --gpu` (or `-- --ignored`) runs them, and then a missing GPU fails them.
//! The NVRTC compile check needs no GPU and is an ordinary test (it skips,
//! saying so, where libnvrtc cannot be loaded, unless `TE_REQUIRE_GPU=1`).

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use rand::{seq::SliceRandom, Rng, SeedableRng};
use te_kernels::cuda::{
    apply_rope_cuda, apply_rope_cuda_out, compile_ptx, convert_bshd_to_thd_cuda,
    convert_thd_to_bshd_cuda, gpu_test_device, save_kv_cuda, CudaDevice, CudaElement,
    CudaRopeTable, KV_CACHE_CU, ROPE_CU,
};
use te_kernels::{
    apply_rope_cpu, apply_rope_cpu_out, convert_bshd_to_thd, convert_thd_to_bshd, save_kv_cpu,
    ConvertArgs, KvCacheLayout, KvStep, QkvFormat, RopeArgs, RopeConvention, RopeFreqs,
    RopeScaling, RopeTable, TensorStrides,
};

type Rng64 = rand::rngs::StdRng;

const FORMATS: [QkvFormat; 3] = [QkvFormat::Bshd, QkvFormat::Sbhd, QkvFormat::Thd];

fn up<T: CudaElement>(dev: &CudaDevice, x: &[T]) -> CudaSlice<T> {
    dev.stream().clone_htod(x).unwrap()
}

fn down<T: CudaElement>(dev: &CudaDevice, x: &CudaSlice<T>) -> Vec<T> {
    dev.stream().clone_dtoh(x).unwrap()
}

fn random<T: CudaElement>(n: usize, rng: &mut Rng64) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.gen_range(-2.0f32..2.0)))
        .collect()
}

/// Equal within `rtol` (relative to max(|cpu|, 1)); poison must match exactly.
fn assert_close<T: CudaElement>(what: &str, gpu: &[T], cpu: &[T], rtol: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
        let (g, c) = (g.to_f32(), c.to_f32());
        assert!(
            (g - c).abs() <= rtol * c.abs().max(1.0),
            "{what} {:?}: element {i}: gpu {g}, cpu {c}",
            T::DTYPE
        );
    }
}

fn rope_parity<T: CudaElement>(dev: &CudaDevice, rtol: f32, rng: &mut Rng64) {
    for format in FORMATS {
        for convention in [RopeConvention::HalfSplit, RopeConvention::Interleaved] {
            for (cp_size, strided) in [(1usize, false), (2, false), (1, true)] {
                let batch = rng.gen_range(1..6);
                let (h, d) = *[(3usize, 16usize), (2, 7), (1, 128), (2, 256)]
                    .choose(rng)
                    .unwrap();
                let rotary_dim = 2 * rng.gen_range(1..=d / 2);
                let mut lens: Vec<usize> = (0..batch).map(|_| rng.gen_range(0..9)).collect();
                if cp_size > 1 {
                    lens.iter_mut().for_each(|l| *l *= 2);
                }
                let max_seqlen = lens.iter().copied().max().unwrap().max(2);
                let mut cu = vec![0i32];
                for &l in &lens {
                    cu.push(cu.last().unwrap() + l as i32);
                }
                let starts: Vec<i32> = (0..batch).map(|_| rng.gen_range(0..1000)).collect();
                let table = RopeTable::new(&RopeFreqs {
                    base: 10000.0,
                    rotary_dim,
                    max_positions: 2000,
                    scaling: RopeScaling::None,
                })
                .unwrap();
                let gpu_table = CudaRopeTable::new(dev, &table).unwrap();
                let rows = if format == QkvFormat::Thd {
                    *cu.last().unwrap() as usize
                } else {
                    batch * max_seqlen
                };
                let mut args = RopeArgs {
                    format,
                    convention,
                    num_heads: h,
                    head_dim: d,
                    batch,
                    max_seqlen,
                    cu_seqlens: if format == QkvFormat::Thd { &cu } else { &[] },
                    start_positions: &starts,
                    cp_size,
                    cp_rank: rng.gen_range(0..cp_size),
                    strides: None,
                };
                // Strided: every row and head padded, inside a poisoned buffer.
                let len = if strided {
                    let head = d + 3;
                    let tok = h * head + 5;
                    args.strides = Some(match format {
                        QkvFormat::Thd => TensorStrides {
                            batch: 0,
                            seq: tok,
                            head,
                            dim: 1,
                        },
                        _ => TensorStrides {
                            batch: tok,
                            seq: batch * tok + 1,
                            head,
                            dim: 1,
                        },
                    });
                    (rows + batch) * (batch * tok + 1) + 64
                } else {
                    rows * h * d
                };
                let what = format!(
                    "rope {format:?} {convention:?} cp {cp_size} strided {strided} h {h} d {d}"
                );
                if rows == 0 {
                    // Nothing to rotate; a zero-size device buffer is not
                    // something the driver promises to allocate.
                    continue;
                }
                let x: Vec<T> = random(len, rng);
                // Out of place into poisoned outputs.
                let mut cpu_out = vec![T::from_f32(-777.0); rows * h * d];
                apply_rope_cpu_out(&x, &mut cpu_out, &table, &args).unwrap();
                let x_dev = up(dev, &x);
                let mut out_dev = up(dev, &vec![T::from_f32(-777.0); rows * h * d]);
                apply_rope_cuda_out(dev, &x_dev, &mut out_dev, &gpu_table, &args).unwrap();
                assert_close(&what, &down(dev, &out_dev), &cpu_out, rtol);
                // In place (untouched elements keep their values).
                let mut cpu_x = x.clone();
                apply_rope_cpu(&mut cpu_x, &table, &args).unwrap();
                let mut x_dev = up(dev, &x);
                apply_rope_cuda(dev, &mut x_dev, &gpu_table, &args).unwrap();
                assert_close(&what, &down(dev, &x_dev), &cpu_x, rtol);
            }
        }
    }
}

fn kv_parity<T: CudaElement>(dev: &CudaDevice, rng: &mut Rng64) {
    for format in FORMATS {
        for page_size in [1usize, 3, 16] {
            let batch = rng.gen_range(1..6);
            let (h, dk, dv) = (
                rng.gen_range(1..4),
                rng.gen_range(1..40),
                rng.gen_range(1..40),
            );
            let step: Vec<usize> = (0..batch).map(|_| rng.gen_range(0..6)).collect();
            let cached: Vec<usize> = (0..batch).map(|_| rng.gen_range(0..20)).collect();
            let seqlens: Vec<i32> = step
                .iter()
                .zip(&cached)
                .map(|(s, c)| (s + c) as i32)
                .collect();
            let mpp = (*seqlens.iter().max().unwrap() as usize)
                .div_ceil(page_size)
                .max(1);
            let num_pages = batch * mpp + 3;
            let mut pages: Vec<i32> = (0..num_pages as i32).collect();
            pages.shuffle(rng);
            let page_table = pages[..batch * mpp].to_vec();
            let mut cu = vec![0i32];
            for &l in &step {
                cu.push(cu.last().unwrap() + l as i32);
            }
            let max_seqlen = *step.iter().max().unwrap();
            let rows = if format == QkvFormat::Thd {
                *cu.last().unwrap() as usize
            } else {
                batch * max_seqlen
            };
            let layout = KvCacheLayout {
                num_heads_kv: h,
                head_dim_k: dk,
                head_dim_v: dv,
                page_size,
                page_table: &page_table,
                max_pages_per_seq: mpp,
                cache_seqlens: &seqlens,
                ring_len: None,
            };
            let kv_step = KvStep {
                format,
                cu_seqlens: &cu,
                max_seqlen,
            };
            if rows == 0 {
                // Nothing to save; avoid zero-size device buffers.
                continue;
            }
            let k: Vec<T> = random(rows * h * dk, rng);
            let v: Vec<T> = random(rows * h * dv, rng);
            let mut kc: Vec<T> = random(num_pages * page_size * h * dk, rng);
            let mut vc: Vec<T> = random(num_pages * page_size * h * dv, rng);
            let (mut kc_dev, mut vc_dev) = (up(dev, &kc), up(dev, &vc));
            save_kv_cpu(&k, &v, &mut kc, &mut vc, &layout, &kv_step).unwrap();
            save_kv_cuda(
                dev,
                &up(dev, &k),
                &up(dev, &v),
                &mut kc_dev,
                &mut vc_dev,
                &layout,
                &kv_step,
            )
            .unwrap();
            let what = format!("save_kv {format:?} page_size {page_size}");
            assert_close(&what, &down(dev, &kc_dev), &kc, 0.0);
            assert_close(&what, &down(dev, &vc_dev), &vc, 0.0);

            // Conversions, with poisoned outputs and padding on both sides.
            let (s, t) = (max_seqlen + 1, *cu.last().unwrap() as usize + 2);
            let args = ConvertArgs {
                cu_seqlens: &cu,
                num_heads: h,
                head_dim: dk,
                max_seqlen: s,
            };
            let thd: Vec<T> = random(t * h * dk, rng);
            let mut bshd = vec![T::from_f32(-777.0); batch * s * h * dk];
            let mut bshd_dev = up(dev, &bshd);
            convert_thd_to_bshd(&thd, &mut bshd, &args).unwrap();
            convert_thd_to_bshd_cuda(dev, &up(dev, &thd), &mut bshd_dev, &args).unwrap();
            assert_close("thd_to_bshd", &down(dev, &bshd_dev), &bshd, 0.0);
            let mut back = vec![T::from_f32(-777.0); t * h * dk];
            let mut back_dev = up(dev, &back);
            convert_bshd_to_thd(&bshd, &mut back, &args).unwrap();
            convert_bshd_to_thd_cuda(dev, &up(dev, &bshd), &mut back_dev, &args).unwrap();
            assert_close("bshd_to_thd", &down(dev, &back_dev), &back, 0.0);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn rope_cuda_matches_cpu() {
    let dev = gpu_test_device();
    let mut rng = Rng64::seed_from_u64(1);
    rope_parity::<f32>(&dev, 1e-5, &mut rng);
    // One rounding of the f32 result may differ (FMA contraction): one ulp.
    rope_parity::<bf16>(&dev, 1e-2, &mut rng);
    rope_parity::<f16>(&dev, 2e-3, &mut rng);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn kv_cache_cuda_matches_cpu() {
    let dev = gpu_test_device();
    let mut rng = Rng64::seed_from_u64(2);
    kv_parity::<f32>(&dev, &mut rng);
    kv_parity::<bf16>(&dev, &mut rng);
    kv_parity::<f16>(&dev, &mut rng);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn cuda_errors_before_launch() {
    let dev = gpu_test_device();
    let table = RopeTable::new(&RopeFreqs {
        base: 10000.0,
        rotary_dim: 4,
        max_positions: 4,
        scaling: RopeScaling::None,
    })
    .unwrap();
    let gpu_table = CudaRopeTable::new(&dev, &table).unwrap();
    let mut x = up(&dev, &[1.0f32; 8]);
    let cu = [0, 2];
    let err = apply_rope_cuda(
        &dev,
        &mut x,
        &gpu_table,
        &RopeArgs::thd(RopeConvention::HalfSplit, 1, 4, &cu, &[3]),
    );
    assert!(
        matches!(
            err,
            Err(te_kernels::KernelError::PositionOutOfRange { seq: 0, .. })
        ),
        "{err:?}"
    );
}

/// The embedded sources (with `common.cuh` spliced in) compile with no
/// include path, as they do at run time. Runs wherever libnvrtc loads (e.g.
/// with `LD_LIBRARY_PATH` pointing at the wheel `cargo xtask kernels` fetched).
#[test]
fn embedded_sources_compile() {
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        if std::env::var("TE_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TE_REQUIRE_GPU=1 but libnvrtc is not loadable");
        }
        eprintln!("skipping NVRTC compile test: libnvrtc not found");
        return;
    }
    for src in [ROPE_CU, KV_CACHE_CU] {
        compile_ptx(src.name, &src.resolved(), "compute_80", &[]).unwrap();
    }
}
