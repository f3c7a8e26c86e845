//! The linear layer of the model forward on the CPU, `y = x · Wᵀ (+ b)`,
//! over f32 or GGUF-quantized weights through the one blocked kernel of
//! [`te_kernels::matmul`]. All f32, row-major.

use rayon::prelude::*;

use te_formats::WeightData;
use te_kernels::matmul::{self, Precision, Scratch, Weights};
use te_kernels::norm::add_inplace;
use te_kernels::quant::dequantize_blocks;

/// A linear layer: `y = x · Wᵀ (+ b)`.
///
/// `weight: [out_features, in_features]`, row-major (Hugging Face and GGUF
/// order: GGUF `ne[0]` is `in_features`), f32 or GGUF-quantized;
/// `bias: [out_features]` when the model has one (Hugging Face
/// `attention_bias` / `mlp_bias`).
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: WeightData,
    /// Added to every output row.
    pub bias: Option<Vec<f32>>,
    pub out_features: usize,
    pub in_features: usize,
    /// How the product multiplies activations with quantized weights
    /// ([`Precision::Exact`] unless the model was set to int8 with
    /// [`crate::weights::ModelWeights::set_precision`]).
    pub precision: Precision,
}

impl Linear {
    /// Wraps a `[out_features, in_features]` weight (no bias); errors name
    /// `tensor` when the data does not hold that many elements.
    pub fn new(
        tensor: &str,
        weight: WeightData,
        out_features: usize,
        in_features: usize,
    ) -> crate::Result<Self> {
        let n = out_features * in_features;
        let ok = match &weight {
            WeightData::F32(w) => w.len() == n,
            WeightData::Quantized { ty, data } => {
                ty.block_layout().is_some_and(|(block_len, _)| {
                    in_features.is_multiple_of(block_len)
                        && ty.bytes_for(n as u64) == Some(data.len() as u64)
                })
            }
        };
        if !ok {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!("data does not hold a [{out_features}, {in_features}] matrix"),
            });
        }
        Ok(Linear {
            weight,
            bias: None,
            out_features,
            in_features,
            precision: Precision::Exact,
        })
    }

    /// The layer with bias `bias: [out_features]` (tensor `tensor`, named
    /// in the error when its length is not `out_features`).
    pub fn with_bias(mut self, tensor: &str, bias: Vec<f32>) -> crate::Result<Self> {
        if bias.len() != self.out_features {
            return Err(crate::ModelError::Tensor {
                tensor: tensor.to_string(),
                reason: format!(
                    "has {} values, expected {} (out_features)",
                    bias.len(),
                    self.out_features
                ),
            });
        }
        self.bias = Some(bias);
        Ok(self)
    }

    /// `x: [t, in_features]` -> `y: [t, out_features]`, bias added.
    pub fn forward(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut y = vec![0.0f32; t * self.out_features];
        self.forward_into(x, t, &mut y, &mut Scratch::default());
        y
    }

    /// [`forward`](Self::forward) into `y: [t, out_features]`, with
    /// `scratch` reused across calls (the kernel's decoded weight panels
    /// and accumulators, `x` rounded to 8 bits in int8 precision): decode
    /// allocates nothing once `scratch` has grown. Each output row is
    /// bit-identical for any `t` and any position in the batch
    /// ([`te_kernels::matmul`]).
    pub fn forward_into(&self, x: &[f32], t: usize, y: &mut [f32], scratch: &mut Scratch) {
        Linear::forward_many_into([self], x, t, [y], scratch)
    }

    /// [`forward_into`](Self::forward_into) of `N` layers that read the
    /// same `x: [t, in_features]` (Q, K and V; gate and up), in one
    /// parallel launch whose tasks cover the rows of every weight (fewer
    /// hand-offs to the thread pool in decode): `ys[i]: [t,
    /// ls[i].out_features]`, each bit-identical to its own
    /// `forward_into`.
    ///
    /// Panics: layers of different `in_features`, or a `y` or `x` of the
    /// wrong length.
    pub fn forward_many_into<const N: usize>(
        ls: [&Linear; N],
        x: &[f32],
        t: usize,
        mut ys: [&mut [f32]; N],
        scratch: &mut Scratch,
    ) {
        let k = ls.first().map_or(0, |l| l.in_features);
        assert!(
            ls.iter().all(|l| l.in_features == k),
            "Linear::forward_many_into: layers of different in_features"
        );
        for (l, y) in ls.iter().zip(&ys) {
            assert_eq!(
                y.len(),
                t * l.out_features,
                "Linear::forward_into: y is not [t, out_features]"
            );
        }
        let products = {
            let mut outs = ys.each_mut().into_iter();
            ls.map(|l| matmul::Product {
                w: match &l.weight {
                    WeightData::F32(w) => Weights::F32(w),
                    WeightData::Quantized { ty, data } => Weights::Quantized { ty: *ty, data },
                },
                n: l.out_features,
                y: outs.next().expect("one output per layer"),
                precision: l.precision,
            })
        };
        matmul::matmul_many_into(x, t, k, products, scratch);
        for (l, y) in ls.iter().zip(ys) {
            if let Some(b) = &l.bias {
                for row in y.chunks_exact_mut(l.out_features) {
                    add_inplace(row, b);
                }
            }
        }
    }

    /// Row `r` of the weight (an embedding lookup), as f32 into `out: [in_features]`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = self.in_features;
        match &self.weight {
            WeightData::F32(w) => out.copy_from_slice(&w[r * k..(r + 1) * k]),
            WeightData::Quantized { ty, data } => {
                let rb = data.len() / self.out_features;
                dequantize_blocks(*ty, &data[r * rb..(r + 1) * rb], out);
            }
        }
    }

    /// The whole weight as f32 `[out_features, in_features]`.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = vec![0.0f32; self.out_features * self.in_features];
        w.par_chunks_mut(self.in_features)
            .enumerate()
            .for_each(|(r, row)| self.row_into(r, row));
        w
    }
}
