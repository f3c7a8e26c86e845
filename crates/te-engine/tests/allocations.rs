//! Heap allocations of a decode step do not grow with the number of
//! layers: every layer's buffers come from the engine's reused workspace.
//! A counting global allocator counts the allocations of one
//! `Engine::step` on tiny models of 2 and 6 layers (run inside a rayon
//! pool, as the model's parallel ops would be in a server's engine thread,
//! so that rayon's own job queue does not allocate per parallel call).

#[path = "../../te-models/tests/tiny/mod.rs"]
mod tiny;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use te_engine::{Engine, EngineConfig, Request};
use tiny::{Checkpoint, Spec};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations of each of several decode steps (after warm-up) on a model
/// of `layers` layers decoding `batch` sequences.
fn decode_step_allocations(layers: usize, batch: usize) -> Vec<usize> {
    let ck = Checkpoint::write(Spec {
        num_hidden_layers: layers,
        sliding_layers: vec![false; layers],
        ..Spec::llama()
    });
    let model = ck.load().expect("load");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| {
        let config = EngineConfig {
            max_batch_size: batch,
            page_size: 4,
            kv_cache_tokens: Some(128),
            prefix_caching: false,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&model, None, config).unwrap();
        for b in 0..batch {
            let prompt: Vec<u32> = (0..5 + b as u32)
                .map(|i| (i * 11 + b as u32) % 50)
                .collect();
            engine
                .add_request(Request {
                    ignore_eos: true,
                    ..Request::new(prompt, 40)
                })
                .unwrap();
        }
        // Prefill and a few decode steps grow every buffer.
        for _ in 0..6 {
            engine.step().unwrap();
        }
        (0..4)
            .map(|_| {
                let before = ALLOCATIONS.load(Ordering::SeqCst);
                engine.step().unwrap();
                ALLOCATIONS.load(Ordering::SeqCst) - before
            })
            .collect()
    })
}

#[test]
fn decode_allocations_do_not_grow_with_layers() {
    for batch in [1, 3] {
        let few = decode_step_allocations(2, batch);
        let many = decode_step_allocations(6, batch);
        eprintln!("batch {batch}: 2 layers {few:?}, 6 layers {many:?}");
        // Per step the same count (events, the step's token list, the
        // plan): nothing per layer.
        assert_eq!(
            few.iter().min(),
            many.iter().min(),
            "batch {batch}: 2 layers {few:?}, 6 layers {many:?}"
        );
        assert!(many.iter().max().unwrap() <= &(few.iter().max().unwrap() + 2));
    }
}
