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
use te_attention::{AttnMaskType, AttnMetadata, DotProductAttention, KvInput};
use te_cache::InferenceParams;
use te_kernels::rope::{apply_rope_cpu, RopeArgs, RopeConvention, RopeTable};
use te_kernels::QkvFormat;

use crate::config::{Activation, ModelConfig};
use crate::ops::{add_inplace, gelu_tanh, rms_norm, rms_norm_inplace, silu};
use crate::weights::LayerWeights;
use crate::Result;

/// Per-layer settings resolved from the config.
pub struct Layer {
    index: usize,
    /// Keys per query, itself included, on a sliding-window layer.
    pub window: Option<usize>,
    attention: DotProductAttention,
    convention: RopeConvention,
    num_heads: usize,
    num_heads_kv: usize,
    head_dim: usize,
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

    /// Runs the layer on `x: [t, hidden]` in place for the step planned in
    /// `cache`, saving this layer's K/V there.
    pub fn forward(
        &self,
        w: &LayerWeights,
        x: &mut [f32],
        t: usize,
        rope: &RopeTable,
        cache: &mut InferenceParams,
    ) -> Result<()> {
        let (hq, hkv, d) = (self.num_heads, self.num_heads_kv, self.head_dim);
        let cu_seqlens_q = cache.cu_seqlens_q().to_vec();
        let start_positions = cache.start_positions().to_vec();

        // Attention block. n: [t, hidden]
        let n = rms_norm(x, &w.attn_norm, self.eps);
        let mut q = w.q_proj.forward(&n, t); // [t, hq, d]
        let mut k = w.k_proj.forward(&n, t); // [t, hkv, d]
        let v = w.v_proj.forward(&n, t); // [t, hkv, d]
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            // Gemma 3: RMSNorm over each head's d values.
            rms_norm_inplace(&mut q, qn, self.eps);
            rms_norm_inplace(&mut k, kn, self.eps);
        }
        let args =
            |heads| RopeArgs::thd(self.convention, heads, d, &cu_seqlens_q, &start_positions);
        apply_rope_cpu(&mut q, rope, &args(hq))?;
        apply_rope_cpu(&mut k, rope, &args(hkv))?;
        let view = cache.step(self.index, &k, &v, QkvFormat::Thd)?;
        let meta = AttnMetadata {
            batch: cu_seqlens_q.len() - 1,
            max_seqlen_q: 0,
            max_seqlen_kv: 0,
            cu_seqlens_q: Some(&cu_seqlens_q),
            cu_seqlens_kv: None,
        };
        let mut attn = vec![0.0f32; t * hq * d]; // [t, hq, d]
        self.attention
            .forward_cpu(&q, KvInput::Cache(view), &meta, &mut attn, None)?;
        let mut o = w.o_proj.forward(&attn, t); // [t, hidden]
        if let Some(post) = &w.post_attn_norm {
            rms_norm_inplace(&mut o, post, self.eps);
        }
        add_inplace(x, &o);

        // MLP block: down(act(gate(n)) * up(n)).
        let n = rms_norm(x, &w.ffn_norm, self.eps);
        let mut g = w.gate_proj.forward(&n, t); // [t, intermediate]
        let u = w.up_proj.forward(&n, t);
        let act = match self.activation {
            Activation::Silu => silu,
            Activation::GeluTanh => gelu_tanh,
        };
        g.par_iter_mut().zip(&u).for_each(|(g, u)| *g = act(*g) * u);
        let mut m = w.down_proj.forward(&g, t); // [t, hidden]
        if let Some(post) = &w.post_ffn_norm {
            rms_norm_inplace(&mut m, post, self.eps);
        }
        add_inplace(x, &m);
        Ok(())
    }
}
