//! A global allocator for tests that counts allocations per thread and
//! records the largest single request (all threads) since the last reset.
//! Install it in a test binary with
//! `#[global_allocator] static A: alloc_counter::Counting = alloc_counter::Counting;`.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts and forwards to the system allocator.
pub struct Counting;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

static LARGEST: AtomicUsize = AtomicUsize::new(0);

fn note(size: usize) {
    let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    LARGEST.fetch_max(size, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's arguments.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations (including reallocations) made by the current thread so far.
pub fn allocations() -> u64 {
    COUNT.with(Cell::get)
}

/// Forgets the largest request seen so far.
pub fn reset_largest() {
    LARGEST.store(0, Ordering::Relaxed);
}

/// The largest single allocation request, in bytes, since [`reset_largest`].
pub fn largest() -> usize {
    LARGEST.load(Ordering::Relaxed)
}
