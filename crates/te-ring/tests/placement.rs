//! `Placement`, the bookkeeping of context-parallel generation, on 1-6
//! ranks run in lockstep over random steps and releases, against a model
//! kept here: every rank places alike, every new token is stored by
//! exactly one rank (computed by one, or by all for a decode token), a
//! prompt chunk lands in the zigzag layout of docs/ARCHITECTURE.md
//! ("Context parallelism") written out here from its formula, a decode
//! token goes to the least-loaded rank (the lowest such), and releases
//! return every count to zero.

use std::collections::BTreeMap;

use proptest::prelude::*;
use te_ring::{Placed, Placement, RingError};

/// One step: sequences with their new tokens, then sequences released.
#[derive(Clone, Debug)]
struct Step {
    feed: Vec<(u64, usize)>,
    release: Vec<u64>,
}

fn step() -> impl Strategy<Value = Step> {
    // Decode tokens (1) as often as prompt chunks; ids unique in a step.
    let n = prop_oneof![Just(1usize), 2usize..40, Just(0usize)];
    (
        prop::collection::btree_map(0u64..5, n, 0..4),
        prop::collection::vec(0u64..5, 0..2),
    )
        .prop_map(|(feed, release)| Step {
            feed: feed.into_iter().collect(),
            release,
        })
}

/// Offsets of a chunk of `n` new tokens that rank `r` of `cp` stores in
/// the zigzag layout, in cache order, from the design's formula: chunks
/// of `c = ceil(n / (2 cp))`, rank `r` holding chunks `r` and
/// `2 cp - 1 - r`.
fn zigzag_offsets(n: usize, cp: usize, r: usize) -> Vec<usize> {
    let c = n.div_ceil(2 * cp).max(1);
    let chunk = |k: usize| (k * c).min(n)..((k + 1) * c).min(n);
    chunk(r).chain(chunk(2 * cp - 1 - r)).collect()
}

fn flat(ranges: &[std::ops::Range<usize>]) -> Vec<usize> {
    ranges.iter().flat_map(|r| r.clone()).collect()
}

/// Runs `steps` on every rank of a `cp`-rank group, checking each step.
fn run(cp: usize, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut ranks: Vec<Placement> = (0..cp).map(|r| Placement::new(cp, r).unwrap()).collect();
    // The model: tokens of each sequence held by each rank.
    let mut held: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for s in steps {
        let placed = ranks[0].place(&s.feed);
        for p in &ranks[1..] {
            prop_assert_eq!(&p.place(&s.feed), &placed, "every rank places alike");
        }
        prop_assert_eq!(placed.len(), s.feed.len());
        let mut row0 = 0;
        let mut sharded_rows = Vec::new();
        for (p, &(seq_id, n)) in placed.iter().zip(&s.feed) {
            let before = held.get(&seq_id).cloned().unwrap_or_else(|| vec![0; cp]);
            prop_assert_eq!(p.seq_id(), seq_id);
            prop_assert_eq!(p.len(), n);
            prop_assert_eq!(p.start(), before.iter().sum::<usize>());
            let stored: Vec<Vec<usize>> =
                (0..cp).map(|r| flat(&ranks[0].stored_by(p, r))).collect();
            let computed: Vec<Vec<usize>> =
                (0..cp).map(|r| flat(&ranks[0].computed_by(p, r))).collect();
            if n == 1 {
                // The least-loaded rank, the lowest such.
                let min = *before.iter().min().unwrap();
                let owner = before.iter().position(|&h| h == min).unwrap();
                prop_assert_eq!(p.owner(), Some(owner));
                prop_assert!(!p.is_sharded());
                for r in 0..cp {
                    prop_assert_eq!(&computed[r], &vec![0], "every rank computes a decode token");
                    let mine = if r == owner { vec![0] } else { vec![] };
                    prop_assert_eq!(&stored[r], &mine);
                }
                prop_assert_eq!(ranks[0].last_row_rank(p), 0);
            } else {
                prop_assert_eq!(p.owner(), None);
                prop_assert!(p.is_sharded());
                for r in 0..cp {
                    prop_assert_eq!(&stored[r], &zigzag_offsets(n, cp, r), "rank {}", r);
                    prop_assert_eq!(&computed[r], &stored[r]);
                    sharded_rows.push(computed[r].iter().map(|i| row0 + i).collect::<Vec<_>>());
                }
                if n > 0 {
                    let last = ranks[0].last_row_rank(p);
                    prop_assert!(computed[last].contains(&(n - 1)));
                }
            }
            // Every new token stored by exactly one rank.
            let mut all: Vec<usize> = stored.concat();
            all.sort_unstable();
            prop_assert_eq!(all, (0..n).collect::<Vec<_>>());
            for (r, rank) in ranks.iter().enumerate() {
                prop_assert_eq!(rank.stored_by(p, r + cp), vec![], "outside the group");
            }
            row0 += n;
        }
        // Rows of the sharded sequences: each once, over all ranks.
        let mut union: Vec<usize> = Vec::new();
        for (r, rank) in ranks.iter().enumerate() {
            let rows = rank.sharded_rows(&placed, r);
            let want: Vec<usize> = sharded_rows
                .iter()
                .skip(r)
                .step_by(cp)
                .flatten()
                .copied()
                .collect();
            prop_assert_eq!(&rows, &want, "rank {}", r);
            union.extend(rows);
        }
        let count = union.len();
        union.sort_unstable();
        union.dedup();
        prop_assert_eq!(union.len(), count, "a sharded row on two ranks");

        // Each rank's cache step, then commit.
        for (r, rank) in ranks.iter_mut().enumerate() {
            let local = rank.local_steps(&placed);
            let want: Vec<(u64, usize)> = placed
                .iter()
                .map(|p| (p.seq_id(), flat(&rank.stored_by(p, r)).len()))
                .collect();
            prop_assert_eq!(local, want);
            rank.commit(placed.clone());
        }
        for p in &placed {
            let h = held.entry(p.seq_id()).or_insert_with(|| vec![0; cp]);
            for (r, c) in h.iter_mut().enumerate() {
                *c += flat(&ranks[0].stored_by(p, r)).len();
            }
        }
        let mut committed = placed;
        for &id in &s.release {
            for rank in &mut ranks {
                rank.release(id);
            }
            held.remove(&id);
            committed.retain(|p| p.seq_id() != id);
        }
        check_held(&ranks, &held, &committed)?;
    }
    // Releasing everything returns every count to zero.
    for id in 0..5 {
        for rank in &mut ranks {
            rank.release(id);
        }
    }
    for rank in &ranks {
        prop_assert_eq!(rank.held_tokens(), 0);
        prop_assert!(rank.step().is_empty());
        for id in 0..5 {
            prop_assert!(rank.held(id).is_empty() && rank.positions(id).is_empty());
        }
    }
    Ok(())
}

/// Every rank's counts agree with the model; each token of a sequence is
/// held by exactly one rank, at increasing positions.
fn check_held(
    ranks: &[Placement],
    held: &BTreeMap<u64, Vec<usize>>,
    committed: &[Placed],
) -> Result<(), TestCaseError> {
    for (r, rank) in ranks.iter().enumerate() {
        prop_assert_eq!(rank.step(), committed);
        let mut total = 0;
        for id in 0..5 {
            let want = held.get(&id).map_or(&[][..], Vec::as_slice);
            prop_assert_eq!(rank.held(id), want, "rank {}, sequence {}", r, id);
            let pos = rank.positions(id);
            prop_assert_eq!(pos.len(), want.get(r).copied().unwrap_or(0));
            prop_assert!(pos.windows(2).all(|w| w[0] < w[1]), "increasing");
            total += pos.len();
        }
        prop_assert_eq!(rank.held_tokens(), total);
    }
    for (&id, h) in held {
        let mut all: Vec<i32> = ranks
            .iter()
            .flat_map(|p| p.positions(id).to_vec())
            .collect();
        all.sort_unstable();
        let n: usize = h.iter().sum();
        prop_assert_eq!(all, (0..n as i32).collect::<Vec<_>>(), "sequence {}", id);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn every_token_is_placed_once_and_releases_return_to_zero(
        cp in 1usize..=6,
        steps in prop::collection::vec(step(), 1..12),
    ) {
        run(cp, &steps)?;
    }
}

#[test]
fn design_example_twelve_tokens_on_two_ranks() {
    let mut ranks: Vec<Placement> = (0..2).map(|r| Placement::new(2, r).unwrap()).collect();
    for rank in &mut ranks {
        let placed = rank.place(&[(3, 12)]);
        rank.commit(placed);
    }
    assert_eq!(ranks[0].positions(3), [0, 1, 2, 9, 10, 11]);
    assert_eq!(ranks[1].positions(3), [3, 4, 5, 6, 7, 8]);
    // A second chunk is zigzagged on its own, at its positions.
    for rank in &mut ranks {
        let placed = rank.place(&[(3, 4)]);
        assert_eq!(placed[0].start(), 12);
        rank.commit(placed);
    }
    assert_eq!(ranks[0].positions(3), [0, 1, 2, 9, 10, 11, 12, 15]);
    assert_eq!(ranks[1].positions(3), [3, 4, 5, 6, 7, 8, 13, 14]);
    // Decode tokens alternate once the counts are even.
    for owner in [0, 1, 0] {
        for rank in &mut ranks {
            let placed = rank.place(&[(3, 1)]);
            assert_eq!(placed[0].owner(), Some(owner));
            rank.commit(placed);
        }
    }
    assert_eq!(ranks[1].held(3), [10, 9]);
    assert_eq!(ranks[0].held_tokens(), 10);
}

#[test]
fn bad_groups_are_named() {
    assert!(matches!(
        Placement::new(0, 0),
        Err(RingError::InvalidArgument { arg: "cp_size", .. })
    ));
    assert!(matches!(
        Placement::new(2, 2),
        Err(RingError::InvalidArgument { arg: "cp_rank", .. })
    ));
}
