//! The model forward: embedding, `num_hidden_layers` transformer layers
//! ([`crate::layer`]), final norm and output projection, over one ragged
//! (thd) step planned by [`InferenceParams::pre_step`].

use std::sync::{Arc, Mutex};

use te_cache::{CacheLayout, CacheShape, HostKvStorage, InferenceParams, KvStorage, StepPlan};
use te_kernels::rope::{RopeFreqs, RopeScaling, RopeTable};
use te_kernels::DType;

use crate::config::ModelConfig;
use crate::device::{check_tokens, DeviceOps};
use crate::layer::{Attend, Layer, LayerBufs, Qkv, Rows, Workspace};
use crate::weights::ModelWeights;
use crate::{ModelError, Result};

/// What a step hands back.
#[derive(Debug)]
pub enum StepOutput<'w> {
    /// f32 logits `[b, vocab]` of each sequence's last token.
    Logits(&'w [f32]),
    /// Greedy tokens `[b]`, chosen on the device.
    Tokens(&'w [u32]),
}

/// Which positions of a step get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// The last token of each sequence: `[b, vocab]` (generation).
    Last,
    /// Every token: `[t, vocab]` (scoring, perplexity).
    All,
}

/// A loaded model: config, weights and the RoPE tables.
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    pub(crate) layers: Vec<Layer>,
    /// The RoPE tables, covering the positions the steps so far reached
    /// (grown by [`Model::rope_covering`], never past
    /// `max_position_embeddings`).
    rope: Mutex<Arc<RopeTables>>,
}

/// A model's RoPE tables for positions `0..positions`: the global layers'
/// and, when it differs, the sliding-window layers' (Gemma 3).
pub(crate) struct RopeTables {
    pub global: RopeTable,
    pub local: Option<RopeTable>,
}

impl RopeTables {
    /// Builds the tables of `config` for `positions` positions. A table's
    /// entries do not depend on `positions` ([`RopeTable::new`] computes
    /// each block of positions alone), so a smaller table is a bitwise
    /// prefix of a larger one and growing changes no result.
    pub fn new(config: &ModelConfig, positions: usize) -> Result<Self> {
        let freqs = |base: f32, scaling: RopeScaling| RopeFreqs {
            base: base as f64,
            rotary_dim: config.head_dim,
            max_positions: positions,
            scaling,
        };
        let table = |base: f32, scaling: RopeScaling| RopeTable::new(&freqs(base, scaling));
        // GGUF `rope_freqs` divide the global layers' frequencies.
        let global = match &config.rope_freq_factors {
            None => table(config.rope_theta, config.rope_scaling)?,
            Some(factors) => {
                let f = freqs(config.rope_theta, config.rope_scaling);
                let inv: Vec<f64> = f
                    .inv_freqs()
                    .iter()
                    .zip(factors)
                    .map(|(inv, div)| inv / *div as f64)
                    .collect();
                RopeTable::from_inv_freqs(&inv, positions, config.rope_scaling.attention_factor())?
            }
        };
        // Gemma 3's local layers use their own base, always unscaled (Hugging
        // Face `rope_local_base_freq`, rope_type "default"); other families
        // (Gemma 2 included) use one table for every layer.
        let local = if config.architecture.family().local_rope_unscaled
            && (config.rope_local_base_freq != config.rope_theta
                || config.rope_scaling != RopeScaling::None)
        {
            Some(table(config.rope_local_base_freq, RopeScaling::None)?)
        } else {
            None
        };
        Ok(RopeTables { global, local })
    }

    /// Positions covered.
    pub fn positions(&self) -> usize {
        self.global.max_positions()
    }

    /// The global and the local layers' tables (the global one twice when
    /// they agree).
    pub fn pair(&self) -> [&RopeTable; 2] {
        [&self.global, self.local.as_ref().unwrap_or(&self.global)]
    }
}

/// Steps of at most this many tokens run on the rayon pool as one job
/// (see [`Model::forward_with`]).
const POOL_STEP_MAX_TOKENS: usize = 64;

/// Positions the RoPE tables cover before any step needs more: 2 MiB of
/// tables for Gemma 3 (head_dim 256, two bases) instead of 64 MiB for all
/// of its 32768 positions.
const ROPE_INITIAL_POSITIONS: usize = 1024;

impl Model {
    /// Builds the model from a validated config and its weights.
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Result<Self> {
        config.validate()?;
        let rope = RopeTables::new(
            &config,
            config.max_position_embeddings.min(ROPE_INITIAL_POSITIONS),
        )?;
        let layers = (0..config.num_hidden_layers)
            .map(|i| Layer::new(&config, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            config,
            weights,
            layers,
            rope: Mutex::new(Arc::new(rope)),
        })
    }

    /// Positions the CPU path's RoPE tables cover now: 1024 (or
    /// `max_position_embeddings` if smaller) at first, grown as steps
    /// reach further.
    pub fn rope_positions(&self) -> usize {
        self.rope.lock().map_or(0, |r| r.positions())
    }

    /// The RoPE tables, grown first if a step reaches `positions`
    /// (exclusive end, over every sequence of the step): to twice their
    /// size or to `positions`, whichever is more, capped at
    /// `max_position_embeddings` (positions past that are the RoPE
    /// kernel's error). The lock is held while the tables are checked and,
    /// when they grow, rebuilt; never across a step, so ranks of a
    /// context-parallel group sharing the model never wait on each other's
    /// steps.
    pub(crate) fn rope_covering(&self, positions: usize) -> Result<Arc<RopeTables>> {
        let mut rope = self
            .rope
            .lock()
            .map_err(|_| ModelError::Poisoned("RoPE tables'"))?;
        let cap = self.config.max_position_embeddings;
        let have = rope.positions();
        if positions > have && have < cap {
            let grown = positions.max(2 * have).min(cap);
            *rope = Arc::new(RopeTables::new(&self.config, grown)?);
        }
        Ok(rope.clone())
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
        let storage = HostKvStorage::new(DType::F32, self.config.num_hidden_layers);
        self.new_cache_in(max_batch_size, max_seqlen, max_step_len, layout, storage)
    }

    /// [`new_cache`](Self::new_cache) over `storage` (host or device
    /// memory: `crate::runner::Runner::new_cache` picks).
    pub fn new_cache_in<S: KvStorage>(
        &self,
        max_batch_size: usize,
        max_seqlen: usize,
        max_step_len: usize,
        layout: CacheLayout,
        storage: S,
    ) -> Result<InferenceParams<S>> {
        let c = &self.config;
        let shape = CacheShape {
            max_batch_size,
            max_seqlen,
            num_layers: c.num_hidden_layers,
            num_heads_kv: c.num_key_value_heads,
            head_dim_k: c.head_dim,
            head_dim_v: c.head_dim,
            dtype: DType::F32,
            layout,
        };
        let mut cache = InferenceParams::with_storage(shape, storage)?;
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
    /// every layer. Returns the logits, borrowed from `ws`. This is the CPU
    /// forward: the cache's storage must be in host memory (an error
    /// otherwise).
    pub fn forward_with<'w, S: KvStorage + Send>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        logits: Logits,
        ws: &'w mut Workspace,
    ) -> Result<&'w [f32]> {
        let t = tokens.len();
        self.forward_rows(tokens, cache, ws, |cu, rows| {
            logit_rows(logits, t, cu, rows);
            Ok(())
        })
    }

    /// [`forward_with`](Self::forward_with) returning the logits of the
    /// last `tails[b]` tokens of each sequence `b` of the step: f32
    /// `[sum(tails), vocab]`, sequence after sequence, each in position
    /// order (speculative verification scores a drafted run and the token
    /// before it). `tails[b] = 1` everywhere is [`Logits::Last`].
    ///
    /// Errors: those of [`forward_with`](Self::forward_with); `tails` not
    /// one entry per sequence, or an entry 0 or longer than its sequence's
    /// step.
    pub fn forward_tails<'w, S: KvStorage + Send>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        tails: &[usize],
        ws: &'w mut Workspace,
    ) -> Result<&'w [f32]> {
        self.forward_rows(tokens, cache, ws, |cu, rows| {
            rows.clear();
            if tails.len() + 1 != cu.len() {
                return Err(ModelError::LogitTails(format!(
                    "{} logit tails for a step of {} sequences",
                    tails.len(),
                    cu.len().saturating_sub(1)
                )));
            }
            for (w, &n) in cu.windows(2).zip(tails) {
                let (start, end) = (w[0] as usize, w[1] as usize);
                if n == 0 || n > end - start {
                    return Err(ModelError::LogitTails(format!(
                        "a logit tail of {n} rows for a sequence of {} step tokens",
                        end - start
                    )));
                }
                rows.extend(end - n..end);
            }
            Ok(())
        })
    }

    /// The CPU forward of the planned step, the rows that get logits chosen
    /// by `select(cu_seqlens_q, rows)`.
    fn forward_rows<'w, S: KvStorage + Send>(
        &self,
        tokens: &[u32],
        cache: &mut InferenceParams<S>,
        ws: &'w mut Workspace,
        select: impl FnOnce(&[i32], &mut Vec<usize>) -> Result<()>,
    ) -> Result<&'w [f32]> {
        let plan = planned_step(cache, tokens)?;
        let t = tokens.len();
        select(plan.cu_seqlens_q(), &mut ws.rows)?;
        let rows = Rows {
            t,
            rope_cu: plan.cu_seqlens_q(),
            rope_start: plan.start_positions(),
        };
        let rope = self.rope_covering(rows.end_position())?;
        let mut run = || {
            let mut attend = crate::layer::attend_cached(cache, &plan);
            let bufs = ModelBufs {
                layer: &mut ws.bufs,
                x: &mut ws.x,
                h: &mut ws.h,
                logits: &mut ws.logits,
            };
            let input = StepInput {
                tokens,
                rows,
                logit_rows: &ws.rows,
            };
            self.forward_on(
                &mut ws.cpu,
                &self.weights,
                rope.pair(),
                input,
                bufs,
                &mut attend,
            )
        };
        // A decode step's ~4 products per layer are short: run the step on
        // a pool thread, which hands each product to the other threads and
        // takes its own share, instead of waking the pool from outside and
        // sleeping for every product (about a fifth of SmolLM2's decode
        // went to those hand-offs). Longer steps measured no better there.
        if t <= POOL_STEP_MAX_TOKENS && rayon::current_thread_index().is_none() {
            rayon::scope(|_| run())?;
        } else {
            run()?;
        }
        Ok(&ws.logits)
    }

    /// The model forward on device `dev` for a device that holds the whole
    /// step: [`run_on`](Self::run_on) of `input` with `attend` (saves K/V
    /// and attends) and the rows `input.logit_rows` of the final hidden
    /// state. `ropes` are the global and the local layers' tables (the same
    /// table twice when they agree).
    pub(crate) fn forward_on<D: DeviceOps>(
        &self,
        dev: &mut D,
        w: &ModelWeights<D::Linear, D::Vector>,
        ropes: [&D::Rope; 2],
        input: StepInput<'_>,
        bufs: ModelBufs<'_, D::Buf>,
        attend: &mut Attend<'_, D>,
    ) -> Result<()> {
        let params = DeviceParams { weights: w, ropes };
        let mut step = WholeStep {
            attend,
            rows: input.logit_rows,
        };
        self.run_on(dev, params, input.tokens, input.rows, bufs, &mut step)
    }

    /// The model loop, written once for every device and for a
    /// context-parallel rank: embedding of `tokens: [t]` into `bufs.x: [t,
    /// hidden]`, every layer at `rows`' positions (`step.attend` saves K/V
    /// and attends), then `step.gather_logit_rows` of the final hidden
    /// state into `bufs.h: [n, hidden]` and [`head_on`](Self::head_on)
    /// into `bufs.logits: [n, vocab]`.
    pub(crate) fn run_on<D: DeviceOps>(
        &self,
        dev: &mut D,
        params: DeviceParams<'_, D>,
        tokens: &[u32],
        rows: Rows<'_>,
        bufs: ModelBufs<'_, D::Buf>,
        step: &mut impl StepOps<D>,
    ) -> Result<()> {
        let c = &self.config;
        let w = params.weights;
        let (t, hidden) = (tokens.len(), c.hidden_size);
        check_tokens(tokens, c.vocab_size)?;
        let x = bufs.x; // [t, hidden]
        dev.resize(x, t * hidden)?;
        dev.embed(&w.embed_tokens, tokens, self.embed_scale(), x)?;
        for (layer, lw) in self.layers.iter().zip(&w.layers) {
            let rope = params.ropes[layer.rope_slot()];
            let attend = &mut |l: &Layer, dev: &mut D, qkv: Qkv<'_, D::Buf>, out: &mut D::Buf| {
                step.attend(l, dev, qkv, out)
            };
            let layer_bufs = LayerBufs {
                x: &mut *x,
                tmp: &mut *bufs.layer,
            };
            layer.run(dev, lw, layer_bufs, rows, rope, attend)?;
        }
        // Rows that get logits: [n, hidden].
        step.gather_logit_rows(dev, x, hidden, bufs.h)?;
        self.head_on(dev, w, bufs.h, bufs.logits)
    }

    /// Final norm, output projection and final softcap on device `dev`:
    /// `h: [n, hidden]` (normed in place) -> `logits: [n, vocab]`.
    pub(crate) fn head_on<D: DeviceOps>(
        &self,
        dev: &mut D,
        w: &ModelWeights<D::Linear, D::Vector>,
        h: &mut D::Buf,
        logits: &mut D::Buf,
    ) -> Result<()> {
        let c = &self.config;
        dev.rms_norm_inplace(h, &w.final_norm, c.rms_norm_eps)?;
        let n = dev.len(h) / c.hidden_size;
        dev.resize(logits, n * c.vocab_size)?;
        dev.linear(w.head(), h, n, logits)?;
        if let Some(cap) = c.final_logit_softcapping {
            dev.softcap(logits, cap)?;
        }
        Ok(())
    }

    /// The embedding scale: sqrt(hidden_size) for Gemma (rounded to the
    /// activation dtype, f32 here), else 1.
    fn embed_scale(&self) -> f32 {
        let c = &self.config;
        if c.scale_embedding {
            (c.hidden_size as f32).sqrt()
        } else {
            1.0
        }
    }
}

/// What one forward pass on a device computes (`Model::forward_on`): the
/// step's tokens, their rows' positions, and which rows get logits.
#[derive(Clone, Copy)]
pub(crate) struct StepInput<'a> {
    /// `[t]` token ids in thd order (sequence after sequence).
    pub tokens: &'a [u32],
    /// The RoPE runs of the `t` rows (`rows.t == tokens.len()`).
    pub rows: Rows<'a>,
    /// `[n]` rows of the hidden state that get logits, in output order
    /// (see [`logit_rows`]).
    pub logit_rows: &'a [usize],
}

/// The model's parameters on device `D`: its weights and the global and
/// the local layers' RoPE tables (the same table twice when they agree).
pub(crate) struct DeviceParams<'a, D: DeviceOps> {
    pub weights: &'a ModelWeights<D::Linear, D::Vector>,
    pub ropes: [&'a D::Rope; 2],
}

/// What a step does beyond the model's own ops, where its tokens and KV
/// cache live: the one place a device holding the whole step
/// ([`Model::forward_on`]) and a context-parallel rank
/// ([`crate::context_parallel`]) differ in the model loop
/// ([`Model::run_on`]).
pub(crate) trait StepOps<D: DeviceOps> {
    /// A layer's `attend` ([`Layer::run`]): saves its K/V and writes its
    /// attention output `out: [t, hq * d]` of the rotated `qkv`.
    fn attend(
        &mut self,
        layer: &Layer,
        dev: &mut D,
        qkv: Qkv<'_, D::Buf>,
        out: &mut D::Buf,
    ) -> Result<()>;

    /// The rows of the final hidden state `x: [t, hidden]` that get
    /// logits, into `h: [n, hidden]` (sized here).
    fn gather_logit_rows(
        &mut self,
        dev: &mut D,
        x: &D::Buf,
        hidden: usize,
        h: &mut D::Buf,
    ) -> Result<()>;
}

/// The [`StepOps`] of a device that holds the whole step: the caller's
/// `attend` and the hidden state's rows `rows`.
struct WholeStep<'a, 'b, D: DeviceOps> {
    attend: &'a mut Attend<'b, D>,
    rows: &'a [usize],
}

impl<D: DeviceOps> StepOps<D> for WholeStep<'_, '_, D> {
    fn attend(
        &mut self,
        layer: &Layer,
        dev: &mut D,
        qkv: Qkv<'_, D::Buf>,
        out: &mut D::Buf,
    ) -> Result<()> {
        (self.attend)(layer, dev, qkv, out)
    }

    fn gather_logit_rows(
        &mut self,
        dev: &mut D,
        x: &D::Buf,
        hidden: usize,
        h: &mut D::Buf,
    ) -> Result<()> {
        dev.resize(h, self.rows.len() * hidden)?;
        dev.gather_rows(x, self.rows, hidden, h)
    }
}

/// The model-level buffers of one forward pass on a device: the layers'
/// eight intermediates, the hidden state `x: [t, hidden]`, the rows that
/// get logits `h: [n, hidden]` and the logits `[n, vocab]`.
pub(crate) struct ModelBufs<'a, B> {
    pub layer: &'a mut [B; 8],
    pub x: &'a mut B,
    pub h: &'a mut B,
    pub logits: &'a mut B,
}

/// The step planned in `cache` (by its last `pre_step`), checked to hold
/// `tokens: [t]`.
///
/// Errors: no step planned; a planned step of another length.
pub(crate) fn planned_step<S: KvStorage>(
    cache: &InferenceParams<S>,
    tokens: &[u32],
) -> Result<Arc<StepPlan>> {
    let plan = cache
        .plan()
        .ok_or(ModelError::NoStepPlanned { op: "forward" })?;
    if plan.num_tokens() != tokens.len() {
        return Err(ModelError::StepTokens {
            op: "forward",
            given: tokens.len(),
            planned: plan.num_tokens(),
        });
    }
    Ok(plan)
}

/// The rows of a step of `t` tokens that get logits, into `rows`: every
/// row, or each sequence's last (`cu_seqlens_q: [b + 1]`).
pub(crate) fn logit_rows(logits: Logits, t: usize, cu_seqlens_q: &[i32], rows: &mut Vec<usize>) {
    rows.clear();
    match logits {
        Logits::All => rows.extend(0..t),
        Logits::Last => rows.extend(cu_seqlens_q[1..].iter().map(|&e| e as usize - 1)),
    }
}
