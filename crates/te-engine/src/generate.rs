//! Batch generation: every request run to completion through the
//! [`Engine`], for callers that have all their
//! prompts up front (tests, benches, scripts). A sequence gets the same
//! tokens batched as alone.

use crate::{Engine, EngineConfig, Event, FinishReason, Request};
use crate::{EngineError, Result};
use te_models::model::Model;

/// What one request produced.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationOutput {
    /// Generated token ids only.
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
}

/// What the per-token callback tells the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop this request now (finish reason `stop`).
    Stop,
}

/// Runs every request to completion, calling `on_token(request_index,
/// token)` for each generated token as soon as it is chosen. No tokenizer:
/// requests must not carry stop strings (use the engine for text).
///
/// Errors: the first invalid request (naming its index and field; nothing
/// runs then), and any error of the forward pass.
pub fn generate(
    model: &Model,
    requests: &[Request],
    config: &EngineConfig,
    mut on_token: impl FnMut(usize, u32) -> Control,
) -> Result<Vec<GenerationOutput>> {
    let mut engine = Engine::new(model, None, config.clone())?;
    let mut ids = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let id = engine
            .add_request(r.clone())
            .map_err(|error| EngineError::Request { index: i, error })?;
        ids.push(id);
    }
    // Ids are handed out in order from 0.
    let index = |id: u64| (id - ids[0]) as usize;
    let mut outputs: Vec<GenerationOutput> = (0..requests.len())
        .map(|_| GenerationOutput {
            tokens: Vec::new(),
            finish_reason: FinishReason::Length,
        })
        .collect();
    let mut stopped = Vec::new();
    while engine.has_work() {
        for event in engine.step()? {
            match event {
                Event::Token { id, token, .. } => {
                    let i = index(id);
                    outputs[i].tokens.push(token);
                    if on_token(i, token) == Control::Stop {
                        stopped.push(id);
                    }
                }
                Event::Finished { id, reason, .. } => {
                    outputs[index(id)].finish_reason = match reason {
                        FinishReason::Abort => FinishReason::Stop,
                        r => r,
                    };
                }
            }
        }
        for id in stopped.drain(..) {
            // Already finished in this step if it also hit an end.
            let _ = engine.abort(id);
        }
    }
    Ok(outputs)
}
