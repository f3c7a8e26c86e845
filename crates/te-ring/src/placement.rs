//! Where the new tokens of context-parallel generation live: which rank
//! computes and which stores each token of a step (docs/ARCHITECTURE.md,
//! "Context parallelism"). Pure bookkeeping: no model, no communication.
//!
//! Every rank keeps its own [`Placement`] and feeds it the same steps in
//! the same order, so every rank places every token alike:
//! - a step of `n > 1` new tokens of a sequence (a prompt chunk) is split
//!   in the zigzag layout of the chunk ([`Zigzag`]: of its `2 cp_size`
//!   chunks, rank `r` takes chunks `r` and `2 cp_size - 1 - r`), each rank
//!   computing and storing only its tokens;
//! - a single new token (decode) is computed by every rank (replicated) and
//!   stored by the rank holding the fewest of the sequence's tokens (the
//!   lowest such rank), so the shards stay balanced.
//!
//! A step is [`Placement::place`]d (nothing changes), its shard checked and
//! planned by each rank's cache with [`Placement::local_steps`], then
//! [`Placement::commit`]ted; [`Placement::release`] forgets a sequence.
//!
//! ```
//! use te_ring::Placement;
//!
//! // Rank 0 of 2: a 12-token prompt, then a decode token.
//! let mut p = Placement::new(2, 0)?;
//! let placed = p.place(&[(7, 12)]);
//! assert_eq!(p.local_steps(&placed), [(7, 6)]);
//! p.commit(placed);
//! assert_eq!(p.positions(7), [0, 1, 2, 9, 10, 11]);
//! let placed = p.place(&[(7, 1)]);
//! assert_eq!(placed[0].owner(), Some(0)); // 6 and 6 held: the lowest rank
//! p.commit(placed);
//! assert_eq!(p.held(7), [7, 6]);
//! p.release(7);
//! assert_eq!(p.held_tokens(), 0);
//! # Ok::<(), te_ring::RingError>(())
//! ```

use std::collections::HashMap;
use std::ops::Range;

use crate::error::RingError;
use crate::layout::Zigzag;

/// One rank's placement of a context-parallel group's tokens: how many
/// tokens of each sequence every rank holds, the positions this rank
/// holds, and the step committed last (see the module doc).
#[derive(Clone, Debug)]
pub struct Placement {
    zigzag: Zigzag,
    cp_rank: usize,
    seqs: HashMap<u64, Held>,
    /// The committed step.
    step: Vec<Placed>,
}

/// Where one sequence's tokens live.
#[derive(Clone, Debug, Default)]
struct Held {
    /// Tokens each rank holds.
    per_rank: Vec<usize>,
    /// Positions of this rank's tokens, in cache order (increasing).
    positions: Vec<i32>,
}

/// One sequence's new tokens in a step, placed ([`Placement::place`]).
#[derive(Clone, Debug, PartialEq, Eq)]
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

impl Placed {
    /// The sequence.
    pub fn seq_id(&self) -> u64 {
        self.seq_id
    }

    /// Position of the first new token: the tokens all ranks held before
    /// the step.
    pub fn start(&self) -> usize {
        self.start
    }

    /// New tokens.
    pub fn len(&self) -> usize {
        self.n
    }

    /// No new token.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// A single new token (decode): `Some(rank that stores it)`; every rank
    /// computes it. `None`: the tokens are split in the zigzag layout.
    pub fn owner(&self) -> Option<usize> {
        self.owner
    }

    /// Whether the tokens are split in the zigzag layout (not replicated).
    pub fn is_sharded(&self) -> bool {
        self.owner.is_none()
    }
}

impl Placement {
    /// Rank `cp_rank` of a group of `cp_size`, holding nothing.
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_size` is 0 or above
    /// [`crate::layout::MAX_CP_SIZE`], or `cp_rank >= cp_size`.
    pub fn new(cp_size: usize, cp_rank: usize) -> Result<Self, RingError> {
        let zigzag = Zigzag::new(cp_size)?;
        zigzag.chunk_ids(cp_rank)?;
        Ok(Placement {
            zigzag,
            cp_rank,
            seqs: HashMap::new(),
            step: Vec::new(),
        })
    }

    /// Ranks in the group.
    pub fn cp_size(&self) -> usize {
        self.zigzag.cp_size()
    }

    /// This rank.
    pub fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    /// Places the new tokens of `steps` (`(seq_id, n)` in step order, the
    /// same on every rank), without committing.
    pub fn place(&self, steps: &[(u64, usize)]) -> Vec<Placed> {
        let cp = self.cp_size();
        steps
            .iter()
            .map(|&(seq_id, n)| {
                let held = self.seqs.get(&seq_id).map(|s| s.per_rank.as_slice());
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
    /// its cache (te-cache's `InferenceParams::pre_step_shard`; entries
    /// may be 0).
    pub fn local_steps(&self, placed: &[Placed]) -> Vec<(u64, usize)> {
        let r = self.cp_rank;
        placed
            .iter()
            .map(|p| (p.seq_id, self.stored_by(p, r).iter().map(Range::len).sum()))
            .collect()
    }

    /// Records a placed step whose cache step this rank has committed; it
    /// becomes [`Placement::step`].
    pub fn commit(&mut self, placed: Vec<Placed>) {
        let (cp, r) = (self.cp_size(), self.cp_rank);
        for p in &placed {
            let ranges: Vec<Vec<Range<usize>>> = (0..cp).map(|q| self.stored_by(p, q)).collect();
            let held = self.seqs.entry(p.seq_id).or_default();
            held.per_rank.resize(cp, 0);
            for (q, rs) in ranges.iter().enumerate() {
                held.per_rank[q] += rs.iter().map(Range::len).sum::<usize>();
            }
            for range in &ranges[r] {
                held.positions
                    .extend(range.clone().map(|i| (p.start + i) as i32));
            }
        }
        self.step = placed;
    }

    /// Forgets a sequence (released from the cache), also from the
    /// committed step.
    pub fn release(&mut self, seq_id: u64) {
        self.seqs.remove(&seq_id);
        self.step.retain(|p| p.seq_id != seq_id);
    }

    /// The step committed last (less the sequences released since).
    pub fn step(&self) -> &[Placed] {
        &self.step
    }

    /// Tokens this rank holds, all sequences together.
    pub fn held_tokens(&self) -> usize {
        self.seqs.values().map(|s| s.positions.len()).sum()
    }

    /// Tokens of `seq_id` each rank holds, indexed by rank (empty for a
    /// sequence with nothing committed).
    pub fn held(&self, seq_id: u64) -> &[usize] {
        self.seqs.get(&seq_id).map_or(&[], |s| &s.per_rank)
    }

    /// Positions of the tokens of `seq_id` this rank holds, in cache order
    /// (increasing; i32 as te-attention's `Positions` takes them).
    pub fn positions(&self, seq_id: u64) -> &[i32] {
        self.seqs.get(&seq_id).map_or(&[], |s| &s.positions)
    }

    /// Offsets (within the step's new tokens) of `p`'s tokens that rank `r`
    /// stores; none for a rank outside the group.
    pub fn stored_by(&self, p: &Placed, r: usize) -> Vec<Range<usize>> {
        match p.owner {
            Some(o) if o == r => std::iter::once(0..1).collect(),
            Some(_) => Vec::new(),
            None => self.computed_by(p, r),
        }
    }

    /// Offsets of `p`'s tokens that rank `r` computes, non-empty runs in
    /// increasing order; none for a rank outside the group.
    pub fn computed_by(&self, p: &Placed, r: usize) -> Vec<Range<usize>> {
        if r >= self.cp_size() {
            return Vec::new();
        }
        match p.owner {
            Some(_) => std::iter::once(0..1).collect(),
            None => self
                .zigzag
                .ranges(p.n, r)
                .into_iter()
                .filter(|c| !c.is_empty())
                .collect(),
        }
    }

    /// The rank whose hidden state gives `p`'s logits: the one that
    /// computes its last new token (rank 0 for a replicated one, and for
    /// no new token).
    pub fn last_row_rank(&self, p: &Placed) -> usize {
        match p.owner {
            Some(_) => 0,
            None => (0..self.cp_size())
                .find(|&r| {
                    self.computed_by(p, r)
                        .iter()
                        .any(|c| c.contains(&(p.n.wrapping_sub(1))))
                })
                .unwrap_or(0),
        }
    }

    /// Rows (of the whole step, `placed` packed in order) of the
    /// zigzag-split sequences that rank `r` computes, in its order: the
    /// layout of the queries it shares; none for a rank outside the group.
    pub fn sharded_rows(&self, placed: &[Placed], r: usize) -> Vec<usize> {
        let mut rows = Vec::new();
        if r >= self.cp_size() {
            return rows;
        }
        let mut row0 = 0;
        for p in placed {
            if p.owner.is_none() {
                for c in self.zigzag.ranges(p.n, r) {
                    rows.extend(c.map(|i| row0 + i));
                }
            }
            row0 += p.n;
        }
        rows
    }
}
