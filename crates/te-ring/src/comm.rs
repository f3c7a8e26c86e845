//! Communicators: how a rank passes blocks around the ring.
//!
//! One trait, [`Communicator`]; [`ThreadComm`] connects ranks that are
//! threads of one process through channels (tests, one machine). MPI
//! (processes, machines) and NCCL (GPUs) implement the same trait later.
//!
//! Every rank makes the same sequence of calls (ring forwards, merges)
//! with the same arguments. Each [`Block`] carries a tag naming its call,
//! so a rank that is running a different call is an error, not silently
//! mixed data; a rank whose call fails aborts its communicator, so its
//! peers fail too instead of waiting or falling out of step. After an
//! error the ring is unusable: build a new one.

use std::sync::mpsc::{channel, Receiver, Sender};

use crate::error::RingError;

/// A message round the ring.
#[derive(Clone, Debug, PartialEq)]
pub struct Block<T> {
    /// Digest of the call the block belongs to: the operation and every
    /// argument all ranks must agree on ([`call_tag`]).
    pub tag: u64,
    /// The payload (a KV block, a partial result); both sides know its
    /// shape.
    pub data: Vec<T>,
}

/// One rank's link in a ring of `cp_size` ranks: it sends to rank
/// `(cp_rank + 1) % cp_size` and receives from `(cp_rank + cp_size - 1) %
/// cp_size`, in order (blocks arrive in the order they were sent).
pub trait Communicator<T>: Send {
    /// This rank, `< cp_size`.
    fn cp_rank(&self) -> usize;
    /// Ranks in the ring.
    fn cp_size(&self) -> usize;
    /// Starts sending `block` to the next rank; returns without waiting
    /// for it to be received, so the caller can compute meanwhile.
    ///
    /// Errors: [`RingError::Communication`] when the next rank is gone or
    /// this communicator was aborted.
    fn send_next(&mut self, block: Block<T>) -> Result<(), RingError>;
    /// Waits for the next block from the previous rank.
    ///
    /// Errors: [`RingError::Communication`] when the previous rank is gone
    /// or aborted (a rank that is alive but never sends is waited for) or
    /// this communicator was aborted.
    fn recv_prev(&mut self) -> Result<Block<T>, RingError>;
    /// Gives up after an error: the neighbours' pending and later
    /// receives and sends fail, and so does every later call here.
    fn abort(&mut self);
}

/// `result`, after aborting `comm` if it is an error (what every ring
/// call does on failure, see the module doc).
pub(crate) fn abort_on_error<T, R>(
    comm: &mut impl Communicator<T>,
    result: Result<R, RingError>,
) -> Result<R, RingError> {
    if result.is_err() {
        comm.abort();
    }
    result
}

/// The tag of a call: FNV-1a over `words` (the operation's name bytes,
/// lengths, dims, flags), the same on every rank and every build.
pub fn call_tag(op: &str, words: impl IntoIterator<Item = u64>) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = op.bytes().map(u64::from).chain(
        words
            .into_iter()
            .flat_map(|w| w.to_le_bytes().map(u64::from)),
    );
    for b in bytes {
        h = (h ^ b).wrapping_mul(PRIME);
    }
    h
}

/// In-process ring: rank `r` is the `r`-th value of [`ThreadComm::ring`],
/// moved to its own thread. Sends never block (unbounded channels).
pub struct ThreadComm<T> {
    cp_rank: usize,
    cp_size: usize,
    /// Both `None` once aborted.
    to_next: Option<Sender<Block<T>>>,
    from_prev: Option<Receiver<Block<T>>>,
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
                to_next: Some(to_next),
                from_prev: Some(from_prev),
            })
            .collect())
    }

    fn error(&self, reason: String) -> RingError {
        RingError::Communication {
            cp_rank: self.cp_rank,
            reason,
        }
    }

    fn aborted(&self) -> RingError {
        self.error("this rank's ring was aborted after an error; build a new ring".into())
    }
}

impl<T: Send> Communicator<T> for ThreadComm<T> {
    fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    fn cp_size(&self) -> usize {
        self.cp_size
    }

    fn send_next(&mut self, block: Block<T>) -> Result<(), RingError> {
        let to_next = self.to_next.as_ref().ok_or_else(|| self.aborted())?;
        to_next.send(block).map_err(|_| {
            self.error(format!(
                "the next rank ({}) failed or left the ring",
                (self.cp_rank + 1) % self.cp_size
            ))
        })
    }

    fn recv_prev(&mut self) -> Result<Block<T>, RingError> {
        let from_prev = self.from_prev.as_ref().ok_or_else(|| self.aborted())?;
        from_prev.recv().map_err(|_| {
            self.error(format!(
                "the previous rank ({}) failed or left the ring",
                (self.cp_rank + self.cp_size - 1) % self.cp_size
            ))
        })
    }

    fn abort(&mut self) {
        self.to_next = None;
        self.from_prev = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(x: usize) -> Block<usize> {
        Block {
            tag: 7,
            data: vec![x],
        }
    }

    #[test]
    fn blocks_go_round_the_ring() {
        let ring = ThreadComm::<usize>::ring(3).unwrap();
        let got: Vec<Vec<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = ring
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut seen = vec![c.cp_rank()];
                        let mut b = block(c.cp_rank());
                        for _ in 1..c.cp_size() {
                            c.send_next(b).unwrap();
                            b = c.recv_prev().unwrap();
                            seen.push(b.data[0]);
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
    fn a_departed_or_aborted_peer_is_an_error_not_a_hang() {
        let mut ring = ThreadComm::<usize>::ring(3).unwrap();
        let mut rank2 = ring.pop().unwrap();
        let mut rank1 = ring.pop().unwrap();
        drop(ring);
        // Rank 0 is gone: rank 1 cannot receive, rank 2 cannot send.
        assert!(matches!(
            rank1.recv_prev(),
            Err(RingError::Communication { cp_rank: 1, .. })
        ));
        assert!(rank2.send_next(block(2)).is_err());
        // Rank 1 aborts: rank 2's receive fails, and rank 1 refuses work.
        rank1.abort();
        assert!(rank2.recv_prev().is_err());
        let err = rank1.send_next(block(1)).unwrap_err().to_string();
        assert!(err.contains("aborted"), "{err}");
    }

    #[test]
    fn tags_depend_on_every_word_and_the_operation() {
        let t = call_tag("op", [1, 2, 3]);
        assert_eq!(t, call_tag("op", [1, 2, 3]));
        assert_ne!(t, call_tag("op", [1, 3, 2]));
        assert_ne!(t, call_tag("op", [1, 2]));
        assert_ne!(t, call_tag("oq", [1, 2, 3]));
        // FNV-1a of the empty input is its offset basis.
        assert_eq!(call_tag("", []), 0xcbf2_9ce4_8422_2325);
    }
}
