//! GPU parity of the CUDA model path: every device op of
//! `te_models::cuda::Cuda` against the CPU op (`te_models::device::Cpu`) on
//! random inputs with poisoned outputs, both GEMMs (cuBLAS and
//! `crates/te-models/kernels/gemm.cu`) against an f32 product of the same bf16 values, the
//! device argmax against the sampler's rule, and the tiny random models of
//! every architecture cuda against cpu (last-token logits within bf16
//! tolerance, the same greedy tokens).
//!
//! Device tests are `#[ignore = "needs a CUDA GPU: cargo xtask test
//! --gpu"]`; the NVRTC compile check runs everywhere libnvrtc loads.

use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::bf16;
use rand::{Rng, SeedableRng};
use te_cache::CacheLayout;
use te_engine::{Engine, EngineConfig, Request};
use te_formats::WeightData;
use te_models::config::Activation;
use te_models::cuda::ops::{GEMM_CU, MODEL_OPS_CU};
use te_models::cuda::{Cuda, CudaLinear, CudaModel, Device, GemmBackend};
use te_models::device::{Cpu, DeviceOps};
use te_models::model::{Logits, Model, StepOutput};
use te_models::ops::Linear;
use te_models::runner::Runner;

type Rng64 = rand::rngs::StdRng;

const NEEDS_GPU: &str = "needs a CUDA GPU: cargo xtask test --gpu";

fn random(n: usize, rng: &mut Rng64) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn cuda(use_cublas: bool) -> Cuda {
    Cuda::new(0, use_cublas).unwrap_or_else(|e| panic!("{NEEDS_GPU}: {e}"))
}

/// A device buffer poisoned with NaN.
fn poisoned(c: &Cuda, n: usize) -> CudaSlice<f32> {
    c.upload(&vec![f32::NAN; n]).unwrap()
}

fn down(c: &Cuda, b: &CudaSlice<f32>) -> Vec<f32> {
    let mut v = Vec::new();
    c.download(b, &mut v).unwrap();
    v
}

fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= atol + rtol * w.abs(),
            "{what}[{i}]: cuda {g}, cpu {w}"
        );
    }
}

#[test]
fn model_kernels_compile() {
    // SAFETY: only checks that the library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        if std::env::var("TE_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TE_REQUIRE_GPU=1 but libnvrtc is not loadable");
        }
        eprintln!("skipping NVRTC compile test: libnvrtc not found");
        return;
    }
    for src in [MODEL_OPS_CU, GEMM_CU] {
        te_kernels::cuda::compile_ptx(src.name, &src.resolved(), "compute_80", &[]).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn small_ops_match_cpu() {
    let mut rng = Rng64::seed_from_u64(14);
    let mut c = cuda(false);
    let mut cpu = Cpu::default();
    for (rows, dim) in [(1, 7), (3, 256), (17, 1000), (5, 3072)] {
        let n = rows * dim;
        let (x, w, u) = (
            random(n, &mut rng),
            random(dim, &mut rng),
            random(n, &mut rng),
        );
        let (xd, wd, ud) = (
            c.upload(&x).unwrap(),
            c.upload(&w).unwrap(),
            c.upload(&u).unwrap(),
        );
        // RMSNorm into and in place.
        let mut want = vec![0.0; n];
        cpu.rms_norm_into(&x, &w, 1e-6, &mut want).unwrap();
        let mut y = poisoned(&c, n);
        c.rms_norm_into(&xd, &wd, 1e-6, &mut y).unwrap();
        assert_close("rms_norm", &down(&c, &y), &want, 1e-5, 1e-5);
        let mut xi = c.upload(&x).unwrap();
        c.rms_norm_inplace(&mut xi, &wd, 1e-6).unwrap();
        assert_close("rms_norm_inplace", &down(&c, &xi), &want, 1e-5, 1e-5);
        // Gated activations.
        for act in [Activation::Silu, Activation::GeluTanh] {
            let mut g = x.clone();
            cpu.gated_act(act, &mut g, &u).unwrap();
            let mut gd = c.upload(&x).unwrap();
            c.gated_act(act, &mut gd, &ud).unwrap();
            assert_close(&format!("{act:?}"), &down(&c, &gd), &g, 1e-5, 1e-5);
        }
        // Residual add and softcap.
        let mut a = x.clone();
        cpu.add_inplace(&mut a, &u).unwrap();
        let mut ad = c.upload(&x).unwrap();
        c.add_inplace(&mut ad, &ud).unwrap();
        assert_close("add", &down(&c, &ad), &a, 0.0, 0.0);
        let mut s = x.clone();
        cpu.softcap(&mut s, 1.5).unwrap();
        let mut sd = c.upload(&x).unwrap();
        c.softcap(&mut sd, 1.5).unwrap();
        assert_close("softcap", &down(&c, &sd), &s, 1e-6, 1e-6);
        // Row gather.
        let pick: Vec<usize> = (0..rows).rev().step_by(2).collect();
        let mut gw = vec![0.0; pick.len() * dim];
        cpu.gather_rows(&x, &pick, dim, &mut gw).unwrap();
        let mut gd = poisoned(&c, pick.len() * dim);
        c.gather_rows(&xd, &pick, dim, &mut gd).unwrap();
        assert_close("gather_rows", &down(&c, &gd), &gw, 0.0, 0.0);
    }
    // Embedding of bf16 rows, scaled.
    let (vocab, hidden) = (50, 96);
    let table = round_bf16(&random(vocab * hidden, &mut rng));
    let host = Linear::new("embed", WeightData::F32(table.clone()), vocab, hidden).unwrap();
    let dev = linear_on(&c, &host);
    let tokens = [3u32, 0, 49, 3, 17];
    let mut want = vec![0.0; tokens.len() * hidden];
    cpu.embed(&host, &tokens, 9.0, &mut want).unwrap();
    let mut got = poisoned(&c, tokens.len() * hidden);
    c.embed(&dev, &tokens, 9.0, &mut got).unwrap();
    assert_close("embed", &down(&c, &got), &want, 0.0, 0.0);
}

fn linear_on(c: &Cuda, l: &Linear) -> CudaLinear {
    let w: Vec<bf16> = l.to_f32().iter().map(|&x| bf16::from_f32(x)).collect();
    CudaLinear {
        weight: c.stream().clone_htod(&w).unwrap(),
        bias: l.bias.as_ref().map(|b| c.upload(b).unwrap()),
        out_features: l.out_features,
        in_features: l.in_features,
    }
}

/// Both GEMMs against the f32 product of the same bf16-rounded values, at
/// awkward sizes (partial tiles, decode rows, bias).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn gemms_match_the_f32_product_of_bf16_values() {
    let mut rng = Rng64::seed_from_u64(7);
    let mut c = cuda(true);
    let mut cpu = Cpu::default();
    let backends: &[GemmBackend] = if c.gemm_backend() == GemmBackend::Cublas {
        &[GemmBackend::Cublas, GemmBackend::Kernel]
    } else {
        eprintln!("cuBLAS did not load: checking the GEMM kernel only");
        &[GemmBackend::Kernel]
    };
    for (t, n, k, bias) in [
        (1, 1, 16, false),
        (1, 97, 200, true),
        (8, 64, 64, false),
        (17, 130, 96, true),
        (64, 256, 3072, false),
        (100, 75, 40, true),
    ] {
        let x = round_bf16(&random(t * k, &mut rng));
        let w = round_bf16(&random(n * k, &mut rng));
        let mut l = Linear::new("w", WeightData::F32(w), n, k).unwrap();
        if bias {
            l = l.with_bias("b", random(n, &mut rng)).unwrap();
        }
        let mut want = vec![0.0; t * n];
        cpu.linear(&l, &x, t, &mut want).unwrap();
        let dl = linear_on(&c, &l);
        let xd = c.upload(&x).unwrap();
        for &b in backends {
            let mut y = poisoned(&c, t * n);
            c.linear_with(b, &dl, &xd, t, &mut y).unwrap();
            // f32 sums of k exact products: rounding grows with k.
            let tol = 1e-6 * k as f32;
            assert_close(
                &format!("{b:?} t={t} n={n} k={k}"),
                &down(&c, &y),
                &want,
                tol,
                tol,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn device_argmax_follows_the_greedy_rule() {
    let mut c = cuda(false);
    let vocab = 1000;
    let mut rows: Vec<Vec<f32>> = vec![vec![0.0; vocab]; 4];
    rows[0][999] = 3.0;
    rows[1][5] = 2.0;
    rows[1][700] = 2.0; // tie: lowest id
    rows[2].iter_mut().for_each(|v| *v = f32::NAN);
    rows[2][42] = -1.0; // NaN never wins
    rows[3]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i as f32 * 0.37).sin());
    let flat: Vec<f32> = rows.concat();
    let logits = c.upload(&flat).unwrap();
    let mut ids = c.stream().alloc_zeros::<u32>(4).unwrap();
    c.argmax(&logits, vocab, &mut ids).unwrap();
    let mut got = Vec::new();
    c.download(&ids, &mut got).unwrap();
    let want: Vec<u32> = rows
        .iter()
        .map(|r| te_engine::sampling::argmax(r))
        .collect();
    assert_eq!(got, want);
}

fn tiny(preset: &str) -> Model {
    let source = te_models::source::resolve_model(&format!("random:{preset}")).unwrap();
    let mut model = te_models::loader::load_model(&source).unwrap().model;
    // bf16 weights on both devices, so the CPU is the reference of the
    // same model.
    for l in model.weights.matrices_mut() {
        if let WeightData::F32(w) = &mut l.weight {
            *w = round_bf16(w);
        }
    }
    model
}

/// `model`'s weights on GPU 0.
fn upload(model: &Model) -> Arc<CudaModel> {
    let cuda = Device::Cuda(0).open().unwrap().expect("GPU 0");
    Arc::new(CudaModel::upload(model, cuda, Engine::default_kv_cache_tokens(model)).unwrap())
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn tiny_models_cuda_match_cpu() {
    for preset in [
        "tiny-llama",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma",
        "tiny-gemma2",
        "tiny-gemma3",
    ] {
        let model = tiny(preset);
        let gpu = upload(&model);
        // One prefill step of two prompts: last-token logits.
        let prompts: [&[u32]; 2] = [&[1, 5, 9, 13, 2, 7, 7, 30], &[4, 3]];
        let tokens: Vec<u32> = prompts.concat();
        let steps: Vec<(u64, usize)> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p.len()))
            .collect();
        let layout = CacheLayout::Paged {
            page_size: 4,
            total_num_pages: 16,
        };
        let mut host = model.new_cache(2, 64, 16, layout).unwrap();
        host.pre_step(&steps).unwrap();
        let want = model.forward(&tokens, &mut host, Logits::Last).unwrap();
        let mut runner = Runner::new(Some(gpu.clone()));
        let mut dev = runner.new_cache(&model, 2, 64, 16, layout).unwrap();
        dev.pre_step(&steps).unwrap();
        let got = match runner.step(&model, &tokens, &mut dev, false).unwrap() {
            StepOutput::Logits(l) => l.to_vec(),
            StepOutput::Tokens(_) => panic!("{preset}: asked for logits"),
        };
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // bf16 activations into each product: errors of ~2^-8 relative.
        assert_close(preset, &got, &want, 2e-2 * scale, 0.0);
        // Greedy generation through the engine: the same tokens.
        let requests: Vec<Request> = prompts
            .iter()
            .map(|p| Request {
                ignore_eos: true,
                ..Request::new(p.to_vec(), 12)
            })
            .collect();
        let run = |gpu: Option<Arc<CudaModel>>| {
            let config = EngineConfig {
                gpu,
                ..EngineConfig::default()
            };
            te_engine::generate::generate(&model, &requests, &config, |_, _| {
                te_engine::generate::Control::Continue
            })
            .unwrap()
            .into_iter()
            .map(|o| o.tokens)
            .collect::<Vec<_>>()
        };
        assert_eq!(run(Some(gpu)), run(None), "{preset}: greedy tokens");
    }
}

/// Tokens of `batch` requests (prompts of 2..12 tokens, 6..10 new tokens
/// each, so the batch shrinks across buckets) on `preset` on GPU 0 with the
/// GEMM kernel (its rows do not depend on the batch, so padded and
/// unpadded steps agree bit for bit), with or without CUDA graphs: greedy
/// (the device argmax in the graph) or sampled at temperature 1 with a
/// seed (the logits copied back), since greedy decoding of a tied-embedding
/// random model tends to repeat its last token whatever the weights.
fn graph_run(preset: &str, batch: usize, graphs: bool, sampled: bool) -> Vec<Vec<u32>> {
    let model = tiny(preset);
    let cuda = Device::Cuda(0).open().unwrap().expect("GPU 0");
    let mut gpu = CudaModel::upload(&model, cuda, Engine::default_kv_cache_tokens(&model)).unwrap();
    gpu.set_gemm_backend(GemmBackend::Kernel).unwrap();
    gpu.set_graphs(graphs);
    let requests: Vec<Request> = (0..batch)
        .map(|i| {
            let prompt = (0..2 + (i * 5) % 11)
                .map(|j| (1 + (i * 7 + j * 3) % 29) as u32)
                .collect();
            let mut r = Request {
                ignore_eos: true,
                ..Request::new(prompt, 6 + i % 5)
            };
            if sampled {
                r.sampling.temperature = 1.0;
                r.sampling.seed = 3 + i as u64;
            }
            r
        })
        .collect();
    let config = EngineConfig {
        max_batch_size: 128,
        gpu: Some(Arc::new(gpu)),
        ..EngineConfig::default()
    };
    te_engine::generate::generate(&model, &requests, &config, |_, _| {
        te_engine::generate::Control::Continue
    })
    .unwrap()
    .into_iter()
    .map(|o| o.tokens)
    .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn graph_decode_matches_plain_decode() {
    // 1 and 8 fill their buckets; 3, 13 and 70 are padded (to 4, 16, 128).
    for preset in [
        "tiny-llama",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-gemma",
        "tiny-gemma2",
        "tiny-gemma3",
    ] {
        for batch in [1, 3, 8, 13, 70] {
            for sampled in [false, true] {
                assert_eq!(
                    graph_run(preset, batch, true, sampled),
                    graph_run(preset, batch, false, sampled),
                    "{preset}, batch {batch}, sampled {sampled}: graph decode vs plain decode"
                );
            }
        }
    }
}

/// Seconds per call of `f` (after one warm-up call), the stream synchronized
/// around `iters` calls.
fn time_per_call(stream: &cudarc::driver::CudaStream, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    stream.synchronize().unwrap();
    let start = std::time::Instant::now();
    for _ in 0..iters {
        f();
    }
    stream.synchronize().unwrap();
    start.elapsed().as_secs_f64() / iters as f64
}

/// Effective bandwidth of the main kernels on Gemma-7B's shapes against a
/// device-to-device copy measured in the same run (bytes each kernel must
/// move at least / time; the copy counts read + write). A report for the
/// GPU bundle (`run.sh` step 5); it checks only that every figure is
/// positive and finite.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test --gpu"]
fn kernel_bandwidth() {
    use te_attention::cuda::CudaKvInput;
    use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention};
    use te_kernels::{KvCacheLayout, QkvFormat};

    let mut c = cuda(true);
    let stream = c.stream().clone();
    let mut rng = Rng64::seed_from_u64(14);
    let gb = |bytes: usize, s: f64| bytes as f64 / s / 1e9;
    let mut rows: Vec<(String, usize, f64)> = Vec::new();

    // Device-to-device copy of 1 GiB.
    let n = 1 << 28;
    let src = c.stream().alloc_zeros::<f32>(n).unwrap();
    let mut dst = c.stream().alloc_zeros::<f32>(n).unwrap();
    let s = time_per_call(&stream, 10, || stream.memcpy_dtod(&src, &mut dst).unwrap());
    rows.push(("d2d copy 1 GiB".into(), 2 * 4 * n, s));
    drop((src, dst));

    // Products on Gemma-7B's weights (bf16): gate/up, down, lm head.
    let (hidden, inter, vocab) = (3072, 24576, 256000);
    let backends = [GemmBackend::Cublas, GemmBackend::Kernel];
    for (name, out_f, in_f) in [
        ("gate/up", inter, hidden),
        ("down", hidden, inter),
        ("lm_head", vocab, hidden),
    ] {
        let w = CudaLinear {
            weight: c
                .stream()
                .clone_htod(&vec![bf16::from_f32(0.01); out_f * in_f])
                .unwrap(),
            bias: None,
            out_features: out_f,
            in_features: in_f,
        };
        for t in [1, 64] {
            let x = c.upload(&random(t * in_f, &mut rng)).unwrap();
            let mut y = poisoned(&c, t * out_f);
            for backend in backends {
                if backend == GemmBackend::Cublas && c.gemm_backend() != GemmBackend::Cublas {
                    continue;
                }
                let s = time_per_call(&stream, 20, || {
                    c.linear_with(backend, &w, &x, t, &mut y).unwrap()
                });
                let bytes = 2 * out_f * in_f + 4 * t * (in_f + out_f);
                rows.push((format!("{name} {out_f}x{in_f} t={t} {backend:?}"), bytes, s));
            }
        }
    }

    // RMSNorm of 4096 rows of 3072 (read x, write y).
    let (r, d) = (4096, hidden);
    let x = c.upload(&random(r * d, &mut rng)).unwrap();
    let wn = c.upload(&random(d, &mut rng)).unwrap();
    let mut y = poisoned(&c, r * d);
    let s = time_per_call(&stream, 50, || {
        c.rms_norm_into(&x, &wn, 1e-6, &mut y).unwrap()
    });
    rows.push((format!("rmsnorm {r}x{d}"), 2 * 4 * r * d, s));

    // Decode attention: 8 sequences of 4096 cached keys, 16 heads of 256
    // (Gemma-7B), f32 cache, contiguous layout (one page per sequence).
    let dev = te_kernels::cuda::CudaDevice::new_capturable(0).unwrap();
    let (b, h, hd, len) = (8, 16, 256, 4096);
    let attn = DotProductAttention::new(h, hd)
        .with_num_gqa_groups(h)
        .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
    let q = dev
        .stream()
        .clone_htod(&random(b * h * hd, &mut rng))
        .unwrap();
    let kc = dev
        .stream()
        .clone_htod(&random(b * len * h * hd, &mut rng))
        .unwrap();
    let vc = dev
        .stream()
        .clone_htod(&random(b * len * h * hd, &mut rng))
        .unwrap();
    let mut out = dev.stream().alloc_zeros::<f32>(b * h * hd).unwrap();
    let page_table: Vec<i32> = (0..b as i32).collect();
    let cache_seqlens = vec![len as i32; b];
    let cu: Vec<i32> = (0..=b as i32).collect();
    let layout = KvCacheLayout {
        num_heads_kv: h,
        head_dim_k: hd,
        head_dim_v: hd,
        page_size: len,
        page_table: &page_table,
        max_pages_per_seq: 1,
        cache_seqlens: &cache_seqlens,
        ring_len: None,
    };
    let meta = AttnMetadata {
        batch: b,
        max_seqlen_q: 0,
        max_seqlen_kv: 0,
        cu_seqlens_q: Some(&cu),
        cu_seqlens_kv: None,
    };
    let kv = CudaKvInput::Cache {
        k_cache: kc.slice(..),
        v_cache: vc.slice(..),
        layout,
    };
    let s = time_per_call(dev.stream(), 20, || {
        attn.forward_cuda(&dev, &q.slice(..), &kv, &meta, &mut out.slice_mut(..), None)
            .unwrap()
    });
    rows.push((
        format!("attention decode b={b} kv={len} h={h} d={hd}"),
        2 * 4 * b * len * h * hd,
        s,
    ));

    let copy = gb(rows[0].1, rows[0].2);
    println!("kernel bandwidth (GB/s; % of the device-to-device copy)");
    for (name, bytes, s) in &rows {
        let bw = gb(*bytes, *s);
        assert!(bw.is_finite() && bw > 0.0, "{name}: {bw} GB/s");
        println!(
            "  {name:<44} {:>9.1} us {:>8.1} GB/s {:>6.1}%",
            s * 1e6,
            bw,
            100.0 * bw / copy
        );
    }
}
