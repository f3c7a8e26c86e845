//! Context-parallel generation: each sequence's tokens and KV cache split
//! over `cp_size` ranks (docs/ARCHITECTURE.md, "Context parallelism"), one [`ContextParallel`] per rank.
//!
//! Every rank runs the same engine on the same requests, so every rank
//! plans the same steps; this module decides where each new token lives
//! and runs the model forward on this rank's part:
//! - a prompt chunk of `n > 1` tokens is split in the zigzag layout
//!   ([`Zigzag`]: rank `r` takes chunks `r` and `2 cp_size - 1 - r` of the
//!   chunk's `2 cp_size`), each rank computes only its tokens (embedding,
//!   norms, projections, MLP) and stores their K/V;
//! - a single token (decode) is computed by every rank (replicated) and
//!   stored by the rank holding the fewest of the sequence's tokens (the
//!   lowest such rank), so the shards stay balanced.
//!
//! Attention passes queries, not keys ("pass-Q": Yang et al. 2024,
//! "Context Parallelism for Scalable Million-Token Inference"): the ranks
//! all-gather the step's sharded query rows, each attends every query of
//! the step to the keys it holds (its cache, this step's keys included) at
//! their true positions ([`te_attention::Positions`]: causal mask and
//! sliding window by position), and [`all_merge()`] combines the partial
//! outputs by log-sum-exp, in rank order, on every rank. Earlier chunks'
//! keys are attended where they are held, so chunked prefill and decode
//! are the same step; the KV cache never moves. The last position of each
//! sequence is computed on one rank (a replicated token: rank 0's copy);
//! its hidden state is all-gathered so every rank computes the same
//! logits, bit for bit, and samples the same token.
//!
//! Ranks check that they agree on every step (sequence ids, lengths,
//! tokens: [`agree`]), so ranks started with other prompts or settings fail
//! at the first step on every rank. Any failure aborts the communicator,
//! so the other ranks fail too, naming the rank where it started.

use std::collections::HashMap;
use std::ops::Range;

use te_attention::{AttentionWorkspace, AttnMetadata, KvInput, Positions};
use te_cache::{InferenceParams, KvStorage};
use te_kernels::QkvFormat;
use te_ring::{agree, all_gather, all_merge, call_tag, Communicator, Zigzag};

use crate::device::Cpu;
use crate::layer::{Layer, Qkv, Rows, Workspace};
use crate::model::Model;
use crate::{ModelError, Result};

/// One rank of a context-parallel group: its communicator and where each
/// sequence's tokens live (see the module doc).
pub struct ContextParallel {
    comm: Box<dyn Communicator>,
    zigzag: Zigzag,
    shards: HashMap<u64, Shard>,
    /// The committed step: how each sequence's new tokens are placed.
    step: Vec<Placed>,
    bufs: Buffers,
}

/// Where one sequence's tokens live.
#[derive(Default)]
struct Shard {
    /// Tokens each rank holds.
    held: Vec<usize>,
    /// Positions of this rank's keys, in cache order (increasing).
    positions: Vec<i32>,
}

/// One sequence's new tokens in a step, placed.
#[derive(Clone, Debug, PartialEq)]
pub struct Placed {
    seq_id: u64,
    /// Tokens held before the step (position of the first new one).
    start: usize,
    /// New tokens.
    n: usize,
    /// `n == 1`: the rank that stores the token every rank computes;
    /// `None`: zigzag chunks.
    owner: Option<usize>,
}

/// Per-step and per-layer buffers, reused.
#[derive(Default)]
struct Buffers {
    /// Rows of the full step this rank computes, in order.
    rows: Vec<usize>,
    /// Indices into `rows` of those whose K/V this rank stores, and of
    /// those of zigzag-split sequences (the queries it all-gathers).
    stored: Vec<usize>,
    sharded: Vec<usize>,
    /// Runs of consecutive positions among `rows`.
    rope_cu: Vec<i32>,
    rope_start: Vec<i32>,
    /// Per sequence of the step: first position and the key positions this
    /// rank holds (after the step).
    q_start: Vec<i32>,
    cu_k: Vec<i32>,
    k_pos: Vec<i32>,
    /// Gathered K/V of the stored rows, the step's full queries, the
    /// partial then merged outputs and their LSE.
    k: Vec<f32>,
    v: Vec<f32>,
    q_full: Vec<f32>,
    out_full: Vec<f32>,
    lse: Vec<f32>,
}

impl ContextParallel {
    /// Rank `comm.cp_rank()` of a group of `comm.cp_size()`.
    ///
    /// Errors: a communicator of 0 ranks or more than te-ring supports.
    pub fn new(comm: Box<dyn Communicator>) -> Result<Self> {
        let zigzag = Zigzag::new(comm.cp_size()).map_err(ring_error)?;
        Ok(ContextParallel {
            comm,
            zigzag,
            shards: HashMap::new(),
            step: Vec::new(),
            bufs: Buffers::default(),
        })
    }

    /// This rank.
    pub fn cp_rank(&self) -> usize {
        self.comm.cp_rank()
    }

    /// Ranks in the group.
    pub fn cp_size(&self) -> usize {
        self.comm.cp_size()
    }

    /// The communicator (for the engine's collective decisions).
    pub fn comm(&mut self) -> &mut dyn Communicator {
        self.comm.as_mut()
    }

    /// Tokens whose K/V this rank holds, all sequences together.
    pub fn held_tokens(&self) -> usize {
        self.shards.values().map(|s| s.positions.len()).sum()
    }

    /// Fails this rank's communicator with `reason`, so that every other
    /// rank's next call fails naming this rank (after an error here).
    pub fn abort(&mut self, reason: &str) {
        self.comm.abort_with(reason);
    }

    /// Places the new tokens of `steps` (`(seq_id, n)` in step order, the
    /// same on every rank), without committing.
    pub fn place(&self, steps: &[(u64, usize)]) -> Vec<Placed> {
        let cp = self.cp_size();
        steps
            .iter()
            .map(|&(seq_id, n)| {
                let held = self.shards.get(&seq_id).map(|s| s.held.as_slice());
                let start = held.map_or(0, |h| h.iter().sum());
                let owner = (n == 1).then(|| {
                    (0..cp)
                        .min_by_key(|&r| held.map_or(0, |h| h[r]))
                        .expect("at least one rank")
                });
                Placed {
                    seq_id,
                    start,
                    n,
                    owner,
                }
            })
            .collect()
    }

    /// This rank's `(seq_id, tokens stored)` of a placed step: the steps of
    /// its cache ([`InferenceParams::pre_step_shard`]; entries may be 0).
    pub fn local_steps(&self, placed: &[Placed]) -> Vec<(u64, usize)> {
        let r = self.cp_rank();
        placed
            .iter()
            .map(|p| (p.seq_id, self.stored_by(p, r).iter().map(Range::len).sum()))
            .collect()
    }

    /// Records a placed step whose cache step this rank has committed.
    pub fn commit(&mut self, placed: Vec<Placed>) {
        let (cp, r) = (self.cp_size(), self.cp_rank());
        for p in &placed {
            let ranges: Vec<Vec<Range<usize>>> = (0..cp).map(|q| self.stored_by(p, q)).collect();
            let shard = self.shards.entry(p.seq_id).or_default();
            shard.held.resize(cp, 0);
            for (q, rs) in ranges.iter().enumerate() {
                shard.held[q] += rs.iter().map(Range::len).sum::<usize>();
            }
            for range in &ranges[r] {
                shard
                    .positions
                    .extend(range.clone().map(|i| (p.start + i) as i32));
            }
        }
        self.step = placed;
    }

    /// Forgets a sequence (released from the cache).
    pub fn release(&mut self, seq_id: u64) {
        self.shards.remove(&seq_id);
        self.step.retain(|p| p.seq_id != seq_id);
    }

    /// Offsets (within the step's new tokens) of `p`'s tokens that rank `r`
    /// stores.
    fn stored_by(&self, p: &Placed, r: usize) -> Vec<Range<usize>> {
        match p.owner {
            Some(o) if o == r => std::iter::once(0..1).collect(),
            Some(_) => Vec::new(),
            None => self.computed_by(p, r),
        }
    }

    /// Offsets of `p`'s tokens that rank `r` computes.
    fn computed_by(&self, p: &Placed, r: usize) -> Vec<Range<usize>> {
        match p.owner {
            Some(_) => std::iter::once(0..1).collect(),
            None => self
                .zigzag
                .chunks(p.n, r)
                .expect("rank below cp_size")
                .into_iter()
                .filter(|c| !c.is_empty())
                .collect(),
        }
    }

    /// The rank whose hidden state gives `p`'s logits: the holder of its
    /// last new token (rank 0 for a replicated one).
    fn last_row_rank(&self, p: &Placed) -> usize {
        match p.owner {
            Some(_) => 0,
            None => (0..self.cp_size())
                .find(|&r| {
                    self.computed_by(p, r)
                        .iter()
                        .any(|c| c.contains(&(p.n - 1)))
                })
                .expect("some rank holds every token"),
        }
    }
}

/// Full-step rows of the zigzag-split sequences of `placed` that rank `r`
/// computes, in its order (the layout of its all-gathered queries).
fn sharded_rows(zigzag: &Zigzag, placed: &[Placed], r: usize) -> Vec<usize> {
    let mut rows = Vec::new();
    let mut row0 = 0;
    for p in placed {
        if p.owner.is_none() {
            for c in zigzag.chunks(p.n, r).expect("rank below cp_size") {
                rows.extend(c.map(|i| row0 + i));
            }
        }
        row0 += p.n;
    }
    rows
}

/// A te-ring error as a model error.
fn ring_error(e: te_ring::RingError) -> ModelError {
    ModelError::Request(format!("context parallelism: {e}"))
}

impl Model {
    /// One context-parallel step on this rank (see the module doc):
    /// `tokens: [t]` are the whole step's tokens in thd order, the same on
    /// every rank; `cache` is this rank's KV cache, planned by
    /// `pre_step_shard` with [`ContextParallel::local_steps`] of the step
    /// `cp` committed. Returns f32 logits `[b, vocab]` for the last token
    /// of each sequence, identical on every rank.
    ///
    /// Errors: ranks that disagree on the step, a failed or departed rank
    /// (named), and everything [`Model::forward`] rejects. The
    /// communicator is aborted then.
    pub fn forward_context_parallel<'w, S: KvStorage>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        cp: &mut ContextParallel,
        ws: &'w mut Workspace,
    ) -> Result<&'w [f32]> {
        let result = self.cp_forward(tokens, cache, cp, ws);
        if let Err(e) = &result {
            cp.abort(&e.to_string());
        }
        result?;
        Ok(&ws.logits)
    }

    fn cp_forward<S: KvStorage>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        cp: &mut ContextParallel,
        ws: &mut Workspace,
    ) -> Result<()> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let t_full: usize = cp.step.iter().map(|p| p.n).sum();
        if tokens.len() != t_full {
            return Err(ModelError::Request(format!(
                "context-parallel forward: {} tokens given, the placed step has {t_full}",
                tokens.len()
            )));
        }
        // Every rank runs the same step: sequences, lengths and tokens.
        let words: Vec<u64> = cp
            .step
            .iter()
            .flat_map(|p| [p.seq_id, p.start as u64, p.n as u64])
            .chain([call_tag("tokens", tokens.iter().map(|&t| t as u64))])
            .collect();
        agree(cp.comm.as_mut(), "generation step", &words).map_err(ring_error)?;
        let end = cp.step.iter().map(|p| p.start + p.n).max().unwrap_or(0);
        let rope = self.rope_covering(end)?;

        // This rank's rows of the step, its runs of positions, its stores,
        // and the key positions it holds.
        let rank = cp.cp_rank();
        let mut bufs = std::mem::take(&mut cp.bufs);
        bufs.rows.clear();
        bufs.stored.clear();
        bufs.sharded.clear();
        bufs.rope_cu.clear();
        bufs.rope_cu.push(0);
        bufs.rope_start.clear();
        bufs.q_start.clear();
        bufs.cu_k.clear();
        bufs.cu_k.push(0);
        bufs.k_pos.clear();
        let mut row0 = 0;
        for p in &cp.step {
            let store = p.owner.is_none_or(|o| o == rank);
            for range in cp.computed_by(p, rank) {
                for i in range.clone() {
                    if store {
                        bufs.stored.push(bufs.rows.len());
                    }
                    if p.owner.is_none() {
                        bufs.sharded.push(bufs.rows.len());
                    }
                    bufs.rows.push(row0 + i);
                }
                bufs.rope_cu.push(bufs.rows.len() as i32);
                bufs.rope_start.push((p.start + range.start) as i32);
            }
            row0 += p.n;
            bufs.q_start.push(p.start as i32);
            let held = cp.shards.get(&p.seq_id).map_or(&[][..], |s| &s.positions);
            bufs.k_pos.extend_from_slice(held);
            bufs.cu_k.push(bufs.k_pos.len() as i32);
        }
        let t = bufs.rows.len();
        let mut cu_q = Vec::with_capacity(cp.step.len() + 1);
        cu_q.push(0i32);
        for p in &cp.step {
            cu_q.push(cu_q.last().unwrap() + p.n as i32);
        }

        let mut x = std::mem::take(&mut ws.x);
        x.resize(t * hidden, 0.0);
        let local_tokens: Vec<u32> = bufs.rows.iter().map(|&r| tokens[r]).collect();
        let mut result = self.embed(&local_tokens, &mut x);
        let (rope_cu, rope_start) = (
            std::mem::take(&mut bufs.rope_cu),
            std::mem::take(&mut bufs.rope_start),
        );
        for (layer, w) in self.layers.iter().zip(&self.weights.layers) {
            if result.is_err() {
                break;
            }
            let rope = rope.pair()[layer.rope_slot()];
            let rows = Rows {
                t,
                rope_cu: &rope_cu,
                rope_start: &rope_start,
            };
            let mut step = CpLayer {
                cache,
                comm: cp.comm.as_mut(),
                zigzag: &cp.zigzag,
                placed: &cp.step,
                cu_q: &cu_q,
                bufs: &mut bufs,
            };
            result = layer.run(
                &mut ws.cpu,
                w,
                &mut x,
                rows,
                rope,
                &mut ws.bufs,
                &mut |l, cpu: &mut Cpu, qkv, out| step.attend(l, qkv, out, &mut cpu.attention),
            );
        }
        (bufs.rope_cu, bufs.rope_start) = (rope_cu, rope_start);
        if let Err(e) = result {
            ws.x = x;
            cp.bufs = bufs;
            return Err(e);
        }

        // Last rows: each rank sends those it holds; all take every one.
        let mut mine = Vec::new();
        let mut row0 = 0;
        for p in &cp.step {
            if cp.last_row_rank(p) == rank {
                let last = row0 + p.n - 1;
                let i = bufs.rows.iter().position(|&r| r == last).expect("held");
                mine.extend_from_slice(&x[i * hidden..(i + 1) * hidden]);
            }
            row0 += p.n;
        }
        ws.x = x;
        cp.bufs = bufs;
        let words = [cp.step.len() as u64, hidden as u64];
        let gathered =
            all_gather(cp.comm.as_mut(), "last hidden rows", &words, &mine).map_err(ring_error)?;
        let mut next = vec![0usize; cp.cp_size()];
        ws.h.clear();
        for p in &cp.step {
            let r = cp.last_row_rank(p);
            let src = gathered[r].get(next[r] * hidden..(next[r] + 1) * hidden);
            let src = src.ok_or_else(|| {
                ring_error(te_ring::RingError::Communication {
                    cp_rank: rank,
                    reason: format!("rank {r} sent too few last rows"),
                })
            })?;
            ws.h.extend_from_slice(src);
            next[r] += 1;
        }
        self.head(ws)
    }
}

/// One layer's attention on a rank: store this rank's K/V, gather the
/// step's queries, attend them to the keys held here, merge over ranks.
struct CpLayer<'a, S> {
    cache: &'a mut InferenceParams<S>,
    comm: &'a mut dyn Communicator,
    zigzag: &'a Zigzag,
    placed: &'a [Placed],
    cu_q: &'a [i32],
    bufs: &'a mut Buffers,
}

impl<S: KvStorage> CpLayer<'_, S> {
    fn attend(
        &mut self,
        layer: &Layer,
        qkv: Qkv<'_, Vec<f32>>,
        out: &mut [f32],
        aws: &mut AttentionWorkspace,
    ) -> Result<()> {
        let (hq, hkv, d) = (layer.num_heads, layer.num_heads_kv, layer.head_dim);
        let b = &mut *self.bufs;
        let t = b.rows.len();
        let (qw, kw) = (hq * d, hkv * d);
        // K/V of the stored rows.
        let view = if b.stored.len() == t {
            self.cache.step(layer.index, qkv.k, qkv.v, QkvFormat::Thd)?
        } else {
            b.k.clear();
            b.v.clear();
            for &i in &b.stored {
                b.k.extend_from_slice(&qkv.k[i * kw..(i + 1) * kw]);
                b.v.extend_from_slice(&qkv.v[i * kw..(i + 1) * kw]);
            }
            self.cache.step(layer.index, &b.k, &b.v, QkvFormat::Thd)?
        };

        // The step's queries: this rank's rows in place, the other ranks'
        // zigzag rows from the all-gather (replicated rows are this rank's).
        let t_full = *self.cu_q.last().unwrap_or(&0) as usize;
        b.q_full.resize(t_full * qw, 0.0);
        for (i, &r) in b.rows.iter().enumerate() {
            b.q_full[r * qw..(r + 1) * qw].copy_from_slice(&qkv.q[i * qw..(i + 1) * qw]);
        }
        let rank = self.comm.cp_rank();
        let cp = self.comm.cp_size();
        if cp > 1 {
            let mut sharded = Vec::with_capacity(b.sharded.len() * qw);
            for &i in &b.sharded {
                sharded.extend_from_slice(&qkv.q[i * qw..(i + 1) * qw]);
            }
            let words = [layer.index as u64, t_full as u64, qw as u64];
            let all = all_gather(&mut *self.comm, "step queries", &words, &sharded)
                .map_err(ring_error)?;
            for (src, rows) in all.iter().enumerate() {
                if src == rank {
                    continue;
                }
                let full_rows = sharded_rows(self.zigzag, self.placed, src);
                if rows.len() != full_rows.len() * qw {
                    return Err(ring_error(te_ring::RingError::Communication {
                        cp_rank: rank,
                        reason: format!(
                            "rank {src} sent {} query values, its shard has {}",
                            rows.len(),
                            full_rows.len() * qw
                        ),
                    }));
                }
                for (from, &r) in rows.chunks_exact(qw).zip(&full_rows) {
                    b.q_full[r * qw..(r + 1) * qw].copy_from_slice(from);
                }
            }
        }

        // Partial attention over the keys held here, merged over ranks.
        b.out_full.resize(t_full * qw, 0.0);
        b.lse.resize(hq * t_full, 0.0);
        let meta = AttnMetadata {
            batch: self.placed.len(),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(self.cu_q),
            cu_seqlens_kv: None,
        };
        let positions = Positions {
            q_start: &b.q_start,
            cu_k: &b.cu_k,
            k: &b.k_pos,
        };
        layer.attention.forward_cpu_at_positions(
            &b.q_full,
            KvInput::Cache(view),
            &meta,
            &positions,
            &mut b.out_full,
            Some(&mut b.lse),
            aws,
        )?;
        if cp > 1 {
            all_merge(&mut *self.comm, &mut b.out_full, &mut b.lse, hq, d).map_err(ring_error)?;
        }
        for (i, &r) in b.rows.iter().enumerate() {
            out[i * qw..(i + 1) * qw].copy_from_slice(&b.out_full[r * qw..(r + 1) * qw]);
        }
        Ok(())
    }
}
