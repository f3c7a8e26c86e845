//! Continuous-batching simulation (like TransformerEngine's test_kv_cache):
//! random arrivals, forks and departures with random step lengths; at every step
//! and layer, te-attention reading the cache view must equal causal
//! attention recomputed in f64 from each sequence's whole history.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_cache::{CacheError, CacheLayout, CacheShape, InferenceParams};
use te_kernels::{DType, QkvFormat};

const H_Q: usize = 4;
const H_KV: usize = 2;
const D_K: usize = 8;
const D_V: usize = 6;
const MAX_BATCH: usize = 6;
const MAX_SEQLEN: usize = 80;
const NUM_LAYERS: usize = 2;

/// Per layer, per token: `[h_kv, d]` rows of k and v.
#[derive(Default)]
struct History {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// Naive f64 attention of one query `q: [h_q, d_k]` over the keys `lo..=pos`,
/// fetched by `kv(j) -> (k: [h_kv, d_k], v: [h_kv, d_v])`; returns `[h_q, d_v]`.
fn attend<'a>(
    q: &[f32],
    lo: usize,
    pos: usize,
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) -> Vec<f64> {
    let scale = 1.0 / (D_K as f64).sqrt();
    let group = H_Q / H_KV;
    let mut out = vec![0.0f64; H_Q * D_V];
    for h in 0..H_Q {
        let kh = h / group;
        let logits: Vec<f64> = (lo..=pos)
            .map(|j| {
                let k = kv(j).0;
                (0..D_K)
                    .map(|e| q[h * D_K + e] as f64 * k[kh * D_K + e] as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        for (w, j) in weights.iter().zip(lo..=pos) {
            let v = kv(j).1;
            for e in 0..D_V {
                out[h * D_V + e] += w / sum * v[kh * D_V + e] as f64;
            }
        }
    }
    out
}

/// Packs per-sequence rows (`[step_len_b][row]`) into `format`.
fn pack(rows: &[Vec<Vec<f32>>], format: QkvFormat, row: usize, cu: &[i32], s: usize) -> Vec<f32> {
    let batch = rows.len();
    let total = match format {
        QkvFormat::Thd => cu[batch] as usize,
        _ => batch * s,
    };
    // Padding rows are poisoned: the save must never read them.
    let mut out = vec![f32::NAN; total * row];
    for (b, seq) in rows.iter().enumerate() {
        for (i, r) in seq.iter().enumerate() {
            let dst = format.token_row(b, i, batch, s, cu);
            out[dst * row..(dst + 1) * row].copy_from_slice(r);
        }
    }
    out
}

/// Who computes attention from the cache view.
#[derive(Clone, Copy, PartialEq)]
enum Reader {
    /// Naive f64 attention in this test, reading the view's rows.
    Naive,
    /// te-attention's `DotProductAttention::forward_cpu` with `KvInput::Cache`.
    TeAttention,
}

/// Runs `steps` random steps; `window` makes layer 1 sliding `(W, max_step_len)`.
fn simulate(
    layout: CacheLayout,
    window: Option<(usize, usize)>,
    seed: u64,
    steps: usize,
    reader: Reader,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut params = InferenceParams::new(CacheShape {
        max_batch_size: MAX_BATCH,
        max_seqlen: MAX_SEQLEN,
        num_layers: NUM_LAYERS,
        num_heads_kv: H_KV,
        head_dim_k: D_K,
        head_dim_v: D_V,
        dtype: DType::F32,
        layout,
    })
    .unwrap();
    let max_step = match window {
        Some((w, max_step_len)) => {
            params.set_sliding_window(1, w, max_step_len).unwrap();
            max_step_len
        }
        None => 24,
    };
    // seq_id -> per-layer history.
    let mut live: BTreeMap<u64, Vec<History>> = BTreeMap::new();
    let mut next_id = 100u64;
    let mut checked_queries = 0usize;
    for _ in 0..steps {
        // Departures: finished sequences and random ones.
        let ids: Vec<u64> = live.keys().copied().collect();
        for id in ids {
            if params.cached_tokens(id) == MAX_SEQLEN || rng.gen_bool(0.1) {
                // A sequence whose first step was refused never joined.
                if params.contains(id) {
                    params.release(id).unwrap();
                }
                live.remove(&id);
            }
        }
        // Parallel sampling: fork a held sequence, history included.
        let held: Vec<u64> = live
            .keys()
            .copied()
            .filter(|&id| params.contains(id))
            .collect();
        if live.len() < MAX_BATCH && !held.is_empty() && rng.gen_bool(0.2) {
            let src = held[rng.gen_range(0..held.len())];
            let before = params.clone();
            match params.fork(src, next_id) {
                Ok(()) => {
                    let copy = live[&src]
                        .iter()
                        .map(|h| History {
                            k: h.k.clone(),
                            v: h.v.clone(),
                        })
                        .collect();
                    live.insert(next_id, copy);
                    next_id += 1;
                }
                Err(CacheError::CacheFull { .. }) => assert!(params == before),
                Err(e) => panic!("unexpected error {e}"),
            }
        }
        // Arrivals.
        while live.len() < MAX_BATCH && rng.gen_bool(0.4) {
            live.insert(
                next_id,
                (0..NUM_LAYERS).map(|_| History::default()).collect(),
            );
            next_id += 1;
        }
        // This step's batch: new sequences always, others at random, shuffled.
        let mut batch: Vec<(u64, usize)> = Vec::new();
        for &id in live.keys() {
            if params.contains(id) && rng.gen_bool(0.2) {
                continue;
            }
            let room = (MAX_SEQLEN - params.cached_tokens(id)).min(max_step);
            let len = if rng.gen_bool(0.5) {
                1
            } else {
                rng.gen_range(1..=room)
            };
            batch.push((id, len));
        }
        batch.shuffle(&mut rng);
        let before = params.clone();
        match params.pre_step(&batch) {
            Ok(()) => {}
            Err(CacheError::CacheFull { .. }) => {
                assert!(params == before, "a failed pre_step changed the cache");
                // Make room: end the longest sequence.
                let longest = *live
                    .keys()
                    .max_by_key(|&&id| params.cached_tokens(id))
                    .unwrap();
                if params.contains(longest) {
                    params.release(longest).unwrap();
                }
                live.remove(&longest);
                continue;
            }
            Err(e) => panic!("unexpected error {e}"),
        }
        let cu_q = params.cu_seqlens_q().to_vec();
        let starts = params.start_positions().to_vec();
        let s = params.max_seqlen_q();
        for (b, &(id, len)) in batch.iter().enumerate() {
            assert_eq!(starts[b] as usize, live[&id][0].k.len());
            assert_eq!(params.cache_seqlens()[b] as usize, starts[b] as usize + len);
            assert_eq!(cu_q[b + 1] - cu_q[b], len as i32);
        }
        for layer in 0..NUM_LAYERS {
            let mut k_rows = Vec::new();
            let mut v_rows = Vec::new();
            let mut q_rows = Vec::new();
            for &(id, len) in &batch {
                let hist = &mut live.get_mut(&id).unwrap()[layer];
                let ks: Vec<Vec<f32>> =
                    (0..len).map(|_| random_vec(&mut rng, H_KV * D_K)).collect();
                let vs: Vec<Vec<f32>> =
                    (0..len).map(|_| random_vec(&mut rng, H_KV * D_V)).collect();
                hist.k.extend(ks.iter().cloned());
                hist.v.extend(vs.iter().cloned());
                k_rows.push(ks);
                v_rows.push(vs);
                q_rows.push(
                    (0..len)
                        .map(|_| random_vec(&mut rng, H_Q * D_K))
                        .collect::<Vec<_>>(),
                );
            }
            let format = *[QkvFormat::Thd, QkvFormat::Bshd, QkvFormat::Sbhd]
                .choose(&mut rng)
                .unwrap();
            let k = pack(&k_rows, format, H_KV * D_K, &cu_q, s);
            let v = pack(&v_rows, format, H_KV * D_V, &cu_q, s);
            let q = pack(&q_rows, QkvFormat::Thd, H_Q * D_K, &cu_q, s);
            let view = params.step(layer, &k, &v, format).unwrap();

            // The cache holds exactly the history's last positions.
            for (b, &(id, _)) in batch.iter().enumerate() {
                let hist = &live[&id][layer];
                let lay = view.layout;
                assert_eq!(lay.seqlen(b), hist.k.len());
                for pos in lay.first_held_position(b)..lay.seqlen(b) {
                    let r = lay.row(b, pos);
                    assert_eq!(
                        &view.k_cache[r * H_KV * D_K..][..H_KV * D_K],
                        &hist.k[pos][..]
                    );
                    assert_eq!(
                        &view.v_cache[r * H_KV * D_V..][..H_KV * D_V],
                        &hist.v[pos][..]
                    );
                }
            }

            let window_w = if layer == 1 {
                window.map(|(w, _)| w)
            } else {
                None
            };
            let out: Vec<f64> = match reader {
                Reader::Naive => {
                    let lay = view.layout;
                    let (rk, rv) = (H_KV * D_K, H_KV * D_V);
                    let mut out = Vec::new();
                    for (b, &(_, len)) in batch.iter().enumerate() {
                        for i in 0..len {
                            let pos = starts[b] as usize + i;
                            let lo = window_w.map_or(0, |w| (pos + 1).saturating_sub(w));
                            assert!(
                                lo >= lay.first_held_position(b),
                                "the ring lost a key in the window"
                            );
                            let row = cu_q[b] as usize + i;
                            out.extend(attend(&q[row * H_Q * D_K..][..H_Q * D_K], lo, pos, |j| {
                                let r = lay.row(b, j);
                                (&view.k_cache[r * rk..][..rk], &view.v_cache[r * rv..][..rv])
                            }));
                        }
                    }
                    out
                }
                Reader::TeAttention => {
                    let mut attn = DotProductAttention::new(H_Q, D_K)
                        .with_num_gqa_groups(H_KV)
                        .with_head_dim_v(D_V)
                        .with_attn_mask_type(AttnMaskType::CausalBottomRight)
                        .with_formats(QkvFormat::Thd, QkvFormat::Thd);
                    if let Some(w) = window_w {
                        attn = attn.with_window_size(w as i64 - 1, 0);
                    }
                    let meta = AttnMetadata {
                        batch: batch.len(),
                        max_seqlen_q: s,
                        max_seqlen_kv: 0,
                        cu_seqlens_q: Some(&cu_q),
                        cu_seqlens_kv: None,
                    };
                    let mut out = vec![f32::NAN; cu_q[batch.len()] as usize * H_Q * D_V];
                    attn.forward_cpu(&q, KvInput::Cache(view), &meta, &mut out, None)
                        .unwrap();
                    out.iter().map(|&x| x as f64).collect()
                }
            };

            // Reference: causal attention over the whole history, no cache.
            for (b, &(id, len)) in batch.iter().enumerate() {
                let hist = &live[&id][layer];
                for i in 0..len {
                    let pos = starts[b] as usize + i;
                    let lo = window_w.map_or(0, |w| (pos + 1).saturating_sub(w));
                    let row = cu_q[b] as usize + i;
                    let want = attend(&q[row * H_Q * D_K..][..H_Q * D_K], lo, pos, |j| {
                        (&hist.k[j], &hist.v[j])
                    });
                    let got = &out[row * H_Q * D_V..][..H_Q * D_V];
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "seq {id} layer {layer} pos {pos}: {g} vs {w}"
                        );
                    }
                    checked_queries += 1;
                }
            }
        }
        // Bookkeeping invariant.
        for layer in 0..NUM_LAYERS {
            let ps = params.page_size(layer).unwrap();
            let cap = params.ring_len(layer).map_or(usize::MAX, |r| r / ps);
            let want: usize = live
                .keys()
                .map(|&id| params.cached_tokens(id).div_ceil(ps).min(cap))
                .sum();
            assert_eq!(params.pages_in_use(layer).unwrap(), want);
        }
    }
    assert!(
        checked_queries > 100,
        "simulation checked only {checked_queries} queries"
    );
}

const LAYOUTS: [(&str, CacheLayout); 4] = [
    ("contiguous", CacheLayout::Contiguous),
    // 200 pages for up to 480 tokens: CacheFull happens and is recovered from.
    (
        "paged 1",
        CacheLayout::Paged {
            page_size: 1,
            total_num_pages: 200,
        },
    ),
    (
        "paged 16",
        CacheLayout::Paged {
            page_size: 16,
            total_num_pages: 16,
        },
    ),
    // Rings of 64 rows, shorter than the 128-row full capacity.
    (
        "paged 64",
        CacheLayout::Paged {
            page_size: 64,
            total_num_pages: 6,
        },
    ),
];

/// Windows of layer 1: none, and `(W, max_step_len)` small enough to wrap.
const WINDOWS: [Option<(usize, usize)>; 3] = [None, Some((5, 6)), Some((20, 5))];

fn run_all(reader: Reader) {
    for (i, (name, layout)) in LAYOUTS.iter().enumerate() {
        for (j, window) in WINDOWS.iter().enumerate() {
            eprintln!("{name}, window {window:?}");
            simulate(*layout, *window, (10 * i + j) as u64, 60, reader);
        }
    }
}

#[test]
fn cache_matches_full_history() {
    run_all(Reader::Naive);
}

#[test]
fn te_attention_over_cache_matches_full_history() {
    run_all(Reader::TeAttention);
}
