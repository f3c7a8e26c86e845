//! Communicators: how a rank passes blocks of bytes around the ring.
//!
//! One trait, [`Communicator`], carrying [`Block`]s of bytes, so one ring
//! serves every element type (bf16 KV blocks, f32 partial results, u64
//! words of the collectives). [`ThreadComm`] connects ranks that are
//! threads of one process through channels (tests, one machine);
//! `MpiComm` (feature `mpi`) connects processes, `NcclComm` (feature
//! `nccl`) GPUs.
//!
//! Every rank makes the same sequence of calls (ring forwards, merges,
//! collectives) with the same arguments. Each [`Block`] carries a tag
//! naming its call, so a rank that is running a different call is an
//! error, not silently mixed data; a rank whose call fails aborts its
//! communicator, so its peers fail too instead of waiting or falling out
//! of step. After an error the ring is unusable: build a new one.
//!
//! **Failure origin.** Aborting sends a marker (the reserved tag
//! [`ABORT_TAG`], the origin rank and a short reason) to the next rank
//! before hanging up. A rank that receives a marker, or finds a
//! neighbour gone, fails with "rank `origin` failed: `reason`" and
//! aborts itself at once, forwarding the *original* origin, so the
//! failure travels round the whole ring and every rank's error names the
//! rank where it started.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use crate::error::RingError;

/// A message round the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Digest of the call the block belongs to: the operation and every
    /// argument all ranks must agree on ([`call_tag`]).
    pub tag: u64,
    /// The payload (a KV block, a partial result), as native-endian
    /// bytes; both sides know its element type and shape.
    pub data: Vec<u8>,
}

impl Block {
    /// Copies `data`'s bytes (native endian).
    pub fn from_slice<T: bytemuck::Pod>(tag: u64, data: &[T]) -> Block {
        Block {
            tag,
            data: bytemuck::cast_slice(data).to_vec(),
        }
    }

    /// The payload as `T`s (copied, so any alignment works).
    ///
    /// Errors: [`RingError::Communication`] (naming `cp_rank`, the
    /// receiving rank) when the byte length is not a multiple of
    /// `size_of::<T>()` or `T` is zero-sized.
    pub fn to_vec<T: bytemuck::Pod>(&self, cp_rank: usize) -> Result<Vec<T>, RingError> {
        let size = std::mem::size_of::<T>();
        if size == 0 || !self.data.len().is_multiple_of(size) {
            return Err(RingError::Communication {
                cp_rank,
                reason: format!(
                    "a block of {} bytes is not a whole number of {size}-byte elements",
                    self.data.len()
                ),
            });
        }
        let mut out = vec![T::zeroed(); self.data.len() / size];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&self.data);
        Ok(out)
    }
}

/// One rank's link in a ring of `cp_size` ranks: it sends to rank
/// `(cp_rank + 1) % cp_size` and receives from `(cp_rank + cp_size - 1) %
/// cp_size`, in order (blocks arrive in the order they were sent).
pub trait Communicator: Send {
    /// This rank, `< cp_size`.
    fn cp_rank(&self) -> usize;
    /// Ranks in the ring.
    fn cp_size(&self) -> usize;
    /// Starts sending `block` to the next rank; returns without waiting
    /// for it to be received, so the caller can compute meanwhile.
    ///
    /// Errors: [`RingError::Communication`] when this communicator already
    /// knows of a failure (it names the rank where it started) or was
    /// aborted, or the next rank is gone.
    fn send_next(&mut self, block: Block) -> Result<(), RingError>;
    /// Waits for the next block from the previous rank, whose payload the
    /// caller's plan expects to take at most `max_bytes` (an abort marker,
    /// at most [`MAX_MARKER_BYTES`], is always accepted). A larger one is
    /// refused before its payload is allocated where the transport tells
    /// the size first (MPI probes it, NCCL sends it ahead).
    ///
    /// Errors: [`RingError::Communication`] naming the rank where a
    /// failure started, when the previous rank is gone or forwards an
    /// abort (a rank that is alive but never sends is waited for), sends a
    /// block over `max_bytes` (naming it), or this communicator was
    /// aborted. A failure seen here aborts this communicator too,
    /// forwarding its origin.
    fn recv_prev(&mut self, max_bytes: usize) -> Result<Block, RingError>;
    /// Gives up after an error: tells the next rank that this rank failed
    /// because of `reason` (or forwards the origin and reason of a failure
    /// this rank learned from a peer), then hangs up. The peers' pending
    /// and later calls fail naming the origin, and so does every later
    /// call here. Aborting twice is a no-op.
    fn abort_with(&mut self, reason: &str);
    /// [`Communicator::abort_with`] with reason "aborted".
    fn abort(&mut self) {
        self.abort_with("aborted");
    }
}

/// `result`, after aborting `comm` with the error's text as the reason
/// if it is an error (what every ring call does on failure, see the
/// module doc).
pub(crate) fn abort_on_error<R>(
    comm: &mut (impl Communicator + ?Sized),
    result: Result<R, RingError>,
) -> Result<R, RingError> {
    if let Err(e) = &result {
        comm.abort_with(&e.to_string());
    }
    result
}

/// The tag of a call: FNV-1a over `words` (the operation's name bytes,
/// lengths, dims, flags), the same on every rank and every build. A call
/// whose tag is [`ABORT_TAG`] (chance 2^-64) would read as an abort.
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

/// The tag reserved for abort markers: payload = origin rank (u64, little
/// endian) then the reason (UTF-8).
pub const ABORT_TAG: u64 = u64::MAX;

/// Where a ring failure started and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Failure {
    pub origin: usize,
    pub reason: String,
}

impl Failure {
    /// The marker block that tells the next rank about this failure.
    pub fn marker(&self) -> Block {
        let mut data = (self.origin as u64).to_le_bytes().to_vec();
        data.extend_from_slice(self.reason.as_bytes());
        Block {
            tag: ABORT_TAG,
            data,
        }
    }

    /// The failure a marker block carries; `None` for any other block.
    /// `prev` is the sending rank, taken as the origin of a marker too
    /// short to name one.
    pub fn from_marker(block: &Block, prev: usize) -> Option<Failure> {
        if block.tag != ABORT_TAG {
            return None;
        }
        Some(match block.data.split_first_chunk::<8>() {
            Some((origin, reason)) => Failure {
                origin: usize::try_from(u64::from_le_bytes(*origin)).unwrap_or(prev),
                reason: clean_reason(reason),
            },
            None => Failure {
                origin: prev,
                reason: "aborted (a malformed abort marker)".into(),
            },
        })
    }

    /// The error of every call on rank `cp_rank` after its ring ended:
    /// the recorded `failure`, or a plain abort when none was recorded.
    pub fn error_after(failure: Option<&Failure>, cp_rank: usize) -> RingError {
        RingError::Communication {
            cp_rank,
            reason: match failure {
                Some(f) => format!("rank {} failed: {}", f.origin, f.reason),
                None => "the ring was aborted".into(),
            },
        }
    }
}

/// The longest abort reason kept (bytes): a peer's reason is printed in
/// this rank's errors, and a peer is not trusted to keep it short.
pub(crate) const MAX_REASON: usize = 1024;

/// The largest abort marker payload a rank accepts: the origin (8 bytes)
/// and a reason of 1024 bytes (the longest kept), each of whose characters may
/// have become a 3-byte U+FFFD when cleaned by a rank that forwards it.
pub const MAX_MARKER_BYTES: usize = 8 + 3 * MAX_REASON;

/// The failure of a block of `got` payload bytes from `prev` when the
/// caller expects at most `max_bytes` (and markers are at most
/// [`MAX_MARKER_BYTES`]); `None` when it fits.
pub(crate) fn oversized(prev: usize, got: usize, max_bytes: usize) -> Option<Failure> {
    (got > max_bytes.max(MAX_MARKER_BYTES)).then(|| Failure {
        origin: prev,
        reason: format!(
            "it sent a block of {got} bytes where this step expects at most {max_bytes}"
        ),
    })
}

/// An abort reason as it may be shown: at most [`MAX_REASON`] bytes (cut
/// at a character boundary), invalid UTF-8 and control characters (which
/// could rewrite a terminal) replaced by U+FFFD.
pub(crate) fn clean_reason(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_REASON)]);
    text.chars()
        .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
        .collect()
}

/// The next and previous rank of `cp_rank` in a ring of `cp_size`.
pub(crate) fn neighbours(cp_rank: usize, cp_size: usize) -> (usize, usize) {
    ((cp_rank + 1) % cp_size, (cp_rank + cp_size - 1) % cp_size)
}

/// In-process ring: rank `r` is the `r`-th value of [`ThreadComm::ring`],
/// moved to its own thread. Sends never block (unbounded channels). A
/// rank whose `ThreadComm` is dropped without aborting (a thread that
/// panicked or returned) counts as failed: its neighbours' calls fail
/// naming it.
pub struct ThreadComm {
    cp_rank: usize,
    cp_size: usize,
    /// `None` once aborted.
    to_next: Option<Sender<Block>>,
    /// Kept after an abort until the value is dropped, so that the
    /// previous rank's sends still succeed and it learns of the failure
    /// (origin and reason) from the marker coming round the ring.
    from_prev: Receiver<Block>,
    /// The failure that ended this rank's ring, once known.
    failure: Option<Failure>,
    /// The first failure any rank of this ring recorded, shared by all of
    /// them: a rank whose neighbour is gone reports it rather than the
    /// neighbour (which may only have stopped because of it).
    first: Arc<Mutex<Option<Failure>>>,
}

impl ThreadComm {
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
        let first = Arc::new(Mutex::new(None));
        Ok(senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(cp_rank, (to_next, from_prev))| ThreadComm {
                cp_rank,
                cp_size,
                to_next: Some(to_next),
                from_prev,
                failure: None,
                first: first.clone(),
            })
            .collect())
    }

    /// Records `failure` (the first one wins, in this rank and in the
    /// ring), aborts, and returns the ring's first failure as this rank's
    /// error.
    fn fail(&mut self, failure: Failure) -> RingError {
        let first = record_first(&self.first, failure);
        self.failure.get_or_insert(first);
        self.abort_with("");
        self.failure_error()
    }

    /// The error of every call after the ring failed.
    fn failure_error(&self) -> RingError {
        Failure::error_after(self.failure.as_ref(), self.cp_rank)
    }

    /// The failure a block received from the previous rank announces.
    fn check(&mut self, block: Block) -> Result<Block, RingError> {
        let prev = neighbours(self.cp_rank, self.cp_size).1;
        match Failure::from_marker(&block, prev) {
            Some(f) => Err(self.fail(f)),
            None => Ok(block),
        }
    }
}

impl Communicator for ThreadComm {
    fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    fn cp_size(&self) -> usize {
        self.cp_size
    }

    fn send_next(&mut self, block: Block) -> Result<(), RingError> {
        if self.to_next.is_none() {
            return Err(self.failure_error());
        }
        let sent = self.to_next.as_ref().is_some_and(|s| s.send(block).is_ok());
        if !sent {
            let next = neighbours(self.cp_rank, self.cp_size).0;
            return Err(self.fail(Failure {
                origin: next,
                reason: "it left the ring".into(),
            }));
        }
        Ok(())
    }

    fn recv_prev(&mut self, max_bytes: usize) -> Result<Block, RingError> {
        let prev = neighbours(self.cp_rank, self.cp_size).1;
        if self.to_next.is_none() {
            return Err(self.failure_error());
        }
        match self.from_prev.recv() {
            Ok(block) => match oversized(prev, block.data.len(), max_bytes) {
                Some(f) => Err(self.fail(f)),
                None => self.check(block),
            },
            Err(_) => Err(self.fail(Failure {
                origin: prev,
                reason: "it left the ring".into(),
            })),
        }
    }

    fn abort_with(&mut self, reason: &str) {
        let Some(to_next) = self.to_next.take() else {
            return;
        };
        let first = &self.first;
        let failure = self.failure.get_or_insert_with(|| {
            record_first(
                first,
                Failure {
                    origin: self.cp_rank,
                    reason: reason.into(),
                },
            )
        });
        // The next rank may be gone already; nothing more to tell then.
        let _ = to_next.send(failure.marker());
    }
}

/// `failure` recorded as the ring's first unless one is recorded already;
/// returns the record (`failure` itself if the lock is poisoned).
fn record_first(first: &Mutex<Option<Failure>>, failure: Failure) -> Failure {
    match first.lock() {
        Ok(mut first) => first.get_or_insert(failure).clone(),
        Err(_) => failure,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn peer_abort_reasons_are_cut_and_cleaned() {
        let mut data = 3u64.to_le_bytes().to_vec();
        data.extend_from_slice(b"bad\x1b[2Jthing");
        data.extend(std::iter::repeat_n(b'x', 5000));
        let f = Failure::from_marker(
            &Block {
                tag: ABORT_TAG,
                data,
            },
            1,
        )
        .unwrap();
        assert_eq!(f.origin, 3);
        assert!(f.reason.starts_with("bad\u{FFFD}[2Jthing"), "{}", f.reason);
        assert!(f.reason.len() <= MAX_REASON + 2, "{}", f.reason.len());
    }

    use super::*;

    #[test]
    fn blocks_go_round_the_ring() {
        let ring = ThreadComm::ring(3).unwrap();
        let got: Vec<Vec<u32>> = std::thread::scope(|s| {
            let handles: Vec<_> = ring
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut seen = vec![c.cp_rank() as u32];
                        let mut b = Block::from_slice(7, &[c.cp_rank() as u32]);
                        for _ in 1..c.cp_size() {
                            c.send_next(b).unwrap();
                            b = c.recv_prev(usize::MAX).unwrap();
                            seen.push(b.to_vec::<u32>(c.cp_rank()).unwrap()[0]);
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
    fn blocks_round_trip_any_pod_type() {
        let b = Block::from_slice(3, &[1.5f32, -2.0]);
        assert_eq!(b.data.len(), 8);
        assert_eq!(b.data[..4], 1.5f32.to_ne_bytes());
        assert_eq!(b.to_vec::<f32>(0).unwrap(), [1.5, -2.0]);
        // Two f32s are four u16s or one u64, but not a whole number of [u8; 3]s.
        assert_eq!(b.to_vec::<u16>(0).unwrap().len(), 4);
        assert_eq!(b.to_vec::<u64>(0).unwrap().len(), 1);
        let err = b.to_vec::<[u8; 3]>(4).unwrap_err();
        assert!(
            matches!(&err, RingError::Communication { cp_rank: 4, reason } if reason.contains("8 bytes")),
            "{err}"
        );
    }

    #[test]
    fn a_departed_or_aborted_peer_is_an_error_naming_it() {
        let mut ring = ThreadComm::ring(3).unwrap();
        let mut rank2 = ring.pop().unwrap();
        let mut rank1 = ring.pop().unwrap();
        drop(ring);
        // Rank 0 is gone: rank 1 cannot receive, rank 2 cannot send.
        let err = rank1.recv_prev(usize::MAX).unwrap_err().to_string();
        assert!(err.contains("rank 1: rank 0 failed: it left"), "{err}");
        // Rank 1 forwarded the origin when it failed.
        let err = rank2.recv_prev(usize::MAX).unwrap_err().to_string();
        assert!(err.contains("rank 2: rank 0 failed: it left"), "{err}");
        let err = rank2.send_next(Block::from_slice(1, &[2u8])).unwrap_err();
        assert!(err.to_string().contains("rank 0 failed"), "{err}");
    }

    /// Rank 1 of 3 leaves; rank 0 notices (its send fails) and leaves
    /// too; rank 2 then finds rank 0 gone before it hears from rank 1, and
    /// still names rank 1, where it began.
    #[test]
    fn a_departure_is_named_by_ranks_that_see_its_effects_first() {
        let mut ring = ThreadComm::ring(3).unwrap();
        let mut rank2 = ring.pop().unwrap();
        let rank1 = ring.pop().unwrap();
        let mut rank0 = ring.pop().unwrap();
        drop(rank1);
        let err = rank0.send_next(Block::from_slice(1, &[0u8])).unwrap_err();
        assert!(err.to_string().contains("rank 1 failed: it left"), "{err}");
        drop(rank0);
        let err = rank2.send_next(Block::from_slice(1, &[0u8])).unwrap_err();
        assert_eq!(
            err.to_string(),
            "ring_attention: rank 2: rank 1 failed: it left the ring"
        );
    }

    #[test]
    fn an_abort_names_its_origin_and_reason_round_the_ring() {
        let mut ring = ThreadComm::ring(4).unwrap();
        ring[2].abort_with("bad input");
        // Rank 3 hears it first, then forwards the original origin.
        let err = ring[3].recv_prev(usize::MAX).unwrap_err().to_string();
        assert_eq!(err, "ring_attention: rank 3: rank 2 failed: bad input");
        let err = ring[0].recv_prev(usize::MAX).unwrap_err().to_string();
        assert_eq!(err, "ring_attention: rank 0: rank 2 failed: bad input");
        // Rank 1 may still send (the failure is behind it, not yet
        // received), then its receive fails.
        ring[1].send_next(Block::from_slice(1, &[0u8])).unwrap();
        let err = ring[1].recv_prev(usize::MAX).unwrap_err().to_string();
        assert_eq!(err, "ring_attention: rank 1: rank 2 failed: bad input");
        // A rank that knows of the failure refuses to send.
        assert!(ring[1].send_next(Block::from_slice(1, &[0u8])).is_err());
        // The origin refuses work too, and a second abort changes nothing.
        ring[2].abort_with("another reason");
        let err = ring[2].recv_prev(usize::MAX).unwrap_err().to_string();
        assert_eq!(err, "ring_attention: rank 2: rank 2 failed: bad input");
        assert!(ring[2].send_next(Block::from_slice(1, &[0u8])).is_err());
    }

    #[test]
    fn a_block_over_what_the_step_expects_is_an_error_naming_its_sender() {
        let mut ring = ThreadComm::ring(3).unwrap();
        ring[0]
            .send_next(Block::from_slice(1, &vec![0u8; MAX_MARKER_BYTES + 1]))
            .unwrap();
        let err = ring[1].recv_prev(16).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "ring_attention: rank 1: rank 0 failed: it sent a block of {} bytes where \
                 this step expects at most 16",
                MAX_MARKER_BYTES + 1
            )
        );
        // The next rank hears of it; a marker passes whatever the bound.
        let err = ring[2].recv_prev(0).unwrap_err().to_string();
        assert!(err.contains("rank 0 failed: it sent a block"), "{err}");
        // Within the bound, a block arrives.
        let mut ring = ThreadComm::ring(2).unwrap();
        ring[0].send_next(Block::from_slice(1, &[7u8; 16])).unwrap();
        assert_eq!(ring[1].recv_prev(16).unwrap().data, [7; 16]);
    }

    #[test]
    fn blocks_sent_before_an_abort_still_arrive() {
        let mut ring = ThreadComm::ring(2).unwrap();
        ring[0].send_next(Block::from_slice(5, &[9u8])).unwrap();
        ring[0].abort();
        assert_eq!(ring[1].recv_prev(usize::MAX).unwrap().data, [9]);
        let err = ring[1].recv_prev(usize::MAX).unwrap_err().to_string();
        assert!(err.contains("rank 0 failed: aborted"), "{err}");
    }

    #[test]
    fn markers_round_trip() {
        let f = Failure {
            origin: 5,
            reason: "x y".into(),
        };
        assert_eq!(Failure::from_marker(&f.marker(), 1), Some(f));
        assert_eq!(Failure::from_marker(&Block::from_slice(3, &[0u8]), 1), None);
        let short = Block {
            tag: ABORT_TAG,
            data: vec![1],
        };
        assert_eq!(Failure::from_marker(&short, 1).unwrap().origin, 1);
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
