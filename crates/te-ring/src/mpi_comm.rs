//! [`MpiComm`]: ranks that are MPI processes (feature `mpi`).
//!
//! Rank `r` of the ring is MPI world rank `r`; launch with e.g. `mpirun
//! -np 4 te ...`. A block travels as one MPI message of bytes (the tag's
//! 8 little-endian bytes, then the payload) under one MPI tag: an
//! immediate send to the next rank, a matched probe and receive of a byte
//! vector from the previous one. MPI keeps the messages between two
//! ranks in order.
//!
//! **Failures.** An error in a ring call aborts the communicator, which
//! sends the abort marker (origin rank and reason) on to the next rank
//! as [`ThreadComm`](crate::ThreadComm) does, so every rank fails naming
//! the origin, returns its error and exits normally (a send the next rank
//! never receives, because it failed first, is waited for at most 2 s on
//! abort or drop, then left to MPI with its buffer leaked). A *dead* process
//! (killed, crashed) sends nothing: MPI's default error handler and
//! `mpirun` deal with it. Measured with Open MPI 4.1.4 (shared memory or
//! `--mca btl self,tcp`, 3 ranks, the others blocked in a receive): about
//! 1 s after a `SIGKILL` of rank 1, `mpirun` has killed the other ranks
//! and exits with status 137, printing "Primary job terminated normally,
//! but 1 process returned a non-zero exit code. Per user-direction, the
//! job has been aborted." and "mpirun noticed that process rank 1 with
//! PID 0 on node N exited on signal 9 (Killed)." (it prints PID 0);
//! `crates/te-ring/tests/mpi.rs`
//! checks that this takes well under 10 s.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use mpi::datatype::Equivalence;
use mpi::environment::Universe;
use mpi::point_to_point::{Destination, MatchedReceiveVec, Source};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::Threading;

use crate::comm::{neighbours, oversized, Block, Communicator, Failure, MAX_REASON};
use crate::error::RingError;

/// The MPI tag of every ring message.
const RING_TAG: mpi::Tag = 0x7e;

/// How long an abort or drop waits for a send in flight to be received
/// before giving up on it (the peer may have failed before receiving).
const SEND_GRACE: Duration = Duration::from_secs(2);

/// A send in flight and its buffer, leaked so that MPI may read it until
/// the request completes; [`Pending::reclaim`] frees it afterwards.
struct Pending {
    request: Request<'static, [u8]>,
    buffer: NonNull<[u8]>,
}

impl Pending {
    /// Starts sending `bytes` to world rank `to`.
    fn start(world: &SimpleCommunicator, to: usize, bytes: Vec<u8>) -> Pending {
        let buffer: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let ptr = NonNull::from(&mut *buffer);
        let request = world
            .process_at_rank(to as mpi::Rank)
            .immediate_send_with_tag(StaticScope, &*buffer, RING_TAG);
        Pending {
            request,
            buffer: ptr,
        }
    }

    /// Frees the buffer of a completed request.
    fn reclaim(buffer: NonNull<[u8]>) {
        // SAFETY: `buffer` came from `Box::leak` in `start`, and its
        // request has completed (MPI no longer reads it) and was consumed,
        // so no reference to it remains.
        drop(unsafe { Box::from_raw(buffer.as_ptr()) });
    }

    /// Waits until the send is received.
    fn wait(self) {
        self.request.wait_without_status();
        Self::reclaim(self.buffer);
    }

    /// Waits at most [`SEND_GRACE`]; a send still in flight then is left
    /// to MPI with its buffer leaked (it belongs to a failed ring).
    fn wait_briefly(self) {
        let start = Instant::now();
        let mut request = self.request;
        loop {
            match request.test() {
                Ok(_) => return Self::reclaim(self.buffer),
                Err(r) if start.elapsed() < SEND_GRACE => request = r,
                Err(r) => {
                    // Forgetting a request is allowed (its buffer is
                    // 'static); only dropping an active one panics.
                    std::mem::forget(r);
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// One MPI process's link in the ring of all world ranks: `cp_rank` =
/// world rank, `cp_size` = world size. It owns MPI's `Universe`: MPI is
/// finalized when it is dropped, and cannot be initialized again in the
/// process. Drop it on the thread that created it.
pub struct MpiComm {
    cp_rank: usize,
    cp_size: usize,
    world: SimpleCommunicator,
    /// At most one send in flight: completed before the next send, on
    /// abort and on drop.
    pending: Option<Pending>,
    /// The failure that ended this rank's ring, once known.
    failure: Option<Failure>,
    aborted: bool,
    /// Last: MPI_Finalize runs after everything above is released.
    _universe: Universe,
}

// SAFETY: MPI is initialized with `Threading::Serialized` (checked in
// `world`), which allows MPI calls from any thread as long as no two run
// at once. Every call goes through `&mut self`, so they never do; the
// raw handles and requests inside hold no thread-local state.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// Initializes MPI (serialized threading: calls from any one thread at
    /// a time) and returns this process's rank of the world ring.
    ///
    /// Errors: [`RingError::Setup`] when MPI was already initialized in
    /// this process (call `world` once; MPI cannot be initialized twice,
    /// even after the first `MpiComm` is dropped) or the library cannot
    /// call MPI from more than its main thread.
    pub fn world() -> Result<MpiComm, RingError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| RingError::Setup {
                reason: "MPI is already initialized in this process: MpiComm::world may be \
                         called only once"
                    .into(),
            })?;
        if matches!(threading, Threading::Single | Threading::Funneled) {
            return Err(RingError::Setup {
                reason: format!(
                    "the MPI library offers threading {threading:?}; MpiComm needs Serialized"
                ),
            });
        }
        let world = universe.world();
        let (cp_rank, cp_size) = (world.rank() as usize, world.size() as usize);
        Ok(MpiComm {
            cp_rank,
            cp_size,
            world,
            pending: None,
            failure: None,
            aborted: false,
            _universe: universe,
        })
    }

    /// Records `failure` (the first one wins), aborts, and returns it as
    /// this rank's error.
    fn fail(&mut self, failure: Failure) -> RingError {
        self.failure.get_or_insert(failure);
        self.abort_with("");
        self.failure_error()
    }

    /// The error of every call after the ring failed.
    fn failure_error(&self) -> RingError {
        Failure::error_after(self.failure.as_ref(), self.cp_rank)
    }

    /// Starts sending `block` to the next rank, after the previous send
    /// completed.
    fn start_send(&mut self, block: &Block) {
        if let Some(p) = self.pending.take() {
            p.wait();
        }
        let mut bytes = Vec::with_capacity(8 + block.data.len());
        bytes.extend_from_slice(&block.tag.to_le_bytes());
        bytes.extend_from_slice(&block.data);
        let next = neighbours(self.cp_rank, self.cp_size).0;
        self.pending = Some(Pending::start(&self.world, next, bytes));
    }
}

impl Communicator for MpiComm {
    fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    fn cp_size(&self) -> usize {
        self.cp_size
    }

    fn send_next(&mut self, block: Block) -> Result<(), RingError> {
        if self.aborted {
            return Err(self.failure_error());
        }
        self.start_send(&block);
        Ok(())
    }

    fn recv_prev(&mut self, max_bytes: usize) -> Result<Block, RingError> {
        if self.aborted {
            return Err(self.failure_error());
        }
        let prev = neighbours(self.cp_rank, self.cp_size).1;
        let source = self.world.process_at_rank(prev as mpi::Rank);
        // The size first, so that a peer's oversized message is refused
        // (and left unreceived: the ring is over) before it is allocated.
        // Only this rank receives from `prev`, so the probed message is
        // the one received next.
        let count = source
            .probe_with_tag(RING_TAG)
            .count(u8::equivalent_datatype());
        let payload = usize::try_from(count).unwrap_or(0).saturating_sub(8);
        if let Some(f) = oversized(prev, payload, max_bytes) {
            return Err(self.fail(f));
        }
        let probed = source.matched_probe_with_tag(RING_TAG);
        let (mut bytes, _) = probed.matched_receive_vec::<u8>();
        let Some(&head) = bytes.first_chunk::<8>() else {
            return Err(self.fail(Failure {
                origin: prev,
                reason: format!(
                    "it sent a {}-byte message, too short for a block",
                    bytes.len()
                ),
            }));
        };
        let tag = u64::from_le_bytes(head);
        bytes.drain(..8);
        let block = Block { tag, data: bytes };
        match Failure::from_marker(&block, prev) {
            Some(f) => Err(self.fail(f)),
            None => Ok(block),
        }
    }

    fn abort_with(&mut self, reason: &str) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        let mut reason = reason.to_owned();
        if reason.len() > MAX_REASON {
            let cut = (0..=MAX_REASON)
                .rev()
                .find(|&i| reason.is_char_boundary(i))
                .unwrap_or(0);
            reason.truncate(cut);
        }
        let cp_rank = self.cp_rank;
        let marker = self
            .failure
            .get_or_insert(Failure {
                origin: cp_rank,
                reason,
            })
            .marker();
        // Best effort: the next rank may have failed before receiving.
        if let Some(p) = self.pending.take() {
            p.wait_briefly();
        }
        self.start_send(&marker);
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            if self.aborted {
                p.wait_briefly();
            } else {
                p.wait();
            }
        }
    }
}
