//! The scheduler without a model: a paged KV pool of a few pages, and a
//! fake runner that "computes" each scheduled step by giving every
//! sequence that completes its feed the next token `1000 + id`. The
//! expected feeds, admissions, preemptions and prefix hits are worked out
//! by hand from the rules in `scheduler.rs`' module doc.

use te_cache::{CacheLayout, CacheShape, HostKvStorage, InferenceParams};
use te_engine::scheduler::{Schedule, Scheduler, SchedulerConfig, SeqState};
use te_kernels::DType;

/// A one-layer cache of `pages` pages of `page_size` tokens.
fn pool(pages: usize, page_size: usize) -> InferenceParams<HostKvStorage> {
    InferenceParams::new(CacheShape {
        max_batch_size: 8,
        max_seqlen: 1024,
        num_layers: 1,
        num_heads_kv: 1,
        head_dim_k: 1,
        head_dim_v: 1,
        dtype: DType::F32,
        layout: CacheLayout::Paged {
            page_size,
            total_num_pages: pages,
        },
    })
    .expect("a small pool")
}

fn config(prefix_caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_size: 8,
        prefill_chunk: 64,
        max_step_tokens: 256,
        prefix_caching,
    }
}

fn seq(id: u64, tokens: &[u32]) -> SeqState<()> {
    SeqState::new(id, tokens.to_vec(), ())
}

/// Ids of the running sequences, in batch order.
fn running(s: &Scheduler<HostKvStorage, ()>) -> Vec<u64> {
    s.running().iter().map(|q| q.id).collect()
}

/// Admits and schedules one step; on `Step`, runs the fake forward: each
/// sequence whose feed reaches its last token gets token `1000 + id`.
/// Returns the feed (empty when idle).
fn step(s: &mut Scheduler<HostKvStorage, ()>) -> Vec<usize> {
    s.admit().expect("admit");
    match s.schedule().expect("schedule") {
        Schedule::Idle => Vec::new(),
        Schedule::PoolFull(q) => panic!("sequence {} does not fit the pool", q.id),
        Schedule::Step { feed } => {
            let picks: Vec<bool> = s
                .running()
                .iter()
                .zip(&feed)
                .map(|(q, &n)| q.completes_with(n))
                .collect();
            s.advance(&feed, &vec![0; feed.len()]).expect("advance");
            for (q, pick) in s.running_mut().iter_mut().zip(picks) {
                if pick {
                    let next = 1000 + q.id as u32;
                    q.tokens.push(next);
                }
            }
            feed
        }
    }
}

#[test]
fn admission_waits_for_pages_under_a_small_pool() {
    // 4 pages of 4 tokens. A's 10 tokens take 3 pages; B (2 tokens) needs
    // its page plus one per running sequence: 2 > 1 free, so it waits.
    let mut s = Scheduler::new(pool(4, 4), config(false)).unwrap();
    s.enqueue(seq(0, &[1; 10]));
    assert_eq!(step(&mut s), vec![10]);
    s.enqueue(seq(1, &[2, 3]));
    assert_eq!(step(&mut s), vec![1], "A decodes alone");
    assert_eq!((running(&s), s.num_waiting()), (vec![0], 1));
    // A finishes: its pages come back and B is admitted.
    let a = s.finish(0).unwrap();
    assert_eq!(a.tokens.len(), 12);
    assert_eq!(s.kv_tokens_in_use(), 0);
    assert_eq!(step(&mut s), vec![2]);
    assert_eq!(running(&s), vec![1]);
}

#[test]
fn the_latest_admitted_is_preempted_and_recomputed_first() {
    // 4 pages of 4 tokens, three 6-token prompts: all three are admitted
    // (free pages are counted before the step), but their 2 + 2 + 2 pages
    // do not fit: the latest (2) is preempted, then 0 and 1 run.
    let mut s = Scheduler::new(pool(4, 4), config(false)).unwrap();
    for id in 0..3 {
        s.enqueue(seq(id, &[id as u32 + 1; 6]));
    }
    assert_eq!(step(&mut s), vec![6, 6]);
    assert_eq!(running(&s), vec![0, 1]);
    assert_eq!(s.num_waiting(), 1);
    assert_eq!(s.stats().preemptions, 1);
    // Positions 6 and 7 fit their second pages.
    assert_eq!(step(&mut s), vec![1, 1]);
    assert_eq!(step(&mut s), vec![1, 1]);
    // Position 8 needs a third page each and none is free: 1 (admitted
    // after 0) is preempted, keeping its tokens.
    assert_eq!(step(&mut s), vec![1]);
    assert_eq!(running(&s), vec![0]);
    assert_eq!((s.num_waiting(), s.stats().preemptions), (2, 2));
    // When 0 leaves, 1 comes back first (front of the queue) and
    // recomputes its 9 tokens; 2 is admitted with it but preempted again
    // (3 + 2 pages > 4).
    s.finish(0).unwrap();
    assert_eq!(step(&mut s), vec![9]);
    assert_eq!(running(&s), vec![1]);
    assert_eq!(s.stats().preemptions, 3);
    let mut want = vec![2; 6];
    want.extend([1001; 4]);
    assert_eq!(s.running()[0].tokens, want);
}

#[test]
fn a_sequence_that_fills_the_pool_alone_leaves() {
    let mut s = Scheduler::new(pool(2, 4), config(false)).unwrap();
    s.enqueue(seq(7, &[1; 8]));
    assert_eq!(step(&mut s), vec![8]);
    s.admit().unwrap();
    match s.schedule().unwrap() {
        Schedule::PoolFull(q) => assert_eq!((q.id, q.tokens.len()), (7, 9)),
        other => panic!("expected PoolFull, got {other:?}"),
    }
    assert!(!s.has_work());
    assert_eq!(s.kv_tokens_in_use(), 0);
}

#[test]
fn prompts_share_registered_prefix_pages() {
    let mut s = Scheduler::new(pool(16, 4), config(true)).unwrap();
    let a: Vec<u32> = (1..=9).collect();
    s.enqueue(seq(0, &a));
    assert_eq!(step(&mut s), vec![9]);
    s.finish(0).unwrap();
    // B starts with A's first 8 tokens (two full pages, registered and
    // still cached): only its last 3 tokens are computed.
    let mut b: Vec<u32> = (1..=8).collect();
    b.extend([50, 51, 52]);
    s.enqueue(seq(1, &b));
    assert_eq!(step(&mut s), vec![3]);
    assert_eq!(s.running()[0].cached_prompt_tokens, 8);
    assert_eq!(s.stats().prefix_hit_tokens, 8);
    // Without prefix caching the same prompts share nothing.
    let mut s = Scheduler::new(pool(16, 4), config(false)).unwrap();
    s.enqueue(seq(0, &a));
    step(&mut s);
    s.finish(0).unwrap();
    s.enqueue(seq(1, &b));
    assert_eq!(step(&mut s), vec![11]);
    assert_eq!(s.stats().prefix_hit_tokens, 0);
}

#[test]
fn abort_frees_pages_of_running_and_waiting_sequences() {
    let mut s = Scheduler::new(pool(4, 4), config(false)).unwrap();
    s.enqueue(seq(0, &[1; 10]));
    s.enqueue(seq(1, &[2; 10]));
    assert_eq!(step(&mut s), vec![10], "1 is preempted: 3 + 3 pages > 4");
    assert_eq!(s.num_waiting(), 1);
    assert_eq!(s.abort(1).unwrap().map(|q| q.id), Some(1));
    assert_eq!(s.num_waiting(), 0);
    assert_eq!(s.abort(0).unwrap().map(|q| q.id), Some(0));
    assert_eq!(s.kv_tokens_in_use(), 0);
    assert!(s.abort(0).unwrap().is_none(), "already gone");
    assert!(!s.has_work());
}

#[test]
fn prompts_are_chunked_within_the_step_budget() {
    let cfg = SchedulerConfig {
        max_batch_size: 8,
        prefill_chunk: 4,
        max_step_tokens: 6,
        prefix_caching: false,
    };
    let mut s = Scheduler::new(pool(32, 4), cfg).unwrap();
    s.enqueue(seq(0, &[1; 10]));
    s.enqueue(seq(1, &[2; 10]));
    // Chunks of at most 4, at most 6 tokens a step: 4 + 2.
    assert_eq!(step(&mut s), vec![4, 2]);
    assert_eq!(step(&mut s), vec![4, 2]);
    // 0 has 2 prompt tokens left, 1 has 6: 2 + 4, 0 completes its prompt.
    assert_eq!(step(&mut s), vec![2, 4]);
    assert_eq!(s.running()[0].tokens.len(), 11);
    // Decoders take one token first, then the budget's rest goes to
    // prompts: 0 decodes, 1 feeds its last 2 prompt tokens.
    assert_eq!(step(&mut s), vec![1, 2]);
    assert_eq!(step(&mut s), vec![1, 1]);
}

#[test]
fn step_tokens_are_each_sequences_next_chunk_in_thd_order() {
    let cfg = SchedulerConfig {
        max_batch_size: 8,
        prefill_chunk: 3,
        max_step_tokens: 64,
        prefix_caching: false,
    };
    let mut s = Scheduler::new(pool(32, 4), cfg).unwrap();
    s.enqueue(seq(0, &[10, 11, 12, 13, 14]));
    s.enqueue(seq(1, &[20, 21]));
    s.admit().unwrap();
    let Schedule::Step { feed } = s.schedule().unwrap() else {
        panic!("a step")
    };
    assert_eq!(feed, vec![3, 2]);
    // 0's first chunk, then all of 1's prompt; both are still prefilling.
    assert_eq!(s.step_tokens(&feed), (vec![10, 11, 12, 20, 21], true));
    s.advance(&feed, &vec![0; feed.len()]).unwrap();
    s.running_mut()[1].tokens.push(99);
    let Schedule::Step { feed } = s.schedule().unwrap() else {
        panic!("a step")
    };
    assert_eq!(feed, vec![2, 1]);
    assert_eq!(s.step_tokens(&feed), (vec![13, 14, 99], true));
    s.advance(&feed, &vec![0; feed.len()]).unwrap();
    s.running_mut()[0].tokens.push(98);
    s.running_mut()[1].tokens.push(97);
    let Schedule::Step { feed } = s.schedule().unwrap() else {
        panic!("a step")
    };
    // Both decode: no prompt token left in the step.
    assert_eq!(s.step_tokens(&feed), (vec![98, 97], false));
}

#[test]
fn a_prompt_waits_for_the_same_first_page_in_flight_and_then_shares_it() {
    let cfg = SchedulerConfig {
        max_batch_size: 8,
        prefill_chunk: 4,
        max_step_tokens: 64,
        prefix_caching: true,
    };
    let mut s = Scheduler::new(pool(32, 4), cfg).unwrap();
    let a: Vec<u32> = (1..=10).collect();
    let mut b: Vec<u32> = (1..=8).collect();
    b.extend([60, 61]);
    s.enqueue(seq(0, &a));
    s.enqueue(seq(1, &b));
    // B begins with A's first page while A is still computing its prompt:
    // B waits (feed 0) until A's prompt is done.
    assert_eq!(step(&mut s), vec![4, 0]);
    assert_eq!(step(&mut s), vec![4, 0]);
    assert_eq!(step(&mut s), vec![2, 0]);
    // Then it takes A's two registered pages and computes only its last 2.
    assert_eq!(step(&mut s), vec![1, 2]);
    assert_eq!(s.running()[1].cached_prompt_tokens, 8);
    assert_eq!(s.stats().prefix_hit_tokens, 8);
}

/// Drafts: fed after the last token within the step's budget, dropped
/// before anyone is preempted for their pages, and rolled back by
/// `advance` past the rejected ones (pages given back).
#[test]
fn drafts_are_fed_shortened_dropped_before_preemption_and_rolled_back() {
    // 3 pages of 4 tokens; A (3 tokens) and B (2) prefill in one step of
    // the budget of 5, a page each.
    let cfg = SchedulerConfig {
        max_step_tokens: 5,
        ..config(false)
    };
    let mut s = Scheduler::new(pool(3, 4), cfg).unwrap();
    s.enqueue(seq(0, &[1, 2, 3]));
    s.enqueue(seq(1, &[7, 8]));
    assert_eq!(step(&mut s), vec![3, 2]);
    assert!(s.running().iter().all(|q| q.decoding()));
    // A drafts 2, B 3: the budget of 5 takes both last tokens and 3
    // drafted tokens, A's first; B's draft is cut to 1.
    s.running_mut()[0].draft = vec![40, 41];
    s.running_mut()[1].draft = vec![50, 51, 52];
    let Schedule::Step { feed } = s.schedule().unwrap() else {
        panic!("a step")
    };
    assert_eq!(feed, vec![3, 2]);
    assert_eq!(s.running()[1].draft, vec![50]);
    assert_eq!(s.step_tokens(&feed), (vec![1000, 40, 41, 1001, 50], false));
    assert_eq!(s.cache().pages_in_use(0).unwrap(), 3);
    // A accepts 1 of 2, B none: one drafted token of each rolled back.
    s.running_mut()[0].tokens.push(40);
    s.advance(&feed, &[1, 1]).unwrap();
    assert_eq!(s.cache().cached_tokens(0), 5);
    assert_eq!(s.cache().cached_tokens(1), 3);
    assert!(s.running().iter().all(|q| q.draft.is_empty()));
    s.running_mut()[0].tokens.push(1000);
    s.running_mut()[1].tokens.push(1001);
    // Plain decode fits the 3 pages; A's draft of 3 would need a fourth:
    // the drafts go, nobody is preempted.
    s.running_mut()[0].draft = vec![60; 3];
    let Schedule::Step { feed } = s.schedule().unwrap() else {
        panic!("a step")
    };
    assert_eq!(feed, vec![1, 1]);
    assert!(s.running()[0].draft.is_empty());
    assert_eq!(running(&s), vec![0, 1]);
    assert_eq!(s.stats().preemptions, 0);
}
