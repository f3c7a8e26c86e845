//! Property tests of the bookkeeping: after any sequence of valid operations
//! pages in use equal the sum over held sequences of ceil(cached /
//! page_size) (ring-capped on sliding layers); an operation is refused
//! exactly when a reference model says it is invalid, and a refused
//! operation leaves the cache (bookkeeping and storage) unchanged.

use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};
use te_cache::{CacheLayout, CacheShape, InferenceParams};
use te_kernels::{DType, QkvFormat};

const NUM_LAYERS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    PreStep(Vec<(u64, usize)>),
    Release(u64),
    /// `fork(src, dst)`.
    Fork(u64, u64),
    /// `step` on a layer with K/V of the right (`true`) or wrong length.
    Step(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => prop::collection::vec((0u64..6, 0usize..12), 0..5).prop_map(Op::PreStep),
        1 => (0u64..7).prop_map(Op::Release),
        1 => (0u64..6, 0u64..7).prop_map(|(src, dst)| Op::Fork(src, dst)),
        1 => (0usize..NUM_LAYERS + 1, any::<bool>()).prop_map(|(l, ok)| Op::Step(l, ok)),
    ]
}

fn layout() -> impl Strategy<Value = CacheLayout> {
    prop_oneof![
        Just(CacheLayout::Contiguous),
        (prop::sample::select(vec![1usize, 3, 16]), 1usize..24).prop_map(
            |(page_size, total_num_pages)| CacheLayout::Paged {
                page_size,
                total_num_pages
            }
        ),
    ]
}

/// Pages a sequence with `cached` tokens holds on `layer`.
fn pages_for(params: &InferenceParams, layer: usize, cached: usize) -> usize {
    let ps = params.page_size(layer).unwrap();
    let cap = params.ring_len(layer).map_or(usize::MAX, |r| r / ps);
    cached.div_ceil(ps).min(cap)
}

/// Whether the reference model accepts `pre_step(steps)`.
fn pre_step_valid(
    params: &InferenceParams,
    model: &BTreeMap<u64, usize>,
    steps: &[(u64, usize)],
) -> bool {
    let ids: HashSet<u64> = steps.iter().map(|s| s.0).collect();
    if steps.len() > params.max_batch_size() || ids.len() != steps.len() {
        return false;
    }
    let joining = ids.iter().filter(|id| !model.contains_key(id)).count();
    if model.len() + joining > params.max_batch_size() {
        return false;
    }
    for &(id, len) in steps {
        let cached = model.get(&id).copied().unwrap_or(0);
        if len == 0 || cached + len > params.max_seqlen() {
            return false;
        }
        for layer in 0..NUM_LAYERS {
            if let (Some(w), Some(_)) = (params.sliding_window(layer), params.ring_len(layer)) {
                if len > w.max_step_len {
                    return false;
                }
            }
        }
    }
    (0..NUM_LAYERS).all(|layer| {
        let needed: usize = steps
            .iter()
            .map(|&(id, len)| {
                let cached = model.get(&id).copied().unwrap_or(0);
                pages_for(params, layer, cached + len) - pages_for(params, layer, cached)
            })
            .sum();
        needed <= params.pages_free(layer).unwrap()
    })
}

fn check_invariants(params: &InferenceParams, model: &BTreeMap<u64, usize>) {
    assert_eq!(
        params.sequence_ids(),
        model.keys().copied().collect::<Vec<_>>()
    );
    for (&id, &cached) in model {
        assert_eq!(params.cached_tokens(id), cached);
    }
    assert_eq!(params.tokens_cached(), model.values().sum::<usize>());
    for layer in 0..NUM_LAYERS {
        let want: usize = model.values().map(|&c| pages_for(params, layer, c)).sum();
        assert_eq!(params.pages_in_use(layer).unwrap(), want, "layer {layer}");
    }
}

/// The planned step's metadata and page tables are consistent: `start +
/// step_len = cache_seqlens`, cumulative sums, and no page is held by two
/// sequences or lies outside the pool.
fn check_plan(params: &InferenceParams, steps: &[(u64, usize)], before: &BTreeMap<u64, usize>) {
    let b = steps.len();
    assert_eq!(params.batch_size(), b);
    assert_eq!(
        params.seq_ids(),
        steps.iter().map(|s| s.0).collect::<Vec<_>>()
    );
    assert_eq!(
        params.step_lens(),
        steps.iter().map(|s| s.1).collect::<Vec<_>>()
    );
    let (cu_q, cu_kv) = (params.cu_seqlens_q(), params.cu_seqlens_kv());
    assert_eq!(
        (cu_q.len(), cu_kv.len(), cu_q[0], cu_kv[0]),
        (b + 1, b + 1, 0, 0)
    );
    for (i, &(id, len)) in steps.iter().enumerate() {
        let start = before.get(&id).copied().unwrap_or(0);
        assert_eq!(params.start_positions()[i] as usize, start);
        assert_eq!(params.cache_seqlens()[i] as usize, start + len);
        assert_eq!((cu_q[i + 1] - cu_q[i]) as usize, len);
        assert_eq!((cu_kv[i + 1] - cu_kv[i]) as usize, start + len);
    }
    assert_eq!(
        params.max_seqlen_q(),
        steps.iter().map(|s| s.1).max().unwrap_or(0)
    );
    for layer in 0..NUM_LAYERS {
        let view = params.view::<f32>(layer).unwrap();
        let lay = view.layout;
        let num_pages = params.pages_in_use(layer).unwrap() + params.pages_free(layer).unwrap();
        let mut seen = HashSet::new();
        for i in 0..b {
            let held = pages_for(params, layer, lay.seqlen(i));
            for &page in &lay.page_table[i * lay.max_pages_per_seq..][..held] {
                assert!((page as usize) < num_pages, "page {page} outside the pool");
                assert!(seen.insert(page), "page {page} held twice");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bookkeeping_follows_reference_model(
        layout in layout(),
        max_batch_size in 1usize..5,
        max_seqlen in 1usize..40,
        window in prop::option::of((1usize..8, 1usize..6)),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        let mut params = InferenceParams::new(CacheShape {
            max_batch_size,
            max_seqlen,
            num_layers: NUM_LAYERS,
            num_heads_kv: 1,
            head_dim_k: 2,
            head_dim_v: 1,
            dtype: DType::F32,
            layout,
        }).unwrap();
        if let Some((w, max_step_len)) = window {
            params.set_sliding_window(1, w, max_step_len).unwrap();
        }
        let mut model: BTreeMap<u64, usize> = BTreeMap::new();
        // Ids of the planned step, if one is planned.
        let mut planned: Option<Vec<u64>> = None;
        for op in ops {
            let before = params.clone();
            let ok = match op {
                Op::PreStep(steps) => {
                    let valid = pre_step_valid(&params, &model, &steps);
                    let result = params.pre_step(&steps);
                    prop_assert_eq!(result.is_ok(), valid, "pre_step {:?}: {:?}", steps, result);
                    if valid {
                        let old = model.clone();
                        for &(id, len) in &steps {
                            *model.entry(id).or_insert(0) += len;
                        }
                        check_plan(&params, &steps, &old);
                        planned = Some(steps.iter().map(|s| s.0).collect());
                    }
                    valid
                }
                Op::Release(id) => {
                    let result = params.release(id);
                    let valid = model.remove(&id).is_some();
                    prop_assert_eq!(result.is_ok(), valid);
                    if planned.as_ref().is_some_and(|ids| ids.contains(&id)) {
                        planned = None;
                    }
                    valid
                }
                Op::Fork(src, dst) => {
                    let valid = model.contains_key(&src)
                        && !model.contains_key(&dst)
                        && model.len() < params.max_batch_size()
                        && (0..NUM_LAYERS).all(|l| pages_for(&params, l, model[&src]) <= params.pages_free(l).unwrap());
                    let result = params.fork(src, dst);
                    prop_assert_eq!(result.is_ok(), valid, "fork {} {}: {:?}", src, dst, result);
                    if valid {
                        model.insert(dst, model[&src]);
                    }
                    valid
                }
                Op::Step(layer, right_shape) => {
                    let t = params.cu_seqlens_q().last().copied().unwrap_or(0) as usize;
                    // k: [t, 1, 2], v: [t, 1, 1].
                    let k = vec![1.5f32; 2 * t + usize::from(!right_shape)];
                    let v = vec![2.5f32; t];
                    let valid = planned.is_some() && layer < NUM_LAYERS && right_shape;
                    let result = params.step(layer, &k, &v, QkvFormat::Thd).map(|_| ());
                    prop_assert_eq!(result.is_ok(), valid, "step {}: {:?}", layer, result);
                    valid
                }
            };
            if !ok {
                prop_assert!(params == before, "a refused operation changed the cache");
            }
            check_invariants(&params, &model);
        }
    }
}
