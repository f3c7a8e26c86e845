//! A pool of fixed-size pages and its free list.

/// Pages of `page_size` token rows shared by one group of layers (the
/// full-attention layers, or the sliding-window layers of one ring length).
///
/// A contiguous cache is a pool of `max_batch_size` pages of `max_seqlen`
/// (or `ring_len`) rows, one page per sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PagePool {
    /// Token rows per page.
    pub page_size: usize,
    /// Pages one sequence can hold (`page_table` columns).
    pub max_pages_per_seq: usize,
    /// `Some(ring_len)` on sliding-window layers: positions wrap modulo
    /// `ring_len = max_pages_per_seq * page_size`.
    pub ring_len: Option<usize>,
    /// Total pages `num_pages` of the pool.
    pub num_pages: usize,
    /// Free page ids; the next allocation pops from the end.
    free: Vec<i32>,
}

impl PagePool {
    /// A pool with every page free; `num_pages` must fit in i32.
    pub fn new(
        page_size: usize,
        max_pages_per_seq: usize,
        ring_len: Option<usize>,
        num_pages: usize,
    ) -> Self {
        // Reversed so that page 0 is handed out first.
        let free = (0..num_pages as i32).rev().collect();
        Self {
            page_size,
            max_pages_per_seq,
            ring_len,
            num_pages,
            free,
        }
    }

    /// Pages a sequence with `cached` tokens holds in this pool:
    /// `min(ceil(cached / page_size), max_pages_per_seq)`.
    pub fn pages_for(&self, cached: usize) -> usize {
        cached.div_ceil(self.page_size).min(self.max_pages_per_seq)
    }

    pub fn pages_free(&self) -> usize {
        self.free.len()
    }

    pub fn pages_in_use(&self) -> usize {
        self.num_pages - self.free.len()
    }

    /// Appends pages to `pages` until it holds `count`; the caller checked
    /// that enough are free.
    pub fn grow(&mut self, pages: &mut Vec<i32>, count: usize) {
        while pages.len() < count {
            let page = self.free.pop().expect("caller checked free pages");
            pages.push(page);
        }
    }

    /// Returns `pages` to the free list.
    pub fn give_back(&mut self, pages: &[i32]) {
        self.free.extend(pages.iter().rev());
    }
}
