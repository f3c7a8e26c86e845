//! [`all_merge`]: combine per-rank partial attention results into the
//! result over every rank's keys, on every rank.
//!
//! This is decode (or any step whose queries every rank holds) with the KV
//! cache split across ranks: each rank runs `DotProductAttention` on its
//! own keys with `lse` on, then `all_merge` gathers the partials round the
//! ring and merges them by log-sum-exp (DESIGN.md §6). Every rank merges
//! in rank order 0, 1, .., so all ranks get bit-identical results (their
//! samplers stay in step).

use te_attention::merge_partial;

use crate::comm::Communicator;
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
/// Errors: [`RingError::InvalidArgument`] for 0 heads;
/// [`RingError::ShapeMismatch`] when `out` and `lse` disagree with the
/// heads; [`RingError::Communication`] when a peer fails or sends
/// a partial of another size; nothing is written then.
pub fn all_merge(
    comm: &mut impl Communicator<f32>,
    out: &mut [f32],
    lse: &mut [f32],
    num_heads: usize,
    head_dim_v: usize,
) -> Result<(), RingError> {
    if num_heads == 0 {
        return Err(RingError::InvalidArgument {
            arg: "num_heads",
            reason: "must be > 0".into(),
        });
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
    // Gather: after step s this rank holds the partial of cp_rank - s.
    let mut partials: Vec<Option<Vec<f32>>> = vec![None; cp_size];
    let mine: Vec<f32> = out.iter().chain(lse.iter()).copied().collect();
    let mut block = mine.clone();
    partials[cp_rank] = Some(mine);
    for step in 1..cp_size {
        comm.send_next(block)?;
        block = comm.recv_prev()?;
        if block.len() != out.len() + lse.len() {
            return Err(RingError::Communication {
                cp_rank,
                reason: format!(
                    "partial of rank {} has {} elements, expected {}",
                    (cp_rank + cp_size - step) % cp_size,
                    block.len(),
                    out.len() + lse.len()
                ),
            });
        }
        partials[(cp_rank + cp_size - step) % cp_size] = Some(block.clone());
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
