//! A pool of fixed-size pages: reference counts, the free list, and the
//! pages kept for prefix reuse (least recently used first out).

use std::collections::BTreeMap;

/// Pages of `page_size` token rows shared by one group of layers (the
/// full-attention layers, or the sliding-window layers of one ring length).
///
/// A contiguous cache is a pool of `max_batch_size` pages of `max_seqlen`
/// (or `ring_len`) rows, one page per sequence.
///
/// Every page is in exactly one state:
/// - **referenced**: `refs[page] > 0` (held by that many sequences);
/// - **cached**: `refs[page] == 0` but registered in the prefix index, kept
///   for reuse until an allocation needs it (oldest release first);
/// - **free**: on the free list.
///
/// Cached and free pages are both available to allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PagePool {
    /// Token rows per page.
    pub page_size: usize,
    /// Pages one sequence can hold (`page_table` columns at most).
    pub max_pages_per_seq: usize,
    /// `Some(ring_len)` on sliding-window layers: positions wrap modulo
    /// `ring_len = max_pages_per_seq * page_size`.
    pub ring_len: Option<usize>,
    /// Total pages `num_pages` of the pool.
    pub num_pages: usize,
    /// Free page ids; the next allocation pops from the end.
    free: Vec<i32>,
    /// `[num_pages]` sequences holding each page.
    refs: Vec<u32>,
    /// Cached pages by release tick (oldest first).
    cached: BTreeMap<u64, i32>,
    /// `[num_pages]` tick of a cached page (meaningless otherwise).
    cached_tick: Vec<u64>,
    tick: u64,
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
            refs: vec![0; num_pages],
            cached: BTreeMap::new(),
            cached_tick: vec![0; num_pages],
            tick: 0,
        }
    }

    /// Whether two pools have the same geometry (state ignored).
    pub fn same_geometry(&self, other: &PagePool) -> bool {
        (
            self.page_size,
            self.max_pages_per_seq,
            self.ring_len,
            self.num_pages,
        ) == (
            other.page_size,
            other.max_pages_per_seq,
            other.ring_len,
            other.num_pages,
        )
    }

    /// Pages a sequence with `cached` tokens holds in this pool:
    /// `min(ceil(cached / page_size), max_pages_per_seq)`.
    pub fn pages_for(&self, cached: usize) -> usize {
        cached.div_ceil(self.page_size).min(self.max_pages_per_seq)
    }

    /// Pages an allocation can take: free plus cached.
    pub fn pages_free(&self) -> usize {
        self.free.len() + self.cached.len()
    }

    /// Pages held by at least one sequence.
    pub fn pages_in_use(&self) -> usize {
        self.num_pages - self.pages_free()
    }

    /// Pages kept for prefix reuse (unreferenced, registered).
    pub fn pages_cached(&self) -> usize {
        self.cached.len()
    }

    /// Sequences holding `page`.
    pub fn refs(&self, page: i32) -> u32 {
        self.refs[page as usize]
    }

    /// Takes one page, referenced once: a free one, else the least recently
    /// released cached one, whose id is returned in the second field so the
    /// caller can drop it from the prefix index. The caller checked that a
    /// page is available.
    pub fn take(&mut self) -> (i32, Option<i32>) {
        let (page, evicted) = match self.free.pop() {
            Some(p) => (p, None),
            None => {
                let (_, p) = self
                    .cached
                    .pop_first()
                    .expect("caller checked available pages");
                (p, Some(p))
            }
        };
        self.refs[page as usize] = 1;
        (page, evicted)
    }

    /// One more sequence holds `page` (a prefix hit); a cached page becomes
    /// referenced again.
    pub fn share(&mut self, page: i32) {
        let p = page as usize;
        if self.refs[p] == 0 {
            self.cached.remove(&self.cached_tick[p]);
        }
        self.refs[p] += 1;
    }

    /// One sequence lets go of `page`. When no sequence holds it any more it
    /// becomes cached (`keep`: registered in the prefix index) or free.
    pub fn unshare(&mut self, page: i32, keep: bool) {
        let p = page as usize;
        debug_assert!(self.refs[p] > 0, "page {page} released twice");
        self.refs[p] -= 1;
        if self.refs[p] == 0 {
            if keep {
                self.tick += 1;
                self.cached_tick[p] = self.tick;
                self.cached.insert(self.tick, page);
            } else {
                self.free.push(page);
            }
        }
    }

    /// A cached page leaves the prefix index (e.g. its content is about to
    /// change): it becomes free.
    pub fn uncache(&mut self, page: i32) {
        let p = page as usize;
        if self.refs[p] == 0 && self.cached.remove(&self.cached_tick[p]).is_some() {
            self.free.push(page);
        }
    }

    /// Every page's state is consistent: each page is referenced, cached or
    /// free, exactly once. For tests and debug assertions.
    pub fn check(&self) -> Result<(), String> {
        let mut state = vec![0u8; self.num_pages];
        for &p in &self.free {
            state[p as usize] += 1;
            if self.refs[p as usize] != 0 {
                return Err(format!("free page {p} is referenced"));
            }
        }
        for &p in self.cached.values() {
            state[p as usize] += 1;
            if self.refs[p as usize] != 0 {
                return Err(format!("cached page {p} is referenced"));
            }
        }
        for (p, s) in state.iter().enumerate() {
            let referenced = u8::from(self.refs[p] > 0);
            if s + referenced != 1 {
                return Err(format!("page {p} is in {} states", s + referenced));
            }
        }
        Ok(())
    }
}
