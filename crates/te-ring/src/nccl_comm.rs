//! [`NcclComm`]: ranks that are GPUs, through NCCL (feature `nccl`).
//!
//! Compile-checked only (CI has no GPUs); it runs where several GPUs
//! exist. Blocks are staged through device buffers: NCCL's send and
//! receive only make progress when both sides are posted, and a send
//! posted alone on a rank's stream would block the receive queued behind
//! it, so [`Communicator::send_next`] keeps the block on the host and the
//! following [`Communicator::recv_prev`] runs one grouped exchange: the
//! block's header (tag, byte length) to the next rank while receiving the
//! previous rank's header, then the payloads the same way. Every
//! `recv_prev` must therefore follow a `send_next` on every rank, the
//! pattern of every te-ring call (a ring of one rank copies the block to
//! itself).
//!
//! **Failures.** Abort markers arriving in a receive are honoured (the
//! error names their origin), but NCCL cannot interrupt a peer's pending
//! receive: `abort_with` marks this communicator failed and aborts its
//! NCCL communicator (`ncclCommAbort`), and a peer waiting on this rank
//! waits until the job is torn down by its launcher. NCCL errors are
//! [`RingError::Communication`] naming this rank.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{group_end, group_start, Comm};

use crate::comm::{neighbours, oversized, Block, Communicator, Failure};
use crate::error::RingError;

/// One GPU's link in a ring of NCCL ranks: `cp_rank` = the NCCL rank,
/// `cp_size` = its world size.
pub struct NcclComm {
    cp_rank: usize,
    cp_size: usize,
    /// `None` once aborted (dropping a cudarc `Comm` aborts it).
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    /// The block `send_next` handed over, sent by the next `recv_prev`.
    outgoing: Option<Block>,
    /// The failure that ended this rank's ring, once known.
    failure: Option<Failure>,
}

// SAFETY: an NCCL communicator may be used from any thread as long as no
// two calls run at once; every call goes through `&mut self`, and each
// binds the stream's CUDA context to the calling thread first.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// The ring of `comm`'s NCCL ranks (built with `Comm::from_rank` in
    /// each process, or `Comm::from_devices` in one), staging blocks on
    /// `comm`'s stream.
    pub fn new(comm: Comm) -> NcclComm {
        NcclComm {
            cp_rank: comm.rank(),
            cp_size: comm.world_size(),
            stream: comm.stream(),
            comm: Some(comm),
            outgoing: None,
            failure: None,
        }
    }

    /// This rank's error for a failed CUDA or NCCL call `what`.
    fn error(&self, what: &str, e: impl std::fmt::Debug) -> RingError {
        RingError::Communication {
            cp_rank: self.cp_rank,
            reason: format!("{what} failed: {e:?}"),
        }
    }

    /// The error of every call after the ring failed.
    fn failure_error(&self) -> RingError {
        Failure::error_after(self.failure.as_ref(), self.cp_rank)
    }

    /// One grouped exchange of `send` (to the next rank) against `recv`
    /// bytes (from the previous one), completed on the host.
    fn exchange(&self, comm: &Comm, send: &[u8], recv_len: usize) -> Result<Vec<u8>, RingError> {
        let (next, prev) = neighbours(self.cp_rank, self.cp_size);
        let s = &self.stream;
        s.context()
            .bind_to_thread()
            .map_err(|e| self.error("binding the CUDA context", e))?;
        let src = s
            .clone_htod(send)
            .map_err(|e| self.error("copying a block to the GPU", e))?;
        let mut dst = s
            .alloc_zeros::<u8>(recv_len)
            .map_err(|e| self.error("allocating a receive buffer", e))?;
        group_start().map_err(|e| self.error("ncclGroupStart", e))?;
        let sent = if send.is_empty() {
            Ok(())
        } else {
            comm.send(&src, next as i32)
        };
        let received = if recv_len == 0 {
            Ok(())
        } else {
            comm.recv(&mut dst, prev as i32).map(drop)
        };
        // End the group even when posting failed, then report.
        let ended = group_end();
        sent.map_err(|e| self.error("ncclSend", e))?;
        received.map_err(|e| self.error("ncclRecv", e))?;
        ended.map_err(|e| self.error("ncclGroupEnd", e))?;
        s.clone_dtoh(&dst)
            .map_err(|e| self.error("copying a block from the GPU", e))
    }
}

impl Communicator for NcclComm {
    fn cp_rank(&self) -> usize {
        self.cp_rank
    }

    fn cp_size(&self) -> usize {
        self.cp_size
    }

    fn send_next(&mut self, block: Block) -> Result<(), RingError> {
        if self.comm.is_none() {
            return Err(self.failure_error());
        }
        if self.outgoing.is_some() {
            return Err(RingError::Communication {
                cp_rank: self.cp_rank,
                reason: "NcclComm: two sends without a receive between them".into(),
            });
        }
        self.outgoing = Some(block);
        Ok(())
    }

    fn recv_prev(&mut self, max_bytes: usize) -> Result<Block, RingError> {
        let Some(comm) = self.comm.take() else {
            return Err(self.failure_error());
        };
        let out = self.outgoing.take().unwrap_or(Block {
            tag: 0,
            data: Vec::new(),
        });
        let header: Vec<u8> = [out.tag, out.data.len() as u64]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let result = self.exchange(&comm, &header, 16).and_then(|h| {
            let word = |i: usize| u64::from_le_bytes(h[i * 8..][..8].try_into().unwrap_or([0; 8]));
            let (tag, len) = (word(0), usize::try_from(word(1)).unwrap_or(usize::MAX));
            let prev = neighbours(self.cp_rank, self.cp_size).1;
            if let Some(f) = oversized(prev, len, max_bytes) {
                return Err(RingError::Communication {
                    cp_rank: self.cp_rank,
                    reason: format!("rank {}: {}", f.origin, f.reason),
                });
            }
            let data = self.exchange(&comm, &out.data, len)?;
            Ok(Block { tag, data })
        });
        self.comm = Some(comm);
        let block = match result {
            Ok(b) => b,
            Err(e) => {
                self.abort_with(&e.to_string());
                return Err(e);
            }
        };
        let prev = neighbours(self.cp_rank, self.cp_size).1;
        match Failure::from_marker(&block, prev) {
            Some(f) => {
                self.failure.get_or_insert(f);
                self.abort_with("");
                Err(self.failure_error())
            }
            None => Ok(block),
        }
    }

    fn abort_with(&mut self, reason: &str) {
        if self.comm.take().is_none() {
            return;
        }
        let cp_rank = self.cp_rank;
        self.failure.get_or_insert_with(|| Failure {
            origin: cp_rank,
            reason: reason.into(),
        });
        self.outgoing = None;
    }
}
