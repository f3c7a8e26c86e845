//! [`all_merge`]: combine per-rank partial attention results into the
//! result over every rank's keys, on every rank.
//!
//! This is decode (or any step whose queries every rank holds) with the KV
//! cache split across ranks: each rank runs `DotProductAttention` on its
//! own keys with `lse` on and f32 output (thd Q; a padding or no_mask mask
//! when every held key precedes the queries; a bottom-right causal mask
//! only on the rank holding the newest keys, since it aligns the last
//! query with that rank's last key), then `all_merge` gathers the partials
//! round the ring and merges them by log-sum-exp (docs/ARCHITECTURE.md, "Context parallelism"). Every rank merges
//! in rank order 0, 1, .., so all ranks get bit-identical results (their
//! samplers stay in step).

use te_attention::merge_partial;

use crate::comm::{abort_on_error, call_tag, Block, Communicator};
use crate::error::RingError;

/// Replaces this rank's partial `(out, lse)` with the merge of every
/// rank's partial.
///
/// - `out`: `[t, num_heads, head_dim_v]` f32, normalized over this rank's
///   keys (0 where it has none); `lse`: `[num_heads, t]`, natural log,
///   -inf where this rank has no visible key: the thd outputs of
///   `DotProductAttention::forward_cpu` with `O = f32`. `t` is the same on
///   every rank.
///
/// Errors: [`RingError::InvalidArgument`] for 0 heads or head dim, or a
/// communicator whose rank is not below its size;
/// [`RingError::ShapeMismatch`] when `out` and `lse` disagree with the
/// heads; [`RingError::Communication`] when a peer fails or runs a
/// different call (another `t`, heads or head dim). Nothing is written
/// then, and `comm` is aborted ([`Communicator::abort_with`] the error),
/// so every peer fails too, naming the rank where the failure started.
pub fn all_merge(
    comm: &mut (impl Communicator + ?Sized),
    out: &mut [f32],
    lse: &mut [f32],
    num_heads: usize,
    head_dim_v: usize,
) -> Result<(), RingError> {
    let result = merge_inner(comm, out, lse, num_heads, head_dim_v);
    abort_on_error(comm, result)
}

fn merge_inner(
    comm: &mut (impl Communicator + ?Sized),
    out: &mut [f32],
    lse: &mut [f32],
    num_heads: usize,
    head_dim_v: usize,
) -> Result<(), RingError> {
    for (arg, n) in [("num_heads", num_heads), ("head_dim_v", head_dim_v)] {
        if n == 0 {
            return Err(RingError::InvalidArgument {
                arg,
                reason: "must be > 0".into(),
            });
        }
    }
    if !lse.len().is_multiple_of(num_heads) {
        return Err(RingError::ShapeMismatch {
            arg: "lse",
            expected: lse.len().next_multiple_of(num_heads),
            got: lse.len(),
        });
    }
    let t = lse.len() / num_heads;
    if out.len() != t * num_heads * head_dim_v {
        return Err(RingError::ShapeMismatch {
            arg: "out",
            expected: t * num_heads * head_dim_v,
            got: out.len(),
        });
    }
    let (cp_rank, cp_size) = (comm.cp_rank(), comm.cp_size());
    if cp_rank >= cp_size {
        return Err(RingError::InvalidArgument {
            arg: "comm",
            reason: format!("cp_rank {cp_rank} with cp_size {cp_size}"),
        });
    }
    let tag = call_tag("all_merge", [t as u64, num_heads as u64, head_dim_v as u64]);
    // Gather: after step s this rank holds the partial of cp_rank - s.
    let mut partials: Vec<Option<Vec<f32>>> = vec![None; cp_size];
    let mine: Vec<f32> = out.iter().chain(lse.iter()).copied().collect();
    let mut block = Block::from_slice(tag, &mine);
    partials[cp_rank] = Some(mine);
    for step in 1..cp_size {
        comm.send_next(block)?;
        block = comm.recv_prev((out.len() + lse.len()) * size_of::<f32>())?;
        let src = (cp_rank + cp_size - step) % cp_size;
        if block.tag != tag || block.data.len() != (out.len() + lse.len()) * size_of::<f32>() {
            return Err(RingError::Communication {
                cp_rank,
                reason: format!(
                    "the partial of rank {src} belongs to another call \
                     (the ranks' token counts, heads or head dims differ)"
                ),
            });
        }
        partials[src] = Some(block.to_vec(cp_rank)?);
    }
    // Merge in rank order.
    let mut acc_out = vec![0f32; out.len()];
    let mut acc_lse = vec![f32::NEG_INFINITY; lse.len()];
    for p in partials.iter().flatten() {
        let (p_out, p_lse) = p.split_at(out.len());
        merge_partial(
            &mut acc_out,
            &mut acc_lse,
            p_out,
            p_lse,
            num_heads,
            head_dim_v,
        )?;
    }
    out.copy_from_slice(&acc_out);
    lse.copy_from_slice(&acc_lse);
    Ok(())
}
