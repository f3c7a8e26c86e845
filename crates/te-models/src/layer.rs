//! The one transformer layer every family maps onto (TransformerEngine's
//! `TransformerLayer`): pre-norm attention and gated MLP, with the Gemma
//! options (q/k norms, post-attention and post-MLP norms, GeGLU-tanh,
//! windows, softcap, query_pre_attn_scalar) switched by the config.
//!
//! ```text
//! n = RMSNorm(x);  q, k, v = n Wqᵀ, n Wkᵀ, n Wvᵀ
//! [Gemma 3] q, k = RMSNorm_head(q), RMSNorm_head(k)
//! q, k = RoPE(q, k at start_positions + i);  save k, v in the cache
//! a = Attention(q, cache; causal bottom-right, window, softcap) Woᵀ
//! [Gemma 2/3] a = RMSNorm(a);  x = x + a
//! n = RMSNorm(x);  m = down(act(gate(n)) * up(n));  [Gemma 2/3] m = RMSNorm(m)
//! x = x + m
//! ```

use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_cache::{InferenceParams, KvStorage, StepPlan};
use te_kernels::rope::{RopeArgs, RopeConvention, RopeTable};
use te_kernels::QkvFormat;

use crate::config::{Activation, ModelConfig};
use crate::device::{Cpu, DeviceOps};
use crate::weights::LayerWeights;
use crate::Result;

/// Per-layer settings resolved from the config.
pub struct Layer {
    pub(crate) index: usize,
    /// Keys per query, itself included, on a sliding-window layer.
    pub window: Option<usize>,
    pub(crate) attention: DotProductAttention,
    convention: RopeConvention,
    pub(crate) num_heads: usize,
    pub(crate) num_heads_kv: usize,
    pub(crate) head_dim: usize,
    pub(crate) hidden: usize,
    pub(crate) intermediate: usize,
    eps: f32,
    activation: Activation,
}

impl Layer {
    /// Which of a model's two RoPE tables this layer rotates with: 1, the
    /// local one, for sliding-window layers (Gemma 3's local base; the
    /// global table again where the bases agree), else 0.
    pub(crate) fn rope_slot(&self) -> usize {
        self.window.is_some() as usize
    }

    /// Layer `index` of a model with config `c`.
    pub fn new(c: &ModelConfig, index: usize) -> Result<Self> {
        let window = c.layer_windows[index];
        let mut attention = DotProductAttention::new(c.num_attention_heads, c.head_dim)
            .with_num_gqa_groups(c.num_key_value_heads)
            .with_softmax_scale(c.softmax_scale)
            // Queries are the last `sq` of `skv` keys: bottom-right causal.
            .with_attn_mask_type(AttnMaskType::PaddingCausalBottomRight)
            .with_formats(QkvFormat::Thd, QkvFormat::Thd);
        if let Some(w) = window {
            attention = attention.with_window_size(w as i64 - 1, 0);
        }
        if let Some(cap) = c.attn_logit_softcapping {
            attention = attention.with_softcap(cap);
        }
        attention.validate()?;
        Ok(Layer {
            index,
            window,
            attention,
            convention: c.rope_convention,
            num_heads: c.num_attention_heads,
            num_heads_kv: c.num_key_value_heads,
            head_dim: c.head_dim,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            eps: c.rms_norm_eps,
            activation: c.hidden_activation,
        })
    }

    /// Runs the layer on `x: [t, hidden]` in place for the step `plan`
    /// planned in `cache`, saving this layer's K/V there. `ws` holds every
    /// intermediate buffer (sized on first use, then reused). The cache's
    /// storage must be in host memory.
    pub fn forward<S: KvStorage>(
        &self,
        w: &LayerWeights,
        x: &mut [f32],
        plan: &StepPlan,
        rope: &RopeTable,
        cache: &mut InferenceParams<S>,
        ws: &mut Workspace,
    ) -> Result<()> {
        // The layer runs on an owned buffer: `x` goes through ws.layer_x.
        let mut xv = std::mem::take(&mut ws.layer_x);
        xv.clear();
        xv.extend_from_slice(x);
        let result = self.forward_cpu(w, &mut xv, plan, rope, cache, ws);
        x.copy_from_slice(&xv);
        ws.layer_x = xv;
        result
    }

    /// [`forward`](Self::forward) on the workspace's own buffer.
    pub(crate) fn forward_cpu<S: KvStorage>(
        &self,
        w: &LayerWeights,
        x: &mut Vec<f32>,
        plan: &StepPlan,
        rope: &RopeTable,
        cache: &mut InferenceParams<S>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let cu_seqlens_q = plan.cu_seqlens_q();
        let rows = Rows {
            t: plan.num_tokens(),
            rope_cu: cu_seqlens_q,
            rope_start: plan.start_positions(),
        };
        let bufs = LayerBufs {
            x,
            tmp: &mut ws.bufs,
        };
        self.run(
            &mut ws.cpu,
            w,
            bufs,
            rows,
            rope,
            &mut attend_cached(cache, plan),
        )
    }

    /// The layer around its attention, on device `dev`: norms,
    /// projections, q/k norms, RoPE at `rows`' positions, then
    /// `attend(self, dev, q/k/v, out)` (save K/V and attend: `out: [t, hq *
    /// d]`), output projection and MLP, on `bufs.x: [t, hidden]` through
    /// `bufs.tmp`. Single-rank ([`Layer::forward`]), context-parallel
    /// ([`crate::context_parallel`]) and CUDA steps differ only in `dev`
    /// and `attend`.
    pub(crate) fn run<D: DeviceOps>(
        &self,
        dev: &mut D,
        w: &LayerWeights<D::Linear, D::Vector>,
        bufs: LayerBufs<'_, D::Buf>,
        rows: Rows<'_>,
        rope: &D::Rope,
        attend: &mut Attend<'_, D>,
    ) -> Result<()> {
        let LayerBufs { x, tmp: bufs } = bufs;
        let (hq, hkv, d) = (self.num_heads, self.num_heads_kv, self.head_dim);
        let t = rows.t;
        let (hidden, inter) = (self.hidden, self.intermediate);
        let [n, q, k, v, attn, o, g, u] = bufs.each_mut();
        for (b, len) in [
            (&mut *n, t * hidden),
            (&mut *q, t * hq * d),
            (&mut *k, t * hkv * d),
            (&mut *v, t * hkv * d),
            (&mut *attn, t * hq * d),
            (&mut *o, t * hidden),
            (&mut *g, t * inter),
            (&mut *u, t * inter),
        ] {
            dev.resize(b, len)?;
        }

        // Attention block. n: [t, hidden]
        dev.rms_norm_into(x, &w.attn_norm, self.eps, n)?;
        // q: [t, hq, d], k and v: [t, hkv, d]
        dev.linear_many([&w.q_proj, &w.k_proj, &w.v_proj], n, t, [q, k, v])?;
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            // Gemma 3: RMSNorm over each head's d values.
            dev.rms_norm_inplace(q, qn, self.eps)?;
            dev.rms_norm_inplace(k, kn, self.eps)?;
        }
        let args = |heads| RopeArgs::thd(self.convention, heads, d, rows.rope_cu, rows.rope_start);
        dev.rope(q, rope, &args(hq))?;
        dev.rope(k, rope, &args(hkv))?;
        attend(
            self,
            dev,
            Qkv {
                q: &*q,
                k: &*k,
                v: &*v,
            },
            attn,
        )?;
        dev.linear(&w.o_proj, attn, t, o)?; // [t, hidden]
        if let Some(post) = &w.post_attn_norm {
            dev.rms_norm_inplace(o, post, self.eps)?;
        }
        dev.add_inplace(x, o)?;

        // MLP block: down(act(gate(n)) * up(n)).
        dev.rms_norm_into(x, &w.ffn_norm, self.eps, n)?;
        // g and u: [t, intermediate]
        dev.linear_many([&w.gate_proj, &w.up_proj], n, t, [g, u])?;
        dev.gated_act(self.activation, g, u)?;
        let m = o; // [t, hidden], reused
        dev.linear(&w.down_proj, g, t, m)?;
        if let Some(post) = &w.post_ffn_norm {
            dev.rms_norm_inplace(m, post, self.eps)?;
        }
        dev.add_inplace(x, m)?;
        Ok(())
    }
}

/// The single-rank CPU `attend` of a layer: saves its K/V in `cache` for
/// the step `plan` ([`InferenceParams::step`]) and attends its queries to
/// the cache (`DotProductAttention::forward_cpu_with`).
pub(crate) fn attend_cached<'a, S: KvStorage>(
    cache: &'a mut InferenceParams<S>,
    plan: &'a StepPlan,
) -> impl FnMut(&Layer, &mut Cpu, Qkv<'_, Vec<f32>>, &mut Vec<f32>) -> Result<()> + 'a {
    move |layer, cpu, qkv, out| {
        let view = cache.step(layer.index, qkv.k, qkv.v, QkvFormat::Thd)?;
        let meta = AttnMetadata {
            batch: plan.batch_size(),
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(plan.cu_seqlens_q()),
            cu_seqlens_kv: None,
        };
        layer.attention.forward_cpu_with(
            qkv.q,
            KvInput::Cache(view),
            &meta,
            out,
            None,
            &mut cpu.attention,
        )?;
        Ok(())
    }
}

/// A layer's activations on a device ([`Layer::run`]), in buffers of type
/// `B` (f32).
pub(crate) struct LayerBufs<'a, B> {
    /// The hidden state `[t, hidden]`, updated in place.
    pub x: &'a mut B,
    /// The eight intermediates, resized by the layer: normed `x` `[t,
    /// hidden]`, q `[t, hq * d]`, k and v `[t, hkv * d]`, attention output
    /// `[t, hq * d]`, projection `[t, hidden]`, gate and up `[t,
    /// intermediate]`.
    pub tmp: &'a mut [B; 8],
}

/// The rows a layer computes: `t` tokens in runs of consecutive positions,
/// `rope_cu: [runs + 1]` i32 offsets and `rope_start: [runs]` i32 first
/// positions (one run per sequence on a single rank).
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a> {
    pub t: usize,
    pub rope_cu: &'a [i32],
    pub rope_start: &'a [i32],
}

impl Rows<'_> {
    /// One past the last position any sequence of the step reaches
    /// (`start_positions[i] + seqlen[i]`, the most over `i`; 0 for none).
    pub fn end_position(&self) -> usize {
        self.rope_start
            .iter()
            .zip(self.rope_cu.windows(2))
            .map(|(&s, cu)| (s.max(0) + (cu[1] - cu[0]).max(0)) as usize)
            .max()
            .unwrap_or(0)
    }
}

/// A layer's rotated queries `[t, hq * d]`, keys and values `[t, hkv * d]`,
/// in buffers of type `B`.
pub(crate) struct Qkv<'a, B> {
    pub q: &'a B,
    pub k: &'a B,
    pub v: &'a B,
}

/// Saves a layer's K/V and writes its attention output `[t, hq * d]`, on
/// device `D`.
pub(crate) type Attend<'a, D> = dyn FnMut(&Layer, &mut D, Qkv<'_, <D as DeviceOps>::Buf>, &mut <D as DeviceOps>::Buf) -> Result<()>
    + 'a;

/// The buffers of one forward pass, reused from step to step: the layers'
/// intermediates (`[t, hidden]`, `[t, h * d]`, `[t, intermediate]` each),
/// the CPU device (its matrix-vector scratch and attention's workspace).
/// Buffers only
/// grow, so a run of decode steps allocates nothing here after the first.
#[derive(Default)]
pub struct Workspace {
    pub(crate) bufs: [Vec<f32>; 8],
    pub(crate) cpu: Cpu,
    /// [`Layer::forward`]'s copy of its `x`.
    layer_x: Vec<f32>,
    /// Model level: the hidden state `[t, hidden]`, the rows that get
    /// logits, their normed copy and the logits.
    pub(crate) x: Vec<f32>,
    pub(crate) rows: Vec<usize>,
    pub(crate) h: Vec<f32>,
    pub(crate) logits: Vec<f32>,
}
