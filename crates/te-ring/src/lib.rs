//! te-ring: ring attention (context parallelism) for te-rs.
//!
//! Each of `cp_size` ranks holds a contiguous shard of every sequence's
//! tokens and of their KV cache (load-balanced zigzag layout for causal
//! attention, DESIGN.md §6); each step a rank attends its queries to the KV
//! block it holds, passes the block on, and merges partial outputs in f32 by
//! log-sum-exp. Not implemented yet: this crate marks its place in the
//! dependency order (te-kernels, te-attention, te-cache <- te-ring <- te-models).
