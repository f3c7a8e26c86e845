//! Property test of the page bookkeeping under prefix sharing: random
//! interleavings of joins with prefix hits, steps of random lengths,
//! registration, releases (finish, abort, preemption are all a release) and
//! failed operations. After every operation no page leaks or is held twice
//! beyond its reference count, usage never exceeds the pool, a refused
//! operation changes nothing, and every sequence reads back exactly the
//! keys its own tokens wrote (shared pages hold the same values, copies on
//! write keep them).

use proptest::prelude::*;
use std::collections::BTreeMap;
use te_cache::{CacheLayout, CacheShape, InferenceParams};
use te_kernels::{DType, QkvFormat};

const NUM_LAYERS: usize = 2;
const MAX_SEQLEN: usize = 48;

#[derive(Clone, Debug)]
enum Op {
    /// A new sequence with these tokens attaches its prefix (at most
    /// `tokens.len() - 1`), then computes the rest in steps of `chunk`.
    Join(u64, Vec<u32>, usize),
    /// Feed `n` more tokens (of value `tok`) to a held sequence.
    Grow(u64, usize, u32),
    Release(u64),
    ClearCache,
}

/// Tokens from a tiny alphabet with shared beginnings, so prefixes repeat.
fn tokens() -> impl Strategy<Value = Vec<u32>> {
    (0usize..3, prop::collection::vec(0u32..2, 0..20)).prop_map(|(stem, tail)| {
        let mut t: Vec<u32> = (0..[4usize, 9, 16][stem]).map(|i| (i % 5) as u32).collect();
        t.extend(tail);
        if t.is_empty() {
            t.push(7);
        }
        t
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..6, tokens(), 1usize..9).prop_map(|(id, t, c)| Op::Join(id, t, c)),
        3 => (0u64..6, 1usize..6, 0u32..3).prop_map(|(id, n, t)| Op::Grow(id, n, t)),
        2 => (0u64..6).prop_map(Op::Release),
        1 => Just(Op::ClearCache),
    ]
}

/// The value stored for token `tok` at position `pos` (layer 0's K).
fn value(tok: u32, pos: usize) -> f32 {
    (tok * 1000) as f32 + pos as f32
}

/// Runs one step of `(id, tokens)` pairs, writing `value(tok, pos)` as K
/// and V on every layer. Returns whether `pre_step` accepted it.
fn run_step(params: &mut InferenceParams, feed: &[(u64, Vec<u32>)]) -> bool {
    let steps: Vec<(u64, usize)> = feed.iter().map(|(id, t)| (*id, t.len())).collect();
    let starts: Vec<usize> = feed
        .iter()
        .map(|(id, _)| params.cached_tokens(*id))
        .collect();
    if params.pre_step(&steps).is_err() {
        return false;
    }
    let mut kv = Vec::new();
    for ((_, t), &start) in feed.iter().zip(&starts) {
        kv.extend(t.iter().enumerate().map(|(i, &tok)| value(tok, start + i)));
    }
    for layer in 0..NUM_LAYERS {
        params.step(layer, &kv, &kv, QkvFormat::Thd).unwrap();
    }
    true
}

/// Every held sequence's cache rows hold `value(token, position)` of its
/// own tokens.
fn check_contents(params: &mut InferenceParams, model: &BTreeMap<u64, Vec<u32>>) {
    if model.is_empty() {
        return;
    }
    // A one-token step per sequence gives a view of all of them; the token
    // is then dropped again by comparing only the positions before it.
    let ids: Vec<u64> = model.keys().copied().collect();
    let before = params.clone();
    let steps: Vec<(u64, usize)> = ids.iter().map(|&id| (id, 1)).collect();
    if params.pre_step(&steps).is_err() {
        return; // full: contents are checked on a later operation
    }
    let view = params.view::<f32>(0).unwrap();
    for (b, id) in ids.iter().enumerate() {
        let toks = &model[id];
        for (pos, &tok) in toks.iter().enumerate() {
            let row = view.layout.row(b, pos);
            assert_eq!(
                view.k_cache[row],
                value(tok, pos),
                "sequence {id} position {pos}"
            );
        }
    }
    *params = before;
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn shared_pages_balance(
        page_size in prop::sample::select(vec![1usize, 2, 4]),
        total_num_pages in 4usize..40,
        max_batch_size in 1usize..6,
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let layout = CacheLayout::Paged { page_size, total_num_pages };
        let mut params = InferenceParams::new(CacheShape {
            max_batch_size,
            max_seqlen: MAX_SEQLEN,
            num_layers: NUM_LAYERS,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout,
        }).unwrap();
        prop_assert!(params.prefix_sharing());
        // Tokens each held sequence has cached.
        let mut model: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        for op in ops {
            let before = params.clone();
            match op {
                Op::Join(id, toks, chunk) => {
                    if toks.len() > MAX_SEQLEN {
                        continue;
                    }
                    let result = params.attach_prefix(id, &toks, toks.len() - 1);
                    let valid = !model.contains_key(&id) && model.len() < max_batch_size;
                    prop_assert_eq!(result.is_ok(), valid);
                    let Ok(hit) = result else {
                        prop_assert!(params == before, "a refused attach changed the cache");
                        continue;
                    };
                    prop_assert!(hit < toks.len());
                    let mut done = hit;
                    while done < toks.len() {
                        let n = chunk.min(toks.len() - done);
                        let snapshot = params.clone();
                        if !run_step(&mut params, &[(id, toks[done..done + n].to_vec())]) {
                            prop_assert!(params == snapshot, "a refused pre_step changed the cache");
                            break;
                        }
                        done += n;
                        params.register_prefix(id, &toks[..done]).unwrap();
                    }
                    model.insert(id, toks[..done].to_vec());
                }
                Op::Grow(id, n, tok) => {
                    let cached = model.get(&id).map_or(0, Vec::len);
                    let ok = run_step(&mut params, &[(id, vec![tok; n])]);
                    if ok {
                        model.entry(id).or_default().extend(std::iter::repeat_n(tok, n));
                        let toks = model[&id].clone();
                        params.register_prefix(id, &toks).unwrap();
                    } else {
                        prop_assert!(params == before, "a refused pre_step changed the cache");
                        // Refused only for a reason: too long, too many
                        // sequences, or not enough pages.
                        let reason = cached + n > MAX_SEQLEN
                            || (!model.contains_key(&id) && model.len() >= max_batch_size)
                            || params.pages_free(0).unwrap() <= n.div_ceil(page_size);
                        prop_assert!(reason, "grow {} by {} refused", id, n);
                    }
                }
                Op::Release(id) => {
                    let result = params.release(id);
                    prop_assert_eq!(result.is_ok(), model.remove(&id).is_some());
                    if result.is_err() {
                        prop_assert!(params == before, "a refused release changed the cache");
                    }
                }
                Op::ClearCache => {
                    params.clear_prefix_cache();
                    prop_assert_eq!(params.pages_cached(), 0);
                }
            }
            if let Err(e) = params.check_consistency() {
                return Err(TestCaseError::fail(e));
            }
            let in_use = params.pages_in_use(0).unwrap();
            prop_assert!(in_use + params.pages_free(0).unwrap() == total_num_pages);
            // Pages in use never exceed what the sequences' tokens need
            // without sharing.
            let unshared: usize = model.values().map(|t| t.len().div_ceil(page_size)).sum();
            prop_assert!(in_use <= unshared, "{} pages in use, {} without sharing", in_use, unshared);
            check_contents(&mut params, &model);
        }
        // Everything released: every page is free or cached.
        for id in model.keys().copied().collect::<Vec<_>>() {
            params.release(id).unwrap();
        }
        prop_assert_eq!(params.pages_in_use(0).unwrap(), 0);
        params.check_consistency().map_err(TestCaseError::fail)?;
    }
}

/// Hand-computed: two prompts sharing two whole pages share them; the
/// second prompt's pages in use are only its own tail; releasing the first
/// keeps the shared pages for the second and caches the first's own
/// registered pages.
#[test]
fn shared_prefix_is_stored_once() {
    let layout = CacheLayout::Paged {
        page_size: 4,
        total_num_pages: 8,
    };
    let mut params = InferenceParams::new(CacheShape {
        max_batch_size: 4,
        max_seqlen: 32,
        num_layers: NUM_LAYERS,
        num_heads_kv: 1,
        head_dim_k: 1,
        head_dim_v: 1,
        dtype: DType::F32,
        layout,
    })
    .unwrap();
    let a: Vec<u32> = (0..10).collect();
    assert_eq!(params.attach_prefix(1, &a, 9).unwrap(), 0);
    assert!(run_step(&mut params, &[(1, a.clone())]));
    params.register_prefix(1, &a).unwrap();
    assert_eq!(params.pages_in_use(0).unwrap(), 3);
    // b shares a's first 8 tokens (two pages), then differs.
    let mut b: Vec<u32> = (0..8).collect();
    b.extend([50, 51, 52]);
    assert_eq!(params.attach_prefix(2, &b, b.len() - 1).unwrap(), 8);
    assert!(run_step(&mut params, &[(2, b[8..].to_vec())]));
    assert_eq!(params.pages_in_use(0).unwrap(), 4);
    let plan = params.plan().unwrap();
    assert_eq!(plan.start_positions(), &[8]);
    drop(plan);
    params.release(1).unwrap();
    // a's third page is registered? No: it is not full (10 tokens), so it
    // is freed; the two shared pages stay held by b.
    assert_eq!(params.pages_in_use(0).unwrap(), 3);
    assert_eq!(params.pages_cached(), 0);
    params.release(2).unwrap();
    // b's 11 tokens: pages 0 and 1 registered (by a), page 2 not full.
    assert_eq!(params.pages_cached(), 2);
    // A prompt equal to the first 8 tokens: capped at 7 tokens, the second
    // page is copied when token 7 is recomputed.
    let c: Vec<u32> = (0..8).collect();
    assert_eq!(params.attach_prefix(3, &c, 7).unwrap(), 7);
    assert!(run_step(&mut params, &[(3, vec![7])]));
    // Held: page 0 (shared from the cache) and the copy of page 1; the
    // original page 1 is cached again.
    assert_eq!(params.pages_in_use(0).unwrap(), 2);
    assert_eq!(params.pages_cached(), 1);
    params.check_consistency().unwrap();
}
