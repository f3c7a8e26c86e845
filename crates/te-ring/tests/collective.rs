//! Collectives and failure propagation on thread rings of 1-6 ranks:
//! results against hand-computed values and naive references (the inputs
//! themselves, a fold for the minimum); mismatched calls and aborted or
//! killed ranks fail every rank, naming the rank where it started, with
//! a timeout instead of a hang.

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use te_ring::{agree, all_gather, all_reduce_min, Block, Communicator, RingError, ThreadComm};

/// Longest a rank may take to report; far beyond what any case needs.
const PATIENCE: Duration = Duration::from_secs(20);

/// Runs `f(rank's communicator)` on each rank of a fresh `cp`-rank ring,
/// each on its own thread; the results indexed by rank. Panics (fails the
/// test) when a rank does not report within [`PATIENCE`]. Communicators
/// live until every rank reported, so no rank sees a peer leave early.
fn on_ring<R: Send + 'static>(
    cp: usize,
    f: impl Fn(&mut ThreadComm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let f = Arc::new(f);
    let (tx, rx) = channel();
    for mut comm in ThreadComm::ring(cp).unwrap() {
        let (tx, f) = (tx.clone(), f.clone());
        std::thread::spawn(move || {
            let rank = comm.cp_rank();
            let r = f(&mut comm);
            let _ = tx.send((rank, r, comm));
        });
    }
    let mut results: Vec<Option<R>> = (0..cp).map(|_| None).collect();
    let mut comms = Vec::new();
    for _ in 0..cp {
        let (rank, r, comm) = rx
            .recv_timeout(PATIENCE)
            .expect("a rank hung: no result within the timeout");
        results[rank] = Some(r);
        comms.push(comm);
    }
    results.into_iter().map(Option::unwrap).collect()
}

/// Asserts every result is a communication error on its own rank.
fn all_fail<T: std::fmt::Debug>(results: &[Result<T, RingError>], case: &str) {
    for (r, res) in results.iter().enumerate() {
        assert!(
            matches!(res, Err(RingError::Communication { cp_rank, .. }) if *cp_rank == r),
            "{case}: rank {r}: {res:?}"
        );
    }
}

#[test]
fn all_gather_by_hand() {
    let inputs: Vec<Vec<u32>> = vec![vec![1], vec![2, 3], vec![], vec![4, 5, 6]];
    let got = on_ring(4, {
        let inputs = inputs.clone();
        move |c| all_gather(c, "lengths", &[7], &inputs[c.cp_rank()]).unwrap()
    });
    for g in got {
        assert_eq!(g, vec![vec![1], vec![2, 3], vec![], vec![4, 5, 6]]);
    }
    // One rank: itself, no communication.
    let got = on_ring(1, |c| all_gather(c, "x", &[], &[1.5f32, 2.5]).unwrap());
    assert_eq!(got, vec![vec![vec![1.5f32, 2.5]]]);
}

#[test]
fn all_reduce_min_by_hand() {
    let inputs: Vec<Vec<u64>> = vec![vec![5, 1, 9], vec![3, 7, 9], vec![4, 4, 0]];
    let got = on_ring(3, move |c| {
        let mut v = inputs[c.cp_rank()].clone();
        all_reduce_min(c, "budget", &mut v).unwrap();
        v
    });
    assert_eq!(got, vec![vec![3, 1, 0]; 3]);
    let got = on_ring(1, |c| {
        let mut v = vec![8, u64::MAX];
        all_reduce_min(c, "budget", &mut v).unwrap();
        v
    });
    assert_eq!(got, vec![vec![8, u64::MAX]]);
}

#[test]
fn agree_accepts_equal_words_and_names_the_first_rank_that_differs() {
    for cp in 1..=6 {
        let got = on_ring(cp, |c| agree(c, "settings", &[1, 2, 3]));
        assert!(got.iter().all(Result::is_ok), "cp {cp}: {got:?}");
    }
    // Ranks 2 and 4 of 5 differ (rank 2 in word 1): all name rank 2.
    let got = on_ring(5, |c| {
        let words: &[u64] = match c.cp_rank() {
            2 => &[6, 7],
            4 => &[6],
            _ => &[6, 6],
        };
        agree(c, "settings", words)
    });
    for (r, res) in got.iter().enumerate() {
        let want = format!(
            "ring_attention: rank {r}: rank 2 runs other settings: word 1 is 7 where rank 0 has 6"
        );
        assert_eq!(res.as_ref().unwrap_err().to_string(), want);
    }
    // Rank 0 is the odd one out: rank 1 is the first to differ from it,
    // here by length.
    let got = on_ring(3, |c| {
        let words: &[u64] = if c.cp_rank() == 0 { &[1, 2] } else { &[1] };
        agree(c, "model digest", words)
    });
    for res in &got {
        let err = res.as_ref().unwrap_err().to_string();
        assert!(
            err.ends_with("rank 1 runs other model digest: it has 1 words where rank 0 has 2"),
            "{err}"
        );
    }
}

#[test]
fn mismatched_calls_fail_every_rank() {
    for cp in 2..=6 {
        for odd in 0..cp {
            let case = format!("cp {cp}, odd rank {odd}");
            // Another op, other words, another element size.
            let got = on_ring(cp, move |c| {
                let op = if c.cp_rank() == odd { "b" } else { "a" };
                all_gather(c, op, &[1], &[1u32])
            });
            all_fail(&got, &format!("{case}, op"));
            let got = on_ring(cp, move |c| {
                let w = if c.cp_rank() == odd { 2 } else { 1 };
                all_gather(c, "a", &[w], &[1u32])
            });
            all_fail(&got, &format!("{case}, words"));
            let got = on_ring(cp, move |c| {
                if c.cp_rank() == odd {
                    all_gather(c, "a", &[1], &[1u16, 0]).map(drop)
                } else {
                    all_gather(c, "a", &[1], &[1u32]).map(drop)
                }
            });
            all_fail(&got, &format!("{case}, element type"));
            // A minimum over another length, and another collective.
            let got = on_ring(cp, move |c| {
                let mut v = vec![1u64; if c.cp_rank() == odd { 3 } else { 2 }];
                all_reduce_min(c, "a", &mut v)
            });
            all_fail(&got, &format!("{case}, length"));
            let got = on_ring(cp, move |c| {
                let mut v = vec![1u64];
                if c.cp_rank() == odd {
                    all_reduce_min(c, "a", &mut v)
                } else {
                    all_gather(c, "a", &[], &v).map(drop)
                }
            });
            all_fail(&got, &format!("{case}, collective"));
            // After the failure, the next (matching) call fails too.
            let got = on_ring(cp, move |c| {
                let op = if c.cp_rank() == odd { "b" } else { "a" };
                let first = agree(c, op, &[]);
                assert!(first.is_err());
                agree(c, "a", &[])
            });
            all_fail(&got, &format!("{case}, after the failure"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn all_gather_returns_every_ranks_input(
        inputs in prop::collection::vec(prop::collection::vec(any::<u16>(), 0..20), 1..=6),
        words in prop::collection::vec(any::<u64>(), 0..4),
    ) {
        let cp = inputs.len();
        let got = on_ring(cp, {
            let inputs = inputs.clone();
            move |c| all_gather(c, "gather", &words, &inputs[c.cp_rank()]).unwrap()
        });
        for g in got {
            prop_assert_eq!(&g, &inputs);
        }
    }

    #[test]
    fn all_reduce_min_is_the_elementwise_minimum(
        (len, inputs) in (0..12usize).prop_flat_map(|len| {
            (Just(len), prop::collection::vec(prop::collection::vec(any::<u64>(), len), 1..=6))
        }),
    ) {
        let cp = inputs.len();
        // Naive reference: the minimum of column i over all rows.
        let want: Vec<u64> = (0..len)
            .map(|i| inputs.iter().map(|row| row[i]).fold(u64::MAX, u64::min))
            .collect();
        let got = on_ring(cp, move |c| {
            let mut v = inputs[c.cp_rank()].clone();
            all_reduce_min(c, "min", &mut v).unwrap();
            v
        });
        for g in got {
            prop_assert_eq!(&g, &want);
        }
    }

    /// Rank `victim` aborts (or is killed: its communicator dropped) before
    /// step `at` of a send/receive loop that every other rank keeps
    /// running; each other rank fails, naming the victim and its reason,
    /// instead of finishing or hanging.
    #[test]
    fn every_peer_of_a_failed_rank_names_it(
        cp in 2..=6usize,
        victim in 0..6usize,
        at in 0..4usize,
        kill: bool,
    ) {
        let victim = victim % cp;
        // Rank victim + j can receive at most at + j - 1 blocks.
        let steps = at + cp + 2;
        let got = on_ring(cp, move |c| -> Result<bool, RingError> {
            let r = c.cp_rank();
            for step in 0..steps {
                if r == victim && step == at {
                    if kill {
                        // As if the thread died: its links hang up.
                        *c = ThreadComm::ring(1).unwrap().pop().unwrap();
                    } else {
                        c.abort_with("chaos");
                    }
                    return Ok(false);
                }
                let block = c
                    .send_next(Block::from_slice(step as u64, &[r as u32]))
                    .and_then(|()| c.recv_prev(usize::MAX));
                match block {
                    Ok(b) => assert_eq!(b.tag, step as u64, "rank {r}"),
                    Err(e) => {
                        c.abort_with(&e.to_string());
                        return Err(e);
                    }
                }
            }
            Ok(true)
        });
        let reason = if kill { "it left the ring" } else { "chaos" };
        for (r, res) in got.iter().enumerate() {
            if r == victim {
                prop_assert!(matches!(res, Ok(false)));
                continue;
            }
            let want = format!("ring_attention: rank {r}: rank {victim} failed: {reason}");
            match res {
                Err(e) => prop_assert_eq!(e.to_string(), want),
                Ok(_) => prop_assert!(false, "rank {} finished its loop", r),
            }
        }
    }
}
