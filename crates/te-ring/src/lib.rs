//! te-ring: ring attention (context parallelism) for te-rs.
//!
//! Each of `cp_size` ranks holds a shard of every sequence's tokens in the
//! load-balanced zigzag layout ([`Zigzag`], docs/ARCHITECTURE.md, "Context parallelism"); each step a rank
//! attends its queries to the KV block it holds, passes the block on to the
//! next rank, and merges partial outputs in f32 by log-sum-exp
//! ([`RingAttention`]: causal or not, sliding windows, GQA, softcap).
//! Blocks entirely in the causal future are skipped.
//! For decode with the KV cache split across ranks, each rank attends the
//! (replicated) queries to its own keys and [`all_merge()`] combines the
//! partial results on every rank.
//! Ranks talk through a [`Communicator`], which carries tagged [`Block`]s
//! of bytes (any [`bytemuck::Pod`] element type, so one ring serves a
//! bf16 forward and its f32 merges): [`ThreadComm`] for threads of one
//! process, `MpiComm` (feature `mpi`) for processes and machines,
//! `NcclComm` (feature `nccl`, compile-checked only) for GPUs. The
//! [`collective`] module adds [`all_gather()`], [`all_reduce_min()`] and
//! [`agree()`] (check that every rank runs the same settings).
//! [`Placement`] is the bookkeeping of generation under context
//! parallelism: which rank computes and stores each new token (zigzag for
//! prompt chunks, the least-loaded rank for a decode token).
//!
//! Every rank makes the same calls in the same order with the same
//! `seqlens` and configuration; blocks are tagged with their call, so a
//! disagreement is an error on every rank, never mixed data. When a call
//! fails on one rank, it aborts its communicator and the others fail too
//! (a rank that stays alive without calling is waited for), with errors
//! that name the rank where the failure started; the ring is then
//! unusable and must be rebuilt.
//!
//! ```
//! use te_attention::{AttnMaskType, AttnOutput, DotProductAttention};
//! use te_ring::{Communicator, RingAttention, RingError, ThreadComm, Zigzag};
//!
//! let (h, d, seqlens, cp) = (2, 8, [10usize, 3], 2);
//! let total: usize = seqlens.iter().sum();
//! // Full thd Q (= K = V here): [13 tokens, 2 heads, 8].
//! let full: Vec<f32> = (0..total * h * d).map(|i| (i % 7) as f32 / 7.0).collect();
//! let ring = RingAttention::new(
//!     DotProductAttention::new(h, d).with_attn_mask_type(AttnMaskType::Causal),
//! )?;
//! let z = Zigzag::new(cp)?;
//! let comms = ThreadComm::ring(cp)?;
//! // One thread per rank, each with its shard.
//! let outs: Vec<Result<Vec<f32>, RingError>> = std::thread::scope(|s| {
//!     let ranks: Vec<_> = comms
//!         .into_iter()
//!         .map(|mut comm| {
//!             let (ring, full) = (&ring, &full);
//!             s.spawn(move || {
//!                 let x = z.shard(full, h * d, &seqlens, comm.cp_rank())?;
//!                 let mut out = vec![0f32; x.len()];
//!                 let output = AttnOutput { out: &mut out, lse: None };
//!                 ring.forward_cpu(&mut comm, &seqlens, &x, &x, &x, output)?;
//!                 Ok(out)
//!             })
//!         })
//!         .collect();
//!     ranks.into_iter().map(|r| r.join().unwrap()).collect()
//! });
//! let outs = outs.into_iter().collect::<Result<Vec<_>, _>>()?;
//! let shards: Vec<&[f32]> = outs.iter().map(Vec::as_slice).collect();
//! // The output of single-rank causal attention over the full sequences.
//! let out = z.unshard(&shards, h * d, &seqlens)?;
//! assert_eq!(out.len(), full.len());
//! # Ok::<(), RingError>(())
//! ```

pub mod all_merge;
pub mod collective;
pub mod comm;
pub mod error;
pub mod layout;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
#[cfg(feature = "nccl")]
pub mod nccl_comm;
pub mod placement;
pub mod ring;

pub use all_merge::all_merge;
pub use collective::{agree, all_gather, all_reduce_min};
pub use comm::{call_tag, Block, Communicator, ThreadComm, ABORT_TAG, MAX_MARKER_BYTES};
pub use error::RingError;
pub use layout::Zigzag;
#[cfg(feature = "mpi")]
pub use mpi_comm::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl_comm::NcclComm;
pub use placement::{Placed, Placement};
pub use ring::RingAttention;
