//! The KV-cache view: where one layer's cached keys and values live.
//!
//! Written by the KV-save op, read by attention, handed out by te-cache.
//! Contiguous and paged caches share one addressing scheme: a contiguous
//! cache `[max_batch, max_seqlen, h_kv, d]` is a paged cache whose
//! `page_size = max_seqlen`, with one page per batch slot.

/// Addressing of a KV cache, without the data.
///
/// Token at absolute position `pos` of sequence `b` (batch order of the step)
/// lives in logical slot `l = pos` (or `pos % ring_len` on a sliding-window
/// layer), physical page `page_table[b * max_pages_per_seq + l / page_size]`,
/// row `l % page_size` of that page.
#[derive(Clone, Copy, Debug)]
pub struct KvCacheLayout<'a> {
    /// KV heads `h_kv`.
    pub num_heads_kv: usize,
    /// Key head dim `d_k`.
    pub head_dim_k: usize,
    /// Value head dim `d_v` (may differ from `d_k`).
    pub head_dim_v: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// `[b, max_pages_per_seq]` i32 physical page ids; entries past a
    /// sequence's last page are unused.
    pub page_table: &'a [i32],
    /// Columns of `page_table`.
    pub max_pages_per_seq: usize,
    /// `[b]` i32: tokens of each sequence seen by the cache, this step's
    /// included (the key length attention uses).
    pub cache_seqlens: &'a [i32],
    /// Sliding-window layer: only the last `ring_len` positions are held
    /// (a multiple of `page_size`); `None`: every position is held.
    pub ring_len: Option<usize>,
}

impl KvCacheLayout<'_> {
    /// Number of sequences `b`.
    pub fn batch(&self) -> usize {
        self.cache_seqlens.len()
    }

    /// Key length (positions seen, this step included) of sequence `b`.
    pub fn seqlen(&self, b: usize) -> usize {
        self.cache_seqlens[b] as usize
    }

    /// First absolute position still held for sequence `b`.
    pub fn first_held_position(&self, b: usize) -> usize {
        let len = self.seqlen(b);
        match self.ring_len {
            Some(r) => len.saturating_sub(r),
            None => 0,
        }
    }

    /// Row (in units of `h_kv * d` elements) of position `pos` of sequence
    /// `b` in the cache tensor `[num_pages * page_size, h_kv, d]`.
    #[inline]
    pub fn row(&self, b: usize, pos: usize) -> usize {
        let logical = match self.ring_len {
            Some(r) => pos % r,
            None => pos,
        };
        let page = self.page_table[b * self.max_pages_per_seq + logical / self.page_size] as usize;
        page * self.page_size + logical % self.page_size
    }
}

/// A read-only view of one layer's cache: `k_cache: [num_pages, page_size,
/// h_kv, d_k]`, `v_cache: [num_pages, page_size, h_kv, d_v]`.
#[derive(Clone, Copy, Debug)]
pub struct KvCacheView<'a, T> {
    pub k_cache: &'a [T],
    pub v_cache: &'a [T],
    pub layout: KvCacheLayout<'a>,
}
