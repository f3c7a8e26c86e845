//! Software prefetch of the weight blocks a task reads next, for the
//! AVX-512 and AVX2 int8 kernels: a task's weight rows are adjacent, and
//! the hardware prefetcher alone loses short rows at each 4 KiB page of a
//! file map.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
use std::ops::Range;

/// Prefetches bytes `at` of `row` into L2 from 4 tiles of `MR` rows on
/// (the same bytes of the row `4·MR` rows below; rows are `row.len()`
/// bytes apart). A prefetch never faults, so an address past the weights
/// is harmless.
///
/// Panics when `at.start > row.len()`.
#[inline(always)]
pub(super) fn row_ahead<const MR: usize>(row: &[u8], at: &Range<usize>) {
    let ahead = row[at.start..].as_ptr().wrapping_add(4 * MR * row.len());
    for line in (0..at.len()).step_by(64) {
        // SAFETY: a prefetch reads nothing architecturally (SSE, part of
        // x86-64).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line).cast()) };
    }
}
