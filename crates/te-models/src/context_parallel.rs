//! Context-parallel generation: each sequence's tokens and KV cache split
//! over `cp_size` ranks (docs/ARCHITECTURE.md, "Context parallelism"), one
//! [`ContextParallel`] per rank.
//!
//! Every rank runs the same engine on the same requests, so every rank
//! plans the same steps; te-ring's [`Placement`] decides where each new
//! token lives, and each rank runs the model loop (`Model::run_on`, the one
//! every device runs) on its part, with collectives:
//! - a prompt chunk of `n > 1` tokens is split in the zigzag layout
//!   ([`te_ring::Zigzag`]: rank `r` takes chunks `r` and `2 cp_size - 1 -
//!   r` of the chunk's `2 cp_size`), each rank computes only its tokens
//!   (embedding, norms, projections, MLP) and stores their K/V;
//! - a single token (decode) is computed by every rank (replicated) and
//!   stored by the rank holding the fewest of the sequence's tokens (the
//!   lowest such rank), so the shards stay balanced.
//!
//! Attention passes queries, not keys ("pass-Q": Yang et al. 2024,
//! "Context Parallelism for Scalable Million-Token Inference"): in each
//! layer's `attend` the ranks all-gather the step's sharded query rows,
//! each attends every query of the step to the keys it holds (its cache,
//! this step's keys included) at their true positions
//! ([`te_attention::Positions`]: causal mask and sliding window by
//! position), and [`all_merge()`] combines the partial outputs by
//! log-sum-exp, in rank order, on every rank. Earlier chunks' keys are
//! attended where they are held, so chunked prefill and decode are the
//! same step; the KV cache never moves. The last position of each sequence
//! is computed on one rank (a replicated token: rank 0's copy); the loop's
//! rows that get logits are these hidden states, all-gathered, so every
//! rank computes the same logits, bit for bit, and samples the same token.
//!
//! Ranks check that they agree on every step (sequence ids, lengths,
//! tokens: [`agree`]), so ranks started with other prompts or settings fail
//! at the first step on every rank. Any failure aborts the communicator,
//! so the other ranks fail too, naming the rank where it started.

use te_attention::{AttentionWorkspace, AttnMetadata, AttnOutput, KvInput, Positions};
use te_cache::{InferenceParams, KvStorage};
use te_kernels::QkvFormat;
use te_ring::{agree, all_gather, all_merge, call_tag, Communicator, Placement};

use crate::device::Cpu;
use crate::layer::{Layer, Qkv, Rows, Workspace};
use crate::model::{DeviceParams, Model, ModelBufs, StepOps};
use crate::{ModelError, Result};

/// One sequence's new tokens in a step, placed (te-ring's).
pub use te_ring::Placed;

/// One rank of a context-parallel group: its communicator and where each
/// sequence's tokens live (see the module doc).
pub struct ContextParallel {
    comm: Box<dyn Communicator>,
    placement: Placement,
    rows: StepRows,
    scratch: Scratch,
}

/// This rank's part of the committed step, rebuilt every step in reused
/// buffers.
#[derive(Default)]
struct StepRows {
    /// Rows of the full step this rank computes, in order, and their
    /// tokens.
    rows: Vec<usize>,
    tokens: Vec<u32>,
    /// Indices into `rows` of those whose K/V this rank stores, and of
    /// those of zigzag-split sequences (the queries it all-gathers).
    stored: Vec<usize>,
    sharded: Vec<usize>,
    /// Runs of consecutive positions among `rows`.
    rope_cu: Vec<i32>,
    rope_start: Vec<i32>,
    /// The full step's `cu_seqlens_q: [b + 1]`.
    cu_q: Vec<i32>,
    /// Per sequence of the step: first position and the key positions this
    /// rank holds (after the step).
    q_start: Vec<i32>,
    cu_k: Vec<i32>,
    k_pos: Vec<i32>,
}

/// Per-layer buffers, reused: gathered K/V of the stored rows, the step's
/// full queries, the partial then merged outputs and their LSE.
#[derive(Default)]
struct Scratch {
    k: Vec<f32>,
    v: Vec<f32>,
    q_full: Vec<f32>,
    out_full: Vec<f32>,
    lse: Vec<f32>,
}

impl ContextParallel {
    /// Rank `comm.cp_rank()` of a group of `comm.cp_size()`.
    ///
    /// Errors: a communicator of 0 ranks or more than te-ring supports, or
    /// whose rank is not below its size.
    pub fn new(comm: Box<dyn Communicator>) -> Result<Self> {
        let placement = Placement::new(comm.cp_size(), comm.cp_rank()).map_err(ring_error)?;
        Ok(ContextParallel {
            comm,
            placement,
            rows: StepRows::default(),
            scratch: Scratch::default(),
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

    /// Where the group's tokens live, as this rank recorded it.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Tokens whose K/V this rank holds, all sequences together.
    pub fn held_tokens(&self) -> usize {
        self.placement.held_tokens()
    }

    /// Fails this rank's communicator with `reason`, so that every other
    /// rank's next call fails naming this rank (after an error here).
    pub fn abort(&mut self, reason: &str) {
        self.comm.abort_with(reason);
    }

    /// Places the new tokens of `steps` (`(seq_id, n)` in step order, the
    /// same on every rank), without committing ([`Placement::place`]).
    pub fn place(&self, steps: &[(u64, usize)]) -> Vec<Placed> {
        self.placement.place(steps)
    }

    /// This rank's `(seq_id, tokens stored)` of a placed step: the steps of
    /// its cache ([`InferenceParams::pre_step_shard`]; entries may be 0).
    pub fn local_steps(&self, placed: &[Placed]) -> Vec<(u64, usize)> {
        self.placement.local_steps(placed)
    }

    /// Records a placed step whose cache step this rank has committed.
    pub fn commit(&mut self, placed: Vec<Placed>) {
        self.placement.commit(placed);
    }

    /// Forgets a sequence (released from the cache).
    pub fn release(&mut self, seq_id: u64) {
        self.placement.release(seq_id);
    }
}

impl StepRows {
    /// This rank's rows of the committed step of `placement`, whose tokens
    /// are `tokens: [t]` (thd order, the whole step).
    fn build(&mut self, placement: &Placement, tokens: &[u32]) {
        for v in [&mut self.rows, &mut self.stored, &mut self.sharded] {
            v.clear();
        }
        for v in [
            &mut self.rope_cu,
            &mut self.rope_start,
            &mut self.cu_q,
            &mut self.q_start,
            &mut self.cu_k,
            &mut self.k_pos,
        ] {
            v.clear();
        }
        self.rope_cu.push(0);
        self.cu_q.push(0);
        self.cu_k.push(0);
        let rank = placement.cp_rank();
        let mut row0 = 0;
        for p in placement.step() {
            let store = p.owner().is_none_or(|o| o == rank);
            for range in placement.computed_by(p, rank) {
                for i in range.clone() {
                    if store {
                        self.stored.push(self.rows.len());
                    }
                    if p.is_sharded() {
                        self.sharded.push(self.rows.len());
                    }
                    self.rows.push(row0 + i);
                }
                self.rope_cu.push(self.rows.len() as i32);
                self.rope_start.push((p.start() + range.start) as i32);
            }
            row0 += p.len();
            self.cu_q.push(row0 as i32);
            self.q_start.push(p.start() as i32);
            self.k_pos
                .extend_from_slice(placement.positions(p.seq_id()));
            self.cu_k.push(self.k_pos.len() as i32);
        }
        self.tokens.clear();
        self.tokens.extend(self.rows.iter().map(|&r| tokens[r]));
    }
}

/// A te-ring error as a model error.
fn ring_error(e: te_ring::RingError) -> ModelError {
    ModelError::ContextParallel(e)
}

/// A communication error on `cp_rank`.
fn comm_error(cp_rank: usize, reason: String) -> ModelError {
    ring_error(te_ring::RingError::Communication { cp_rank, reason })
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

    /// The model loop (`Model::run_on`) on this rank's rows, with the
    /// collectives of [`CpStep`].
    fn cp_forward<S: KvStorage>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        cp: &mut ContextParallel,
        ws: &mut Workspace,
    ) -> Result<()> {
        let step = cp.placement.step();
        let t_full: usize = step.iter().map(Placed::len).sum();
        if tokens.len() != t_full {
            return Err(ModelError::StepTokens {
                op: "context-parallel forward",
                given: tokens.len(),
                planned: t_full,
            });
        }
        // Every rank runs the same step: sequences, lengths and tokens.
        let words: Vec<u64> = step
            .iter()
            .flat_map(|p| [p.seq_id(), p.start() as u64, p.len() as u64])
            .chain([call_tag("tokens", tokens.iter().map(|&t| t as u64))])
            .collect();
        agree(cp.comm.as_mut(), "generation step", &words).map_err(ring_error)?;
        let end = step.iter().map(|p| p.start() + p.len()).max().unwrap_or(0);
        let rope = self.rope_covering(end)?;

        // This rank's rows of the step, its runs of positions, its stores,
        // and the key positions it holds.
        cp.rows.build(&cp.placement, tokens);
        let ContextParallel {
            comm,
            placement,
            rows,
            scratch,
        } = cp;
        let layer_rows = Rows {
            t: rows.rows.len(),
            rope_cu: &rows.rope_cu,
            rope_start: &rows.rope_start,
        };
        let mut step = CpStep {
            cache,
            comm: comm.as_mut(),
            placement,
            rows,
            scratch,
        };
        let params = DeviceParams {
            weights: &self.weights,
            ropes: rope.pair(),
        };
        let bufs = ModelBufs {
            layer: &mut ws.bufs,
            x: &mut ws.x,
            h: &mut ws.h,
            logits: &mut ws.logits,
        };
        self.run_on(
            &mut ws.cpu,
            params,
            &rows.tokens,
            layer_rows,
            bufs,
            &mut step,
        )
    }
}

/// A rank's [`StepOps`]: each layer stores this rank's K/V, gathers the
/// step's queries, attends them to the keys held here and merges over
/// ranks; the last rows are gathered from the ranks that hold them.
struct CpStep<'a, S> {
    cache: &'a mut InferenceParams<S>,
    comm: &'a mut dyn Communicator,
    placement: &'a Placement,
    rows: &'a StepRows,
    scratch: &'a mut Scratch,
}

impl<S: KvStorage> StepOps<Cpu> for CpStep<'_, S> {
    fn attend(
        &mut self,
        layer: &Layer,
        cpu: &mut Cpu,
        qkv: Qkv<'_, Vec<f32>>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.attend_cpu(layer, qkv, out, &mut cpu.attention)
    }

    /// Each rank sends the last rows it holds; all take every one, in
    /// step order.
    fn gather_logit_rows(
        &mut self,
        _cpu: &mut Cpu,
        x: &Vec<f32>,
        hidden: usize,
        h: &mut Vec<f32>,
    ) -> Result<()> {
        let rank = self.comm.cp_rank();
        let step = self.placement.step();
        let mut mine = Vec::new();
        let mut row0 = 0;
        for p in step {
            if self.placement.last_row_rank(p) == rank {
                let last = row0 + p.len() - 1;
                let i = self
                    .rows
                    .rows
                    .iter()
                    .position(|&r| r == last)
                    .expect("held");
                mine.extend_from_slice(&x[i * hidden..(i + 1) * hidden]);
            }
            row0 += p.len();
        }
        let words = [step.len() as u64, hidden as u64];
        let gathered =
            all_gather(&mut *self.comm, "last hidden rows", &words, &mine).map_err(ring_error)?;
        let mut next = vec![0usize; self.comm.cp_size()];
        h.clear();
        for p in step {
            let r = self.placement.last_row_rank(p);
            let src = gathered[r].get(next[r] * hidden..(next[r] + 1) * hidden);
            let src =
                src.ok_or_else(|| comm_error(rank, format!("rank {r} sent too few last rows")))?;
            h.extend_from_slice(src);
            next[r] += 1;
        }
        Ok(())
    }
}

impl<S: KvStorage> CpStep<'_, S> {
    /// One layer's attention on this rank: store its K/V, gather the
    /// step's queries, attend them to the keys held here, merge over ranks.
    fn attend_cpu(
        &mut self,
        layer: &Layer,
        qkv: Qkv<'_, Vec<f32>>,
        out: &mut [f32],
        aws: &mut AttentionWorkspace,
    ) -> Result<()> {
        let (hq, hkv, d) = (layer.num_heads, layer.num_heads_kv, layer.head_dim);
        let (rows, b) = (self.rows, &mut *self.scratch);
        let t = rows.rows.len();
        let (qw, kw) = (hq * d, hkv * d);
        // K/V of the stored rows.
        let view = if rows.stored.len() == t {
            self.cache.step(layer.index, qkv.k, qkv.v, QkvFormat::Thd)?
        } else {
            b.k.clear();
            b.v.clear();
            for &i in &rows.stored {
                b.k.extend_from_slice(&qkv.k[i * kw..(i + 1) * kw]);
                b.v.extend_from_slice(&qkv.v[i * kw..(i + 1) * kw]);
            }
            self.cache.step(layer.index, &b.k, &b.v, QkvFormat::Thd)?
        };

        // The step's queries: this rank's rows in place, the other ranks'
        // zigzag rows from the all-gather (replicated rows are this rank's).
        let t_full = *rows.cu_q.last().unwrap_or(&0) as usize;
        b.q_full.resize(t_full * qw, 0.0);
        for (i, &r) in rows.rows.iter().enumerate() {
            b.q_full[r * qw..(r + 1) * qw].copy_from_slice(&qkv.q[i * qw..(i + 1) * qw]);
        }
        let rank = self.comm.cp_rank();
        let cp = self.comm.cp_size();
        if cp > 1 {
            let mut sharded = Vec::with_capacity(rows.sharded.len() * qw);
            for &i in &rows.sharded {
                sharded.extend_from_slice(&qkv.q[i * qw..(i + 1) * qw]);
            }
            let words = [layer.index as u64, t_full as u64, qw as u64];
            let all = all_gather(&mut *self.comm, "step queries", &words, &sharded)
                .map_err(ring_error)?;
            let placed = self.placement.step();
            for (src, got) in all.iter().enumerate() {
                if src == rank {
                    continue;
                }
                let full_rows = self.placement.sharded_rows(placed, src);
                if got.len() != full_rows.len() * qw {
                    return Err(comm_error(
                        rank,
                        format!(
                            "rank {src} sent {} query values, its shard has {}",
                            got.len(),
                            full_rows.len() * qw
                        ),
                    ));
                }
                for (from, &r) in got.chunks_exact(qw).zip(&full_rows) {
                    b.q_full[r * qw..(r + 1) * qw].copy_from_slice(from);
                }
            }
        }

        // Partial attention over the keys held here, merged over ranks.
        b.out_full.resize(t_full * qw, 0.0);
        b.lse.resize(hq * t_full, 0.0);
        let meta = AttnMetadata {
            batch: self.placement.step().len(),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(&rows.cu_q),
            cu_seqlens_kv: None,
        };
        let positions = Positions {
            q_start: &rows.q_start,
            cu_k: &rows.cu_k,
            k: &rows.k_pos,
        };
        layer.attention.forward_cpu_at_positions(
            &b.q_full,
            KvInput::Cache(view),
            &meta,
            &positions,
            AttnOutput {
                out: &mut b.out_full,
                lse: Some(&mut b.lse),
            },
            aws,
        )?;
        if cp > 1 {
            all_merge(&mut *self.comm, &mut b.out_full, &mut b.lse, hq, d).map_err(ring_error)?;
        }
        for (i, &r) in rows.rows.iter().enumerate() {
            out[i * qw..(i + 1) * qw].copy_from_slice(&b.out_full[r * qw..(r + 1) * qw]);
        }
        Ok(())
    }
}
