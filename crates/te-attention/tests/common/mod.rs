//! Shared test harness: a naive float64 reference written straight from
//! docs/ARCHITECTURE.md, "Formats and masks" (not from the crate's `KeyRange`), random cases, packing of
//! per-sequence tensors into bshd/sbhd/thd and contiguous/paged caches, and
//! the comparison with poisoned outputs.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_kernels::{Element, KvCacheLayout, KvCacheView, QkvFormat};

/// Where K/V come from in a case.
#[derive(Clone, Copy, Debug)]
pub enum KvSource {
    Tensors(QkvFormat),
    /// `page_size`, `ring_len` (multiple of page_size) for sliding-window layers.
    Cache {
        page_size: usize,
        ring_len: Option<usize>,
    },
}

#[derive(Clone, Debug)]
pub struct Case {
    pub q_format: QkvFormat,
    pub kv: KvSource,
    pub mask: AttnMaskType,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f32>,
    pub softmax_scale: Option<f32>,
    pub h_kv: usize,
    pub group: usize,
    pub d_qk: usize,
    pub d_v: usize,
    /// Query lengths per sequence.
    pub sq: Vec<usize>,
    /// Key lengths per sequence.
    pub skv: Vec<usize>,
    pub max_seqlen_q: usize,
    pub max_seqlen_kv: usize,
    pub seed: u64,
}

/// Per-sequence data: `q[b]: [sq, h_q, d_qk]`, `k[b]: [skv, h_kv, d_qk]`,
/// `v[b]: [skv, h_kv, d_v]`, already rounded to the storage dtype.
pub struct Data {
    pub q: Vec<Vec<f64>>,
    pub k: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
}

impl Case {
    pub fn h_q(&self) -> usize {
        self.h_kv * self.group
    }

    pub fn attention(&self) -> DotProductAttention {
        let kv_format = match self.kv {
            KvSource::Tensors(f) => f,
            KvSource::Cache { .. } => QkvFormat::Thd,
        };
        let mut a = DotProductAttention::new(self.h_q(), self.d_qk)
            .with_num_gqa_groups(self.h_kv)
            .with_head_dim_v(self.d_v)
            .with_attn_mask_type(self.mask)
            .with_formats(self.q_format, kv_format);
        a.window_size = self.window;
        a.softcap = self.softcap;
        a.softmax_scale = self.softmax_scale;
        a
    }

    /// First key still held by the cache (keys before it are absent).
    pub fn first_key(&self, b: usize) -> usize {
        match self.kv {
            KvSource::Cache {
                ring_len: Some(r), ..
            } => self.skv[b].saturating_sub(r),
            _ => 0,
        }
    }

    pub fn data<T: Element>(&self) -> Data {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut gen = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| T::from_f32(rng.gen_range(-1.0f32..1.0)).to_f32() as f64)
                .collect()
        };
        let (hq, hkv) = (self.h_q(), self.h_kv);
        let b = self.sq.len();
        Data {
            q: (0..b).map(|s| gen(self.sq[s] * hq * self.d_qk)).collect(),
            k: (0..b).map(|s| gen(self.skv[s] * hkv * self.d_qk)).collect(),
            v: (0..b).map(|s| gen(self.skv[s] * hkv * self.d_v)).collect(),
        }
    }

    /// Whether key `j` is visible to query `i` of sequence `b` (docs/ARCHITECTURE.md, "Formats and masks").
    pub fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        let (i, j) = (i as i64, j as i64);
        let (sq, skv) = (self.sq[b] as i64, self.skv[b] as i64);
        if j < self.first_key(b) as i64 || j >= skv {
            return false;
        }
        let top_left = matches!(
            self.mask,
            AttnMaskType::Causal | AttnMaskType::PaddingCausal
        );
        let diag = if top_left { i } else { i + skv - sq };
        if self.mask.is_causal() && j > diag {
            return false;
        }
        if let Some((l, r)) = self.window {
            if l >= 0 && j < diag - l {
                return false;
            }
            if r >= 0 && j > diag + r {
                return false;
            }
        }
        true
    }

    /// Naive float64 attention of sequence `b`: `out: [sq, h_q, d_v]`,
    /// `lse: [sq, h_q]`.
    pub fn reference(&self, data: &Data, b: usize) -> (Vec<f64>, Vec<f64>) {
        let (hq, hkv, dqk, dv) = (self.h_q(), self.h_kv, self.d_qk, self.d_v);
        let scale = self
            .softmax_scale
            .map(|s| s as f64)
            .unwrap_or(1.0 / (dqk as f64).sqrt());
        let (sq, skv) = (self.sq[b], self.skv[b]);
        let mut out = vec![0.0; sq * hq * dv];
        let mut lse = vec![f64::NEG_INFINITY; sq * hq];
        for i in 0..sq {
            for h in 0..hq {
                let g = h / self.group;
                let q = &data.q[b][(i * hq + h) * dqk..][..dqk];
                let mut logits = Vec::new();
                for j in (0..skv).filter(|&j| self.visible(b, i, j)) {
                    let k = &data.k[b][(j * hkv + g) * dqk..][..dqk];
                    let mut s = scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
                    if let Some(c) = self.softcap {
                        s = c as f64 * (s / c as f64).tanh();
                    }
                    logits.push((j, s));
                }
                if logits.is_empty() {
                    continue;
                }
                let m = logits.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = logits.iter().map(|x| (x.1 - m).exp()).sum();
                lse[i * hq + h] = m + z.ln();
                for &(j, s) in &logits {
                    let p = (s - m).exp() / z;
                    let v = &data.v[b][(j * hkv + g) * dv..][..dv];
                    for (o, x) in out[(i * hq + h) * dv..][..dv].iter_mut().zip(v) {
                        *o += p * x;
                    }
                }
            }
        }
        (out, lse)
    }
}

fn cu(lens: &[usize]) -> Vec<i32> {
    let mut c = vec![0i32];
    for &l in lens {
        c.push(c.last().unwrap() + l as i32);
    }
    c
}

/// Packs per-sequence rows `[len_b, width]` into `format` (padding poisoned
/// with a large finite value so any read of it shows).
fn pack<T: Element>(
    format: QkvFormat,
    seqs: &[Vec<f64>],
    lens: &[usize],
    max_seqlen: usize,
    width: usize,
) -> Vec<T> {
    let b = lens.len();
    let rows = match format {
        QkvFormat::Thd => lens.iter().sum(),
        _ => b * max_seqlen,
    };
    let mut out = vec![T::from_f32(1.0e4); rows * width];
    let cu = cu(lens);
    for s in 0..b {
        for i in 0..lens[s] {
            let row = format.token_row(s, i, b, max_seqlen, &cu);
            for (d, &x) in out[row * width..][..width]
                .iter_mut()
                .zip(&seqs[s][i * width..][..width])
            {
                *d = T::from_f32(x as f32);
            }
        }
    }
    out
}

/// Result of one forward: output and lse in the case's Q layout.
pub struct Run<O> {
    pub out: Vec<O>,
    pub lse: Vec<f32>,
}

/// A case's inputs packed in its formats and storage type `T` (host
/// buffers; the GPU tests upload them as they are).
pub struct Inputs<T> {
    /// Q in the case's `q_format`.
    pub q: Vec<T>,
    pub cu_q: Vec<i32>,
    pub cu_kv: Vec<i32>,
    pub kv: PackedKv<T>,
}

/// K/V of [`Inputs`]: tensors in the case's K/V format, or a paged cache
/// (pages shuffled, unused slots poisoned with a large finite value).
pub enum PackedKv<T> {
    Tensors {
        k: Vec<T>,
        v: Vec<T>,
    },
    Cache {
        k_cache: Vec<T>,
        v_cache: Vec<T>,
        page_table: Vec<i32>,
        max_pages_per_seq: usize,
        cache_seqlens: Vec<i32>,
    },
}

impl<T> Inputs<T> {
    pub fn meta(&self, case: &Case) -> AttnMetadata<'_> {
        AttnMetadata {
            batch: case.sq.len(),
            max_seqlen_q: case.max_seqlen_q,
            max_seqlen_kv: case.max_seqlen_kv,
            cu_seqlens_q: Some(&self.cu_q),
            cu_seqlens_kv: Some(&self.cu_kv),
        }
    }

    /// The cache layout (`None` for tensors).
    pub fn layout(&self, case: &Case) -> Option<KvCacheLayout<'_>> {
        match (&self.kv, case.kv) {
            (
                PackedKv::Cache {
                    page_table,
                    max_pages_per_seq,
                    cache_seqlens,
                    ..
                },
                KvSource::Cache {
                    page_size,
                    ring_len,
                },
            ) => Some(KvCacheLayout {
                num_heads_kv: case.h_kv,
                head_dim_k: case.d_qk,
                head_dim_v: case.d_v,
                page_size,
                page_table,
                max_pages_per_seq: *max_pages_per_seq,
                cache_seqlens,
                ring_len,
            }),
            _ => None,
        }
    }

    /// Output rows of the case's Q layout (`t_q` or `b * max_seqlen_q`).
    pub fn q_rows(&self, case: &Case) -> usize {
        self.q.len() / (case.h_q() * case.d_qk)
    }
}

/// Packs a case's data into its formats (and cache, for cache sources).
pub fn inputs<T: Element>(case: &Case, data: &Data) -> Inputs<T> {
    let (hq, hkv, dqk, dv) = (case.h_q(), case.h_kv, case.d_qk, case.d_v);
    let b = case.sq.len();
    let q = pack::<T>(
        case.q_format,
        &data.q,
        &case.sq,
        case.max_seqlen_q,
        hq * dqk,
    );
    let cu_q = cu(&case.sq);
    let cu_kv = cu(&case.skv);
    let kv = match case.kv {
        KvSource::Tensors(f) => PackedKv::Tensors {
            k: pack::<T>(f, &data.k, &case.skv, case.max_seqlen_kv, hkv * dqk),
            v: pack::<T>(f, &data.v, &case.skv, case.max_seqlen_kv, hkv * dv),
        },
        KvSource::Cache {
            page_size,
            ring_len,
        } => {
            let mut rng = StdRng::seed_from_u64(case.seed ^ 0x9e37);
            let slots: Vec<usize> = case
                .skv
                .iter()
                .map(|&s| ring_len.map_or(s, |r| s.min(r)))
                .collect();
            let pages: Vec<usize> = slots.iter().map(|s| s.div_ceil(page_size)).collect();
            let max_pages_per_seq = ring_len
                .map_or(pages.iter().copied().max().unwrap_or(0), |r| r / page_size)
                .max(1);
            let num_pages = pages.iter().sum::<usize>() + 2;
            let mut ids: Vec<i32> = (0..num_pages as i32).collect();
            ids.shuffle(&mut rng);
            let mut page_table = vec![-1i32; b * max_pages_per_seq];
            let mut next = 0;
            for s in 0..b {
                for p in 0..pages[s] {
                    page_table[s * max_pages_per_seq + p] = ids[next];
                    next += 1;
                }
            }
            let cache_seqlens: Vec<i32> = case.skv.iter().map(|&s| s as i32).collect();
            let layout = KvCacheLayout {
                num_heads_kv: hkv,
                head_dim_k: dqk,
                head_dim_v: dv,
                page_size,
                page_table: &page_table,
                max_pages_per_seq,
                cache_seqlens: &cache_seqlens,
                ring_len,
            };
            let mut k_cache = vec![T::from_f32(1.0e4); num_pages * page_size * hkv * dqk];
            let mut v_cache = vec![T::from_f32(1.0e4); num_pages * page_size * hkv * dv];
            for s in 0..b {
                for p in case.first_key(s)..case.skv[s] {
                    let row = layout.row(s, p);
                    for (d, &x) in k_cache[row * hkv * dqk..][..hkv * dqk]
                        .iter_mut()
                        .zip(&data.k[s][p * hkv * dqk..])
                    {
                        *d = T::from_f32(x as f32);
                    }
                    for (d, &x) in v_cache[row * hkv * dv..][..hkv * dv]
                        .iter_mut()
                        .zip(&data.v[s][p * hkv * dv..])
                    {
                        *d = T::from_f32(x as f32);
                    }
                }
            }
            PackedKv::Cache {
                k_cache,
                v_cache,
                page_table,
                max_pages_per_seq,
                cache_seqlens,
            }
        }
    };
    Inputs { q, cu_q, cu_kv, kv }
}

/// Runs the case through `forward_cpu` with NaN-poisoned outputs.
pub fn run<T: Element, O: Element>(case: &Case, data: &Data) -> Run<O> {
    let inp = inputs::<T>(case, data);
    let meta = inp.meta(case);
    let rows = inp.q_rows(case);
    let mut out = vec![O::from_f32(f32::NAN); rows * case.h_q() * case.d_v];
    let mut lse = vec![f32::NAN; rows * case.h_q()];
    let kv = match &inp.kv {
        PackedKv::Tensors { k, v } => KvInput::Tensors { k, v },
        PackedKv::Cache {
            k_cache, v_cache, ..
        } => KvInput::Cache(KvCacheView {
            k_cache,
            v_cache,
            layout: inp.layout(case).unwrap(),
        }),
    };
    case.attention()
        .forward_cpu(&inp.q, kv, &meta, &mut out, Some(&mut lse))
        .unwrap();
    Run { out, lse }
}

/// Compares a run with the reference: every output and lse element,
/// padding rows included (0 and -inf). `|got - want| <= atol + rtol |want|`.
pub fn check<O: Element>(
    case: &Case,
    data: &Data,
    run: &Run<O>,
    atol: f64,
    rtol: f64,
) -> Result<(), String> {
    let (hq, dv) = (case.h_q(), case.d_v);
    let b = case.sq.len();
    let cu_q = cu(&case.sq);
    let rows = run.lse.len() / hq;
    let mut want_out = vec![0.0f64; rows * hq * dv];
    let mut want_lse = vec![f64::NEG_INFINITY; rows * hq];
    for s in 0..b {
        let (o, l) = case.reference(data, s);
        for i in 0..case.sq[s] {
            let row = case.q_format.token_row(s, i, b, case.max_seqlen_q, &cu_q);
            want_out[row * hq * dv..][..hq * dv].copy_from_slice(&o[i * hq * dv..][..hq * dv]);
            for h in 0..hq {
                let idx = match case.q_format {
                    QkvFormat::Thd => h * rows + row,
                    _ => (s * hq + h) * case.max_seqlen_q + i,
                };
                want_lse[idx] = l[i * hq + h];
            }
        }
    }
    for (n, (g, w)) in run.out.iter().zip(&want_out).enumerate() {
        let g = g.to_f32() as f64;
        let close = (g - w).abs() <= atol + rtol * w.abs();
        if !close {
            return Err(format!(
                "out[{n}] (row {}, head {}, col {}): got {g}, want {w}",
                n / (hq * dv),
                n / dv % hq,
                n % dv
            ));
        }
    }
    for (n, (&g, &w)) in run.lse.iter().zip(&want_lse).enumerate() {
        let g = g as f64;
        let ok = if w == f64::NEG_INFINITY {
            g == f64::NEG_INFINITY
        } else {
            (g - w).abs() <= 1e-5 * (1.0 + w.abs())
        };
        if !ok {
            return Err(format!("lse[{n}]: got {g}, want {w}"));
        }
    }
    Ok(())
}
