//! Model weights, loaded through a [`TensorSource`] (GGUF or safetensors)
//! by one name mapping per file format: vectors in f32, matrices as the
//! source hands them out ([`TensorSource::load_matrix`]: f32, or GGUF blocks
//! and bf16/f16 kept as stored), after
//! [`crate::validate`] has checked the tensors against the config.

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::family::{NameScheme, TensorNames};
use te_formats::TensorSource;

use te_kernels::matmul::Precision;

use crate::ops::Linear;
use crate::validate::{check_tensors, expected_tensors};
use crate::{ModelError, Result};

/// One transformer layer's weights. Norm weights are the effective
/// multipliers (Gemma's `1 + w` already applied). `L` is the matrix type and
/// `V` the vector type of a device: host [`Linear`] and `Vec<f32>` by
/// default (the CUDA path uploads the same struct, bf16 matrices).
#[derive(Clone, Debug)]
pub struct LayerWeights<L = Linear, V = Vec<f32>> {
    /// Pre-attention RMSNorm `[hidden]`.
    pub attn_norm: V,
    /// `[h_q * d, hidden]`.
    pub q_proj: L,
    /// `[h_kv * d, hidden]`.
    pub k_proj: L,
    /// `[h_kv * d, hidden]`.
    pub v_proj: L,
    /// `[hidden, h_q * d]`.
    pub o_proj: L,
    /// Gemma 3 per-head norms `[d]`.
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// Gemma 2/3 post-attention norm `[hidden]`.
    pub post_attn_norm: Option<V>,
    /// Pre-MLP RMSNorm `[hidden]`.
    pub ffn_norm: V,
    /// `[intermediate, hidden]`.
    pub gate_proj: L,
    /// `[intermediate, hidden]`.
    pub up_proj: L,
    /// `[hidden, intermediate]`.
    pub down_proj: L,
    /// Gemma 2/3 post-MLP norm `[hidden]`.
    pub post_ffn_norm: Option<V>,
}

/// All weights of a model, with `L` and `V` as in [`LayerWeights`].
#[derive(Clone, Debug)]
pub struct ModelWeights<L = Linear, V = Vec<f32>> {
    /// Token embedding `[vocab, hidden]` (also the output projection when tied).
    pub embed_tokens: L,
    pub layers: Vec<LayerWeights<L, V>>,
    /// Final RMSNorm `[hidden]`.
    pub final_norm: V,
    /// Output projection `[vocab, hidden]`; `None` when tied to the embedding.
    pub lm_head: Option<L>,
}

impl<L, V> LayerWeights<L, V> {
    /// The same layer with every matrix through `lin` and every vector
    /// through `vec` (the CUDA upload); the first error stops.
    pub fn try_map<L2, V2, E>(
        &self,
        lin: &mut impl FnMut(&L) -> std::result::Result<L2, E>,
        vec: &mut impl FnMut(&V) -> std::result::Result<V2, E>,
    ) -> std::result::Result<LayerWeights<L2, V2>, E> {
        let mut opt = |v: &Option<V>| v.as_ref().map(&mut *vec).transpose();
        Ok(LayerWeights {
            q_norm: opt(&self.q_norm)?,
            k_norm: opt(&self.k_norm)?,
            post_attn_norm: opt(&self.post_attn_norm)?,
            post_ffn_norm: opt(&self.post_ffn_norm)?,
            attn_norm: vec(&self.attn_norm)?,
            ffn_norm: vec(&self.ffn_norm)?,
            q_proj: lin(&self.q_proj)?,
            k_proj: lin(&self.k_proj)?,
            v_proj: lin(&self.v_proj)?,
            o_proj: lin(&self.o_proj)?,
            gate_proj: lin(&self.gate_proj)?,
            up_proj: lin(&self.up_proj)?,
            down_proj: lin(&self.down_proj)?,
        })
    }
}

impl<L, V> ModelWeights<L, V> {
    /// The output projection: `lm_head`, or the embedding when tied.
    pub fn head(&self) -> &L {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Every matrix of the model: the embedding, the output projection
    /// when it is not tied, then each layer's seven projections.
    pub fn matrices_mut(&mut self) -> impl Iterator<Item = &mut L> {
        std::iter::once(&mut self.embed_tokens)
            .chain(self.lm_head.as_mut())
            .chain(self.layers.iter_mut().flat_map(|l| {
                [
                    &mut l.q_proj,
                    &mut l.k_proj,
                    &mut l.v_proj,
                    &mut l.o_proj,
                    &mut l.gate_proj,
                    &mut l.up_proj,
                    &mut l.down_proj,
                ]
            }))
    }

    /// [`LayerWeights::try_map`] over every weight of the model.
    pub fn try_map<L2, V2, E>(
        &self,
        mut lin: impl FnMut(&L) -> std::result::Result<L2, E>,
        mut vec: impl FnMut(&V) -> std::result::Result<V2, E>,
    ) -> std::result::Result<ModelWeights<L2, V2>, E> {
        Ok(ModelWeights {
            embed_tokens: lin(&self.embed_tokens)?,
            layers: self
                .layers
                .iter()
                .map(|l| l.try_map(&mut lin, &mut vec))
                .collect::<std::result::Result<_, E>>()?,
            final_norm: vec(&self.final_norm)?,
            lm_head: self.lm_head.as_ref().map(&mut lin).transpose()?,
        })
    }
}

fn expect_shape(name: &str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(ModelError::Tensor {
            tensor: name.to_string(),
            reason: format!("has shape {got:?}, expected {expected:?}"),
        });
    }
    Ok(())
}

impl ModelWeights {
    /// Sets how every matrix of the model multiplies its activations on
    /// the CPU ([`Precision::Int8`]: Q4_K and Q6_K matrices with 8-bit
    /// activations, the others exact; see `te_kernels::int8`). The CUDA
    /// upload ignores it.
    pub fn set_precision(&mut self, precision: Precision) {
        for l in self.matrices_mut() {
            l.precision = precision;
        }
    }

    /// Checks the tensors of `src` against `cfg`
    /// ([`crate::validate::check_tensors`]: every needed tensor present with
    /// the shape the config implies, none unused, every type readable),
    /// then loads them (biases included where the config has them).
    ///
    /// `norm_offset` is added to every norm weight: 1.0 for Gemma weights in
    /// Hugging Face files (which store `w` of `(1 + w)`), 0.0 otherwise
    /// (GGUF Gemma files store `1 + w` already; see tests/refs/README.md).
    pub fn load(
        src: &dyn TensorSource,
        scheme: NameScheme,
        cfg: &ModelConfig,
        norm_offset: f32,
    ) -> Result<Self> {
        check_tensors(cfg, scheme, src)?;
        let names = TensorNames {
            scheme,
            arch: cfg.architecture,
        };
        // The shapes validation checked, by name.
        let expected: HashMap<String, Vec<usize>> = expected_tensors(cfg, scheme)
            .into_iter()
            .map(|e| (e.name, e.shape))
            .collect();
        let shape_of = |name: &str| -> Result<&[usize]> {
            expected
                .get(name)
                .map(Vec::as_slice)
                .ok_or_else(|| ModelError::Tensor {
                    tensor: name.to_string(),
                    reason: "not a tensor of this architecture".into(),
                })
        };
        let vector = |name: &str, offset: f32| -> Result<Vec<f32>> {
            let (shape, mut data) = src.load(name)?;
            expect_shape(name, &shape, shape_of(name)?)?;
            if offset != 0.0 {
                data.iter_mut().for_each(|w| *w += offset);
            }
            Ok(data)
        };
        let norm = |name: &str| vector(name, norm_offset);
        let matrix = |name: &str, bias: Option<String>| -> Result<Linear> {
            let want = shape_of(name)?;
            let (shape, data) = src.load_matrix(name)?;
            expect_shape(name, &shape, want)?;
            let lin = Linear::new(name, data, want[0], want[1])?;
            match bias {
                Some(b) => {
                    let v = vector(&b, 0.0)?;
                    lin.with_bias(&b, v)
                }
                None => Ok(lin),
            }
        };
        let optional = |present: bool, name: String| -> Result<Option<Vec<f32>>> {
            if present {
                norm(&name).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let n = |what: &str| names.layer(i, what);
            let proj = |what: &str| {
                matrix(
                    &n(what),
                    cfg.has_bias(what).then(|| names.layer_bias(i, what)),
                )
            };
            layers.push(LayerWeights {
                attn_norm: norm(&n("attn_norm"))?,
                q_proj: proj("q")?,
                k_proj: proj("k")?,
                v_proj: proj("v")?,
                o_proj: proj("o")?,
                q_norm: optional(cfg.qk_norm, n("q_norm"))?,
                k_norm: optional(cfg.qk_norm, n("k_norm"))?,
                post_attn_norm: optional(cfg.sandwich_norms, n("post_attn_norm"))?,
                ffn_norm: norm(&n("ffn_norm"))?,
                gate_proj: proj("gate")?,
                up_proj: proj("up")?,
                down_proj: proj("down")?,
                post_ffn_norm: optional(cfg.sandwich_norms, n("post_ffn_norm"))?,
            });
        }
        let embed_tokens = matrix(names.global("embed"), None)?;
        let lm_head_name = names.global("lm_head");
        let lm_head = if !cfg.tie_word_embeddings || src.contains(lm_head_name) {
            Some(matrix(lm_head_name, None)?)
        } else {
            None
        };
        Ok(ModelWeights {
            embed_tokens,
            layers,
            final_norm: norm(names.global("norm"))?,
            lm_head,
        })
    }
}
