//! Collectives over a [`Communicator`] ring: [`all_gather`],
//! [`all_reduce_min`] and [`agree`].
//!
//! Every rank calls them in the same order. Each call tags its blocks
//! with [`call_tag`] of its kind, `op`, `words` and whatever lengths must
//! match, so a rank running a different call is a
//! [`RingError::Communication`] on every rank, never mixed data; on any
//! error the call aborts the communicator with the error's text (as ring
//! attention does), so the peers fail too, naming the rank where the
//! failure started.
//!
//! Each is a ring all-gather: `cp_size - 1` steps, at step `s` a rank
//! forwards the block it received at step `s - 1` (its own at step 0)
//! and receives the block of rank `(cp_rank + cp_size - s - 1) %
//! cp_size`. Every rank ends with the same values, in rank order.

use crate::comm::{abort_on_error, call_tag, neighbours, Block, Communicator};
use crate::error::RingError;

/// Every rank's `local` (lengths may differ per rank), indexed by rank,
/// on every rank. Ring all-gather: `cp_size - 1` steps.
///
/// `op` and `words` name the call (e.g. `"kv_lengths"`, `[layer]`); every
/// rank must pass the same ones and the same `T` (its size is part of the
/// tag).
///
/// Errors: [`RingError::InvalidArgument`] for a communicator whose rank is
/// not below its size; [`RingError::Communication`] when a peer fails or
/// runs a different call. `comm` is aborted then.
pub fn all_gather<T: bytemuck::Pod>(
    comm: &mut (impl Communicator + ?Sized),
    op: &str,
    words: &[u64],
    local: &[T],
) -> Result<Vec<Vec<T>>, RingError> {
    let tag = call_tag(
        op,
        [KIND_ALL_GATHER, size_of::<T>() as u64, words.len() as u64]
            .into_iter()
            .chain(words.iter().copied()),
    );
    let result = gather(comm, tag, local, None, "op or words");
    abort_on_error(comm, result)
}

/// Element-wise minimum over ranks of `values` (same length on every
/// rank), written to `values` on every rank.
///
/// Errors: [`RingError::InvalidArgument`] for a communicator whose rank is
/// not below its size; [`RingError::Communication`] when a peer fails or
/// runs a different call (another `op` or length). `values` is unchanged
/// and `comm` aborted then.
pub fn all_reduce_min(
    comm: &mut (impl Communicator + ?Sized),
    op: &str,
    values: &mut [u64],
) -> Result<(), RingError> {
    let tag = call_tag(op, [KIND_ALL_REDUCE_MIN, values.len() as u64]);
    let result = gather(comm, tag, values, Some(values.len()), "op or length");
    let all = abort_on_error(comm, result)?;
    for (i, v) in values.iter_mut().enumerate() {
        *v = all.iter().map(|r| r[i]).min().unwrap_or(*v);
    }
    Ok(())
}

/// Checks that every rank passes the same `words` (settings, model
/// digest, prompt digest); `what` describes them ("settings").
///
/// Errors: [`RingError::Communication`] on every rank, naming the first
/// rank whose words differ from rank 0's, e.g. "rank 1 runs other
/// settings: word 2 is 5 where rank 0 has 4"; also when a peer fails or
/// runs a different call (another `what`). [`RingError::InvalidArgument`]
/// for a communicator whose rank is not below its size. `comm` is aborted
/// then.
pub fn agree(
    comm: &mut (impl Communicator + ?Sized),
    what: &str,
    words: &[u64],
) -> Result<(), RingError> {
    let tag = call_tag(what, [KIND_AGREE]);
    let result = gather(comm, tag, words, None, "description").and_then(|all| {
        let cp_rank = comm.cp_rank();
        match all.iter().enumerate().find(|(_, w)| *w != &all[0]) {
            None => Ok(()),
            Some((r, w)) => Err(RingError::Communication {
                cp_rank,
                reason: format!("rank {r} runs other {what}: {}", difference(w, &all[0])),
            }),
        }
    });
    abort_on_error(comm, result)
}

/// Kinds of collective, the first word of their tags.
const KIND_ALL_GATHER: u64 = 1;
const KIND_ALL_REDUCE_MIN: u64 = 2;
const KIND_AGREE: u64 = 3;

/// How `words` differ from rank 0's `first`.
fn difference(words: &[u64], first: &[u64]) -> String {
    match words.iter().zip(first).position(|(a, b)| a != b) {
        Some(i) => format!("word {i} is {} where rank 0 has {}", words[i], first[i]),
        None => format!(
            "it has {} words where rank 0 has {}",
            words.len(),
            first.len()
        ),
    }
}

/// The largest block an all-gather of blocks of unknown length (and
/// [`agree`]) accepts from a peer: they carry descriptions and small
/// shards; ring attention's KV blocks are bounded by its plan instead.
const MAX_GATHER_BYTES: usize = 64 << 20;

/// The ring all-gather under `tag`; `len`, when given, is the element
/// count every block must have. `differs` names what a tag mismatch means
/// for the caller.
fn gather<T: bytemuck::Pod>(
    comm: &mut (impl Communicator + ?Sized),
    tag: u64,
    local: &[T],
    len: Option<usize>,
    differs: &str,
) -> Result<Vec<Vec<T>>, RingError> {
    let (cp_rank, cp_size) = (comm.cp_rank(), comm.cp_size());
    if cp_rank >= cp_size {
        return Err(RingError::InvalidArgument {
            arg: "comm",
            reason: format!("cp_rank {cp_rank} with cp_size {cp_size}"),
        });
    }
    let mut all: Vec<Vec<T>> = vec![Vec::new(); cp_size];
    all[cp_rank] = local.to_vec();
    let mut block = Block::from_slice(tag, local);
    for step in 0..cp_size - 1 {
        comm.send_next(block)?;
        block = comm.recv_prev(len.map_or(MAX_GATHER_BYTES, |n| n * size_of::<T>()))?;
        let src = (cp_rank + cp_size - step - 1) % cp_size;
        let error = |reason: String| RingError::Communication { cp_rank, reason };
        if block.tag != tag {
            return Err(error(format!(
                "the block of rank {src} (from rank {}) belongs to another call: the ranks' \
                 {differs} differ",
                neighbours(cp_rank, cp_size).1
            )));
        }
        let values: Vec<T> = block.to_vec(cp_rank)?;
        if let Some(n) = len.filter(|&n| n != values.len()) {
            return Err(error(format!(
                "the block of rank {src} has {} values, expected {n}",
                values.len()
            )));
        }
        all[src] = values;
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_name_the_first_word() {
        assert_eq!(
            difference(&[1, 5], &[1, 4]),
            "word 1 is 5 where rank 0 has 4"
        );
        assert_eq!(
            difference(&[1], &[1, 4]),
            "it has 1 words where rank 0 has 2"
        );
    }
}
