//! The generation engine on tiny random models: requests that join, leave
//! and are aborted between steps (directly and from a second thread through
//! the documented driver), preemption under a small KV pool, prefix
//! sharing, and bad requests. The reference for every sequence is the same
//! request run alone in an engine with room to spare; the f64 reference
//! tests (`tiny_models.rs`) check that single runs are right.

#[path = "../../te-models/tests/tiny/mod.rs"]
mod tiny;

use std::collections::BTreeMap;

use te_engine::generate::{generate, Control};
use te_engine::sampling::SamplingParams;
use te_engine::{channel, Engine, EngineConfig, Event, FinishReason, Request, RequestError};
use te_models::model::Model;
use tiny::{Checkpoint, Spec};

/// A prompt of `len` tokens from `seed` (ids below the tiny vocabulary).
fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 7 + i * 13 + i * i) % 50 + 1)
        .collect()
}

fn roomy() -> EngineConfig {
    EngineConfig {
        max_batch_size: 1,
        page_size: 4,
        prefill_chunk: 16,
        kv_cache_tokens: Some(128),
        ..EngineConfig::default()
    }
}

/// Each request alone.
fn alone(model: &Model, requests: &[Request]) -> Vec<Vec<u32>> {
    requests
        .iter()
        .map(|r| {
            generate(model, std::slice::from_ref(r), &roomy(), |_, _| {
                Control::Continue
            })
            .expect("alone")[0]
                .tokens
                .clone()
        })
        .collect()
}

fn request(seed: u32, len: usize, new: usize) -> Request {
    Request {
        ignore_eos: true,
        ..Request::new(prompt(seed, len), new)
    }
}

/// Runs the engine until done, collecting tokens and finish reasons by id.
fn drain(engine: &mut Engine) -> BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> {
    let mut out: BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> = BTreeMap::new();
    engine
        .run_to_completion(|e| match e {
            Event::Token { id, token, .. } => out.entry(id).or_default().0.push(token),
            Event::Finished { id, reason, .. } => {
                let slot = &mut out.entry(id).or_default().1;
                assert!(slot.is_none(), "request {id} finished twice");
                *slot = Some(reason);
            }
        })
        .expect("run");
    out
}

#[test]
fn requests_join_and_leave_between_steps() {
    let ck = Checkpoint::write(Spec::llama());
    let model = ck.load().expect("load");
    let reqs = [request(1, 9, 12), request(2, 21, 15), request(3, 5, 10)];
    let want = alone(&model, &reqs);
    let config = EngineConfig {
        max_batch_size: 4,
        page_size: 4,
        prefill_chunk: 8,
        kv_cache_tokens: Some(96),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, None, config).unwrap();
    let a = engine.add_request(reqs[0].clone()).unwrap();
    let b = engine.add_request(reqs[1].clone()).unwrap();
    let mut got: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    fn record(events: Vec<Event>, got: &mut BTreeMap<u64, Vec<u32>>) {
        for e in events {
            if let Event::Token { id, token, .. } = e {
                got.entry(id).or_default().push(token);
            }
        }
    }
    for _ in 0..5 {
        let ev = engine.step().unwrap();
        record(ev, &mut got);
    }
    // c joins mid-run; b leaves mid-decode and its pages return at once.
    let c = engine.add_request(reqs[2].clone()).unwrap();
    let before = engine.kv_tokens_in_use();
    assert!(before > 0);
    engine.abort(b).unwrap();
    let after = engine.kv_tokens_in_use();
    assert!(after < before, "abort freed nothing ({before} -> {after})");
    // b held 21 prompt tokens plus what it generated, in pages of 4, of
    // which whole pages stay cached for reuse (free, not in use).
    assert!(before - after >= 20, "{before} -> {after}");
    assert_eq!(engine.abort(b), Err(RequestError::Unknown(b)));
    let ev = engine.step().unwrap();
    assert!(ev
        .iter()
        .any(|e| matches!(e, Event::Finished { id, reason: FinishReason::Abort, .. } if *id == b)));
    record(ev, &mut got);
    let rest = drain(&mut engine);
    for (id, (toks, reason)) in rest {
        got.entry(id).or_default().extend(toks);
        if id != b {
            assert_eq!(reason, Some(FinishReason::Length), "request {id}");
        }
    }
    assert_eq!(got[&a], want[0], "a");
    assert_eq!(got[&c], want[2], "c");
    assert!(got.get(&b).map_or(0, Vec::len) < 15);
    assert_eq!(engine.kv_tokens_in_use(), 0);
    assert!(!engine.has_work());
}

#[test]
fn driver_serves_other_threads() {
    let ck = Checkpoint::write(Spec::gemma2());
    let model = ck.load().expect("load");
    // Client 1 asks for many tokens so that its abort lands mid-stream.
    let reqs: Vec<Request> = (0..6)
        .map(|i| request(10 + i, 3 + 4 * i as usize, if i == 1 { 40 } else { 12 }))
        .collect();
    let want = alone(&model, &reqs);
    let config = EngineConfig {
        max_batch_size: 3,
        page_size: 4,
        prefill_chunk: 8,
        kv_cache_tokens: Some(64),
        ..EngineConfig::default()
    };
    // The abort races the engine's steps: up to ATTEMPTS runs, until one
    // lands mid-stream.
    const ATTEMPTS: usize = 5;
    let mut aborted = false;
    for _ in 0..ATTEMPTS {
        let mut engine = Engine::new(&model, None, config.clone()).unwrap();
        let (handle, commands) = channel();
        std::thread::scope(|s| {
            let engine = &mut engine;
            let runner = s.spawn(move || engine.run(commands));
            let mut clients = Vec::new();
            for (i, r) in reqs.iter().cloned().enumerate() {
                let handle = handle.clone();
                clients.push(s.spawn(move || {
                    let (id, rx) = handle.submit(r).unwrap().unwrap();
                    let mut toks = Vec::new();
                    for e in rx {
                        match e {
                            Event::Token { token, .. } => {
                                toks.push(token);
                                // Client 1 aborts after 3 tokens, client 2
                                // hangs up after 2.
                                if i == 1 && toks.len() == 3 {
                                    handle.abort(id).unwrap();
                                }
                                if i == 2 && toks.len() == 2 {
                                    return (i, toks, None);
                                }
                            }
                            Event::Finished { reason, .. } => return (i, toks, Some(reason)),
                        }
                    }
                    panic!("client {i}: the stream ended without a Finished event");
                }));
            }
            // A bad request from another thread is refused alone.
            let bad = handle.submit(Request::new(vec![], 4)).unwrap();
            assert!(matches!(
                bad,
                Err(RequestError::Invalid {
                    field: "prompt_tokens",
                    ..
                })
            ));
            for c in clients {
                let (i, toks, reason) = c.join().unwrap();
                match i {
                    1 if reason == Some(FinishReason::Abort) => {
                        assert!(toks.len() < 40 && toks[..] == want[1][..toks.len()]);
                        aborted = true;
                    }
                    // The tiny model can finish all 40 tokens before the
                    // client's thread gets to send its abort: then it must
                    // have run to its length, and the scenario runs again.
                    1 => {
                        assert_eq!(reason, Some(FinishReason::Length));
                        assert_eq!(toks, want[1]);
                    }
                    2 => assert_eq!(toks[..], want[2][..2]),
                    _ => {
                        assert_eq!(reason, Some(FinishReason::Length), "client {i}");
                        assert_eq!(toks, want[i], "client {i}");
                    }
                }
            }
            drop(handle);
            runner.join().unwrap().unwrap();
        });
        assert_eq!(engine.kv_tokens_in_use(), 0, "pages leaked");
        assert!(!engine.has_work());
        if aborted {
            return;
        }
    }
    panic!("client 1's abort never landed mid-stream in {ATTEMPTS} runs");
}

#[test]
fn preemption_under_a_small_pool_keeps_every_token() {
    for spec in [Spec::llama(), Spec::gemma2(), Spec::gemma3()] {
        let ck = Checkpoint::write(spec);
        let model = ck.load().expect("load");
        let reqs: Vec<Request> = (0..10)
            .map(|i| request(20 + i, 1 + (i as usize * 7) % 30, 8 + (i as usize * 5) % 20))
            .collect();
        let want = alone(&model, &reqs);
        // Together they need ~10 x 40 tokens; the pool holds 64.
        let config = EngineConfig {
            max_batch_size: 6,
            page_size: 4,
            prefill_chunk: 8,
            max_step_tokens: 20,
            kv_cache_tokens: Some(64),
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&model, None, config).unwrap();
        for r in &reqs {
            engine.add_request(r.clone()).unwrap();
        }
        let got = drain(&mut engine);
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&got[&(i as u64)].0, w, "{:?} request {i}", ck.spec.family);
            assert_eq!(got[&(i as u64)].1, Some(FinishReason::Length));
        }
        let stats = engine.stats();
        assert!(stats.preemptions > 0, "{:?}: no preemption", ck.spec.family);
        assert!(stats.peak_kv_tokens <= engine.kv_capacity_tokens());
        assert_eq!(engine.kv_tokens_in_use(), 0);
    }
}

#[test]
fn shared_prefixes_are_computed_once() {
    let ck = Checkpoint::write(Spec::llama());
    let model = ck.load().expect("load");
    let stem = prompt(40, 22); // five whole pages of 4, and two tokens
    let reqs: Vec<Request> = (0..6)
        .map(|i| {
            let mut p = stem.clone();
            p.extend(prompt(50 + i, 3));
            Request {
                ignore_eos: true,
                ..Request::new(p, 6)
            }
        })
        .collect();
    let want = alone(&model, &reqs);
    let run = |prefix_caching: bool| {
        let config = EngineConfig {
            max_batch_size: 6,
            page_size: 4,
            prefill_chunk: 32,
            kv_cache_tokens: Some(120),
            prefix_caching,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&model, None, config).unwrap();
        for r in &reqs {
            engine.add_request(r.clone()).unwrap();
        }
        let got = drain(&mut engine);
        (got, engine.stats().clone())
    };
    let (shared, stats) = run(true);
    let (unshared, no_stats) = run(false);
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&shared[&(i as u64)].0, w, "request {i} with sharing");
        assert_eq!(&unshared[&(i as u64)].0, w, "request {i} without sharing");
    }
    // Five whole pages (20 tokens) of the stem, for each of the 5 later
    // requests.
    assert!(stats.prefix_hit_tokens >= 5 * 20, "{stats:?}");
    assert_eq!(no_stats.prefix_hit_tokens, 0);
    // Computed: 25 + 5 x 5 prompt tokens (plus decode tokens of the same
    // steps) instead of 6 x 25.
    assert!(
        2 * stats.prefill_tokens < no_stats.prefill_tokens,
        "{stats:?} vs {no_stats:?}"
    );
}

#[test]
fn bad_requests_fail_alone() {
    let ck = Checkpoint::write(Spec::llama());
    let model = ck.load().expect("load"); // context 128, vocab 53
    let config = EngineConfig {
        kv_cache_tokens: Some(64),
        page_size: 4,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, None, config).unwrap();
    let good = engine.add_request(request(60, 7, 5)).unwrap();
    let field = |r: Result<u64, RequestError>| match r {
        Err(RequestError::Invalid { field, .. }) => field.to_string(),
        Err(RequestError::TooLong { what, .. }) => what.to_string(),
        other => panic!("expected an error, got {other:?}"),
    };
    assert_eq!(
        field(engine.add_request(Request::new(vec![], 3))),
        "prompt_tokens"
    );
    assert_eq!(
        field(engine.add_request(Request::new(vec![1, 53], 3))),
        "prompt_tokens"
    );
    assert_eq!(
        field(engine.add_request(request(1, 128, 3))),
        "model's context"
    );
    assert_eq!(
        field(engine.add_request(request(1, 64, 3))),
        "KV cache (--kv-cache-tokens)"
    );
    let bad_sampling = Request {
        sampling: SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        ..request(1, 4, 3)
    };
    assert_eq!(field(engine.add_request(bad_sampling)), "sampling");
    let empty_stop = Request {
        stop: vec![String::new()],
        ..request(1, 4, 3)
    };
    assert_eq!(field(engine.add_request(empty_stop)), "stop");
    let no_tokenizer = Request {
        stop: vec!["x".into()],
        ..request(1, 4, 3)
    };
    assert_eq!(field(engine.add_request(no_tokenizer)), "stop");
    let msg = engine
        .add_request(request(1, 64, 3))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("64 tokens") && msg.contains("--kv-cache-tokens"),
        "{msg}"
    );
    // The good request is undisturbed.
    let want = alone(&model, &[request(60, 7, 5)]);
    let got = drain(&mut engine);
    assert_eq!(got.len(), 1);
    assert_eq!(got[&good].0, want[0]);
    // A request for no tokens finishes at once.
    let zero = engine.add_request(request(2, 3, 0)).unwrap();
    let ev = engine.step().unwrap();
    assert!(
        matches!(&ev[..], [Event::Finished { id, reason: FinishReason::Length, .. }] if *id == zero)
    );
}

mod interleavings {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// A request: prompt seed, prompt length, new tokens, whether it
        /// shares a stem with the others.
        Add(u32, usize, usize, bool),
        /// Abort the k-th unfinished request (if any).
        Abort(usize),
        /// Run this many steps.
        Steps(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u32..40, 1usize..30, 0usize..12, any::<bool>()).prop_map(|(s, l, n, p)| Op::Add(s, l, n, p)),
            1 => (0usize..8).prop_map(Op::Abort),
            3 => (1usize..6).prop_map(Op::Steps),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Random interleavings of adds (with shared prefixes), aborts and
        /// steps under a small pool (preemption): the cache's bookkeeping
        /// stays consistent after every operation, usage never exceeds the
        /// capacity, every page is back at the end, and every request that
        /// was not aborted gets exactly its tokens alone.
        #[test]
        fn engine_bookkeeping_balances(ops in prop::collection::vec(op(), 1..30), pool in 40usize..100) {
            let ck = Checkpoint::write(Spec { seed: 31, ..Spec::llama() });
            let model = ck.load().expect("load");
            let config = EngineConfig {
                max_batch_size: 4,
                page_size: 4,
                prefill_chunk: 8,
                max_step_tokens: 16,
                kv_cache_tokens: Some(pool),
                ..EngineConfig::default()
            };
            let mut engine = Engine::new(&model, None, config).unwrap();
            let mut requests: BTreeMap<u64, Request> = BTreeMap::new();
            let mut aborted = std::collections::BTreeSet::new();
            let mut out: BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> = BTreeMap::new();
            let record = |events: Vec<Event>, out: &mut BTreeMap<u64, (Vec<u32>, Option<FinishReason>)>| {
                for e in events {
                    match e {
                        Event::Token { id, token, .. } => out.entry(id).or_default().0.push(token),
                        Event::Finished { id, reason, .. } => out.entry(id).or_default().1 = Some(reason),
                    }
                }
            };
            for op in ops {
                match op {
                    Op::Add(seed, len, new, shared) => {
                        let mut p = if shared { prompt(99, 9) } else { vec![] };
                        p.extend(prompt(seed, len));
                        let r = Request { ignore_eos: true, ..Request::new(p, new) };
                        match engine.add_request(r.clone()) {
                            Ok(id) => { requests.insert(id, r); }
                            Err(e) => prop_assert!(r.prompt_tokens.len() >= engine.kv_capacity_tokens(), "{e}"),
                        }
                    }
                    Op::Abort(k) => {
                        // Requests without a Finished event yet and not aborted.
                        let live: Vec<u64> = requests
                            .keys()
                            .copied()
                            .filter(|id| !aborted.contains(id) && out.get(id).is_none_or(|o| o.1.is_none()))
                            .collect();
                        if let Some(&id) = live.get(k) {
                            let before = engine.kv_tokens_in_use();
                            match engine.abort(id) {
                                Ok(()) => {
                                    aborted.insert(id);
                                }
                                // Finished already, its event still pending:
                                // a request for no tokens.
                                Err(RequestError::Unknown(_)) => prop_assert_eq!(requests[&id].max_new_tokens, 0),
                                Err(e) => return Err(TestCaseError::fail(e.to_string())),
                            }
                            prop_assert!(engine.kv_tokens_in_use() <= before);
                        }
                    }
                    Op::Steps(n) => {
                        for _ in 0..n {
                            let ev = engine.step().unwrap();
                            record(ev, &mut out);
                        }
                    }
                }
                engine.cache().check_consistency().map_err(TestCaseError::fail)?;
                prop_assert!(engine.kv_tokens_in_use() <= engine.kv_capacity_tokens());
            }
            while engine.has_work() {
                let ev = engine.step().unwrap();
                record(ev, &mut out);
                engine.cache().check_consistency().map_err(TestCaseError::fail)?;
            }
            prop_assert_eq!(engine.kv_tokens_in_use(), 0);
            for (id, r) in &requests {
                let (toks, reason) = &out[id];
                prop_assert!(reason.is_some(), "request {} never finished", id);
                if *reason == Some(FinishReason::Abort) {
                    continue;
                }
                let want = alone(&model, std::slice::from_ref(r));
                let n = r.prompt_tokens.len();
                if n + r.max_new_tokens > engine.kv_capacity_tokens() {
                    // Alone it fills the pool: cut short, with `length`.
                    prop_assert_eq!(*reason, Some(FinishReason::Length));
                    prop_assert!(toks.len() >= engine.kv_capacity_tokens() - n);
                    prop_assert_eq!(&toks[..], &want[0][..toks.len()], "request {}", id);
                } else {
                    prop_assert_eq!(toks, &want[0], "request {}", id);
                }
            }
        }
    }
}

/// Greedy generation through `generate` (continuous batching, paged cache,
/// chunked prefill) on Gemma 3 with window 8: the 40-token prompt and the
/// tokens it produces match greedy decoding of the f64 reference.
#[test]
fn gemma3_greedy_generation_past_the_window_matches_f64_reference() {
    let ck = Checkpoint::write(Spec::gemma3());
    let model = ck.load().expect("load");
    let prompts = {
        let mut rng = tiny::Rng::new(ck.spec.seed + 1000);
        let vocab = ck.spec.vocab_size;
        vec![rng.tokens(40, vocab), rng.tokens(40 * 2 / 3 + 1, vocab)]
    };
    let new_tokens = 8;
    let mut expected = Vec::new();
    for prompt in &prompts {
        let mut tokens = prompt.clone();
        for _ in 0..new_tokens {
            let last = ck.reference(&tokens).pop().expect("a row");
            let mut order: Vec<usize> = (0..last.len()).collect();
            order.sort_by(|&i, &j| last[j].total_cmp(&last[i]));
            assert!(
                last[order[0]] - last[order[1]] > 1e-3,
                "near-tie in the reference; pick another seed"
            );
            tokens.push(order[0] as u32);
        }
        expected.push(tokens[prompt.len()..].to_vec());
    }
    let requests: Vec<Request> = prompts
        .iter()
        .map(|p| Request {
            ignore_eos: true,
            ..Request::new(p.clone(), new_tokens)
        })
        .collect();
    let config = EngineConfig {
        max_batch_size: 2,
        prefill_chunk: 7,
        max_step_tokens: 10,
        page_size: 4,
        ..EngineConfig::default()
    };
    let out = generate(&model, &requests, &config, |_, _| Control::Continue).expect("generate");
    for (i, (o, want)) in out.iter().zip(&expected).enumerate() {
        assert_eq!(&o.tokens, want, "request {i}");
    }
}
