//! Communicators: how a rank passes its KV block around the ring.
//!
//! One trait, [`Communicator`]; [`ThreadComm`] connects ranks that are
//! threads of one process through channels (tests, one machine). MPI
//! (processes, machines) and NCCL (GPUs) implement the same trait later.

use std::sync::mpsc::{channel, Receiver, Sender};

use crate::error::RingError;

/// One rank's link in a ring of `cp_size` ranks: it sends to rank
/// `(cp_rank + 1) % cp_size` and receives from `(cp_rank + cp_size - 1) %
/// cp_size`. Blocks are flat element vectors; both sides know their
/// shapes.
pub trait Communicator<T>: Send {
    /// This rank, `< cp_size`.
    fn cp_rank(&self) -> usize;
    /// Ranks in the ring.
    fn cp_size(&self) -> usize;
    /// Starts sending `block` to the next rank; returns without waiting
    /// for it to be received, so the caller can compute meanwhile.
    ///
    /// Errors: [`RingError::Communication`] when the next rank is gone.
    fn send_next(&mut self, block: Vec<T>) -> Result<(), RingError>;
    /// Waits for the next block from the previous rank (blocks arrive in
    /// the order they were sent).
    ///
    /// Errors: [`RingError::Communication`] when the previous rank is gone
    /// (it failed or returned early), instead of waiting forever.
    fn recv_prev(&mut self) -> Result<Vec<T>, RingError>;
}

/// In-process ring: rank `r` is the `r`-th value of [`ThreadComm::ring`],
/// moved to its own thread. Sends never block (unbounded channels).
pub struct ThreadComm<T> {
    cp_rank: usize,
    cp_size: usize,
    to_next: Sender<Vec<T>>,
    from_prev: Receiver<Vec<T>>,
}

impl<T: Send> ThreadComm<T> {
    /// The `cp_size` connected ranks, rank `r` at index `r`.
    ///
    /// Errors: [`RingError::InvalidArgument`] when `cp_size` is 0.
    pub fn ring(cp_size: usize) -> Result<Vec<Self>, RingError> {
        if cp_size == 0 {
            return Err(RingError::InvalidArgument {
                arg: "cp_size",
                reason: "must be at least 1".into(),
            });
        }
        // Channel r carries blocks from rank r to rank r + 1.
        let (senders, mut receivers): (Vec<_>, Vec<_>) = (0..cp_size).map(|_| channel()).unzip();
        receivers.rotate_right(1);
        Ok(senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(cp_rank, (to_next, from_prev))| ThreadComm {
                cp_rank,
                cp_size,
                to_next,
                from_prev,
            })
            .collect())
    }
}

impl<T: Send> Communicator<T> for ThreadComm<T> {
    fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    fn cp_size(&self) -> usize {
        self.cp_size
    }

    fn send_next(&mut self, block: Vec<T>) -> Result<(), RingError> {
        self.to_next
            .send(block)
            .map_err(|_| RingError::Communication {
                cp_rank: self.cp_rank,
                reason: format!("rank {} is gone", (self.cp_rank + 1) % self.cp_size),
            })
    }

    fn recv_prev(&mut self) -> Result<Vec<T>, RingError> {
        self.from_prev.recv().map_err(|_| RingError::Communication {
            cp_rank: self.cp_rank,
            reason: format!(
                "rank {} is gone",
                (self.cp_rank + self.cp_size - 1) % self.cp_size
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_go_round_the_ring() {
        let ring = ThreadComm::<usize>::ring(3).unwrap();
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = ring
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut seen = vec![c.cp_rank()];
                        let mut block = vec![c.cp_rank()];
                        for _ in 1..c.cp_size() {
                            c.send_next(block).unwrap();
                            block = c.recv_prev().unwrap();
                            seen.push(block[0]);
                        }
                        seen
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![vec![0, 2, 1], vec![1, 0, 2], vec![2, 1, 0]]);
    }

    #[test]
    fn a_departed_peer_is_an_error_not_a_hang() {
        let mut ring = ThreadComm::<u8>::ring(2).unwrap();
        let mut rank1 = ring.pop().unwrap();
        drop(ring);
        assert!(matches!(
            rank1.recv_prev(),
            Err(RingError::Communication { cp_rank: 1, .. })
        ));
        assert!(rank1.send_next(vec![1]).is_err());
    }
}
