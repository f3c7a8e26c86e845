//! Engine benchmarks: prefix reuse. 16 requests whose prompts share a
//! ~400-token prefix (different endings), one new token each, run with and
//! without prefix caching in the same invocation; the rows give the
//! prefill seconds (the engine's `prefill_s`), the prompt tokens computed
//! and those served from shared pages.

use std::time::Instant;

use anyhow::Context;
use te_engine::{Engine, EngineConfig, Request};

/// Markdown rows: `| case | prefix caching | prefill s | tokens computed | prefix hits | wall s |`.
pub fn run(model_name: &str) -> anyhow::Result<Vec<String>> {
    let source = te_models::source::resolve_model(model_name)?;
    let loaded =
        te_models::loader::load_model(&source).with_context(|| format!("loading {model_name}"))?;
    let stem = "The committee met on Tuesdays, and the minutes were always late. ".repeat(28);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| loaded.tokenizer.encode(&format!("{stem}Item {i}:"), true))
        .collect::<te_tokenizer::Result<_>>()?;
    let mut rows = Vec::new();
    for caching in [false, true] {
        let config = EngineConfig {
            prefix_caching: caching,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new(&loaded.model, Some(&loaded.tokenizer), config)?;
        for p in &prompts {
            engine
                .add_request(Request {
                    ignore_eos: true,
                    ..Request::new(p.clone(), 1)
                })
                .map_err(anyhow::Error::msg)?;
        }
        let start = Instant::now();
        engine.run_to_completion(|_| {})?;
        let wall = start.elapsed().as_secs_f64();
        let s = engine.stats();
        rows.push(format!(
            "| {model_name}: 16 prompts of {} tokens sharing {} | {} | {:.2} | {} | {} | {:.2} |",
            prompts[0].len(),
            stem_tokens(&prompts),
            if caching { "on" } else { "off" },
            s.prefill_s,
            s.prefill_tokens,
            s.prefix_hit_tokens,
            wall
        ));
    }
    Ok(rows)
}

/// Tokens every prompt starts with.
fn stem_tokens(prompts: &[Vec<u32>]) -> usize {
    (0..prompts[0].len())
        .take_while(|&i| prompts.iter().all(|p| p.get(i) == prompts[0].get(i)))
        .count()
}
