//! Model throughput: prompt processing (a 128-token prompt) and generation
//! (64 new tokens, greedy) on each known model. No peer column: figures
//! recorded on another machine are not comparable; the same-run
//! comparison with llama.cpp is `cargo xtask bench --vs-llama-cpp`
//! (`bench_peers`), through `te bench`.

use std::time::Instant;

use anyhow::Context;
use te_engine::generate::{generate, Control};
use te_engine::{EngineConfig, Request};
use te_models::model::Logits;

/// Markdown rows: `| model | test | te-rs tok/s |`.
pub fn run(models: &[&str]) -> anyhow::Result<Vec<String>> {
    let mut rows = Vec::new();
    for &name in models {
        let source = te_models::source::resolve_model(name)?;
        let loaded =
            te_models::loader::load_model(&source).with_context(|| format!("loading {name}"))?;
        let model = &loaded.model;
        // Prompt processing: 128 tokens in one step (best of 3).
        let prompt: Vec<u32> = (0..128u32).map(|i| 1000 + i * 7).collect();
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let mut cache = model.new_cache(1, 128, 128, te_cache::CacheLayout::Contiguous)?;
            cache.pre_step(&[(0, 128)])?;
            let start = Instant::now();
            model.forward(&prompt, &mut cache, Logits::Last)?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        let pp = 128.0 / best;
        // Generation: 64 tokens after a short prompt, timed from the first
        // generated token to the last (prefill excluded).
        let request = Request {
            ignore_eos: true,
            ..Request::new(prompt[..8].to_vec(), 65)
        };
        let mut first = None;
        let mut last = Instant::now();
        generate(model, &[request], &EngineConfig::default(), |_, _| {
            let now = Instant::now();
            first.get_or_insert(now);
            last = now;
            Control::Continue
        })?;
        let tg = 64.0 / (last - first.expect("tokens were generated")).as_secs_f64();
        rows.push(format!("| {name} | pp128 | {pp:.1} |"));
        rows.push(format!("| {name} | tg64 | {tg:.1} |"));
    }
    Ok(rows)
}
