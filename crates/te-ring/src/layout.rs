//! The load-balanced zigzag layout of context parallelism (docs/ARCHITECTURE.md, "Context parallelism").
//!
//! With `cp_size` ranks, a sequence of `n` tokens is cut into `2 * cp_size`
//! chunks of `c = ceil(n / (2 * cp_size))` positions (the last ones shorter
//! or empty when `n` does not divide: that padding is never stored). Rank
//! `r` holds chunks `r` and `2 * cp_size - 1 - r`, so under a causal mask
//! every rank has the same amount of work: 12 tokens on 2 ranks, rank 0
//! holds positions 0, 1, 2, 9, 10, 11 and rank 1 positions 3..9.
//!
//! A rank's shard of a thd tensor holds, for each sequence in order, the
//! rows of its first chunk and then of its second, packed (thd, with
//! [`Zigzag::local_cu_seqlens`]). When `n` divides by `2 * cp_size` this is
//! the layout `te_kernels::RopeArgs` assumes with `cp_size`/`cp_rank`
//! (TransformerEngine's); otherwise apply RoPE per chunk with
//! [`Zigzag::chunks`] as the start positions.

use std::ops::Range;

use crate::error::RingError;

/// Most ranks [`Zigzag`] accepts.
pub const MAX_CP_SIZE: usize = 1 << 16;

/// Zigzag sharding over `cp_size` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Zigzag {
    cp_size: usize,
}

impl Zigzag {
    /// Errors: [`RingError::InvalidArgument`] when `cp_size` is 0 or above
    /// [`MAX_CP_SIZE`].
    pub fn new(cp_size: usize) -> Result<Self, RingError> {
        if cp_size == 0 || cp_size > MAX_CP_SIZE {
            return Err(RingError::InvalidArgument {
                arg: "cp_size",
                reason: format!("{cp_size}: must be in 1..={MAX_CP_SIZE}"),
            });
        }
        Ok(Zigzag { cp_size })
    }

    /// Ranks.
    pub fn cp_size(&self) -> usize {
        self.cp_size
    }

    /// Chunk length `ceil(seq_len / (2 * cp_size))`.
    pub fn chunk_len(&self, seq_len: usize) -> usize {
        seq_len.div_ceil(2 * self.cp_size)
    }

    /// Positions of chunk `chunk` of a sequence of `seq_len` tokens; empty
    /// past the end (and for `chunk >= 2 * cp_size`).
    pub fn chunk(&self, seq_len: usize, chunk: usize) -> Range<usize> {
        let c = self.chunk_len(seq_len);
        let start = chunk.saturating_mul(c).min(seq_len);
        start..chunk.saturating_add(1).saturating_mul(c).min(seq_len)
    }

    /// The chunk indices rank `cp_rank` holds, in storage order.
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_rank >= cp_size`.
    pub fn chunk_ids(&self, cp_rank: usize) -> Result<[usize; 2], RingError> {
        self.check_rank(cp_rank)?;
        Ok(self.ids(cp_rank))
    }

    /// The two position ranges rank `cp_rank` holds of a sequence of
    /// `seq_len` tokens, in storage order (the first precedes the second).
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_rank >= cp_size`.
    pub fn chunks(&self, seq_len: usize, cp_rank: usize) -> Result<[Range<usize>; 2], RingError> {
        self.check_rank(cp_rank)?;
        Ok(self.ranges(seq_len, cp_rank))
    }

    /// Tokens rank `cp_rank` holds of a sequence of `seq_len` tokens.
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_rank >= cp_size`.
    pub fn local_len(&self, seq_len: usize, cp_rank: usize) -> Result<usize, RingError> {
        self.check_rank(cp_rank)?;
        Ok(self.len_of(seq_len, cp_rank))
    }

    /// `cu_seqlens` (int32, `[b + 1]`) of rank `cp_rank`'s shard.
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_rank >= cp_size` or
    /// the total does not fit an i32.
    pub fn local_cu_seqlens(
        &self,
        seqlens: &[usize],
        cp_rank: usize,
    ) -> Result<Vec<i32>, RingError> {
        self.check_rank(cp_rank)?;
        let mut cu = Vec::with_capacity(seqlens.len() + 1);
        let mut total = 0usize;
        cu.push(0);
        for &n in seqlens {
            total = total.saturating_add(self.len_of(n, cp_rank));
            cu.push(
                i32::try_from(total).map_err(|_| RingError::InvalidArgument {
                    arg: "seqlens",
                    reason: format!("more than {} local tokens (i32 cu_seqlens)", i32::MAX),
                })?,
            );
        }
        Ok(cu)
    }

    /// Rank `cp_rank`'s shard of a full thd tensor `full: [sum(seqlens),
    /// width]` (`width` elements per token, e.g. `heads * head_dim`).
    ///
    /// Errors: [`RingError::ShapeMismatch`] when `full` is not
    /// `sum(seqlens) * width` long; [`RingError::InvalidArgument`] for a
    /// bad rank.
    pub fn shard<T: Copy>(
        &self,
        full: &[T],
        width: usize,
        seqlens: &[usize],
        cp_rank: usize,
    ) -> Result<Vec<T>, RingError> {
        self.check_rank(cp_rank)?;
        let expected = seqlens
            .iter()
            .try_fold(0usize, |a, &n| a.checked_add(n))
            .and_then(|t| t.checked_mul(width));
        if expected != Some(full.len()) {
            return Err(RingError::ShapeMismatch {
                arg: "full",
                expected: expected.unwrap_or(usize::MAX),
                got: full.len(),
            });
        }
        let mut out = Vec::new();
        let mut start = 0;
        for &n in seqlens {
            for r in self.ranges(n, cp_rank) {
                out.extend_from_slice(&full[(start + r.start) * width..(start + r.end) * width]);
            }
            start += n;
        }
        Ok(out)
    }

    /// The full thd tensor from every rank's shard (`shards[r]`: rank
    /// `r`'s, as [`Zigzag::shard`] makes it).
    ///
    /// Errors: [`RingError::InvalidArgument`] when there are not
    /// `cp_size` shards; [`RingError::ShapeMismatch`] when a shard's
    /// length disagrees with `seqlens`. Checked before allocating.
    pub fn unshard<T: Copy + Default>(
        &self,
        shards: &[&[T]],
        width: usize,
        seqlens: &[usize],
    ) -> Result<Vec<T>, RingError> {
        if shards.len() != self.cp_size {
            return Err(RingError::InvalidArgument {
                arg: "shards",
                reason: format!("{} shards for cp_size {}", shards.len(), self.cp_size),
            });
        }
        for (rank, shard) in shards.iter().enumerate() {
            let expected = seqlens
                .iter()
                .try_fold(0usize, |a, &n| a.checked_add(self.len_of(n, rank)))
                .and_then(|t| t.checked_mul(width));
            if expected != Some(shard.len()) {
                return Err(RingError::ShapeMismatch {
                    arg: "shards",
                    expected: expected.unwrap_or(usize::MAX),
                    got: shard.len(),
                });
            }
        }
        // Every token is in exactly one shard, so this is the shards' total.
        let mut full = vec![T::default(); shards.iter().map(|s| s.len()).sum()];
        for (rank, shard) in shards.iter().enumerate() {
            let mut local = 0;
            let mut start = 0;
            for &n in seqlens {
                for r in self.ranges(n, rank) {
                    let rows = r.len() * width;
                    full[(start + r.start) * width..][..rows]
                        .copy_from_slice(&shard[local..local + rows]);
                    local += rows;
                }
                start += n;
            }
        }
        Ok(full)
    }

    /// The full lse `[num_heads, sum(seqlens)]` from every rank's
    /// `[num_heads, t_r]` (the layout of [`crate::RingAttention`]'s lse).
    ///
    /// Errors: as [`Zigzag::unshard`]; [`RingError::InvalidArgument`] for
    /// 0 heads.
    pub fn unshard_lse(
        &self,
        shards: &[&[f32]],
        num_heads: usize,
        seqlens: &[usize],
    ) -> Result<Vec<f32>, RingError> {
        if num_heads == 0 {
            return Err(RingError::InvalidArgument {
                arg: "num_heads",
                reason: "must be > 0".into(),
            });
        }
        // [h, t_r] -> [t_r, h] per rank, unshard by token, -> [h, t].
        let token_major: Vec<Vec<f32>> = shards
            .iter()
            .map(|s| {
                let t = s.len() / num_heads;
                (0..t * num_heads)
                    .map(|x| s[(x % num_heads) * t + x / num_heads])
                    .collect()
            })
            .collect();
        for (s, tm) in shards.iter().zip(&token_major) {
            if s.len() != tm.len() {
                return Err(RingError::ShapeMismatch {
                    arg: "shards",
                    expected: tm.len(),
                    got: s.len(),
                });
            }
        }
        let refs: Vec<&[f32]> = token_major.iter().map(Vec::as_slice).collect();
        let full = self.unshard(&refs, num_heads, seqlens)?;
        let t = full.len() / num_heads;
        Ok((0..full.len())
            .map(|x| full[(x % t) * num_heads + x / t])
            .collect())
    }

    fn check_rank(&self, cp_rank: usize) -> Result<(), RingError> {
        if cp_rank >= self.cp_size {
            return Err(RingError::InvalidArgument {
                arg: "cp_rank",
                reason: format!("{cp_rank} with cp_size {}", self.cp_size),
            });
        }
        Ok(())
    }

    /// [`Zigzag::chunk_ids`] of a checked rank.
    pub(crate) fn ids(&self, cp_rank: usize) -> [usize; 2] {
        [cp_rank, 2 * self.cp_size - 1 - cp_rank]
    }

    /// [`Zigzag::chunks`] of a checked rank.
    pub(crate) fn ranges(&self, seq_len: usize, cp_rank: usize) -> [Range<usize>; 2] {
        self.ids(cp_rank).map(|c| self.chunk(seq_len, c))
    }

    /// [`Zigzag::local_len`] of a checked rank.
    pub(crate) fn len_of(&self, seq_len: usize, cp_rank: usize) -> usize {
        self.ranges(seq_len, cp_rank).iter().map(|r| r.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_example_twelve_tokens_on_two_ranks() {
        let z = Zigzag::new(2).unwrap();
        assert_eq!(z.chunks(12, 0).unwrap(), [0..3, 9..12]);
        assert_eq!(z.chunks(12, 1).unwrap(), [3..6, 6..9]);
    }

    #[test]
    fn lengths_that_do_not_divide_leave_the_padding_out() {
        let z = Zigzag::new(2).unwrap();
        // c = ceil(5 / 4) = 2: chunks 0..2, 2..4, 4..5, 5..5 (padding).
        assert_eq!(z.chunks(5, 0).unwrap(), [0..2, 5..5]);
        assert_eq!(z.chunks(5, 1).unwrap(), [2..4, 4..5]);
        assert_eq!(
            z.local_cu_seqlens(&[5, 12, 0, 1], 0).unwrap(),
            vec![0, 2, 8, 8, 9]
        );
        assert_eq!(
            z.local_cu_seqlens(&[5, 12, 0, 1], 1).unwrap(),
            vec![0, 3, 9, 9, 9]
        );
    }

    #[test]
    fn shard_then_unshard_is_the_identity() {
        let seqlens = [7, 1, 0, 16, 9];
        let width = 3;
        let total: usize = seqlens.iter().sum();
        let full: Vec<u32> = (0..(total * width) as u32).collect();
        for cp in 1..=4 {
            let z = Zigzag::new(cp).unwrap();
            let shards: Vec<Vec<u32>> = (0..cp)
                .map(|r| z.shard(&full, width, &seqlens, r).unwrap())
                .collect();
            let lens: usize = shards.iter().map(Vec::len).sum();
            assert_eq!(lens, full.len(), "cp {cp}: every token held once");
            let refs: Vec<&[u32]> = shards.iter().map(Vec::as_slice).collect();
            assert_eq!(z.unshard(&refs, width, &seqlens).unwrap(), full, "cp {cp}");
        }
    }

    #[test]
    fn unshard_lse_transposes_per_rank() {
        let z = Zigzag::new(2).unwrap();
        let (h, seqlens) = (2usize, [5usize, 3]);
        // Full lse [h, t] with value 10 h + t.
        let full: Vec<f32> = (0..h * 8).map(|x| (10 * (x / 8) + x % 8) as f32).collect();
        let shards: Vec<Vec<f32>> = (0..2)
            .map(|r| {
                // Rank r's tokens, in shard order, then [h, t_r].
                let mut tokens = Vec::new();
                let mut start = 0;
                for &n in &seqlens {
                    for range in z.chunks(n, r).unwrap() {
                        tokens.extend(range.map(|p| start + p));
                    }
                    start += n;
                }
                (0..h)
                    .flat_map(|hh| tokens.iter().map(move |&t| (10 * hh + t) as f32))
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = shards.iter().map(Vec::as_slice).collect();
        assert_eq!(z.unshard_lse(&refs, h, &seqlens).unwrap(), full);
    }

    #[test]
    fn huge_sizes_are_errors_not_crashes() {
        let z = Zigzag::new(3).unwrap();
        let empty: [&[f32]; 3] = [&[], &[], &[]];
        assert!(matches!(
            z.unshard(&empty, 1, &[1 << 40, 3]),
            Err(RingError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            z.unshard(&empty, 1, &[usize::MAX]),
            Err(RingError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            z.shard::<f32>(&[], 2, &[1 << 63], 0),
            Err(RingError::ShapeMismatch { .. })
        ));
        assert!(matches!(
            z.shard::<f32>(&[0.0; 16], 1, &[usize::MAX / 2, usize::MAX / 2 + 2], 0),
            Err(RingError::ShapeMismatch { .. })
        ));
        assert_eq!(z.chunk(usize::MAX, 3).len(), usize::MAX.div_ceil(6));
        assert!(z.chunk(10, 1 << 62).is_empty());
        assert!(z.local_cu_seqlens(&[usize::MAX], 0).is_err());
        assert!(Zigzag::new(usize::MAX / 2 + 1).is_err());
        assert!(z.chunk_ids(3).is_err() && z.chunks(4, 5).is_err() && z.local_len(4, 3).is_err());
    }

    #[test]
    fn bad_arguments_are_named() {
        assert!(matches!(
            Zigzag::new(0),
            Err(RingError::InvalidArgument { arg: "cp_size", .. })
        ));
        let z = Zigzag::new(2).unwrap();
        assert!(matches!(
            z.shard(&[0u8; 5], 1, &[4], 0),
            Err(RingError::ShapeMismatch { arg: "full", .. })
        ));
        assert!(matches!(
            z.local_cu_seqlens(&[4], 2),
            Err(RingError::InvalidArgument { arg: "cp_rank", .. })
        ));
        assert!(matches!(
            z.unshard::<u8>(&[&[0; 2]], 1, &[4]),
            Err(RingError::InvalidArgument { arg: "shards", .. })
        ));
    }
}
