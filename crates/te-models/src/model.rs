//! The model forward: embedding, `num_hidden_layers` transformer layers
//! ([`crate::layer`]), final norm and output projection, over one ragged
//! (thd) step planned by [`InferenceParams::pre_step`].

use te_cache::{CacheLayout, InferenceParams};
use te_kernels::rope::{RopeFreqs, RopeScaling, RopeTable};
use te_kernels::DType;

use crate::config::{Architecture, ModelConfig};
use crate::layer::{Layer, Workspace};
use crate::ops::rms_norm_inplace;
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// Which positions of a step get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last token of each sequence: `[b, vocab]` (generation).
    Last,
    /// Every token: `[t, vocab]` (scoring, perplexity).
    All,
}

/// A loaded model: config, weights and the RoPE tables, built once.
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub(crate) layers: Vec<Layer>,
    /// `[max_position_embeddings, d/2]` tables: global layers, then the
    /// sliding-window layers' (same table when the bases agree).
    rope_global: RopeTable,
    rope_local: Option<RopeTable>,
}

impl Model {
    /// Builds the model from a validated config and its weights.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Result<Self> {
        config.validate()?;
        let table = |base: f32, scaling: RopeScaling| {
            RopeTable::new(&RopeFreqs {
                base: base as f64,
                rotary_dim: config.head_dim,
                max_positions: config.max_position_embeddings,
                scaling,
            })
        };
        let rope_global = table(config.rope_theta, config.rope_scaling)?;
        // Gemma 3's local layers use their own base, always unscaled (Hugging
        // Face `rope_local_base_freq`, rope_type "default"); other families
        // (Gemma 2 included) use one table for every layer.
        let rope_local = if config.architecture == Architecture::Gemma3
            && (config.rope_local_base_freq != config.rope_theta
                || config.rope_scaling != RopeScaling::None)
        {
            Some(table(config.rope_local_base_freq, RopeScaling::None)?)
        } else {
            None
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::new(&config, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            config,
            weights,
            layers,
            rope_global,
            rope_local,
        })
    }

    /// A KV cache sized for this model: `max_batch_size` sequences of up
    /// to `max_seqlen` tokens, f32, with a ring for every sliding-window
    /// layer that holds steps of up to `max_step_len` tokens per sequence.
    pub fn new_cache(
        &self,
        max_batch_size: usize,
        max_seqlen: usize,
        max_step_len: usize,
        layout: CacheLayout,
    ) -> Result<InferenceParams> {
        let c = &self.config;
        let mut cache = InferenceParams::new(
            max_batch_size,
            max_seqlen,
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            c.head_dim,
            DType::F32,
            layout,
        )?;
        for (layer, window) in c.layer_windows.iter().enumerate() {
            if let Some(w) = *window {
                cache.set_sliding_window(layer, w, max_step_len)?;
            }
        }
        Ok(cache)
    }

    /// Runs one step. `tokens: [t]` are the step's tokens in thd order, as
    /// planned by the last `cache.pre_step` (`t = cu_seqlens_q[b]`).
    ///
    /// Returns f32 logits `[b, vocab]` ([`Logits::Last`]) or `[t, vocab]`
    /// ([`Logits::All`]), final softcap applied.
    ///
    /// Errors: a token id outside the vocabulary, `tokens` not matching the
    /// planned step, positions past `max_position_embeddings`, and whatever
    /// the kernels, attention or cache reject.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let mut ws = Workspace::default();
        Ok(self.forward_with(tokens, cache, logits, &mut ws)?.to_vec())
    }

    /// [`forward`](Self::forward) with every buffer kept in `ws` (reuse one
    /// workspace for every step: decode steps then allocate nothing per
    /// layer). The step's plan is taken from `cache` once and borrowed by
    /// every layer. Returns the logits, borrowed from `ws`.
    pub fn forward_with<'w>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams,
        logits: Logits,
        ws: &'w mut Workspace,
    ) -> Result<&'w [f32]> {
        let c = &self.config;
        let plan = cache.plan().ok_or_else(|| {
            ModelError::Request("forward: no step planned (call pre_step first)".into())
        })?;
        let t = tokens.len();
        if plan.num_tokens() != t {
            return Err(ModelError::Request(format!(
                "forward: {t} tokens given, the planned step has {}",
                plan.num_tokens()
            )));
        }
        let hidden = c.hidden_size;
        // x: [t, hidden]
        let mut x = std::mem::take(&mut ws.x);
        x.resize(t * hidden, 0.0);
        let result = self.embed(tokens, &mut x).and_then(|()| {
            for (layer, w) in self.layers.iter().zip(&self.weights.layers) {
                let rope = self.rope_for(layer);
                layer.forward(w, &mut x, &plan, rope, cache, ws)?;
            }
            Ok(())
        });
        drop(plan);
        if let Err(e) = result {
            ws.x = x;
            return Err(e);
        }
        // Rows that get logits: [n, hidden].
        ws.rows.clear();
        match logits {
            Logits::All => ws.rows.extend(0..t),
            Logits::Last => {
                let cu = cache.cu_seqlens_q();
                ws.rows.extend(cu[1..].iter().map(|&e| e as usize - 1));
            }
        }
        let n = ws.rows.len();
        ws.h.resize(n * hidden, 0.0);
        for (dst, &r) in ws.h.chunks_exact_mut(hidden).zip(&ws.rows) {
            dst.copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        ws.x = x;
        self.head(ws);
        Ok(&ws.logits)
    }

    /// The RoPE table of `layer` (Gemma 3's local layers have their own).
    pub(crate) fn rope_for(&self, layer: &Layer) -> &RopeTable {
        match (&self.rope_local, layer.window.is_some()) {
            (Some(local), true) => local,
            _ => &self.rope_global,
        }
    }

    /// Final norm, output projection and final softcap: `ws.h: [n, hidden]`
    /// (normed in place) -> `ws.logits: [n, vocab]`.
    pub(crate) fn head(&self, ws: &mut Workspace) {
        let c = &self.config;
        let n = ws.h.len() / c.hidden_size;
        rms_norm_inplace(&mut ws.h, &self.weights.final_norm, c.rms_norm_eps);
        let head = self
            .weights
            .lm_head
            .as_ref()
            .unwrap_or(&self.weights.embed_tokens);
        ws.logits.resize(n * head.out_features, 0.0);
        head.forward_into(&ws.h, n, &mut ws.logits, &mut ws.scratch);
        if let Some(cap) = c.final_logit_softcapping {
            ws.logits
                .iter_mut()
                .for_each(|l| *l = cap * (*l / cap).tanh());
        }
    }

    /// `tokens: [t]` -> `x: [t, hidden]`, times sqrt(hidden_size) for Gemma
    /// (rounded to the activation dtype, f32 here).
    pub(crate) fn embed(&self, tokens: &[u32], x: &mut [f32]) -> Result<()> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let scale = if c.scale_embedding {
            (hidden as f32).sqrt()
        } else {
            1.0
        };
        for (&tok, row) in tokens.iter().zip(x.chunks_exact_mut(hidden)) {
            let id = tok as usize;
            if id >= c.vocab_size {
                return Err(ModelError::Request(format!(
                    "token id {tok} is outside the vocabulary of {} tokens",
                    c.vocab_size
                )));
            }
            self.weights.embed_tokens.row_into(id, row);
            row.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }
}
