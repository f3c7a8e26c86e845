//! Property test of `truncate` (the rollback of rejected speculative
//! tokens): random interleavings of append, truncate, fork, a shared prefix
//! (attach + register), preemption (release, then recompute from the
//! tokens) and release never leak or double-free a page, and every
//! sequence reads back exactly the keys and values of its accepted tokens.
//!
//! The reference: each sequence is its list of accepted tokens; the key
//! stored for position `p` is a hash of the tokens `0..=p` (as a model's
//! would be: a function of the prefix), so a page shared by two sequences,
//! or kept from before a rollback, reads back right only if it really holds
//! that prefix.

use proptest::prelude::*;
use std::collections::BTreeMap;
use te_cache::{CacheError, CacheLayout, CacheShape, InferenceParams};
use te_kernels::{DType, QkvFormat};

const NUM_LAYERS: usize = 2;
/// The sliding-window layer of the ring configurations.
const RING_LAYER: usize = 1;
const WINDOW: usize = 3;
const MAX_STEP: usize = 5;
const MAX_SEQLEN: usize = 40;

#[derive(Clone, Debug)]
enum Op {
    /// Append these tokens to sequence `id` (starting it if new, from any
    /// registered prefix).
    Append(u64, Vec<u32>),
    /// Drop the last `n` tokens of sequence `id`.
    Truncate(u64, usize),
    Fork(u64, u64),
    /// Release and recompute from the accepted tokens.
    Preempt(u64),
    Release(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0u64..4, prop::collection::vec(0u32..2, 1..=MAX_STEP)).prop_map(|(i, t)| Op::Append(i, t)),
        3 => (0u64..4, 0usize..8).prop_map(|(i, n)| Op::Truncate(i, n)),
        1 => (0u64..4, 0u64..4).prop_map(|(a, b)| Op::Fork(a, b)),
        1 => (0u64..4).prop_map(Op::Preempt),
        1 => (0u64..4).prop_map(Op::Release),
    ]
}

/// The value stored for the token at the end of `prefix` on `layer` (an
/// integer below 2^22: exact in f32).
fn value(prefix: &[u32], layer: usize) -> f32 {
    let mut h: u32 = 0x9e37;
    for &t in prefix {
        h = h.wrapping_mul(0x01000193) ^ (t + 1);
    }
    ((h >> 12) + ((layer as u32) << 20)) as f32
}

struct Harness {
    params: InferenceParams,
    /// Accepted tokens of each live sequence.
    seqs: BTreeMap<u64, Vec<u32>>,
    /// Most tokens each live sequence ever held (a ring was written up to
    /// there).
    written: BTreeMap<u64, usize>,
    ring: bool,
}

impl Harness {
    /// Feeds `tokens[from..]` of sequence `id` in steps of at most
    /// `MAX_STEP`, writing each position's value and checking what every
    /// step reads back. `Ok(false)`: the pool is full (the step was refused
    /// and nothing changed).
    fn feed(&mut self, id: u64, tokens: &[u32], from: usize) -> Result<bool, TestCaseError> {
        let mut at = from;
        while at < tokens.len() {
            let n = (tokens.len() - at).min(MAX_STEP);
            let before = self.params.clone();
            match self.params.pre_step(&[(id, n)]) {
                Ok(()) => {}
                Err(CacheError::CacheFull { .. }) => {
                    prop_assert!(self.params == before, "a refused step changed the cache");
                    return Ok(false);
                }
                Err(e) => return Err(TestCaseError::fail(format!("pre_step: {e}"))),
            }
            for layer in 0..NUM_LAYERS {
                let rows: Vec<f32> = (at..at + n).map(|p| value(&tokens[..=p], layer)).collect();
                let view = self
                    .params
                    .step(layer, &rows, &rows, QkvFormat::Thd)
                    .map_err(|e| TestCaseError::fail(format!("step: {e}")))?;
                // Every position the step's queries may see.
                let end = at + n;
                let first = match view.layout.ring_len {
                    Some(_) => (at + 1).saturating_sub(WINDOW),
                    None => 0,
                };
                prop_assert!(first >= view.layout.first_held_position(0));
                for p in first..end {
                    let row = view.layout.row(0, p);
                    let want = value(&tokens[..=p], layer);
                    prop_assert_eq!(view.k_cache[row], want, "layer {} pos {} key", layer, p);
                    prop_assert_eq!(view.v_cache[row], want, "layer {} pos {} value", layer, p);
                }
            }
            at += n;
            let w = self.written.entry(id).or_insert(0);
            *w = (*w).max(at);
            self.params
                .register_prefix(id, &tokens[..at])
                .map_err(|e| TestCaseError::fail(format!("register: {e}")))?;
        }
        Ok(true)
    }

    /// Starts sequence `id` on `tokens` (prefix hit first) and computes the
    /// rest; drops it when the pool is full.
    fn start(&mut self, id: u64, tokens: Vec<u32>) -> Result<(), TestCaseError> {
        if self.seqs.len() == self.params.max_batch_size() || tokens.len() > MAX_SEQLEN {
            return Ok(());
        }
        let hit = self
            .params
            .attach_prefix(id, &tokens, tokens.len() - 1)
            .map_err(|e| TestCaseError::fail(format!("attach: {e}")))?;
        self.written.insert(id, hit);
        if self.feed(id, &tokens, hit)? {
            self.seqs.insert(id, tokens);
        } else {
            self.params.release(id).unwrap();
            self.written.remove(&id);
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Append(id, new) => match self.seqs.get(&id).cloned() {
                None => self.start(id, new)?,
                Some(mut tokens) => {
                    if tokens.len() + new.len() > MAX_SEQLEN {
                        return Ok(());
                    }
                    let from = tokens.len();
                    tokens.extend(&new);
                    if self.feed(id, &tokens, from)? {
                        self.seqs.insert(id, tokens);
                    }
                }
            },
            Op::Truncate(id, n) => {
                let Some(tokens) = self.seqs.get_mut(&id) else {
                    prop_assert!(self.params.truncate(id, 0).is_err());
                    return Ok(());
                };
                let cached = tokens.len();
                prop_assert!(self.params.truncate(id, cached + 1).is_err());
                let new_len = cached.saturating_sub(n);
                // A ring keeps the positions the next query needs only if
                // the rollback is shallow enough.
                let ring_len = self.params.ring_len(RING_LAYER);
                let fits = match (self.ring, ring_len) {
                    (true, Some(r)) => {
                        (new_len + 1).saturating_sub(WINDOW) + r >= self.written[&id]
                    }
                    _ => true,
                };
                let before = self.params.clone();
                let result = self.params.truncate(id, new_len);
                prop_assert_eq!(
                    result.is_ok(),
                    fits,
                    "truncate {} -> {}: {:?}",
                    cached,
                    new_len,
                    result
                );
                if fits {
                    tokens.truncate(new_len);
                } else {
                    prop_assert!(
                        self.params == before,
                        "a refused truncate changed the cache"
                    );
                }
            }
            Op::Fork(src, dst) => {
                let result = self.params.fork(src, dst);
                match (self.seqs.get(&src).cloned(), self.seqs.contains_key(&dst)) {
                    (Some(tokens), false) => {
                        if result.is_ok() {
                            self.seqs.insert(dst, tokens);
                            self.written.insert(dst, self.written[&src]);
                        }
                    }
                    _ => prop_assert!(result.is_err()),
                }
            }
            Op::Preempt(id) => {
                if let Some(tokens) = self.seqs.remove(&id) {
                    self.params.release(id).unwrap();
                    self.written.remove(&id);
                    if !tokens.is_empty() {
                        self.start(id, tokens)?;
                    }
                }
            }
            Op::Release(id) => {
                prop_assert_eq!(
                    self.params.release(id).is_ok(),
                    self.seqs.remove(&id).is_some()
                );
                self.written.remove(&id);
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.params
            .check_consistency()
            .map_err(TestCaseError::fail)?;
        for (&id, tokens) in &self.seqs {
            prop_assert_eq!(self.params.cached_tokens(id), tokens.len());
        }
        Ok(())
    }
}

fn layout() -> impl Strategy<Value = CacheLayout> {
    prop_oneof![
        1 => Just(CacheLayout::Contiguous),
        4 => (prop::sample::select(vec![1usize, 2, 3, 4]), 4usize..40).prop_map(
            |(page_size, total_num_pages)| CacheLayout::Paged {
                page_size,
                total_num_pages
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn rollback_never_leaks_and_reads_back_the_accepted_tokens(
        layout in layout(),
        ring in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut params = InferenceParams::new(CacheShape {
            max_batch_size: 4,
            max_seqlen: MAX_SEQLEN,
            num_layers: NUM_LAYERS,
            num_heads_kv: 1,
            head_dim_k: 1,
            head_dim_v: 1,
            dtype: DType::F32,
            layout,
        }).unwrap();
        if ring {
            params.set_sliding_window(RING_LAYER, WINDOW, MAX_STEP).unwrap();
        }
        let mut h = Harness { params, seqs: BTreeMap::new(), written: BTreeMap::new(), ring };
        for op in ops {
            h.apply(op)?;
            h.check()?;
        }
        // Every live sequence reads back its tokens once more (a one-token
        // step), then everything is released: no page stays held.
        let ids: Vec<u64> = h.seqs.keys().copied().collect();
        for id in ids {
            h.apply(Op::Append(id, vec![0]))?;
            h.check()?;
        }
        let ids: Vec<u64> = h.seqs.keys().copied().collect();
        for id in ids {
            h.apply(Op::Release(id))?;
        }
        h.check()?;
        h.params.clear_prefix_cache();
        for layer in 0..NUM_LAYERS {
            prop_assert_eq!(h.params.pages_in_use(layer).unwrap(), 0);
        }
        prop_assert_eq!(h.params.pages_cached(), 0);
    }
}
