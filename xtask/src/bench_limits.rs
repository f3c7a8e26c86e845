//! The machine's limits, measured where the figures they bound are:
//! read bandwidth (a parallel sum over a buffer), the f32 FMA peak
//! (independent fused multiply-add chains on every thread) and the same
//! FMAs fed by the matrix kernel's loads, and what a
//! model's token costs against them (weight bytes read, multiply-adds),
//! from its GGUF file's tensor table.

use std::time::Instant;

use rayon::prelude::*;

/// Read bandwidth (GB/s) of a parallel sum over `x`, on the current rayon
/// pool: the best of 3 passes after one warm-up.
pub fn read_bandwidth(x: &[f32]) -> f64 {
    let mut sink = 0f32;
    let t = crate::best_of(3, || {
        sink += x
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0f32; 16];
                for ch in c.chunks_exact(16) {
                    for (a, v) in acc.iter_mut().zip(ch) {
                        *a += v;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum::<f32>();
    });
    std::hint::black_box(sink);
    std::mem::size_of_val(x) as f64 / t / 1e9
}

/// Read bandwidth (GB/s) over a fresh buffer of `bytes` bytes (rounded
/// down to whole f32), summed by `threads` threads.
pub fn read_bandwidth_over(bytes: usize, threads: usize) -> anyhow::Result<f64> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?;
    let x = vec![1.0f32; bytes / 4];
    Ok(pool.install(|| read_bandwidth(&x)))
}

/// Independent FMA chains per thread: enough to cover the FMA latency (4
/// cycles) on both FMA ports.
const CHAINS: usize = 10;

/// FMA steps per chain in one timed call.
const STEPS: usize = 20_000_000;

/// The f32 FMA peak (GFLOP/s, a fused multiply-add counted as 2 FLOP) of
/// `threads` threads, each running [`CHAINS`] independent chains of
/// 512-bit FMAs (256-bit without AVX-512F, scalar `mul_add` without FMA),
/// all threads at once: the best of 3 runs.
pub fn fma_peak(threads: usize) -> f64 {
    let (lanes, run): (usize, fn(usize) -> f32) = best_chains();
    let flops = 2.0 * (CHAINS * STEPS * lanes) as f64;
    all_threads_gflops(threads, flops, || run(STEPS))
}

/// GFLOP/s of `threads` threads each running `run` (`flops` FLOP per
/// call, its result kept from the optimizer) at once: the best of 3 runs.
fn all_threads_gflops(threads: usize, flops: f64, run: impl Fn() -> f32 + Sync) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads).map(|_| s.spawn(&run)).collect();
                for h in handles {
                    std::hint::black_box(h.join().expect("an FMA thread panicked"));
                }
            });
            threads as f64 * flops / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// Steps of [`x86::tile_mix`] per thread in one timed call (24 FMAs each).
const MIX_STEPS: usize = 8_000_000;

/// The f32 multiply-add rate (GFLOP/s) of `threads` threads running the
/// instruction mix of te-kernels' AVX-512 register tile (`matmul`: 4
/// weight rows x 6 token rows): each step loads 10 64-byte vectors from
/// an L1-resident buffer and issues 24 independent FMAs on them, all
/// threads at once, the best of 3 runs. The FMA peak bounds it; the
/// difference is what the loads cost the FMAs on this core at this
/// moment. On a virtual machine whose core's sibling hyperthread runs
/// another tenant's loads it fell to 65-80% of the peak for seconds at a
/// time, while the peak itself moved by a few percent. `None` without
/// AVX-512F.
pub fn tile_mix_peak(threads: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let flops = 2.0 * (24 * 16 * MIX_STEPS) as f64;
        // SAFETY: AVX-512F is present (checked above).
        let run = || unsafe { x86::tile_mix(MIX_STEPS) };
        return Some(all_threads_gflops(threads, flops, run));
    }
    let _ = threads;
    None
}

/// The widest FMA chains this processor runs: (f32 lanes, function).
fn best_chains() -> (usize, fn(usize) -> f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F is present (checked above).
            return (16, |steps| unsafe { x86::chains_512(steps) });
        }
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: FMA and AVX are present (FMA implies AVX).
            return (8, |steps| unsafe { x86::chains_256(steps) });
        }
    }
    (1, chains_scalar)
}

/// Scalar fallback: [`CHAINS`] chains of `steps` `f32::mul_add`s.
fn chains_scalar(steps: usize) -> f32 {
    let mut acc = [0f32; CHAINS];
    let (a, b) = std::hint::black_box((0.999_f32, 1e-3_f32));
    for _ in 0..steps {
        for v in acc.iter_mut() {
            *v = v.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// [`CHAINS`] chains of `steps` `_mm512_fmadd_ps`, `acc = acc * a + b`
    /// from 0 (a = 0.999, b = 0.001: every lane tends to 1); the lanes' sum.
    ///
    /// # Safety
    /// The processor must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn chains_512(steps: usize) -> f32 {
        let (a, b) = std::hint::black_box((0.999_f32, 1e-3_f32));
        let (a, b) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
        let mut acc = [_mm512_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    /// `steps` steps of the register tile's mix: 6 and then 4 vectors
    /// loaded from a 40 KiB buffer (10 consecutive lines a step, the
    /// buffer walked in a cycle of 64 steps, so every load hits L1), and
    /// the 24 products of the pairs accumulated into 24 registers
    /// (`acc = fma(x, w, acc)`); the lanes' sum of the accumulators.
    ///
    /// # Safety
    /// The processor must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_mix(steps: usize) -> f32 {
        const STEP: usize = 10 * 16;
        let buf: Vec<f32> = (0..64 * STEP + 16).map(|i| 1e-3 * (i % 7) as f32).collect();
        // The first line boundary (loads never straddle two lines).
        let base = buf[buf.as_ptr().align_offset(64)..].as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 6]; 4];
        for i in 0..steps {
            // SAFETY: step `i % 64` reads floats up to 64 * STEP past
            // `base`, inside `buf`.
            let p = unsafe { base.add(i % 64 * STEP) };
            // SAFETY: as above.
            let x: [__m512; 6] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(p.add(16 * r)) });
            for (m, acc) in acc.iter_mut().enumerate() {
                // SAFETY: as above.
                let w = unsafe { _mm512_loadu_ps(p.add(16 * (6 + m))) };
                for (a, &x) in acc.iter_mut().zip(&x) {
                    *a = _mm512_fmadd_ps(x, w, *a);
                }
            }
        }
        acc.iter().flatten().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    /// [`CHAINS`] chains of `steps` `_mm256_fmadd_ps`, as [`chains_512`].
    ///
    /// # Safety
    /// The processor must have FMA (and so AVX).
    #[target_feature(enable = "avx,fma")]
    pub unsafe fn chains_256(steps: usize) -> f32 {
        let (a, b) = std::hint::black_box((0.999_f32, 1e-3_f32));
        let (a, b) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
        let mut acc = [_mm256_setzero_ps(); CHAINS];
        for _ in 0..steps {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut out = [0f32; 8];
        acc.iter()
            .map(|&v| {
                // SAFETY: `out` holds the 8 lanes stored.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr(), v) };
                out.iter().sum::<f32>()
            })
            .sum()
    }
}

/// What one token costs a model, from its GGUF tensor table.
#[derive(Debug, PartialEq)]
pub struct TokenCost {
    /// Bytes of weights a decoded token reads: every tensor, the token
    /// embedding only when it is also the output projection (no
    /// `output.weight`; a lookup reads one row otherwise).
    pub bytes: u64,
    /// Multiply-adds of the layers' matrices per token (every 2-D weight
    /// but the token embedding and the output projection).
    pub layer_macs: u64,
    /// Multiply-adds of the output projection per token (`output.weight`,
    /// or the tied token embedding).
    pub output_macs: u64,
}

impl TokenCost {
    /// The cost of `tensors`: `(name, dims, bytes)` of each.
    pub fn of(tensors: &[(&str, &[u64], u64)]) -> TokenCost {
        let tied = !tensors.iter().any(|(n, _, _)| *n == "output.weight");
        let mut cost = TokenCost {
            bytes: 0,
            layer_macs: 0,
            output_macs: 0,
        };
        for &(name, dims, bytes) in tensors {
            let embedding = name == "token_embd.weight";
            let output = name == "output.weight" || (embedding && tied);
            if !embedding || tied {
                cost.bytes += bytes;
            }
            if dims.len() == 2 {
                let macs = dims.iter().product::<u64>();
                if output {
                    cost.output_macs += macs;
                } else if !embedding {
                    cost.layer_macs += macs;
                }
            }
        }
        cost
    }

    /// The cost of the model in the GGUF file `path`.
    pub fn of_gguf(path: &std::path::Path) -> anyhow::Result<TokenCost> {
        let file = te_formats::gguf::GgufFile::open(path)?;
        let tensors = file
            .tensors()
            .iter()
            .map(|t| {
                let bytes = t.n_bytes.ok_or_else(|| {
                    anyhow::anyhow!("{}: tensor {} has no byte size", path.display(), t.name)
                })?;
                Ok((t.name.as_str(), &t.dims[..], bytes))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(TokenCost::of(&tensors))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tied and untied output projections, costs summed by hand.
    #[test]
    fn token_cost_counts_the_output_once() {
        // Tied: the embedding [64, 100] (100 tokens) is the output.
        let tied = [
            ("token_embd.weight", &[64u64, 100][..], 3200),
            ("blk.0.attn_q.weight", &[64, 64], 2048),
            ("blk.0.attn_norm.weight", &[64], 256),
        ];
        assert_eq!(
            TokenCost::of(&tied),
            TokenCost {
                bytes: 3200 + 2048 + 256,
                layer_macs: 64 * 64,
                output_macs: 6400,
            }
        );
        // Untied: the lookup reads one row, not counted; output is.
        let untied = [
            ("token_embd.weight", &[64u64, 100][..], 3200),
            ("blk.0.ffn_up.weight", &[64, 128], 4096),
            ("output.weight", &[64, 100], 6400),
        ];
        assert_eq!(
            TokenCost::of(&untied),
            TokenCost {
                bytes: 4096 + 6400,
                layer_macs: 64 * 128,
                output_macs: 6400,
            }
        );
    }

    /// Each lane of each chain runs `acc = 0.999 acc + 0.001` from 0, so
    /// after n steps it holds 1 - 0.999^n (by hand): the sum over the
    /// lanes is that times the lane count.
    #[test]
    fn fma_chains_compute_their_recurrence() {
        let (lanes, run) = best_chains();
        let steps = 2000;
        let want = (CHAINS * lanes) as f64 * (1.0 - 0.999f64.powi(steps as i32));
        let got = run(steps) as f64;
        assert!((got - want).abs() < 1e-3 * want, "{got} against {want}");
        assert!((chains_scalar(steps) as f64 - want / lanes as f64).abs() < 1e-3 * want);
    }
}
