//! [`RingAttention`]: attention over sequences sharded across ranks.
//!
//! Each rank holds its zigzag shard of Q, K and V ([`crate::Zigzag`]). At
//! step `s` of `cp_size`, a rank holds the KV block of rank
//! `src = (cp_rank + cp_size - s) % cp_size`: it first sends that block on
//! to the next rank,
//! then attends each of its two query chunks to each of the block's two
//! key chunks, and merges the partial outputs in f32 by log-sum-exp
//! ([`te_attention::merge_partial`]; Liu et al. 2023, "Ring Attention with
//! Blockwise Transformers"; Brandon et al. 2023, "Striped Attention", for
//! the load balance). Chunks hold whole aligned position ranges, so under a
//! causal mask a (query chunk, key chunk) pair is either entirely visible
//! (earlier key chunk: no mask), the diagonal (same chunk: causal), or
//! entirely in the future (skipped without computing).

use te_attention::{
    merge_partial, merge_row, AttnMaskType, AttnMetadata, AttnOutput, DotProductAttention, KvInput,
};
use te_kernels::{Element, QkvFormat};

use crate::comm::{abort_on_error, call_tag, Block, Communicator};
use crate::error::RingError;
use crate::layout::Zigzag;

/// Ring attention: a [`DotProductAttention`] configuration applied to
/// sequences whose tokens are split across `cp_size` ranks.
///
/// Supported: self-attention (`sq == skv` per sequence) with `no_mask` /
/// `padding` or a causal mask (`causal`, `padding_causal` and their
/// bottom-right variants, which coincide for self-attention); GQA/MQA,
/// `d_qk != d_v`, softcap and `softmax_scale` as configured. Shards are
/// always thd (the configuration's formats are replaced), and `padding`
/// is `no_mask` here (thd has no padding). Sliding windows `(left,
/// right)` are in positions: the query at position `p` sees keys
/// `p - left ..= p + right` (`right` 0 under a causal mask; -1 unbounded).
/// Without a window (a causal mask alone included), every chunk pair of
/// all sequences is one batched attention call; with one, each sequence's
/// pair is its own call, with the window shifted to the chunks' positions.
/// Window sides beyond 2^40 are treated as that (unbounded in effect).
#[derive(Clone, Debug)]
pub struct RingAttention {
    attn: DotProductAttention,
    causal: bool,
    /// `(left, right)` with causal's right = 0; `None` when unbounded.
    window: Option<(i64, i64)>,
}

/// What one (query chunk, key chunk) pair needs.
#[derive(Clone, Copy, PartialEq)]
enum Pair {
    Full,
    Diagonal,
    Future,
}

/// The tokens of one chunk slot (first or second chunk of every
/// sequence), packed thd.
struct Slot {
    cu: Vec<i32>,
    rows: usize,
}

/// The operands of one chunk pair: Q rows of a slot and its layout, K and
/// V rows of a slot of the block and their layout.
struct Parts<'a, T> {
    q: (&'a [T], &'a Slot),
    k: &'a [T],
    v: &'a [T],
    kv: &'a Slot,
}

impl RingAttention {
    /// Errors: [`RingError::Attention`] for an invalid configuration
    /// (see [`DotProductAttention::validate`]).
    pub fn new(attn: DotProductAttention) -> Result<Self, RingError> {
        attn.validate()?;
        let causal = attn.attn_mask_type.is_causal();
        // Sides past any sequence (positions fit i32 cu_seqlens) are
        // unbounded in effect; the clamp keeps the band arithmetic of
        // `windowed_pair` free of overflow.
        const EDGE: i64 = 1 << 40;
        let (left, right) = attn.window_size.unwrap_or((-1, -1));
        let left = if left >= 0 { left.min(EDGE) } else { -1 };
        let right = if causal {
            0
        } else if right >= 0 {
            right.min(EDGE)
        } else {
            -1
        };
        // A causal mask's right side of 0 is not a window.
        let window = (left >= 0 || (!causal && right >= 0)).then_some((left, right));
        let attn = attn
            .with_formats(QkvFormat::Thd, QkvFormat::Thd)
            .with_window_size(-1, -1);
        Ok(RingAttention {
            attn,
            causal,
            window,
        })
    }

    /// One rank's part of the forward; every rank of `comm`'s ring calls it
    /// with the same `seqlens` at the same time.
    ///
    /// - `seqlens`: full length of each sequence (all ranks together).
    /// - `q`: `[t, h_q, d_qk]`, `k`: `[t, h_kv, d_qk]`, `v`: `[t, h_kv,
    ///   d_v]`: this rank's zigzag shard (thd, `t` = the sum of
    ///   [`Zigzag::local_cu_seqlens`]).
    /// - `output`: `out: [t, h_q, d_v]`; `lse`: optional `[h_q, t]` f32,
    ///   natural log, -inf where a query sees no key
    ///   ([`Zigzag::unshard_lse`] reassembles the full `[h_q, total]`).
    ///
    /// Results equal single-rank attention over the full sequences (f32:
    /// within rounding of the merge).
    ///
    /// Errors: [`RingError::ShapeMismatch`] naming the tensor whose length
    /// disagrees with `seqlens`; [`RingError::InvalidArgument`] for a
    /// communicator whose rank is not below its size;
    /// [`RingError::Communication`] when a peer fails, or runs a different
    /// call (other `seqlens`, heads, dims, mask, scale, softcap or dtype);
    /// [`RingError::Attention`] from a block's attention. Nothing is
    /// written to `out`/`lse` then, and `comm` is aborted
    /// ([`Communicator::abort_with`] the error) so that no peer waits for
    /// this rank or falls out of step with it; their errors name the rank
    /// where the failure started.
    pub fn forward_cpu<T: Element, O: Element>(
        &self,
        comm: &mut (impl Communicator + ?Sized),
        seqlens: &[usize],
        q: &[T],
        k: &[T],
        v: &[T],
        output: AttnOutput<'_, O>,
    ) -> Result<(), RingError> {
        let result = self.forward_inner(comm, seqlens, q, k, v, output);
        abort_on_error(comm, result)
    }

    /// The tag of a forward: every argument the ranks must agree on.
    fn tag<T: Element>(&self, seqlens: &[usize]) -> u64 {
        let a = &self.attn;
        let config = [
            a.num_attention_heads as u64,
            a.num_gqa_groups as u64,
            a.head_dim_qk as u64,
            a.head_dim_v as u64,
            u64::from(self.causal),
            u64::from(a.effective_softmax_scale().to_bits()),
            a.softcap.map_or(u64::MAX, |c| u64::from(c.to_bits())),
            T::DTYPE.size_in_bytes() as u64 * 10 + T::DTYPE as u64,
            self.window.map_or(u64::MAX, |(l, _)| l as u64),
            self.window.map_or(u64::MAX, |(_, r)| r as u64),
            seqlens.len() as u64,
        ];
        call_tag(
            "ring_attention",
            config.into_iter().chain(seqlens.iter().map(|&n| n as u64)),
        )
    }

    fn forward_inner<T: Element, O: Element>(
        &self,
        comm: &mut (impl Communicator + ?Sized),
        seqlens: &[usize],
        q: &[T],
        k: &[T],
        v: &[T],
        AttnOutput { out, lse }: AttnOutput<'_, O>,
    ) -> Result<(), RingError> {
        let a = &self.attn;
        let (hq, hkv, dqk, dv) = (
            a.num_attention_heads,
            a.num_gqa_groups,
            a.head_dim_qk,
            a.head_dim_v,
        );
        let (cp_rank, cp_size) = (comm.cp_rank(), comm.cp_size());
        let z = Zigzag::new(cp_size)?;
        z.chunk_ids(cp_rank)?;
        let tag = self.tag::<T>(seqlens);
        let t = z
            .local_cu_seqlens(seqlens, cp_rank)?
            .last()
            .copied()
            .unwrap_or(0) as usize;
        for (arg, got, width) in [
            ("q", q.len(), hq * dqk),
            ("k", k.len(), hkv * dqk),
            ("v", v.len(), hkv * dv),
            ("out", out.len(), hq * dv),
        ] {
            if got != t * width {
                return Err(RingError::ShapeMismatch {
                    arg,
                    expected: t * width,
                    got,
                });
            }
        }
        if let Some(l) = lse.as_deref() {
            if l.len() != hq * t {
                return Err(RingError::ShapeMismatch {
                    arg: "lse",
                    expected: hq * t,
                    got: l.len(),
                });
            }
        }

        let my_slots = slots(&z, seqlens, cp_rank);
        let q_parts: [Vec<T>; 2] = [0, 1].map(|s| gather(q, hq * dqk, &z, seqlens, cp_rank, s));
        let mut acc_out: [Vec<f32>; 2] = [0, 1].map(|s| vec![0.0; my_slots[s].rows * hq * dv]);
        let mut acc_lse: [Vec<f32>; 2] =
            [0, 1].map(|s| vec![f32::NEG_INFINITY; my_slots[s].rows * hq]);

        // The block travelling round the ring: its holder's K then V.
        let mut block = Block::from_slice(tag, &[k, v].concat());
        for step in 0..cp_size {
            let src = (cp_rank + cp_size - step) % cp_size;
            let src_t = z
                .local_cu_seqlens(seqlens, src)?
                .last()
                .copied()
                .unwrap_or(0) as usize;
            if block.tag != tag || block.data.len() != src_t * hkv * (dqk + dv) * size_of::<T>() {
                return Err(RingError::Communication {
                    cp_rank,
                    reason: format!(
                        "the block of rank {src} belongs to another call: the ranks' seqlens, \
                         heads, dims, mask, scale, softcap or dtype differ"
                    ),
                });
            }
            let kv: Vec<T> = block.to_vec(cp_rank)?;
            if step + 1 < cp_size {
                let data = std::mem::take(&mut block.data);
                comm.send_next(Block { tag, data })?;
            }
            let (k_src, v_src) = kv.split_at(src_t * hkv * dqk);
            let kv_slots = slots(&z, seqlens, src);
            let k_parts: [Vec<T>; 2] =
                [0, 1].map(|s| gather(k_src, hkv * dqk, &z, seqlens, src, s));
            let v_parts: [Vec<T>; 2] = [0, 1].map(|s| gather(v_src, hkv * dv, &z, seqlens, src, s));
            for qs in 0..2 {
                for ks in 0..2 {
                    let parts = Parts {
                        q: (&q_parts[qs], &my_slots[qs]),
                        k: &k_parts[ks],
                        v: &v_parts[ks],
                        kv: &kv_slots[ks],
                    };
                    let (acc_out, acc_lse) = (&mut acc_out[qs], &mut acc_lse[qs]);
                    match self.window {
                        Some(window) => {
                            let chunks = |n: usize| {
                                (z.ranges(n, cp_rank)[qs].start, z.ranges(n, src)[ks].start)
                            };
                            self.windowed_pair(window, seqlens, chunks, parts, acc_out, acc_lse)?
                        }
                        None => {
                            let pair = self.pair(z.ids(cp_rank)[qs], z.ids(src)[ks]);
                            self.batched_pair(pair, seqlens.len(), parts, acc_out, acc_lse)?
                        }
                    }
                }
            }
            if step + 1 < cp_size {
                // The next block is the K and V of the rank before `src`.
                let next = (src + cp_size - 1) % cp_size;
                let next_t = z
                    .local_cu_seqlens(seqlens, next)?
                    .last()
                    .copied()
                    .unwrap_or(0) as usize;
                block = comm.recv_prev(next_t * hkv * (dqk + dv) * size_of::<T>())?;
            }
        }

        // Scatter the two slots back into the shard's order.
        let mut lse = lse;
        let mut row = 0;
        let mut slot_row = [0usize; 2];
        for &n in seqlens {
            for (s, r) in z.ranges(n, cp_rank).into_iter().enumerate() {
                for _ in r {
                    let src = &acc_out[s][slot_row[s] * hq * dv..][..hq * dv];
                    for (d, &x) in out[row * hq * dv..][..hq * dv].iter_mut().zip(src) {
                        *d = O::from_f32(x);
                    }
                    if let Some(l) = lse.as_deref_mut() {
                        for h in 0..hq {
                            l[h * t + row] = acc_lse[s][h * my_slots[s].rows + slot_row[s]];
                        }
                    }
                    row += 1;
                    slot_row[s] += 1;
                }
            }
        }
        Ok(())
    }

    /// One (query chunk, key chunk) pair without a window, all `batch`
    /// sequences in one attention call: no mask for an earlier key chunk,
    /// causal on the diagonal, nothing for a future one.
    fn batched_pair<T: Element>(
        &self,
        pair: Pair,
        batch: usize,
        parts: Parts<'_, T>,
        acc_out: &mut [f32],
        acc_lse: &mut [f32],
    ) -> Result<(), RingError> {
        let (q, q_slot) = parts.q;
        if pair == Pair::Future || q_slot.rows == 0 || parts.kv.rows == 0 {
            return Ok(());
        }
        let mask = if pair == Pair::Diagonal {
            AttnMaskType::Causal
        } else {
            AttnMaskType::NoMask
        };
        let a = &self.attn;
        let (hq, dv) = (a.num_attention_heads, a.head_dim_v);
        let meta = AttnMetadata {
            batch,
            max_seqlen_q: max_len(&q_slot.cu),
            max_seqlen_kv: max_len(&parts.kv.cu),
            cu_seqlens_q: Some(&q_slot.cu),
            cu_seqlens_kv: Some(&parts.kv.cu),
        };
        let mut part_out = vec![0f32; q_slot.rows * hq * dv];
        let mut part_lse = vec![0f32; q_slot.rows * hq];
        a.clone().with_attn_mask_type(mask).forward_cpu(
            q,
            KvInput::Tensors {
                k: parts.k,
                v: parts.v,
            },
            &meta,
            &mut part_out,
            Some(&mut part_lse),
        )?;
        merge_partial(acc_out, acc_lse, &part_out, &part_lse, hq, dv)?;
        Ok(())
    }

    /// One (query chunk, key chunk) pair under a sliding window, sequence
    /// by sequence: `chunks(n)` gives the first positions of the query and
    /// key chunks of a sequence of `n` tokens. In local indices query `i`
    /// sees keys `i + D - left ..= i + D + right`, `D` = query chunk start
    /// minus key chunk start. Keys past the last visible one are dropped
    /// (`k1`) and queries that see no key at all are left out (`q1`); then
    /// `DotProductAttention`'s bottom-right window `(k1 - q1 - D + left,
    /// D + right - k1 + q1)` over `q1` queries and `k1` keys is that band.
    fn windowed_pair<T: Element>(
        &self,
        (left, right): (i64, i64),
        seqlens: &[usize],
        chunks: impl Fn(usize) -> (usize, usize),
        parts: Parts<'_, T>,
        acc_out: &mut [f32],
        acc_lse: &mut [f32],
    ) -> Result<(), RingError> {
        let a = &self.attn;
        let (hq, hkv, dqk, dv) = (
            a.num_attention_heads,
            a.num_gqa_groups,
            a.head_dim_qk,
            a.head_dim_v,
        );
        let (q_all, q_slot) = parts.q;
        let t = q_slot.rows;
        let attn = a.clone().with_attn_mask_type(AttnMaskType::NoMask);
        for (b, &n) in seqlens.iter().enumerate() {
            let (q0, q_end) = (q_slot.cu[b] as usize, q_slot.cu[b + 1] as usize);
            let (k0, k_end) = (parts.kv.cu[b] as usize, parts.kv.cu[b + 1] as usize);
            let (nq, nk) = ((q_end - q0) as i64, (k_end - k0) as i64);
            let (q_start, k_start) = chunks(n);
            let d = q_start as i64 - k_start as i64;
            // Queries whose lowest visible key is past the chunk see nothing.
            let q1 = if left >= 0 { nq.min(nk - d + left) } else { nq };
            // Keys past the last query's highest visible key are never seen.
            let k1 = if right >= 0 {
                nk.min(q1 + d + right)
            } else {
                nk
            };
            if q1 <= 0 || k1 <= 0 {
                continue;
            }
            let window = (
                if left >= 0 { k1 - q1 - d + left } else { -1 },
                if right >= 0 { d + right - k1 + q1 } else { -1 },
            );
            let (q1, k1) = (q1 as usize, k1 as usize);
            let attn = attn.clone().with_window_size(window.0, window.1);
            let (cu_q, cu_kv) = ([0, q1 as i32], [0, k1 as i32]);
            let meta = AttnMetadata {
                batch: 1,
                max_seqlen_q: q1,
                max_seqlen_kv: k1,
                cu_seqlens_q: Some(&cu_q),
                cu_seqlens_kv: Some(&cu_kv),
            };
            let mut part_out = vec![0f32; q1 * hq * dv];
            let mut part_lse = vec![0f32; q1 * hq];
            attn.forward_cpu(
                &q_all[q0 * hq * dqk..(q0 + q1) * hq * dqk],
                KvInput::Tensors {
                    k: &parts.k[k0 * hkv * dqk..(k0 + k1) * hkv * dqk],
                    v: &parts.v[k0 * hkv * dv..(k0 + k1) * hkv * dv],
                },
                &meta,
                &mut part_out,
                Some(&mut part_lse),
            )?;
            for i in 0..q1 {
                for h in 0..hq {
                    merge_row(
                        &mut acc_out[((q0 + i) * hq + h) * dv..][..dv],
                        &mut acc_lse[h * t + q0 + i],
                        &part_out[(i * hq + h) * dv..][..dv],
                        part_lse[h * q1 + i],
                    );
                }
            }
        }
        Ok(())
    }

    /// How query chunk `qc` sees key chunk `kc`.
    fn pair(&self, qc: usize, kc: usize) -> Pair {
        if !self.causal || kc < qc {
            Pair::Full
        } else if kc == qc {
            Pair::Diagonal
        } else {
            Pair::Future
        }
    }
}

/// `cu_seqlens` and row count of slot `s` (first or second chunk of every
/// sequence) of rank `cp_rank`.
fn slots(z: &Zigzag, seqlens: &[usize], cp_rank: usize) -> [Slot; 2] {
    [0, 1].map(|s| {
        let mut cu = vec![0i32];
        let mut rows = 0;
        for &n in seqlens {
            rows += z.ranges(n, cp_rank)[s].len();
            cu.push(rows as i32);
        }
        Slot { cu, rows }
    })
}

/// The rows of slot `s` out of rank `cp_rank`'s shard `x` (`width`
/// elements per token), packed thd.
fn gather<T: Copy>(
    x: &[T],
    width: usize,
    z: &Zigzag,
    seqlens: &[usize],
    cp_rank: usize,
    s: usize,
) -> Vec<T> {
    let mut out = Vec::new();
    let mut row = 0;
    for &n in seqlens {
        let [a, b] = z.ranges(n, cp_rank);
        let lens = [a.len(), b.len()];
        let start = row + if s == 0 { 0 } else { lens[0] };
        out.extend_from_slice(&x[start * width..(start + lens[s]) * width]);
        row += lens[0] + lens[1];
    }
    out
}

/// Longest sequence of a `cu_seqlens`.
fn max_len(cu: &[i32]) -> usize {
    cu.windows(2)
        .map(|w| (w[1] - w[0]) as usize)
        .max()
        .unwrap_or(0)
}
