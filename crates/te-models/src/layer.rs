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

use rayon::prelude::*;
use te_attention::{AttentionWorkspace, AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_cache::{InferenceParams, StepPlan};
use te_kernels::rope::{apply_rope_cpu, RopeArgs, RopeConvention, RopeTable};
use te_kernels::QkvFormat;

use crate::config::{Activation, ModelConfig};
use crate::ops::{add_inplace, gelu_tanh, rms_norm_inplace, rms_norm_into, silu};
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
    eps: f32,
    activation: Activation,
}

impl Layer {
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
            eps: c.rms_norm_eps,
            activation: c.hidden_activation,
        })
    }

    /// Runs the layer on `x: [t, hidden]` in place for the step `plan`
    /// planned in `cache`, saving this layer's K/V there. `ws` holds every
    /// intermediate buffer (sized on first use, then reused).
    pub fn forward(
        &self,
        w: &LayerWeights,
        x: &mut [f32],
        plan: &StepPlan,
        rope: &RopeTable,
        cache: &mut InferenceParams,
        ws: &mut Workspace,
    ) -> Result<()> {
        let cu_seqlens_q = plan.cu_seqlens_q();
        let rows = Rows {
            t: plan.num_tokens(),
            rope_cu: cu_seqlens_q,
            rope_start: plan.start_positions(),
        };
        self.run(w, x, rows, rope, ws, &mut |layer, qkv, out, aws| {
            let view = cache.step(layer.index, qkv.k, qkv.v, QkvFormat::Thd)?;
            let meta = AttnMetadata {
                batch: plan.batch_size(),
                max_seqlen_q: 0,
                max_seqlen_kv: 0,
                cu_seqlens_q: Some(cu_seqlens_q),
                cu_seqlens_kv: None,
            };
            layer
                .attention
                .forward_cpu_with(qkv.q, KvInput::Cache(view), &meta, out, None, aws)?;
            Ok(())
        })
    }

    /// The layer around its attention: norms, projections, q/k norms, RoPE
    /// at `rows`' positions, then `attend(self, q/k/v, out, workspace)`
    /// (save K/V and attend: `out: [t, hq * d]`), output projection and
    /// MLP. Single-rank ([`Layer::forward`]) and context-parallel steps
    /// ([`crate::context_parallel`]) differ only in `attend`.
    pub(crate) fn run(
        &self,
        w: &LayerWeights,
        x: &mut [f32],
        rows: Rows<'_>,
        rope: &RopeTable,
        ws: &mut Workspace,
        attend: &mut Attend<'_>,
    ) -> Result<()> {
        let (hq, hkv, d) = (self.num_heads, self.num_heads_kv, self.head_dim);
        let t = rows.t;
        let hidden = x.len() / t.max(1);
        let inter = w.gate_proj.out_features;
        let [n, q, k, v, attn, o, g, u] = buffers(
            &mut ws.bufs,
            [
                t * hidden,
                t * hq * d,
                t * hkv * d,
                t * hkv * d,
                t * hq * d,
                t * hidden,
                t * inter,
                t * inter,
            ],
        );
        let scratch = &mut ws.scratch;

        // Attention block. n: [t, hidden]
        rms_norm_into(x, &w.attn_norm, self.eps, n);
        w.q_proj.forward_into(n, t, q, scratch); // [t, hq, d]
        w.k_proj.forward_into(n, t, k, scratch); // [t, hkv, d]
        w.v_proj.forward_into(n, t, v, scratch); // [t, hkv, d]
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            // Gemma 3: RMSNorm over each head's d values.
            rms_norm_inplace(q, qn, self.eps);
            rms_norm_inplace(k, kn, self.eps);
        }
        let args = |heads| RopeArgs::thd(self.convention, heads, d, rows.rope_cu, rows.rope_start);
        apply_rope_cpu(q, rope, &args(hq))?;
        apply_rope_cpu(k, rope, &args(hkv))?;
        attend(self, Qkv { q, k, v }, attn, &mut ws.attention)?;
        w.o_proj.forward_into(attn, t, o, scratch); // [t, hidden]
        if let Some(post) = &w.post_attn_norm {
            rms_norm_inplace(o, post, self.eps);
        }
        add_inplace(x, o);

        // MLP block: down(act(gate(n)) * up(n)).
        rms_norm_into(x, &w.ffn_norm, self.eps, n);
        w.gate_proj.forward_into(n, t, g, scratch); // [t, intermediate]
        w.up_proj.forward_into(n, t, u, scratch);
        let act = match self.activation {
            Activation::Silu => silu,
            Activation::GeluTanh => gelu_tanh,
        };
        g.par_iter_mut()
            .zip(&*u)
            .for_each(|(g, u)| *g = act(*g) * u);
        let m = o; // [t, hidden], reused
        w.down_proj.forward_into(g, t, m, scratch);
        if let Some(post) = &w.post_ffn_norm {
            rms_norm_inplace(m, post, self.eps);
        }
        add_inplace(x, m);
        Ok(())
    }
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

/// A layer's rotated queries `[t, hq * d]`, keys and values `[t, hkv * d]`.
pub(crate) struct Qkv<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Saves a layer's K/V and writes its attention output `[t, hq * d]`.
pub(crate) type Attend<'a> =
    dyn FnMut(&Layer, Qkv<'_>, &mut [f32], &mut AttentionWorkspace) -> Result<()> + 'a;

/// The buffers of one forward pass, reused from step to step: the layers'
/// intermediates (`[t, hidden]`, `[t, h * d]`, `[t, intermediate]` each),
/// the matrix-vector scratch and attention's workspace. Buffers only grow,
/// so a run of decode steps allocates nothing here after the first.
#[derive(Default)]
pub struct Workspace {
    bufs: [Vec<f32>; 8],
    pub(crate) scratch: Vec<f32>,
    attention: AttentionWorkspace,
    /// Model level: the hidden state `[t, hidden]`, the rows that get
    /// logits, their normed copy and the logits.
    pub(crate) x: Vec<f32>,
    pub(crate) rows: Vec<usize>,
    pub(crate) h: Vec<f32>,
    pub(crate) logits: Vec<f32>,
}

/// The eight layer buffers, each resized to its length.
fn buffers(bufs: &mut [Vec<f32>; 8], lens: [usize; 8]) -> [&mut [f32]; 8] {
    for (b, &len) in bufs.iter_mut().zip(&lens) {
        b.resize(len, 0.0);
    }
    let [a, b, c, d, e, f, g, h] = bufs;
    [a, b, c, d, e, f, g, h].map(|v| v.as_mut_slice())
}
